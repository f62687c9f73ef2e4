"""An OpenAI-compatible engine emulator: twin's ``Engine`` and an engine profile, in real time.

One replica per server. The engine loop is schedule -> sleep the profile's step time -> complete, on
the event loop's monotonic clock; tokens stream to clients as steps complete. It exposes vLLM's metric
names so routers and calibration code can run against many emulated replicas without GPUs or vLLM.

Requests: ``/v1/completions`` (``prompt`` as token ids or text; text is tokenized as in
:mod:`twin.router.prompt`) and ``/v1/chat/completions``, streaming or not. There is no model, so a
request always generates ``max_tokens`` tokens (as ``ignore_eos`` does) and its output token ids are a
fixed sequence (position ``k`` has id ``(1000 + 7919 k) mod vocab``); text is one placeholder word per
token. A client that disconnects aborts its request at the next step boundary (as vLLM does).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from twin.models.engine import Engine
from twin.models.request import EngineRequest, Status
from twin.models.tokens import TokenSeq, pieces_from_ids
from twin.router.openai_api import ApiError, Kind, ParsedRequest, error_body, parse_request
from twin.router.prom import CONTENT_TYPE, Counter, Gauge, Histogram, Registry

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's time_to_first_token_seconds buckets
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_LAG_S = 0.05


def output_token_id(position: int, vocab_size: int) -> int:
    return (1000 + 7919 * position) % vocab_size


class EmulatedReplica:
    """One emulated vLLM server: an engine, its real-time loop, its HTTP app and its metrics.

    Build with :func:`build_emulator` (profile + engine settings); ``app()`` gives the aiohttp app whose
    startup starts the engine loop and whose cleanup stops it.
    """

    def __init__(self, *, engine: Engine, step_model: Any, model_name: str = "twin-model",
                 vocab_size: int = DEFAULT_VOCAB_SIZE, time_scale: float = 1.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.step_model = step_model
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.time_scale = time_scale
        self.max_body_bytes = max_body_bytes
        self._t0 = time.monotonic()
        self._n = 0  # request counter (ids and output segments), per instance
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pending_aborts: list[EngineRequest] = []
        self._idle = True  # the loop waits for work (an arrival then is not held back under async scheduling)
        # Live requests -> [their token queue, output tokens already pushed]. The loop pushes new token
        # counts after each step and None when the request ends (no engine callbacks needed).
        self._streams: dict[EngineRequest, list] = {}
        self.num_aborted = 0
        self.num_steps = 0
        lbl = ("model_name", "engine")
        self._lv = (model_name, "0")
        self.registry = r = Registry()
        eng = engine
        r.add(Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lbl,
                    fn=lambda: {self._lv: float(len(eng.running))}))
        r.add(Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lbl,
                    fn=lambda: {self._lv: float(len(eng.waiting))}))
        r.add(Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lbl,
                    fn=lambda: {self._lv: eng.kv.usage()}))
        for name, attr, help_text in (
            ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
            ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
            ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
        ):
            r.add(_EngineCounter(name, help_text, lbl, lambda a=attr: {self._lv: float(getattr(eng, a))}))
        self.m_success = r.add(Counter("vllm:request_success", "Count of successfully processed requests.",
                                       (*lbl, "finished_reason")))
        self.m_ttft = r.add(Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                      TTFT_BUCKETS_S, lbl))

    # ---- the engine loop -----------------------------------------------------------------------
    def now_s(self) -> float:
        return time.monotonic() - self._t0

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        eng = self.engine
        self._wake = wake = asyncio.Event()
        prev_end: float | None = None  # when the previous step was due to end, while the engine stays busy
        while True:
            self._apply_aborts()
            if not eng.has_work:
                wake.clear()
                self._idle = True
                await wake.wait()
                self._idle = False
                prev_end = None
                continue
            now = self.now_s()
            # Back-to-back steps follow the profile's clock, not the sleeps' overshoot (which would add up),
            # unless the loop fell far behind (an overloaded host): then it restarts from now.
            t_start = prev_end if prev_end is not None and now - prev_end < MAX_LAG_S else now
            step = eng.schedule(t_start)
            # (async scheduling) requests that arrived during the last step join the step after this one
            if eng.held and eng.release_held() and step is None:
                step = eng.schedule(t_start)
            if step is None:  # nothing schedulable (the head request can never fit the KV pool): fail, not spin
                stuck = [eng.waiting.peek()] if len(eng.waiting) else list(eng.running)
                for r in stuck:
                    eng.abort(r, now, "abort")
                    self._publish(r)
                continue
            d = self.step_model.step_time_s(step.shape) * self.time_scale
            prev_end = t_start + d
            await asyncio.sleep(max(0.0, prev_end - self.now_s()))
            eng.complete(step, prev_end)
            for r in step.reqs:
                self._publish(r)
            self.num_steps += 1

    def _publish(self, r: EngineRequest) -> None:
        """Push ``r``'s new output tokens to its handler, then None if it has ended."""
        entry = self._streams.get(r)
        if entry is None:
            return
        queue, seen = entry
        if r.num_output > seen:
            queue.put_nowait(r.num_output - seen)
            entry[1] = r.num_output
        if r.status == Status.FINISHED:
            queue.put_nowait(None)
            del self._streams[r]

    def _apply_aborts(self) -> None:
        now = self.now_s()
        for req in self._pending_aborts:
            if self.engine.abort(req, now, "abort"):
                self._publish(req)
                self.num_aborted += 1
        self._pending_aborts.clear()

    async def _start(self, _app: web.Application) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def _stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # ---- HTTP ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _health(self, _request: web.Request) -> web.Response:
        ok = self._task is not None and not self._task.done()
        return web.Response(status=200 if ok else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.registry.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        try:
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                raise ApiError(413, f"the body is larger than {self.max_body_bytes} bytes")
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, f"the body is larger than {self.max_body_bytes} bytes") from None
            parsed = parse_request(raw, kind, max_model_len=self.engine.cfg.max_model_len, vocab_size=self.vocab_size)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        self._n += 1
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self._n}"
        arrival = self.now_s()
        req = EngineRequest(request_id=rid, arrival_s=arrival, max_tokens=parsed.max_tokens,
                            seq=TokenSeq(pieces_from_ids(parsed.prompt_ids), block_size=self.engine.cfg.block_size,
                                         output_segment=self._n))
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._streams[req] = [queue, 0]
        # async scheduling (a GPU profile's default): arriving while a step runs, it misses the step already formed
        self.engine.add(req, held=self.engine.cfg.async_scheduling and not self._idle)
        self._poke()
        try:
            if parsed.stream:
                return await self._stream(request, parsed, req, queue, rid)
            return await self._unary(parsed, req, queue, rid)
        finally:
            if req.status != Status.FINISHED:  # client gone (cancelled or write failed): abort at the step boundary
                self._pending_aborts.append(req)
                self._poke()
            else:
                self.m_success.inc(*self._lv, req.finished_reason or "length")

    def _first_token(self, req: EngineRequest) -> None:
        self.m_ttft.observe(self.now_s() - req.arrival_s, *self._lv)

    async def _unary(self, parsed: ParsedRequest, req: EngineRequest, queue: asyncio.Queue, rid: str) -> web.Response:
        n_out = 0
        while (n := await queue.get()) is not None:
            if n_out == 0:
                self._first_token(req)
            n_out += n
        if req.finished_reason == "abort":
            return web.json_response(error_body("the engine could not schedule this request", "server_error", 503),
                                     status=503)
        ids = [output_token_id(k, self.vocab_size) for k in range(n_out)]
        text = "".join(f" t{i}" for i in ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": req.finished_reason, "logprobs": None}
        if parsed.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if parsed.return_token_ids or not parsed.prompt_is_text:
            choice["token_ids"] = ids
        return web.json_response({
            "id": rid, "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": self._usage(req, n_out)})

    def _usage(self, req: EngineRequest, n_out: int) -> dict[str, Any]:
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": n_out,
                "total_tokens": req.prompt_tokens + n_out,
                "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0}}

    async def _stream(self, request: web.Request, parsed: ParsedRequest, req: EngineRequest, queue: asyncio.Queue,
                      rid: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": [choice] if choice else []}
            if usage is not None:
                body["usage"] = usage
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        n_out = 0
        while (n := await queue.get()) is not None:
            if n_out == 0:
                self._first_token(req)
            ids = [output_token_id(k, self.vocab_size) for k in range(n_out, n_out + n)]
            n_out += n
            text = "".join(f" t{i}" for i in ids)
            choice: dict[str, Any] = {"index": 0, "finish_reason": None, "token_ids": ids}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if n_out == n else {"content": text}
            else:
                choice["text"] = text
            await resp.write(chunk(choice))
        if req.finished_reason == "abort":
            err = error_body("the engine could not schedule this request", "server_error", 503)
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            await resp.write_eof()
            return resp
        last: dict[str, Any] = {"index": 0, "finish_reason": req.finished_reason, "token_ids": []}
        last["delta" if chat else "text"] = {} if chat else ""
        await resp.write(chunk(last))
        if parsed.include_usage:
            await resp.write(chunk({}, self._usage(req, n_out)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _EngineCounter(Gauge):
    """A counter whose value is read from the engine at exposition time (exposed as ``<name>_total``)."""

    kind = "counter"

    def render(self) -> list[str]:
        lines = super().render()
        return lines[:2] + [line.replace(self.name, self.name + "_total", 1) for line in lines[2:]]


def build_emulator(*, profile: str, engine_overrides: dict[str, Any] | None = None, model_name: str = "twin-model",
                   vocab_size: int = DEFAULT_VOCAB_SIZE, time_scale: float = 1.0) -> EmulatedReplica:
    """An emulated replica from a profile name (or YAML path) and vLLM engine settings.

    ``engine_overrides`` are :class:`twin.engine_settings.EngineSettings` fields (block_size,
    num_gpu_blocks, max_num_batched_tokens, max_num_seqs, max_model_len, ...); unset ones keep their
    defaults, and ``num_gpu_blocks`` is derived from the profile's memory model when not given.
    """
    from twin.runner import build_step_model, engine_config, on_gpu
    from twin.scenario import EngineSettings, ProfileStepTime, ReplicaConfig

    settings = EngineSettings(**(engine_overrides or {}))
    rc = ReplicaConfig(step_time=ProfileStepTime(profile=profile), engine=settings)
    step_model, blocks = build_step_model(rc)
    return EmulatedReplica(engine=Engine(engine_config(settings, blocks, gpu=on_gpu(rc))), step_model=step_model,
                           model_name=model_name, vocab_size=vocab_size, time_scale=time_scale)
