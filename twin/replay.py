"""Replay a recorded real-engine run on one simulated replica, and compare.

The engine settings (block size, block count, limits, chunking, caching) come from the run's
``run.json``; the requests are the exact prompt token ids, arrival times and output lengths that were
sent. Step time comes from a profile, or (``step_times="recorded"``) from the recorded iteration log
itself plus the profile's per-step overhead, so scheduling and latency accounting can be judged apart
from the step-time model.

A run recorded through the OpenAI server (run.json ``mode: server``) replayed with a profile that has a
``server`` section gets the API front end as well (``twin.calibration.server``): each request reaches the
engine ``server.arrival_s`` after its send, steps take the server-mode step time plus the front end's time
per step and per streamed chunk, and latencies are measured from the send, as the client measured them.
Offline runs, and profiles without a ``server`` section, replay as before.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from twin.calibration.recorded import RecordedRun
from twin.engine_profiles.step import StepShape, StepTimeModel, repeated_reads
from twin.metrics import distribution
from twin.models.workload import RequestSpec
from twin.rng import stable_hash
from twin.runner import RunResult, run_scenario
from twin.scenario import parse_scenario

COMPOSITION = ("ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens")


class RecordedStepTimes:
    """Step i takes the recorded ``elapsed_ms`` of step i plus a per-step overhead (plus ``per_chunk_s`` per
    request computed in the step: the server front end's streaming time)."""

    def __init__(self, elapsed_ms: np.ndarray, *, overhead_s: float, fallback: StepTimeModel | None,
                 per_chunk_s: float = 0.0) -> None:
        self.elapsed_s = np.asarray(elapsed_ms, dtype=np.float64) / 1000.0
        self.overhead_s = overhead_s
        self.per_chunk_s = per_chunk_s
        self.fallback = fallback
        self.i = 0
        self.beyond = 0  # steps the twin ran past the end of the recording

    def step_time_s(self, shape: StepShape) -> float:
        i = self.i
        self.i += 1
        if i < self.elapsed_s.size:
            front = self.per_chunk_s * (shape.decode_requests + shape.prefill_requests) if self.per_chunk_s else 0.0
            return float(self.elapsed_s[i]) + self.overhead_s + front
        self.beyond += 1
        if self.fallback is not None:
            return self.fallback.step_time_s(shape)
        return float(self.elapsed_s[-1]) + self.overhead_s

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        raise RuntimeError("recorded step times are consumed one step at a time (decode runs are off)")


class MatchedStepTimes:
    """Recorded step times for a server run, matched to the twin's steps by their work rather than by index.

    On a server the engine batches what has arrived when a step starts, so the twin's step *i* is often not the
    recorded step *i* (a request a step earlier or later shifts every step after it, and a prefill step can take a
    short decode step's time). Here each step of the twin is timed from the recorded steps that did the same work,
    found through the run's FCFS reconstruction (``twin.calibration.server.reconstruct``): a member computing prompt
    tokens ``[a, b)`` of request *r* maps to the recorded steps whose chunk of *r*'s prompt overlaps them, a member
    decoding *r*'s output token *j* to the recorded step that emitted it. When the members map to one recorded
    step of the same shape, the step takes that step's recorded time; otherwise the profile's model time for its
    shape times the measured speed of the recorded steps it maps to (their recorded time over their model time,
    summed); with no recorded step (work past the recording) the model time. Plus the per-step overhead and
    ``per_chunk_s`` per request, as ``RecordedStepTimes``. ``exact``, ``scaled`` and ``modelled`` count the steps
    timed each way. The replica calls ``step_time_for(step)`` (decode runs are off in these replays)."""

    def __init__(self, steps: Any, model: StepTimeModel, *, overhead_s: float, per_chunk_s: float) -> None:
        self.steps = steps  # twin.calibration.server.ServerSteps
        self.model = model  # the profile's server step time: the front end's base (overhead_s) and per_chunk_s in it
        self.overhead_s = overhead_s
        self.per_chunk_s = per_chunk_s
        self._base = float(getattr(model, "overhead_s", 0.0))
        self._model_s = np.array([self._model_time(sh) for sh in steps.shapes], dtype=np.float64)
        self.exact = self.scaled = self.modelled = 0

    def _model_time(self, shape: StepShape) -> float:
        """The model's execution time for ``shape`` (its step time less the front end's base and chunks)."""
        chunks = shape.decode_requests + shape.prefill_requests
        return self.model.step_time_s(shape) - self._base - self.per_chunk_s * chunks

    def recorded_steps(self, step: Any) -> set[int]:
        """The recorded steps that did the work of the twin's ``step`` (``twin.models.engine_parts.Step``, read
        right after it was scheduled: each member's ``num_computed`` already counts its tokens in it)."""
        S = self.steps
        ks: set[int] = set()
        for i, (r, n) in enumerate(zip(step.reqs, step.ns, strict=True)):
            rid = r.request_id
            start = None if i < step.g_n else r.num_computed - n
            if start is None or (start >= r.prompt_tokens and n == 1):  # decoding output token num_output
                ts = S.token_steps.get(rid)
                j = r.num_output
                if ts is not None and j < len(ts):
                    ks.add(int(ts[j]))
                continue
            end = min(start + n, r.prompt_tokens)  # a resumed request's re-prefill past its prompt: no map
            for a, b, k in S.chunk_steps.get(rid, ()):
                if a < end and start < b:
                    ks.add(k)
        return ks

    def step_time_for(self, step: Any) -> float:
        shape = step.shape
        front = self.overhead_s + self.per_chunk_s * (shape.decode_requests + shape.prefill_requests)
        ks = self.recorded_steps(step)
        if len(ks) == 1:
            k = next(iter(ks))
            if self.steps.shapes[k] == shape:
                self.exact += 1
                return float(self.steps.elapsed_s[k]) + front
        model_s = self._model_time(shape)
        if not ks:
            self.modelled += 1
            return model_s + front
        self.scaled += 1
        idx = sorted(ks)
        speed = float(np.sum(self.steps.elapsed_s[idx])) / float(np.sum(self._model_s[idx]))
        return model_s * speed + front

    def step_time_s(self, shape: StepShape) -> float:  # a step without its members: the model's time
        return self.model.step_time_s(shape) - self._base + self.overhead_s

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        raise RuntimeError("recorded step times are consumed one step at a time (decode runs are off)")


def stream_ends_of(step: Any, max_model_len: int) -> tuple[int, int]:
    """``(opened, closed)``: the requests of a twin step (``twin.models.engine_parts.Step``, read right after it was
    scheduled) that get their first token in it and those whose last token it emits (a prefill chunk that does not
    finish its prompt emits nothing; the last token is where ``EngineRequest.remaining_steps`` runs out)."""
    opened = closed = 0
    for i, r in enumerate(step.reqs):
        if i >= step.g_n and r.num_computed < r.seq.num_tokens:  # (a decode group's members decode one token)
            continue
        if r.num_output == 0:
            opened += 1
        if r.remaining_steps(max_model_len) <= 1:
            closed += 1
    return opened, closed


def shared_context_tokens(step: Any, block_size: int) -> int:
    """``StepShape.decode_shared_tokens`` of a twin step (read right after it was scheduled): over the KV blocks its
    decode items read, each block's readers beyond the first, times the block size. Requests share a block only
    through a prefix-cache hit, so a shared block is a full block of a prompt. A decode item is one the engine's
    step shape counts as one (``Engine._shape``): one token, its prompt computed, output already emitted; a decode
    group's members always are."""
    g_n = step.g_n
    return block_size * repeated_reads(
        r.blocks for i, (r, n) in enumerate(zip(step.reqs, step.ns))
        if i < g_n or (n == 1 and r.num_computed == r.seq.num_tokens and r.num_output > 0))


class SharedContextExtra:
    """A replay's step-time model that counts each step's shared decode context (``shared_context_tokens``) into the
    shape it times, for a profile whose ``decode.shared_context_fraction`` discounts it (``SharedContextStepTime``).
    It needs each step's members (``step_time_for``), so replays that use it run without decode runs. Replays only:
    the fleet simulation never counts shared context."""

    def __init__(self, base: Any, *, block_size: int) -> None:
        self.base = base
        self.block_size = int(block_size)
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self.woke_after_idle = getattr(base, "woke_after_idle", None)  # (IdleWakeExtra's hook, passed through)

    def step_time_for(self, step: Any) -> float:
        shared = shared_context_tokens(step, self.block_size)
        if not shared:
            return self.base.step_time_s(step.shape)
        sh = step.shape
        return self.base.step_time_s(StepShape(sh.decode_requests, sh.decode_context_tokens, sh.prefill_requests,
                                               sh.prefill_tokens, sh.prefill_attention_pairs, shared))

    def step_time_s(self, shape: StepShape) -> float:  # a step without its members: no shared context known
        return self.base.step_time_s(shape)

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        raise RuntimeError("shared context is counted one step at a time (decode runs are off)")


class StreamEndsExtra:
    """A server run's step-time model plus the front end's time per stream a step opens and closes (a profile's
    ``server.per_first_chunk_s`` and ``per_last_chunk_s``, fitted with ``twin calibrate --stream-ends``: in the
    recorded CPU server runs a step that sent a request's first or last chunk was followed by its next tokens
    later than the per-chunk time says, docs/calibration.md). It needs each step's members (``step_time_for``),
    so replays that use it run without decode runs. Replays only: the fleet simulation never builds it."""

    def __init__(self, base: Any, *, per_first_s: float, per_last_s: float, max_model_len: int) -> None:
        self.base = base
        self.per_first_s = float(per_first_s)
        self.per_last_s = float(per_last_s)
        self.max_model_len = int(max_model_len)
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self.woke_after_idle = getattr(base, "woke_after_idle", None)  # (IdleWakeExtra's hook, passed through)
        self._by_step = getattr(base, "step_time_for", None)

    def step_time_for(self, step: Any) -> float:
        t = self._by_step(step) if self._by_step is not None else self.base.step_time_s(step.shape)
        opened, closed = stream_ends_of(step, self.max_model_len)
        return t + self.per_first_s * opened + self.per_last_s * closed

    def step_time_s(self, shape: StepShape) -> float:  # a step without its members: no stream ends known
        return self.base.step_time_s(shape)

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        raise RuntimeError("stream ends are added one step at a time (decode runs are off)")


class IntakeExtra:
    """A server run's step-time model plus the front end's time per request the client sends while a step runs (a
    profile's ``server.per_request_in_s``, fitted with ``twin calibrate --intake``: in the recorded CPU server runs
    the next tokens came about 0.7 ms later for each request sent during the step, the API server parsing,
    tokenizing and handing it to the engine core on the core the engine shares; docs/calibration-sessions.md, "The front
    end's time per request taken in"). ``sends_s`` are the recorded client send times, on the replay's clock. The
    replica asks ``stretch_step`` with each step's start and duration; a step that grows can take in more sends, so
    the count is iterated to its fixed point. ``engine_per_request_s`` (profile replays: a profile's
    ``server.per_request_in_step_s``, fitted with ``twin calibrate --intake-step``) is the engine's own step time per
    such send, the intake slowing the engine on the cores it shares; it lengthens the step the same way but stays out
    of ``added_s`` (it is step time, not front end). It needs each step's start, so replays that use it run without
    decode runs. Replays only: the fleet simulation never builds it."""

    def __init__(self, base: Any, *, per_request_in_s: float, sends_s: Any, engine_per_request_s: float = 0.0) -> None:
        self.base = base
        self.per_request_in_s = float(per_request_in_s)
        self.engine_per_request_s = float(engine_per_request_s)  # (profile replays: the engine's own part)
        self.sends_s = sorted(float(t) for t in sends_s)
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self.woke_after_idle = getattr(base, "woke_after_idle", None)  # (IdleWakeExtra's hook, passed through)
        self._by_step = getattr(base, "step_time_for", None)
        self.added_s = 0.0  # the intake time added over the replay (``compare`` takes it out of the step-time sum)
        self.taken_in = 0  # requests counted

    def step_time_for(self, step: Any) -> float:
        return self._by_step(step) if self._by_step is not None else self.base.step_time_s(step.shape)

    def stretch_step(self, t0_s: float, duration_s: float) -> float:
        """``duration_s`` plus ``per_request_in_s + engine_per_request_s`` for each send in ``(t0_s, t0_s + the
        result]``."""
        sends, x = self.sends_s, self.per_request_in_s + self.engine_per_request_s
        lo = bisect_right(sends, t0_s)
        n = 0
        d = duration_s
        while True:
            m = bisect_right(sends, t0_s + d, lo) - lo
            if m == n:
                break
            n = m
            d = duration_s + x * n
        self.added_s += self.per_request_in_s * n
        self.taken_in += n
        return d

    def step_time_s(self, shape: StepShape) -> float:  # a step without its start: no sends known
        return self.base.step_time_s(shape)

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        raise RuntimeError("the intake time is added one step at a time (decode runs are off)")


def _unwrapped(model: Any) -> Any:
    """The step model under the replay's per-step wrappers (``IntakeExtra``, ``StreamEndsExtra``)."""
    while isinstance(model, (IntakeExtra, StreamEndsExtra)):
        model = model.base
    return model


def recorded_step_timing(result: RunResult) -> dict[str, Any]:
    """How a recorded-step replay timed its steps: ``{"matched": "work", "exact": ..., "scaled": ...,
    "modelled": ...}`` (``MatchedStepTimes``: a server run) or ``{"matched": "index"}`` (step *i* took the recorded
    step *i*'s time)."""
    m = _unwrapped(result.world.replica.step_model)
    if isinstance(m, MatchedStepTimes):
        return {"matched": "work", "exact": m.exact, "scaled": m.scaled, "modelled": m.modelled}
    return {"matched": "index"}


def run_label(run: dict[str, Any]) -> str:
    """``mode[, async scheduling], N requests`` of a replayed run (``compare``'s or a fidelity run entry's keys): the
    header that ``twin replay`` and ``twin fidelity`` print for it."""
    sched = ", async scheduling" if run.get("async_scheduling") else ""  # (a GPU recording; replayed so)
    return f"{run['mode']}{sched}, {run['requests']} requests"


def format_step_timing(timing: dict[str, Any]) -> str | None:
    """The line the fidelity table and ``twin replay`` print for ``recorded_step_timing``'s counts (None by index)."""
    if timing.get("matched") != "work":
        return None
    return (f"twin* steps: {timing['exact']} timed by the one recorded step that did their work, {timing['scaled']} "
            f"by the model at the speed of the recorded steps that did it, {timing['modelled']} by the model alone")


class NoisyStepTimes:
    """A step-time model whose every step's model-execution time is multiplied by a draw from the profile's
    fitted ``step_time_noise`` (``measured / fitted`` percentiles of the calibration steps, per regime).

    The time outside model execution (``fixed_s(requests_in_step)``: the per-step overhead, plus the server
    front end) is left as modelled; the noise was measured on ``elapsed_ms``, which does not include it.
    Draws are inverse-CDF on the 101 percentiles (linear in between) from a ``numpy`` generator seeded by the
    caller, consumed in step order, so the same run and profile give the same table.
    """

    def __init__(self, base: StepTimeModel, noise: Any, *, seed: int,
                 fixed_s: Callable[[int], float]) -> None:  # noise: a StepTimeNoise
        self.base = base
        self.fixed_s = fixed_s
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self._grid = np.linspace(0.0, 1.0, 101)
        self._decode = np.asarray(noise.decode, dtype=np.float64)
        self._prefill = np.asarray(noise.prefill, dtype=np.float64)
        self._rng = np.random.default_rng(seed)

    def step_time_s(self, shape: StepShape) -> float:
        t = self.base.step_time_s(shape)
        fixed = self.fixed_s(shape.decode_requests + shape.prefill_requests)
        q = self._decode if shape.prefill_requests == 0 else self._prefill
        ratio = float(np.interp(self._rng.random(), self._grid, q))
        return fixed + (t - fixed) * ratio

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        t = self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)
        fixed = self.fixed_s(decode_requests)
        return fixed + (t - fixed) * np.interp(self._rng.random(num_steps), self._grid, self._decode)


