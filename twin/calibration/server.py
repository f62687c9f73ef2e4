"""The OpenAI-server front end of a recorded vLLM run, and the server-mode step time: reconstruct, fit, apply.

In server mode a request's batches depend on when it reaches the engine, so a replay's steps do not line up
with the recording and ``calibrate`` cannot pair the twin's step shapes with recorded durations. But the
recorded iteration log, the per-request prompt/cached/output lengths and vLLM's FCFS scheduling determine the
shapes by themselves when nothing is preempted: walking the requests in send order, step *i*'s ``ctx_tokens``
are the next prompt chunks and its ``gen_requests`` are the requests that already have a token and still owe
one. :func:`reconstruct` does that walk and checks it against the log (the decode count of every step must
come out equal to ``gen_requests``); it also says which step emitted each streamed token.

From the reconstructed steps of server runs :func:`fit_server` fits (see docs/calibration.md, "Server mode"):

* **step time in server mode**: the same two regimes as the offline fit, refitted (``robust_fit``) to the
  server steps' ``elapsed_ms``: on this machine the API server, the engine core and the client share the
  core the CPU worker leaves, and the worker's steps run slower than offline;
* **per-step front-end time**: the time between a step's model output and the next step's tokens reaching
  the client that ``elapsed_ms`` does not cover, as ``base + per_chunk * (streamed chunks of the step)``
  (each request that gets a token in a step is one SSE chunk the API server detokenizes and writes while the
  engine core waits for its share of the core). Least squares over consecutive token-emitting steps. Optional
  terms: per stream opened and closed (``--stream-ends``) and per request the client sent while the step ran
  (``--intake``: the API server parses, tokenizes and hands a new request to the engine core on the same core);
* **arrival time**: from the client's send to the request being schedulable in the engine (HTTP, request
  parsing, IPC to the engine core) plus the last hop back to the client, measured on requests that reached an
  idle engine: ``TTFT - (recorded time of its one prefill step + that step's front-end time)``.

:class:`ServerStepTimeModel` is the fitted step time as a ``StepTimeModel``; ``twin.replay`` uses it (and
shifts arrivals by the arrival time) for runs whose run.json says ``mode: server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twin.calibration.recorded import RecordedRun
from twin.engine_profiles.profile import SharedContextStepTime
from twin.engine_profiles.step import StepShape, prefill_attention_work, repeated_reads


class ReconstructionError(ValueError):
    """The iteration log cannot be explained by FCFS scheduling of the recorded requests."""


@dataclass
class ServerSteps:
    """A server run's steps as reconstructed from its iteration log."""

    path: Path
    shapes: list[StepShape]
    elapsed_s: np.ndarray
    chunks: np.ndarray  # streamed chunks per step: requests that got a token in the step
    first_step: dict[str, int]  # request id -> step of its first prefill chunk
    token_steps: dict[str, np.ndarray]  # request id -> step that emitted each of its tokens
    end_s: dict[int, float] = field(default_factory=dict)  # step -> median client time of its tokens
    # request id -> its prefill chunks as (first prompt token computed, one past the last, step)
    chunk_steps: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    sent: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per step (sends_during)


