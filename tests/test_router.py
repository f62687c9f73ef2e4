"""The router against emulated replicas on loopback: policy decisions, cancellation, auth, quotas, failures."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from twin.policies import build_router  # noqa: E402
from twin.router.keys import KeysFile  # noqa: E402
from twin.router.local import LocalFleet, LocalServers, free_port  # noqa: E402
from twin.router.service import RouterService, RouterServiceConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROFILE = "llama3-8b-bf16-tp1-h100"
ENGINE = {"max_model_len": 4096, "num_gpu_blocks": 2048}
KEY_A, KEY_B, KEY_Q = "sk-tenant-a-000001", "sk-tenant-b-000001", "sk-tenant-q-000001"
KEYS = KeysFile.model_validate({"keys": {
    KEY_A: {"tenant": "tenant-a"}, KEY_B: {"tenant": "tenant-b", "tier": "free"},
    KEY_Q: {"tenant": "tenant-q", "tokens_per_minute": 100}}})


def request(port: int, path: str, body: object | bytes | None = None, *, key: str | None = KEY_A,
            method: str = "POST", timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def open_stream(port: int, body: dict, *, key: str = KEY_A) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30.0)
    conn.request("POST", "/v1/completions", body=json.dumps(body | {"stream": True}).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def data_events(resp: http.client.HTTPResponse, limit: int | None = None) -> list[str]:
    out: list[str] = []
    while limit is None or len(out) < limit:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith(b"data:"):
            out.append(line[5:].strip().decode())
    return out


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_openai_error(status: int, body: bytes, expect: int | None = None) -> dict:
    assert 400 <= status < 500, (status, body[:300])
    if expect is not None:
        assert status == expect, (status, body[:300])
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "code" in err
    return err


@pytest.fixture
def fleet_factory():
    made: list[LocalFleet] = []

    def make(n: int = 3, policy: dict | None = None, **cfg) -> LocalFleet:
        config = RouterServiceConfig(**({"scrape_interval_s": 0.05, "max_model_len": 4096} | cfg))
        f = LocalFleet(n=n, policy=policy or {"kind": "round_robin"}, keys=KEYS, config=config, profile=PROFILE,
                       engine_overrides=ENGINE)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


# ---- policy decisions are the policy's ------------------------------------------------------------
def _workload(n_groups: int, n_requests: int) -> list[dict]:
    """Requests sharing one of ``n_groups`` 96-token prefixes, with distinct tails and lengths."""
    out = []
    for i in range(n_requests):
        g = (i * 7) % n_groups
        prefix = [100 + 1000 * g + k for k in range(96)]
        tail = [30000 - i - k for k in range(5 + (i * 13) % 40)]
        out.append({"prompt": prefix + tail, "max_tokens": 4 + (i * 5) % 24, "user": f"session-{i % 5}"})
    return out


@pytest.mark.parametrize("policy", [
    {"kind": "llm_d_scorer"},
    {"kind": "prefix_affinity", "prefix_blocks": 4},
    {"kind": "power_of_two"},
    {"kind": "dynamo_kv_cost", "temperature": 0.5},
    {"kind": "session_affinity"},
])
def test_router_decisions_replay_through_a_fresh_policy(fleet_factory, policy) -> None:
    fleet = fleet_factory(3, policy, record_decisions=True, seed=7)
    reqs = _workload(n_groups=4, n_requests=36)
    with ThreadPoolExecutor(max_workers=6) as pool:  # concurrent: in-flight counts and ledgers matter
        results = list(pool.map(lambda b: request(fleet.router_port, "/v1/completions", b), reqs))
    assert all(s == 200 for s, _, _ in results), [r[2][:200] for r in results if r[0] != 200]
    log = fleet.router.log
    routes = [e for e in log if e.op == "route"]
    assert len(routes) == len(reqs)
    assert sum(e.op == "completed" for e in log) == len(reqs)
    # Replay the exact call sequence (same snapshots, same times) through a fresh policy with the same seed.
    fresh = build_router(policy, seed=7)
    for e in log:
        if e.op == "route":
            d = fresh.route(e.request, e.replicas, e.now_s)
            assert d == e.decision, (e.request.request_id, d, e.decision)
        elif e.op == "routed":
            fresh.on_routed(e.request, e.replica_id, e.now_s)
        else:
            fresh.on_completed(e.request_id, e.replica_id, e.now_s)
    # The log is what really happened: each emulator served exactly the requests routed to it.
    by_replica = {rid: sum(e.decision.replica_id == rid for e in routes) for rid in fleet.router.upstreams}
    served = [em.m_success.get("twin-model", "0", "length") for em in fleet.emulators]
    assert list(by_replica.values()) == served
    # The signals the policy saw were live: some snapshot shows load (ledger or scraped queue).
    assert any(s.outstanding_tokens > 0 or s.num_running > 0 for e in routes for s in e.replicas)


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(fleet_factory) -> None:
    fleet = fleet_factory(3, {"kind": "prefix_affinity", "prefix_blocks": 4}, record_decisions=True)
    for b in _workload(n_groups=3, n_requests=12):  # one at a time: bounded loads never spill
        assert request(fleet.router_port, "/v1/completions", b)[0] == 200
    groups: dict[int, set[str]] = {}
    for e in fleet.router.log:
        if e.op == "route":
            groups.setdefault(e.request.block_hashes[0], set()).add(e.decision.replica_id)
    assert len(groups) == 3 and all(len(r) == 1 for r in groups.values()), groups
    hits = sum(em.engine.prefix_cache_hits for em in fleet.emulators)
    assert hits >= 9 * 96, hits  # every repeat of a group hits its 6 cached blocks on the emulator


# ---- cancellation ----------------------------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_upstream(fleet_factory) -> None:
    fleet = fleet_factory(1)
    conn, resp = open_stream(fleet.router_port, {"prompt": list(range(50)), "max_tokens": 3000})
    assert len(data_events(resp, limit=2)) == 2
    resp.close()
    conn.close()
    emu = fleet.emulators[0]
    wait_for(lambda: emu.num_aborted == 1, what="the emulator's abort")
    wait_for(lambda: fleet.router.in_flight == 0, what="the router to end the request")
    assert emu.engine.generation_tokens < 3000
    assert fleet.router.m_cancelled.get() == 1
    assert all(u.outstanding_tokens == 0 for u in fleet.router.upstreams.values())
    assert emu.m_success.get("twin-model", "0", "length") == 0


def test_client_disconnect_while_waiting_for_a_unary_answer_aborts_upstream(fleet_factory) -> None:
    fleet = fleet_factory(1)
    conn = http.client.HTTPConnection("127.0.0.1", fleet.router_port, timeout=30.0)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [5] * 40, "max_tokens": 3000}).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
    emu = fleet.emulators[0]
    wait_for(lambda: emu.engine.generation_tokens >= 5, what="generation to start")
    conn.close()
    wait_for(lambda: emu.num_aborted == 1, what="the emulator's abort")
    assert emu.engine.generation_tokens < 3000


# ---- a killed upstream ----------------------------------------------------------------------------
def test_killed_upstream_mid_stream_gives_an_explicit_error_event(tmp_path) -> None:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "twin", "emulate", "--profile", PROFILE, "--port", str(port), "--max-model-len", "4096",
         "--num-gpu-blocks", "2048", "--time-scale", "3"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    servers = LocalServers()
    try:
        def up() -> bool:
            try:
                return request(port, "/health", method="GET", key=None, timeout=1.0)[0] == 200
            except OSError:
                return False

        wait_for(up, timeout_s=30.0, what="the emulator subprocess")
        router = RouterService(policy={"kind": "round_robin"}, upstreams=[f"http://127.0.0.1:{port}"], keys=KEYS,
                               config=RouterServiceConfig(scrape_interval_s=0.1))
        rport = servers.start(router.app())
        conn, resp = open_stream(rport, {"prompt": list(range(20)), "max_tokens": 2000})
        first = data_events(resp, limit=3)
        assert all("token_ids" in json.loads(d)["choices"][0] for d in first)
        os.killpg(proc.pid, signal.SIGKILL)
        rest = data_events(resp)
        conn.close()
        assert rest, "the stream ended with no event after the kill"
        assert "[DONE]" not in rest
        err = json.loads(rest[-1])["error"]
        assert err["type"] == "upstream_error" and "before it was complete" in err["message"]
        assert router.m_upstream_errors.get("upstream0", "midstream") == 1
        status, _, body = request(rport, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status in (502, 503), status  # dead upstream: an error, not a hang
        assert json.loads(body)["error"]["message"]
    finally:
        servers.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


# ---- keys and quotas --------------------------------------------------------------------------------
def test_missing_or_unknown_key_is_401(fleet_factory) -> None:
    fleet = fleet_factory(1)
    for key in (None, "sk-not-a-known-key-0000"):
        status, _, body = request(fleet.router_port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, key=key)
        assert assert_openai_error(status, body, 401)["type"] == "authentication_error"
    assert fleet.router.m_rejected.get("unauthorized") == 2
    assert sum(e.engine.prompt_tokens for e in fleet.emulators) == 0  # nothing reached an engine


def test_over_quota_is_429_with_retry_after_and_other_tenants_are_unaffected(fleet_factory) -> None:
    fleet = fleet_factory(1)
    body = {"prompt": list(range(10)), "max_tokens": 50}  # costs 60 of tenant-q's 100 tokens per minute
    assert request(fleet.router_port, "/v1/completions", body, key=KEY_Q)[0] == 200
    status, headers, raw = request(fleet.router_port, "/v1/completions", body, key=KEY_Q)
    assert assert_openai_error(status, raw, 429)["type"] == "rate_limit_error"
    assert int(headers["retry-after"]) >= 1
    assert request(fleet.router_port, "/v1/completions", body, key=KEY_A)[0] == 200
    status, headers, raw = request(fleet.router_port, "/v1/completions", {"prompt": [1] * 10, "max_tokens": 200},
                                   key=KEY_Q)
    assert status == 429 and "exceeds" in json.loads(raw)["error"]["message"]
    assert fleet.router.m_rejected.get("quota") == 2


def test_metrics_show_no_tenant_and_upstream_never_sees_the_key() -> None:
    """Tenants cannot learn about each other from /metrics, and keys stop at the router."""
    from aiohttp import web

    seen: list[dict[str, str]] = []

    async def completions(req: web.Request) -> web.Response:
        seen.append(dict(req.headers))
        return web.json_response({"id": "x", "object": "text_completion", "choices": []})

    async def metrics(_req: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    servers = LocalServers()
    try:
        up = servers.start(app)
        router = RouterService(policy={"kind": "round_robin"}, upstreams=[f"http://127.0.0.1:{up}"], keys=KEYS)
        port = servers.start(router.app())
        for key in (KEY_A, KEY_B):
            assert request(port, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}, key=key)[0] == 200
        text = request(port, "/metrics", method="GET", key=None)[2].decode()
        assert "twin_router_decisions_total" in text
        for secret in ("tenant-a", "tenant-b", KEY_A, KEY_B):
            assert secret not in text
        assert len(seen) == 2
        assert not any(k.lower() in ("authorization", "x-api-key") for h in seen for k in h)
    finally:
        servers.close()


# ---- health and metrics ---------------------------------------------------------------------------
def test_router_metrics_count_decisions_and_in_flight(fleet_factory) -> None:
    fleet = fleet_factory(2, {"kind": "round_robin"})
    for i in range(4):
        assert request(fleet.router_port, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 3})[0] == 200
    status, _, body = request(fleet.router_port, "/metrics", method="GET", key=None)
    text = body.decode()
    assert status == 200
    assert 'twin_router_decisions_total{policy="round_robin",replica="upstream0"} 2.0' in text
    assert 'twin_router_decisions_total{policy="round_robin",replica="upstream1"} 2.0' in text
    assert "twin_router_requests_in_flight 0.0" in text
    assert request(fleet.router_port, "/health", method="GET", key=None)[0] == 200


def test_no_healthy_upstream_is_503_and_refunds_the_quota() -> None:
    servers = LocalServers()
    try:
        dead = free_port()  # nothing listens there
        router = RouterService(policy={"kind": "least_outstanding_tokens"}, upstreams=[f"http://127.0.0.1:{dead}"],
                               keys=KEYS, config=RouterServiceConfig(scrape_interval_s=0.05))
        port = servers.start(router.app())
        assert request(port, "/health", method="GET", key=None)[0] == 503
        body = {"prompt": list(range(10)), "max_tokens": 50}  # 60 of tenant-q's 100 tokens per minute
        for _ in range(3):  # without the refund the second would be a 429
            status, _, raw = request(port, "/v1/completions", body, key=KEY_Q)
            assert status == 503 and json.loads(raw)["error"]["type"] == "server_error"
        assert router.m_rejected.get("no_replica") == 3 and router.m_rejected.get("quota") == 0
    finally:
        servers.close()