class HostSpeedStepTimes:
    """A step-time model whose every step's model-execution time is multiplied by ``factor``: the host's speed during
    a recorded run against the calibration's, as the run's host witness predicts it (``twin.calibration.witness.
    host_factor``; ``twin fidelity --host-witness``). The time outside model execution (``fixed_s``) is left as
    modelled, as ``NoisyStepTimes`` leaves it."""

    def __init__(self, base: StepTimeModel, factor: float, *, fixed_s: Callable[[int], float]) -> None:
        if not factor > 0:
            raise ValueError(f"host speed factor must be positive, not {factor}")
        self.base = base
        self.factor = float(factor)
        self.fixed_s = fixed_s
        self.overhead_s = getattr(base, "overhead_s", 0.0)

    def step_time_s(self, shape: StepShape) -> float:
        t = self.base.step_time_s(shape)
        fixed = self.fixed_s(shape.decode_requests + shape.prefill_requests)
        return fixed + (t - fixed) * self.factor

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        t = self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)
        fixed = self.fixed_s(decode_requests)
        return fixed + (t - fixed) * self.factor


class FirstStepExtra:
    """A step-time model whose first step takes ``first_step_s`` longer (a profile's ``first_step_s``: the cold start
    of a recorded run). Replays only: the fleet simulation never builds it."""

    def __init__(self, base: StepTimeModel, first_step_s: float) -> None:
        self.base = base
        self.first_step_s = float(first_step_s)
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self._started = False

    def _extra(self) -> float:
        if self._started:
            return 0.0
        self._started = True
        return self.first_step_s

    def step_time_s(self, shape: StepShape) -> float:
        return self.base.step_time_s(shape) + self._extra()

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        t = self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)
        if num_steps > 0:
            t[0] += self._extra()
        return t