def reconstruct(rec: RecordedRun) -> ServerSteps:
    """Step shapes and token-to-step assignment of a recorded run without preemptions (see the module doc).

    Raises :class:`ReconstructionError` when the run has preemptions, lacks per-request cached counts or
    token times, or when the walk does not reproduce the log's ``gen_requests`` at every step.
    """
    it = rec.iterations
    if it is None or len(it) == 0:
        raise ReconstructionError(f"{rec.path}: no iterations.csv")
    if (rec.metric("num_preemptions") or 0) != 0:
        raise ReconstructionError(f"{rec.path}: preemptions make the FCFS walk ambiguous")
    reqs = sorted(rec.requests, key=lambda r: (r.arrival_s, r.request_id))
    if any(r.token_times_s is None or len(r.token_times_s) != r.output_tokens for r in reqs):
        raise ReconstructionError(f"{rec.path}: a request lacks per-token times")
    cached = [r.num_cached_tokens or 0 for r in reqs]
    computed = list(cached)  # prompt tokens whose KV is present
    outputs = [0] * len(reqs)  # tokens emitted so far
    pending = 0  # index of the first request whose prefill is not complete
    decoding: list[int] = []  # requests with 1 <= output < output_tokens, in admission order
    first_step: dict[str, int] = {}
    token_steps: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    chunk_steps: dict[str, list[tuple[int, int, int]]] = {r.request_id: [] for r in reqs}
    shapes: list[StepShape] = []
    chunks = np.zeros(len(it), dtype=np.int64)
    for i, (ctx_r, ctx_t, gen_r, gen_t) in enumerate(it.composition()):
        if len(decoding) != gen_r or gen_t != gen_r:
            raise ReconstructionError(
                f"{rec.path}: step {i}: the walk has {len(decoding)} decoding requests, the log {gen_r} "
                f"({gen_t} tokens)")
        d_ctx = sum(reqs[j].prompt_tokens + outputs[j] for j in decoding)  # KV incl. the token computed now
        emitted = list(decoding)
        # prefill chunks: FCFS from the first incomplete prompt
        left, touched, p_tok, p_pairs = int(ctx_t), 0, 0, 0
        j = pending
        while touched < ctx_r:
            if j >= len(reqs):
                raise ReconstructionError(f"{rec.path}: step {i}: {ctx_r} context requests, more than were sent")
            need = reqs[j].prompt_tokens - computed[j]
            n = need if touched < ctx_r - 1 else min(need, left)
            if n <= 0 or n > left:
                raise ReconstructionError(f"{rec.path}: step {i}: context tokens {ctx_t} do not split into "
                                          f"{ctx_r} FCFS chunks")
            first_step.setdefault(reqs[j].request_id, i)
            chunk_steps[reqs[j].request_id].append((computed[j], computed[j] + n, i))
            p_pairs += prefill_attention_work(computed[j], n)
            computed[j] += n
            p_tok += n
            left -= n
            touched += 1
            if computed[j] == reqs[j].prompt_tokens:
                emitted.append(j)
                j += 1
        if left != 0:
            raise ReconstructionError(f"{rec.path}: step {i}: {left} context tokens left over")
        pending = j
        shapes.append(StepShape(decode_requests=gen_r, decode_context_tokens=d_ctx, prefill_requests=touched,
                                prefill_tokens=p_tok, prefill_attention_pairs=p_pairs))
        chunks[i] = len(emitted)
        still = []
        for k in emitted:
            outputs[k] += 1
            token_steps[reqs[k].request_id].append(i)
            if outputs[k] < reqs[k].output_tokens:
                still.append(k)
        decoding = still
    if decoding or pending < len(reqs):
        raise ReconstructionError(f"{rec.path}: requests left unfinished after the last step")
    steps = ServerSteps(path=rec.path, shapes=shapes, elapsed_s=it.elapsed_ms / 1000.0, chunks=chunks,
                        first_step=first_step,
                        token_steps={k: np.asarray(v, dtype=np.int64) for k, v in token_steps.items()},
                        chunk_steps=chunk_steps)
    per_step: dict[int, list[float]] = {}
    for r in reqs:
        assert r.token_times_s is not None
        for k, t in zip(steps.token_steps[r.request_id].tolist(), r.token_times_s, strict=True):
            per_step.setdefault(k, []).append(r.arrival_s + t)
    steps.end_s = {k: float(np.median(v)) for k, v in sorted(per_step.items())}
    steps.sent = sends_during(steps, {r.request_id: r.arrival_s for r in reqs})
    return steps


