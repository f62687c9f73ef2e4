"""The production router: an OpenAI-compatible asynchronous proxy that places requests with a twin policy.

Per request: authenticate the tenant's key (401), read and validate the body (4xx with an OpenAI error
body), charge the tenant's token quota (429 + ``retry-after``), build :class:`RequestFacts` (block
hashes from :mod:`twin.router.prompt`), build one :class:`ReplicaSnapshot` per upstream from the last
``/metrics`` scrape plus the router's own outstanding-token ledger, ask the policy, forward, relay the
answer (streaming or not), and tell the policy when the request ends, whatever the outcome.

A client that disconnects closes the upstream connection, which vLLM (and the emulator) treat as an
abort. An upstream that dies mid-stream gives the client an explicit ``data: {"error": ...}`` event
(the stream then ends without ``[DONE]``), never a silent truncation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import yaml
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from twin.policies import ReplicaSnapshot, RequestFacts, RoutingDecision, build_router, parse_router_config
from twin.policies.routing import RouterParams
from twin.router.keys import KeysFile, TokenBucket
from twin.router.openai_api import ApiError, Kind, ParsedRequest, error_body, parse_request
from twin.router.prom import CONTENT_TYPE, Counter, Gauge, Registry, parse_exposition
from twin.router.prompt import block_hashes

PosFloat = Annotated[float, Field(gt=0.0)]
PosInt = Annotated[int, Field(gt=0)]


class RouterServiceConfig(BaseModel):
    """The router process's own settings (command-line flags, or a ``router_service`` section)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scrape_interval_s: PosFloat = 1.0
    scrape_timeout_s: PosFloat = 2.0
    block_size_tokens: PosInt = 16  # the engines' --block-size, for the router's prefix hashes
    max_model_len: PosInt = 4096  # the engines' --max-model-len (prompt + max_tokens must fit)
    model: str = "twin-model"  # the served model name every upstream serves
    region: str = "local"
    max_body_bytes: PosInt = 1024 * 1024
    upstream_timeout_s: PosFloat = 600.0
    seed: Annotated[int, Field(ge=0)] = 0  # the policy's seed
    record_decisions: bool = False  # keep every policy call in ``RouterService.log`` (tests, audits)