class IdleWakeExtra:
    """A step-time model whose first step after the engine sat idle for at least ``idle_after_s`` takes
    ``idle_wake_s`` longer (a server section's fitted ``idle_wake_s``: in recorded CPU server runs, a request sent
    to a quiet server got its first token a few ms later than one sent while it was busy, most of it in that
    step's own recorded time; docs/calibration-sessions.md, "A quiet server's first step"). The replica reports each
    idle spell through ``woke_after_idle``; the step after it is always a single step (a prefill). Replays only:
    the fleet simulation never builds it."""

    def __init__(self, base: StepTimeModel, idle_wake_s: float, idle_after_s: float) -> None:
        self.base = base
        self.idle_wake_s = float(idle_wake_s)
        self.idle_after_s = float(idle_after_s)
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self._pending = 0.0

    def woke_after_idle(self, idle_s: float) -> None:
        self._pending = self.idle_wake_s if idle_s >= self.idle_after_s else 0.0

    def step_time_s(self, shape: StepShape) -> float:
        extra, self._pending = self._pending, 0.0
        return self.base.step_time_s(shape) + extra

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        t = self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)
        if num_steps > 0 and self._pending:
            t = t.copy()
            t[0] += self._pending
        self._pending = 0.0
        return t


class BatchChangeExtra:
    """A step-time model whose decode-only steps take ``batch_change_s`` longer when they decode fewer requests than
    the decode-only step before them (``profile.decode_batch_changed``: a request finished or was preempted). A
    profile's fitted decode ``batch_change_s``: in most recorded CPU runs vLLM spent 2-3 ms more on such a step
    (docs/calibration.md). It remembers the previous step, so one instance serves one replica's steps in order:
    replays only; the fleet simulation shares one step model between replicas and never builds it."""

    def __init__(self, base: StepTimeModel, batch_change_s: float) -> None:
        self.base = base
        self.batch_change_s = float(batch_change_s)
        self.overhead_s = getattr(base, "overhead_s", 0.0)
        self._prev: tuple[bool, int] | None = None  # (previous step decode-only, its decode requests)

    def _changed(self, decode_only: bool, n: int) -> bool:
        changed = decode_only and self._prev is not None and self._prev[0] and n < self._prev[1]
        self._prev = (decode_only, n)
        return changed

    def step_time_s(self, shape: StepShape) -> float:
        t = self.base.step_time_s(shape)
        return t + self.batch_change_s if self._changed(shape.is_decode_only, shape.decode_requests) else t

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        t = np.array(self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps), dtype=np.float64)
        if num_steps > 0 and self._changed(True, decode_requests):
            t[0] += self.batch_change_s
        return t