def decode_shared_tokens(rec: RecordedRun, steps: ServerSteps) -> np.ndarray:
    """Per reconstructed step, ``StepShape.decode_shared_tokens`` of its decode items as far as the recording shows
    them (0 on a step that carries a prefill: only decode-only steps are counted). A step's decode items are the
    requests that got a token in it; a request reads its prompt's full KV blocks, and two requests read the same
    block where their prompts agree up to its end (the prefix cache's block hash chain). Requests that computed
    the same prefix at the same time hold separate copies in vLLM; the recording does not show that, and the
    count takes them as shared."""
    bs = rec.run.block_size
    chains: dict[str, list[int]] = {}
    for q in rec.requests:
        ids, h, chain = q.prompt_token_ids, 0, []
        for i in range(len(ids) // bs):
            h = hash((h, tuple(ids[i * bs:(i + 1) * bs])))
            chain.append(h)
        chains[q.request_id] = chain
    members: list[list[str]] = [[] for _ in steps.shapes]
    for rid, ts in steps.token_steps.items():
        for i in ts.tolist():
            members[i].append(rid)
    out = np.zeros(len(steps.shapes), dtype=np.int64)
    for i, (sh, rids) in enumerate(zip(steps.shapes, members, strict=True)):
        if not sh.prefill_requests and len(rids) > 1:
            out[i] = bs * repeated_reads(chains[rid] for rid in rids)
    return out


def fit_shared_fraction(model: Any, shapes: Sequence[StepShape], elapsed_s: np.ndarray, shared: np.ndarray,
                        runs: np.ndarray) -> tuple[float, int, int]:
    """``DecodeCoefficients.shared_context_fraction`` for ``model`` (the other terms as fitted): the fraction in
    0, 0.01, ..., 1 with the least squared log error of the model-execution time over the decode-only steps, each
    run at its own speed level (the run's mean log error is taken out before squaring: a host runs 10-40 % slower in
    one run than in the next, which a fraction fitted on absolute times would take up). So the fraction is what the
    steps with shared context say against the steps of the same run without it. ``runs``: each step's run; only the
    runs with shared context count. Returns the fraction, the number of decode-only steps with shared context and
    the number of runs."""
    decode = np.asarray([not sh.prefill_requests and sh.decode_requests > 0 for sh in shapes]) & (elapsed_s > 0)
    with_shared = np.unique(runs[decode & (shared > 0)])
    idx = np.flatnonzero(decode & np.isin(runs, with_shared))
    if with_shared.size == 0:
        raise ValueError("no decode-only step with shared context")
    y = np.log(elapsed_s[idx])
    groups = [np.flatnonzero(runs[idx] == r) for r in with_shared]
    best = (np.inf, 1.0)
    for f in np.linspace(0.0, 1.0, 101):
        m = SharedContextStepTime(model, float(f))
        pred = np.asarray([m.step_time_s(StepShape(shapes[i].decode_requests, shapes[i].decode_context_tokens,
                                                    decode_shared_tokens=int(shared[i]))) - m.overhead_s
                           for i in idx])
        r = y - np.log(np.maximum(pred, 1e-9))
        err = float(sum(np.sum((r[g] - r[g].mean()) ** 2) for g in groups))
        if err < best[0] - 1e-15:
            best = (err, round(float(f), 2))
    return best[1], int(np.count_nonzero(shared[idx])), int(with_shared.size)


def _in_flight(steps: ServerSteps) -> np.ndarray:
    """Per step i, the requests admitted by step i and not finished by it (the engine is busy after step i when
    this is positive)."""
    n = len(steps.shapes)
    admitted = np.zeros(n + 1, dtype=np.int64)  # requests first scheduled at step i
    finished = np.zeros(n + 1, dtype=np.int64)  # requests whose last token came at step i
    for rid, first in steps.first_step.items():
        admitted[first] += 1
        finished[int(steps.token_steps[rid][-1])] += 1
    return np.cumsum(admitted) - np.cumsum(finished)


def sends_during(steps: ServerSteps, sends_s: dict[str, float]) -> np.ndarray:
    """Per step k, how many requests (``sends_s``: request id -> client send time) the client sent while it ran:
    those sent in ``(end_s[k-1], end_s[k]]`` when the engine was busy between the two steps (some request admitted
    by step k-1 unfinished), and in ``(send of the earliest request step k admitted, end_s[k]]`` when step k started
    on that request reaching an idle engine (its own send, and those before it, are not taken in while step k runs:
    as in the twin's replay, where the step starts on the arrival). 0 where step k streamed nothing, or step k-1
    nothing with the engine busy."""
    sends = np.sort(np.fromiter(sends_s.values(), dtype=np.float64, count=len(sends_s)))
    earliest: dict[int, float] = {}  # step -> the earliest send among the requests it admitted
    for rid, first in steps.first_step.items():
        earliest[first] = min(earliest.get(first, np.inf), sends_s[rid])
    in_flight = _in_flight(steps)
    out = np.zeros(len(steps.shapes), dtype=np.int64)
    for k, t_b in steps.end_s.items():
        if k > 0 and in_flight[k - 1] > 0:
            t_a = steps.end_s.get(k - 1)
        else:
            t_a = earliest.get(k)
        if t_a is not None:
            out[k] = int(np.searchsorted(sends, t_b, side="right") - np.searchsorted(sends, t_a, side="right"))
    return out


def stream_ends(steps: ServerSteps) -> tuple[np.ndarray, np.ndarray]:
    """``(firsts, lasts)``: per step, the requests whose first token (a stream's first chunk) and whose last token
    (its final chunk) it emitted."""
    n = len(steps.shapes)
    firsts = np.zeros(n, dtype=np.int64)
    lasts = np.zeros(n, dtype=np.int64)
    for ts in steps.token_steps.values():
        if ts.size:
            firsts[int(ts[0])] += 1
            lasts[int(ts[-1])] += 1
    return firsts, lasts


def _busy_pairs(steps: ServerSteps) -> tuple[np.ndarray, np.ndarray]:
    """``(gaps_s, later)``: for every pair of consecutive streaming steps a, a+1 with the engine busy in between,
    the client-side interval between their tokens less step a+1's recorded model time, and a+1."""
    in_flight = _in_flight(steps)
    gaps, later = [], []
    for a, t_a in steps.end_s.items():
        t_b = steps.end_s.get(a + 1)
        if t_b is not None and in_flight[a] > 0:
            gaps.append(t_b - t_a - float(steps.elapsed_s[a + 1]))
            later.append(a + 1)
    return np.asarray(gaps, dtype=np.float64), np.asarray(later, dtype=np.int64)


def front_end_samples(steps: ServerSteps) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(gaps_s, chunks, firsts, lasts)`` for every pair of consecutive steps a, a+1 that both streamed tokens with
    the engine busy in between (some request admitted by step a still unfinished): the client-side interval between
    their tokens minus step a+1's recorded model time, and step a+1's streamed chunks, first chunks and last chunks
    (``stream_ends``). Pairs with the engine idle in between are left out: their interval includes the wait for the
    next request. ``front_end_sent`` gives the same pairs' requests sent."""
    gaps, b = _busy_pairs(steps)
    step_firsts, step_lasts = stream_ends(steps)
    return gaps, steps.chunks[b].astype(np.int64), step_firsts[b], step_lasts[b]


def front_end_sent(steps: ServerSteps) -> np.ndarray:
    """For the pairs of ``front_end_samples``, in its order: the requests sent while the later step ran
    (``ServerSteps.sent``, the column ``twin calibrate --intake`` adds to the fit)."""
    return steps.sent[_busy_pairs(steps)[1]]


def fit_front_end(gaps_s: np.ndarray, chunks: np.ndarray, ends: tuple[np.ndarray, np.ndarray] | None = None, *,
                  sent: np.ndarray | None = None) -> tuple[float, float, float, float, float]:
    """``gap = base + per_chunk * chunks`` by non-negative least squares: ``(base_s, per_chunk_s, 0, 0, 0)``. With
    ``ends`` = ``(firsts, lasts)`` (``front_end_samples``), ``+ per_first * firsts + per_last * lasts`` as well
    (``twin calibrate --stream-ends``); with ``sent`` (``front_end_sent``), ``+ per_in * sent`` (``--intake``):
    ``(base_s, per_chunk_s, per_first_chunk_s, per_last_chunk_s, per_request_in_s)``, 0 for a term not fitted.

    Least squares, not a robust fit, so the twin's summed front-end time equals the recorded one (E2E and
    throughput add the gaps up). With the idle pairs left out (``front_end_samples``) the largest gap in the
    committed server runs is 48 ms, against a median of 1.4 ms.
    """
    from twin.engine_profiles.fit import nnls

    cols = [np.ones(gaps_s.size), chunks.astype(np.float64)]
    if ends is not None:
        cols += [np.asarray(e, dtype=np.float64) for e in ends]
    if sent is not None:
        cols.append(np.asarray(sent, dtype=np.float64))
    coef = [float(c) for c in nnls(np.column_stack(cols), np.asarray(gaps_s, dtype=np.float64))]
    base_s, per_chunk_s = coef[0], coef[1]
    per_first_s, per_last_s = (coef[2], coef[3]) if ends is not None else (0.0, 0.0)
    per_in_s = coef[-1] if sent is not None else 0.0
    return base_s, per_chunk_s, per_first_s, per_last_s, per_in_s


def arrival_bounds(rec: RecordedRun, steps: ServerSteps, *, front_end_s: float,
                   step_front_s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per request, the interval ``(lower, upper]`` its arrival time must lie in to be first scheduled where it was,
    relative to its send time (``lower`` is -inf where there is no such bound).

    A request first scheduled in step k reached the engine before step k started. When step k-1's tokens
    reached the client after the send, step k started then (the engine was busy), and, if step k-1 had room
    left in its token budget, the request arrived after step k-1 started (else it would have joined it).
    When step k-1's tokens came before the send (or there is no step k-1), the engine was idle and started step
    k on the arrival: the interval is ``(start - front_end_s, start]`` with ``start`` the client time of step
    k's tokens less step k's recorded time (and the front end's ``front_end_s``), when step k finished its prompt.
    With ``step_front_s`` (each step's modelled front-end time, ``step_front_end_s``: a fit with stream ends) that
    interval is centred on step k's own front-end time instead, its half-width still ``front_end_s``.

    A run recorded with async scheduling (``RunInfo.async_scheduling``: a GPU's default) formed step k as step k-1
    started, so on a busy engine the bounds are a step earlier: the request came before step k-2's tokens and, if
    step k-1 had room, after step k-3's; unless it was sent after step k-2's tokens, when step k can only have been
    formed once step k-1 ended (nothing ran on) and the synchronous bounds hold.
    """
    budget = rec.run.max_num_batched_tokens
    formed_back = 1 if rec.run.async_scheduling else 0  # async: step k was formed as step k-1 started
    lower, upper = [], []
    for r in rec.requests:
        k = steps.first_step[r.request_id]
        prev_end = steps.end_s.get(k - 1)
        if prev_end is not None and prev_end > r.arrival_s:  # busy engine
            formed = steps.end_s.get(k - 1 - formed_back)  # (the client time of the tokens of the step before)
            if formed is None or formed <= r.arrival_s:  # formed after the send (nothing ran on), or no tokens
                # date that step: the synchronous bound, the looser one
                formed, j = prev_end, k - 1
            else:
                j = k - 1 - formed_back
            start_prev = steps.end_s.get(j - 1)
            room = steps.shapes[k - 1].total_tokens < budget
            upper.append(formed - r.arrival_s)
            lower.append(start_prev - r.arrival_s if (room and start_prev is not None) else -np.inf)
        elif steps.token_steps[r.request_id][0] == k:  # idle engine, one-step prefill
            front = front_end_s if step_front_s is None else float(step_front_s[k])
            start = steps.end_s[k] - float(steps.elapsed_s[k]) - front
            upper.append(start - r.arrival_s + front_end_s)
            lower.append(start - r.arrival_s - front_end_s)
    return np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64)


# A request reaching an engine that has run no step for at least this long is an idle wake (the profile's
# ``server.idle_wake_s``, fitted with ``twin calibrate --idle-wake``). In the committed CPU server runs the first
# step of a request sent to an idle engine ran +0.7 to +1.7 ms over the server fit (medians) after 0-20 ms of idle
# time and +1.7 to +2.7 ms after more than 20 ms (docs/calibration-sessions.md, "A quiet server's first step").
IDLE_AFTER_S = 0.02


def idle_wakes(rec: RecordedRun, steps: ServerSteps, *, arrival_s: float) -> list[tuple[int, float, float]]:
    """The steps that start on a request reaching an idle engine, as ``(step, ready_s, first_token_s)``: step k is
    one when its earliest-sent request's ready time (``send + arrival_s``) is at least ``IDLE_AFTER_S`` after step
    k-1's tokens reached the client (or k = 0), and that request's first token came from step k."""
    out: list[tuple[int, float, float]] = []
    seen: set[int] = set()
    for r in sorted(rec.requests, key=lambda x: (x.arrival_s, x.request_id)):
        k = steps.first_step.get(r.request_id)
        if k is None or k in seen:
            continue
        seen.add(k)
        ts = steps.token_steps.get(r.request_id)
        if ts is None or ts.size == 0 or int(ts[0]) != k or not r.token_times_s:
            continue
        ready = r.arrival_s + arrival_s
        if k > 0:
            prev = steps.end_s.get(k - 1)
            if prev is None or ready - prev < IDLE_AFTER_S:
                continue
        out.append((k, ready, r.arrival_s + r.token_times_s[0]))
    return out


def idle_wake_excess_s(wakes: list[tuple[int, float, float]], model_s: np.ndarray,
                       fixed_s: np.ndarray) -> list[float]:
    """How much later than the fitted server model puts it each idle wake's first token came (``idle_wakes``):
    ``first token - (ready + model_s[k] + fixed_s[k])``, with ``fixed_s`` each step's front-end time
    (``step_front_end_s``)."""
    return [t - (ready + float(model_s[k]) + float(fixed_s[k])) for k, ready, t in wakes]


def step_front_end_s(steps: ServerSteps, *, base_s: float, per_chunk_s: float, per_first_s: float = 0.0,
                     per_last_s: float = 0.0, per_in_s: float = 0.0) -> np.ndarray:
    """Each reconstructed step's front-end time as a profile's ``server`` section models it: the per-step base, the
    per-chunk time of its streamed chunks and, where fitted, its streams opened and closed (``--stream-ends``) and
    the requests sent while it ran (``--intake``)."""
    t = base_s + per_chunk_s * steps.chunks
    if per_first_s or per_last_s:
        firsts, lasts = stream_ends(steps)
        t = t + per_first_s * firsts + per_last_s * lasts
    if per_in_s:
        t = t + per_in_s * steps.sent
    return t


ARRIVAL_GRID_S = 0.0005  # the arrival time is chosen on this grid (a step of a few ms cannot resolve finer)


def fit_arrival_s(lower: np.ndarray, upper: np.ndarray) -> tuple[float, int]:
    """The arrival time consistent with the most requests' bounds (``lower < d <= upper``); the smallest on ties."""
    hi = float(np.percentile(upper, 90)) if upper.size else 0.0
    grid = np.arange(0.0, max(hi, 0.0) + ARRIVAL_GRID_S, ARRIVAL_GRID_S)
    counts = [int(np.sum((lower < d) & (d <= upper))) for d in grid]
    best = int(np.argmax(counts))
    return round(float(grid[best]), 6), counts[best]


class ServerStepTimeModel:
    """Step time of an engine behind the API server (implements ``StepTimeModel``).

    ``coefficients`` are the server-mode regimes, their ``overhead_s`` the per-step front-end base; each
    request computed in the step adds ``per_chunk_s`` (a streamed SSE chunk for every request that gets a
    token; a prefill chunk that does not finish its prompt is counted too, a small overstatement).
    """

    def __init__(self, coefficients, *, per_chunk_s: float) -> None:  # noqa: ANN001 (StepTimeCoefficients)
        from twin.engine_profiles.profile import step_time_model_of

        self.base = step_time_model_of(coefficients)
        self.per_chunk_s = float(per_chunk_s)
        self.overhead_s = self.base.overhead_s

    def front_end_s(self, requests_in_step: int) -> float:
        """The step's time outside model execution."""
        return self.overhead_s + self.per_chunk_s * requests_in_step

    def step_time_s(self, shape: StepShape) -> float:
        return self.base.step_time_s(shape) + self.per_chunk_s * (shape.decode_requests + shape.prefill_requests)

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        base = self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)
        return base + self.per_chunk_s * decode_requests