def load_policy_file(path: str | Path) -> tuple[RouterParams, dict[str, Any]]:
    """``policy.router`` (validated with ``RouterConfig``) and the optional ``router_service`` section.

    Every other key of the file (a full scenario's workload, fleet, ...) is ignored.
    """
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    try:
        section = doc["policy"]["router"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: no policy.router section") from None
    return parse_router_config(section), dict(doc.get("router_service") or {})


@dataclass(slots=True)
class Upstream:
    replica_id: str
    url: str
    healthy: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    scraped_at_s: float = 0.0
    outstanding_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One call the router made on its policy: ``route`` (with its snapshots and decision), ``routed``
    or ``completed``. Replaying these calls through a fresh policy must give the same decisions."""

    op: str
    now_s: float
    request: RequestFacts | None = None
    replicas: tuple[ReplicaSnapshot, ...] = ()
    decision: RoutingDecision | None = None
    request_id: str = ""
    replica_id: str = ""


_DONE = b"data: [DONE]"


class RouterService:
    def __init__(self, *, policy: Mapping[str, Any] | RouterParams, upstreams: Sequence[str], keys: KeysFile,
                 config: RouterServiceConfig | None = None) -> None:
        if not upstreams:
            raise ValueError("at least one upstream is needed")
        self.cfg = config or RouterServiceConfig()
        self.params = parse_router_config(policy)
        self.policy = build_router(self.params, seed=self.cfg.seed)
        width = len(str(len(upstreams) - 1))
        self.upstreams = {f"upstream{i:0{width}d}": Upstream(f"upstream{i:0{width}d}", u.rstrip("/"))
                          for i, u in enumerate(upstreams)}
        self.keys = keys
        self.buckets: dict[str, TokenBucket] = {}
        self.log: list[LogEntry] = []
        self._t0 = time.monotonic()
        self._n = 0
        self.in_flight = 0
        self.session: aiohttp.ClientSession | None = None
        self._scraper: asyncio.Task | None = None
        r = self.registry = Registry()
        self.m_requests = r.add(Counter("twin_router_requests", "Requests answered, by endpoint and HTTP status.",
                                        ("endpoint", "status")))
        self.m_decisions = r.add(Counter("twin_router_decisions", "Routing decisions, by policy and replica.",
                                         ("policy", "replica")))
        self.m_rejected = r.add(Counter("twin_router_rejections", "Requests refused before routing "
                                        "(unauthorized, invalid, too_large, quota = 429, no_replica = shed).",
                                        ("reason",)))
        self.m_upstream_errors = r.add(Counter("twin_router_upstream_errors", "Upstream failures, by replica and kind "
                                               "(connect, midstream, status).", ("replica", "kind")))
        self.m_cancelled = r.add(Counter("twin_router_client_cancellations",
                                         "Requests whose client went away before the end (upstream cancelled)."))
        self.m_scrapes = r.add(Counter("twin_router_scrapes", "Metric scrapes, by replica and outcome.",
                                       ("replica", "outcome")))
        r.add(Gauge("twin_router_requests_in_flight", "Requests forwarded and not yet ended.",
                    fn=lambda: {(): float(self.in_flight)}))
        r.add(Gauge("twin_router_upstream_healthy", "1 if the last scrape or connection succeeded.", ("replica",),
                    fn=lambda: {(u.replica_id,): float(u.healthy) for u in self.upstreams.values()}))
        r.add(Gauge("twin_router_outstanding_tokens", "Prompt + max_tokens in flight (the router's ledger).",
                    ("replica",), fn=lambda: {(u.replica_id,): float(u.outstanding_tokens)
                                              for u in self.upstreams.values()}))

    def now_s(self) -> float:
        return time.monotonic() - self._t0

    # ---- lifecycle -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))
        await self.scrape_all()
        self._scraper = asyncio.get_running_loop().create_task(self._scrape_loop())

    async def _stop(self, _app: web.Application) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            try:
                await self._scraper
            except asyncio.CancelledError:
                pass
        if self.session is not None:
            await self.session.close()

    # ---- scraping ------------------------------------------------------------------------------
    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.scrape_interval_s)
            await self.scrape_all()

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(u) for u in self.upstreams.values()))

    async def _scrape(self, u: Upstream) -> None:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.scrape_timeout_s)
            async with self.session.get(u.url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                m = parse_exposition(await resp.text())
            u.num_running = max(0, int(m.get("vllm:num_requests_running", 0.0)))
            u.num_waiting = max(0, int(m.get("vllm:num_requests_waiting", 0.0)))
            u.kv_usage = min(1.0, max(0.0, m.get("vllm:kv_cache_usage_perc", 0.0)))
            u.healthy = True
            u.scraped_at_s = self.now_s()
            self.m_scrapes.inc(u.replica_id, "ok")
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ValueError, UnicodeDecodeError):
            u.healthy = False
            self.m_scrapes.inc(u.replica_id, "error")

    def snapshots(self) -> tuple[ReplicaSnapshot, ...]:
        c = self.cfg
        return tuple(ReplicaSnapshot(
            replica_id=u.replica_id, region=c.region, model=c.model, pool="default", healthy=u.healthy,
            num_running=u.num_running, num_waiting=u.num_waiting, kv_usage=u.kv_usage,
            outstanding_tokens=u.outstanding_tokens, max_model_len=c.max_model_len, scraped_at_s=u.scraped_at_s,
        ) for u in self.upstreams.values())

    # ---- plain endpoints -----------------------------------------------------------------------
    async def _health(self, _request: web.Request) -> web.Response:
        healthy = sum(u.healthy for u in self.upstreams.values())
        return web.json_response({"status": "ok" if healthy else "no healthy upstream",
                                  "healthy_upstreams": healthy}, status=200 if healthy else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.registry.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    # ---- one request ---------------------------------------------------------------------------
    def _tenant(self, request: web.Request) -> tuple[str, str]:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        entry = self.keys.keys.get(key) if key else None
        if entry is None:
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer <key>)",
                           type_="authentication_error", reason="unauthorized")
        return entry.tenant, entry.tier

    async def _read(self, request: web.Request, kind: Kind) -> ParsedRequest:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the body is larger than {limit} bytes", reason="too_large")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the body is larger than {limit} bytes", reason="too_large") from None
        return parse_request(raw, kind, max_model_len=self.cfg.max_model_len)

    def _charge(self, tenant: str, parsed: ParsedRequest) -> None:
        tpm = self.keys.tenant_quota(tenant)
        if tpm is None:
            return
        now = self.now_s()
        bucket = self.buckets.setdefault(tenant, TokenBucket(tpm, now))
        cost = parsed.prompt_tokens + parsed.max_tokens
        wait_s = bucket.take(cost, now)
        if wait_s > 0:
            what = "exceeds" if cost > tpm else "would exceed"
            raise ApiError(429, f"this request ({cost} tokens) {what} your quota of {tpm} tokens per minute",
                           type_="rate_limit_error", reason="quota", headers={"retry-after": str(int(wait_s))})

    def _facts(self, parsed: ParsedRequest, tenant: str, tier: str) -> RequestFacts:
        self._n += 1
        return RequestFacts(
            request_id=f"req-{self._n}", tenant=tenant, tier=tier, session_id=parsed.user,
            prompt_tokens=parsed.prompt_tokens, expected_output_tokens=parsed.max_tokens,
            block_hashes=block_hashes(parsed.prompt_ids, self.cfg.block_size_tokens), model=self.cfg.model,
            region=None, allowed_regions=None, needs_long_context=False)

    def _error(self, e: ApiError, endpoint: str) -> web.Response:
        self.m_rejected.inc(e.reason)
        self.m_requests.inc(endpoint, str(e.status))
        return web.json_response(e.body(), status=e.status, headers=e.headers)

    async def _handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        endpoint = request.path
        try:
            tenant, tier = self._tenant(request)
            parsed = await self._read(request, kind)
            self._charge(tenant, parsed)
        except ApiError as e:
            return self._error(e, endpoint)
        facts = self._facts(parsed, tenant, tier)
        now = self.now_s()
        snaps = self.snapshots()
        decision = self.policy.route(facts, snaps, now)
        rid = decision.replica_id
        if self.cfg.record_decisions:
            self.log.append(LogEntry("route", now, request=facts, replicas=snaps, decision=decision))
        if rid is None:
            if tenant in self.buckets:
                self.buckets[tenant].refund(parsed.prompt_tokens + parsed.max_tokens)
            return self._error(ApiError(503, "no healthy upstream can take this request", type_="server_error",
                                        reason="no_replica"), endpoint)
        up = self.upstreams[rid]
        self.policy.on_routed(facts, rid, now)
        if self.cfg.record_decisions:
            self.log.append(LogEntry("routed", now, request=facts, replica_id=rid))
        self.m_decisions.inc(self.params.kind, rid)
        up.outstanding_tokens += facts.total_tokens
        self.in_flight += 1
        status = 499
        try:
            resp = await self._forward(request, up, parsed)
            status = resp.status
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            self.m_cancelled.inc()
            raise
        finally:
            self.in_flight -= 1
            up.outstanding_tokens -= facts.total_tokens
            end = self.now_s()
            self.policy.on_completed(facts.request_id, rid, end)
            if self.cfg.record_decisions:
                self.log.append(LogEntry("completed", end, request_id=facts.request_id, replica_id=rid))
            self.m_requests.inc(endpoint, str(status))

    async def _forward(self, request: web.Request, up: Upstream, parsed: ParsedRequest) -> web.StreamResponse:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.cfg.upstream_timeout_s, sock_connect=self.cfg.scrape_timeout_s)
        try:
            upstream = await self.session.post(up.url + request.path, data=parsed.raw, timeout=timeout,
                                               headers={"Content-Type": "application/json"})
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError) as exc:
            up.healthy = False  # until the next successful scrape
            self.m_upstream_errors.inc(up.replica_id, "connect")
            return web.json_response(error_body(f"upstream {up.replica_id} failed: {type(exc).__name__}",
                                                "upstream_error", 502), status=502)
        complete = False
        try:
            ctype = upstream.headers.get("Content-Type", "")
            if upstream.status != 200 or not ctype.startswith("text/event-stream"):
                if upstream.status >= 500:
                    self.m_upstream_errors.inc(up.replica_id, "status")
                try:
                    payload = await upstream.read()
                except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError):
                    self.m_upstream_errors.inc(up.replica_id, "midstream")
                    return web.json_response(error_body(f"upstream {up.replica_id} failed before answering",
                                                        "upstream_error", 502), status=502)
                complete = True
                return web.Response(status=upstream.status, body=payload,
                                    headers={"Content-Type": ctype or "application/json"})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await out.prepare(request)
            tail = b""
            chunks = upstream.content.iter_any().__aiter__()
            while True:
                try:
                    data = await chunks.__anext__()
                except StopAsyncIteration:
                    complete = _DONE in tail
                    break
                except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError):
                    break  # the upstream died or stalled mid-stream
                try:
                    await out.write(data)
                except ConnectionResetError:  # the client went away: the finally clause cancels upstream
                    self.m_cancelled.inc()
                    return out
                tail = (tail + data)[-64:]
            if not complete:
                up.healthy = False
                self.m_upstream_errors.inc(up.replica_id, "midstream")
                err = error_body(f"upstream {up.replica_id} ended the stream before it was complete",
                                 "upstream_error", 502)
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            await out.write_eof()
            return out
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()  # drops the connection: the upstream sees the client gone and aborts