def request_specs(rec: RecordedRun, *, arrival_delay_s: float = 0.0) -> list[RequestSpec]:
    """The recorded requests; each reaches the engine ``arrival_delay_s`` after its recorded send time."""
    specs = []
    for r in rec.requests:
        specs.append(RequestSpec(
            request_id=r.request_id, arrival_s=float(r.arrival_s) + arrival_delay_s,
            pieces=(("ids", tuple(r.prompt_token_ids)),),
            prompt_tokens=len(r.prompt_token_ids), output_tokens=max(r.output_tokens, 1),
            max_tokens=max(r.max_tokens, 1), output_segment=stable_hash(f"{rec.path.name}/{r.request_id}")))
    return specs


def replay_scenario(rec: RecordedRun, profile: str | None) -> Any:
    info = rec.run
    raw = {
        "name": f"replay-{rec.path.name}",
        "description": f"replay of recorded run {rec.path.name} ({info.engine} {info.engine_version}, {info.mode})",
        "workload": {"kind": "synthetic", "num_requests": max(len(rec.requests), 1),
                     "arrival": {"kind": "offline"}, "prompt_tokens": {"kind": "constant", "value": 1},
                     "output_tokens": {"kind": "constant", "value": 1}},
        "replica": {
            "step_time": {"kind": "profile", "profile": profile} if profile else {"kind": "fixed"},
            "max_decode_run_steps": 512,
            "engine": {"block_size": info.block_size, "num_gpu_blocks": info.num_gpu_blocks,
                       "max_num_batched_tokens": info.max_num_batched_tokens, "max_num_seqs": info.max_num_seqs,
                       "max_model_len": info.max_model_len, "enable_chunked_prefill": info.enable_chunked_prefill,
                       "enable_prefix_caching": info.enable_prefix_caching,
                       "async_scheduling": info.async_scheduling},
        },
        "output": {"record_iterations": True, "record_token_times": True},
    }
    return parse_scenario(raw, source=str(rec.path))


def server_front_end(rec: RecordedRun, profile: str | None) -> Any:
    """The profile's ``server`` section when ``rec`` was recorded through the API server, else None."""
    if rec.run.mode != "server" or profile is None:
        return None
    from twin.engine_profiles import load_profile

    return load_profile(profile).spec.server


def replay(rec: RecordedRun, *, profile: str | None, step_times: str = "profile", noise: bool | None = None,
           noise_seed: int = 0, host_speed: float = 1.0) -> RunResult:
    """Simulate ``rec`` in the twin. ``step_times`` is ``"profile"`` or ``"recorded"``. ``noise``: multiply
    each profile step time by a draw from the profile's fitted ``step_time_noise`` (``NoisyStepTimes``, seeded
    by the run's folder name); True is an error when the profile has no such table. None (the default): on when
    the profile has the table, off otherwise (chosen by leave-one-run-out cross-validation on both calibration
    sweeps, docs/calibration.md). Recorded step times are never noised. ``noise_seed``: another draw of the noise
    (0, the default, is the run's own seed; k > 0 a different one per k), to see the twin's own spread. A profile's
    ``first_step_s`` (server runs: its server section's), where fitted, is added to the first step of a profile
    replay (``FirstStepExtra``), never to recorded step times; likewise a fitted decode ``batch_change_s``
    (``BatchChangeExtra``) and a server section's ``idle_wake_s`` (``IdleWakeExtra``). A server section's stream-end
    and intake terms, where fitted, are added to profile and recorded replays alike (``StreamEndsExtra``,
    ``IntakeExtra``), its engine intake term ``per_request_in_step_s`` to profile replays only. ``host_speed``:
    multiply a profile replay's model-execution time (noise and batch-change term included, the other extras not)
    by it (``HostSpeedStepTimes``; 1, the default, leaves it as modelled); recorded step times are never scaled."""
    if step_times not in ("profile", "recorded"):
        raise ValueError("step_times must be 'profile' or 'recorded'")
    if step_times == "profile" and profile is None:
        raise ValueError("a profile is needed unless step times are taken from the recording")
    sc = replay_scenario(rec, profile)
    model: StepTimeModel | None = None
    server = server_front_end(rec, profile)
    if step_times == "profile":
        from twin.engine_profiles import load_profile

        assert profile is not None
        prof = load_profile(profile)
        if server is not None:
            from twin.calibration.server import ServerStepTimeModel

            srv = ServerStepTimeModel(server.step_time, per_chunk_s=server.per_chunk_s)
            model, fixed_s, coefficients, table = srv, srv.front_end_s, server.step_time, server.step_time_noise
        else:
            base = prof.step_time_model()
            model, coefficients, table = base, prof.spec.step_time, prof.spec.step_time_noise
            fixed_s = lambda n, o=base.overhead_s: o  # noqa: E731
        assert coefficients is not None
        if coefficients.decode.batch_change_s:
            model = BatchChangeExtra(model, coefficients.decode.batch_change_s)
        if noise and table is None:
            raise ValueError(f"profile {profile!r} has no fitted "
                             f"{'server.' if server is not None else ''}step_time_noise (refit it with twin calibrate)")
        if noise is not False and table is not None:
            key = f"noise/{rec.path.name}" + (f"/{noise_seed}" if noise_seed else "")
            model = NoisyStepTimes(model, table, seed=stable_hash(key), fixed_s=fixed_s)
        if host_speed != 1.0:
            model = HostSpeedStepTimes(model, host_speed, fixed_s=fixed_s)
        if coefficients.first_step_s:
            model = FirstStepExtra(model, coefficients.first_step_s)
        if server is not None and server.idle_wake_s:
            from twin.calibration.server import IDLE_AFTER_S

            model = IdleWakeExtra(model, server.idle_wake_s, IDLE_AFTER_S)
        if coefficients.decode.shared_context_fraction < 1.0:
            model = SharedContextExtra(model, block_size=rec.run.block_size)
    if step_times == "recorded":
        if rec.iterations is None:
            raise ValueError(f"{rec.path}: no iterations.csv, so there are no recorded step times")
        fallback = None
        overhead = 0.0
        per_chunk = 0.0
        if profile is not None:
            from twin.engine_profiles import load_profile

            fallback = load_profile(profile).step_time_model()
            overhead = float(getattr(fallback, "overhead_s", 0.0) or 0.0)
        if server is not None:
            from twin.calibration.server import ServerStepTimeModel

            fallback = ServerStepTimeModel(server.step_time, per_chunk_s=server.per_chunk_s)
            overhead, per_chunk = server.step_time.overhead_s, server.per_chunk_s
        model = None
        if server is not None:  # matched by work where the run's FCFS reconstruction holds (MatchedStepTimes)
            from twin.calibration.server import ReconstructionError, reconstruct

            try:
                model = MatchedStepTimes(reconstruct(rec), fallback, overhead_s=overhead, per_chunk_s=per_chunk)
            except ReconstructionError:
                pass
        if model is None:
            model = RecordedStepTimes(rec.iterations.elapsed_ms, overhead_s=overhead, fallback=fallback,
                                      per_chunk_s=per_chunk)
    if server is not None and server.has_stream_ends:
        assert model is not None
        model = StreamEndsExtra(model, per_first_s=server.per_first_chunk_s, per_last_s=server.per_last_chunk_s,
                                max_model_len=rec.run.max_model_len)
    engine_in = server.per_request_in_step_s if server is not None and step_times == "profile" else 0.0
    if server is not None and (server.per_request_in_s or engine_in):
        assert model is not None
        model = IntakeExtra(model, per_request_in_s=server.per_request_in_s,
                            sends_s=[r.arrival_s for r in rec.requests], engine_per_request_s=engine_in)
    if step_times == "recorded" or isinstance(model, (StreamEndsExtra, IntakeExtra, SharedContextExtra)):
        # (these time a step at a time)
        sc = sc.model_copy(update={"replica": sc.replica.model_copy(update={"max_decode_run_steps": 1})})
    delay = server.arrival_s if server is not None else 0.0
    result = run_scenario(sc, specs=request_specs(rec, arrival_delay_s=delay), step_model=model)
    if delay and result.ok:
        result.tables["requests"] = _measured_from_send(result.tables["requests"], delay)
    return result


def _measured_from_send(requests: pa.Table, delay_s: float) -> pa.Table:
    """Requests table with times measured from the client's send (``delay_s`` before the engine saw it)."""
    out = requests
    for name in ("arrival_s", "ttft_s", "e2e_s"):
        col = out.column(name).to_numpy(zero_copy_only=False)
        out = out.set_column(out.schema.get_field_index(name), name,
                             pa.array(col - delay_s if name == "arrival_s" else col + delay_s))
    if "token_times_s" in out.column_names:
        tt = [[t + delay_s for t in ts] for ts in out.column("token_times_s").to_pylist()]
        out = out.set_column(out.schema.get_field_index("token_times_s"), "token_times_s",
                             pa.array(tt, pa.list_(pa.float64())))
    return out


# ---- comparison ---------------------------------------------------------------------------------------
def _latencies(token_times: list[list[float]], e2e: list[float | None]) -> dict[str, np.ndarray]:
    ttft = np.array([t[0] for t in token_times if t], dtype=np.float64)
    itl = np.concatenate([np.diff(t) for t in token_times if len(t) > 1] or [np.zeros(0)])
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1], dtype=np.float64)
    e = np.array([x if x is not None else (t[-1] if t else np.nan) for x, t in zip(e2e, token_times)],
                 dtype=np.float64)
    return {"ttft_s": ttft, "itl_s": itl, "tpot_s": tpot, "e2e_s": e[np.isfinite(e)]}


def real_latencies(rec: RecordedRun) -> dict[str, np.ndarray]:
    return _latencies([list(r.token_times_s or ()) for r in rec.requests], [r.e2e_s for r in rec.requests])


def twin_latencies(result: RunResult) -> dict[str, np.ndarray]:
    req = result.tables["requests"].to_pydict()
    return _latencies(req["token_times_s"], req["e2e_s"])


def _rel(twin: float, real: float) -> float | None:
    if real is None or twin is None or not np.isfinite(real) or not np.isfinite(twin) or real == 0:
        return None
    return (twin - real) / real


def compare(rec: RecordedRun, result: RunResult, *, server: Any = None) -> dict[str, Any]:
    """Exact items (steps, composition, preemptions, prefix hits) and latency percentiles, real vs twin.

    ``server``: the profile's ``server`` section a server run was replayed with (``server_front_end``). The
    twin's logged step times leave out only the front end's per-step base, so its per-chunk and per-stream time is
    taken out of the twin's step-time sum here, as the recording's ``elapsed_ms`` has none of it."""
    out: dict[str, Any] = {"run": rec.path.name, "mode": rec.run.mode, "requests": len(rec.requests),
                           "async_scheduling": rec.run.async_scheduling}
    eng = result.world.engine
    twin_it = result.tables["iterations"].to_pydict()
    twin_comp = list(zip(*(twin_it[c] for c in COMPOSITION)))
    if rec.iterations is not None:
        real_comp = rec.iterations.composition()
        first = next((i for i, (a, b) in enumerate(zip(real_comp, twin_comp)) if a != b), None)
        if first is None and len(real_comp) != len(twin_comp):
            first = min(len(real_comp), len(twin_comp))
        out["steps"] = {"real": len(real_comp), "twin": len(twin_comp), "match": len(real_comp) == len(twin_comp)}
        out["composition"] = {
            "match": first is None, "first_mismatch_step": first,
            "real_at_mismatch": list(real_comp[first]) if first is not None and first < len(real_comp) else None,
            "twin_at_mismatch": list(twin_comp[first]) if first is not None and first < len(twin_comp) else None,
        }
        real_ms = float(np.sum(rec.iterations.elapsed_ms))
        twin_s = float(np.sum(twin_it["elapsed_ms"])) / 1000.0
        if server is not None and server.per_chunk_s:
            twin_s -= server.per_chunk_s * (sum(twin_it["ctx_requests"]) + sum(twin_it["gen_requests"]))
        if server is not None and server.has_stream_ends:  # each request opens one stream and closes one
            twin_s -= (server.per_first_chunk_s + server.per_last_chunk_s) * len(rec.requests)
        if isinstance(result.world.replica.step_model, IntakeExtra):
            twin_s -= result.world.replica.step_model.added_s
        out["step_time_sum_s"] = {"real": real_ms / 1000.0, "twin": twin_s}
        out["step_time_sum_s"]["rel_error"] = _rel(out["step_time_sum_s"]["twin"], out["step_time_sum_s"]["real"])
    pre_real = rec.metric("num_preemptions")
    out["preemptions"] = {"real": pre_real, "twin": eng.num_preemptions,
                          "match": None if pre_real is None else int(pre_real) == eng.num_preemptions}
    hits_real = rec.metric("prefix_cache_hits")
    q_real = rec.metric("prefix_cache_queries")
    out["prefix_cache_hits"] = {"real": hits_real, "twin": eng.prefix_cache_hits,
                                "match": None if hits_real is None else int(hits_real) == eng.prefix_cache_hits}
    out["prefix_cache_queries"] = {"real": q_real, "twin": eng.prefix_cache_queries}
    twin_req = result.tables["requests"].to_pydict()
    twin_cached = dict(zip(twin_req["request_id"], twin_req["num_cached_tokens"]))
    per_req = [(r.num_cached_tokens, twin_cached.get(r.request_id)) for r in rec.requests
               if r.num_cached_tokens is not None]
    out["num_cached_tokens"] = {"compared": len(per_req), "match": sum(1 for a, b in per_req if a == b)}
    real_l, twin_l = real_latencies(rec), twin_latencies(result)
    lat: dict[str, Any] = {}
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        a, b = distribution(real_l[key]), distribution(twin_l[key])
        lat[key] = {p: {"real": a[p], "twin": b[p], "rel_error": _rel(b[p], a[p])} for p in ("p50", "p90", "p99", "mean")}
    out["latency"] = lat
    dur_real = max((r.arrival_s + (r.e2e_s or 0.0) for r in rec.requests), default=0.0)
    tok = sum(r.output_tokens for r in rec.requests)
    out["output_tokens_per_s"] = {"real": tok / dur_real if dur_real else None,
                                  "twin": tok / result.summary["sim_time_s"] if result.summary["sim_time_s"] else None}
    out["output_tokens_per_s"]["rel_error"] = _rel(out["output_tokens_per_s"]["twin"] or np.nan,
                                                  out["output_tokens_per_s"]["real"] or np.nan)
    return out


@dataclass
class ReplayOutcome:
    result: RunResult
    comparison: dict[str, Any]
