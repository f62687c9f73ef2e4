"""Cross-check the capacity arithmetic (``twin.capacity``) by simulating one replica at rising load.

Pure orchestration over ``twin.runner.run_scenario``: build one single-replica scenario per load point
(Poisson arrivals, the preset's prompt/output tokens per turn, its prefix-cache hit rate realised by a
real shared prefix), run it, and measure over a steady window. ``docs/capacity.md`` ("Cross-check by
simulation") defines every figure and rule; ``twin capacity --cross-check`` prints the report.

Load ladder: an offline burst first measures the simulated replica's saturation rate (requests
completed / simulated time with ``max_num_seqs`` requests in flight); the ladder is fixed fractions of
it, plus the analytic per-replica peak rate (``peak_rps / replicas``). Measurement window of a point:
from the arrival of its middle request to its last arrival (the first half warms the replica up).
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from twin.capacity import CapacityInputs, CapacityResult

DEFAULT_PROFILE = "llama3-70b-fp8-tp4-h100"
LADDER_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25)
REFINE_STEPS = 2  # rate bisections at each TPOT target (last point meeting it, first missing it); one fewer at the TTFT knee
TTFT_KNEE_FACTOR = 3.0  # "TTFT p99 above 3x its light-load value"
BLOCK_SIZE = 16  # vLLM's default; the engine setting the scenarios use


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoadPoint(_Frozen):
    """One simulated load: figures over its steady window (requests arriving in the window)."""

    rate_per_s: float
    num_requests: int
    window_s: float
    window_arrivals: int
    running_mean: float
    waiting_mean: float
    in_system_mean: float  # Little's L, measured (running + waiting, time-weighted)
    littles_lambda_w: float  # window arrival rate × mean E2E of the window's requests
    analytic_in_system: float | None  # rate × the capacity model's generation_duration_s
    e2e_mean_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float  # output of requests finishing in the window / window length
    kv_usage_mean: float
    kv_usage_max: float
    prefill_time_share: float  # share of window time in steps that carry prefill tokens
    decode_only_step_mean_s: float | None
    prefill_step_mean_s: float | None
    prefix_cache_hit_rate: float
    preemptions: int
    unfinished: int
    running_max: int
    at_cap: bool  # in the window the batch reached max_num_seqs or KV use reached 99%, or a request was preempted
    wall_s: float


class AtTarget(_Frozen):
    """The highest ladder point (walking up from light load) whose TPOT percentile meets the target."""

    percentile: Literal["p50", "p95"]
    rate_per_s: float | None
    streams: float | None  # mean running requests at that point
    tpot_s: float | None
    output_tokens_per_s: float | None


class CrossCheckReport(_Frozen):
    preset: str | None
    profile: str
    profile_note: str
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int
    prefix_fraction: float
    prefix_hit_target: float
    prefix_hit_achieved: float  # over all ladder points' first admissions
    speed_target_tokens_per_s: float
    speed_target_note: str
    tpot_target_s: float
    ttft_slo_s: float | None
    saturation_rate_per_s: float
    points: list[LoadPoint]
    at_target_p50: AtTarget
    at_target_p95: AtTarget
    ttft_knee_slo: float | None  # first rate whose TTFT p99 > ttft_slo_s
    ttft_knee_slo_streams: float | None
    ttft_knee_factor: float
    ttft_knee_relative: float | None  # first rate whose TTFT p99 > factor × the lightest point's
    ttft_knee_relative_streams: float | None
    analytic_streams_by_latency: int | None
    analytic_streams_by_memory: int | None
    analytic_active_streams_per_replica: float | None
    analytic_rate_per_replica: float | None
    analytic_generation_duration_s: float | None
    analytic_decode_capacity_per_replica_tokens_per_s: float | None
    sim_kv_capacity_streams: int  # KV blocks / blocks of one whole unshared stream
    decode_only_streams_at_target: int  # the profile's decode-only step time alone, at the mean context
    gap_explained: list[str]
    seed: int
    wall_s: float
    cpu_s: float  # process CPU time: the wall time less waiting for a loaded machine


# ------------------------------------------------------------------------------------------ inputs


def speed_target(inputs: CapacityInputs) -> tuple[float, str]:
    """The per-stream decode speed target: stated, else output tokens / stated generation duration."""
    if inputs.stream_decode_speed_target_tokens_per_s is not None:
        return inputs.stream_decode_speed_target_tokens_per_s, "stated (stream_decode_speed_target_tokens_per_s)"
    if inputs.mean_generation_duration_s is not None:
        v = inputs.output_tokens_per_turn / inputs.mean_generation_duration_s
        return v, (f"not stated; output_tokens_per_turn / mean_generation_duration_s = "
                   f"{inputs.output_tokens_per_turn} / {inputs.mean_generation_duration_s:g} s")
    raise ValueError("cross-check needs stream_decode_speed_target_tokens_per_s or mean_generation_duration_s")


def choose_profile(inputs: CapacityInputs, requested: str | None) -> tuple[str, str]:
    """The profile to simulate and why: asked for, the inputs', or the 70B FP8 TP4 H100 default."""
    if requested is not None:
        return requested, "given with --profile"
    if inputs.profile is not None:
        return inputs.profile, "the inputs' profile"
    from twin.engine_profiles import load_profile

    p = load_profile(DEFAULT_PROFILE)
    if inputs.kv_bytes_per_token == p.kv_bytes_per_token and inputs.tp == p.tp:
        return DEFAULT_PROFILE, (f"inputs name no profile; {DEFAULT_PROFILE} has their KV bytes/token "
                                 f"({p.kv_bytes_per_token}) and TP ({p.tp})")
    return DEFAULT_PROFILE, "inputs name no model or hardware; default 70B FP8 TP4 H100 profile assumed"


def shared_prefix_for(*, prompt_tokens: int, hit_fraction: float) -> tuple[int, float]:
    """(prefix tokens, fraction of requests sharing it) so that cached/prompt ≈ ``hit_fraction``.

    Every request shares one system prefix of whole blocks (only full blocks hit); 0 when no hit."""
    if hit_fraction <= 0:
        return 0, 0.0
    blocks = max(round(hit_fraction * prompt_tokens / BLOCK_SIZE), 1)
    tokens = min(blocks * BLOCK_SIZE, (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
    return tokens, 1.0


def scenario_dict(*, profile: str, rate_per_s: float | None, num_requests: int, prompt_tokens: int,
                  output_tokens: int, prefix_tokens: int, ttft_slo_s: float, itl_s: float) -> dict[str, Any]:
    """One replica, constant lengths, Poisson arrivals (``rate_per_s=None``: offline burst)."""
    arrival = {"kind": "offline"} if rate_per_s is None else {"kind": "poisson", "rate_per_s": rate_per_s}
    workload: dict[str, Any] = {
        "kind": "synthetic", "num_requests": num_requests, "arrival": arrival,
        "prompt_tokens": {"kind": "constant", "value": prompt_tokens},
        "output_tokens": {"kind": "constant", "value": output_tokens},
    }
    if prefix_tokens > 0:
        workload["shared_prefix"] = {"groups": 1, "tokens": prefix_tokens, "fraction": 1.0}
    return {"name": "capacity-cross-check", "workload": workload,
            "replica": {"step_time": {"kind": "profile", "profile": profile}},
            "slo": {"ttft_s": ttft_slo_s, "itl_s": itl_s},
            "output": {"levels_interval_s": 0.0, "record_iterations": True}}


# ------------------------------------------------------------------------------------ measurements


def time_weighted_mean(t: np.ndarray, v: np.ndarray, a: float, b: float) -> float:
    """Mean over [a, b] of the step function that takes value v[i] from t[i] (sorted) to t[i+1]."""
    if b <= a:
        return float("nan")
    starts = np.clip(t, a, b)
    ends = np.clip(np.append(t[1:], b), a, b)
    return float(np.sum(v * (ends - starts)) / (b - a))


def _series(levels: pa.Table, metric: str) -> tuple[np.ndarray, np.ndarray]:
    mask = np.array(levels.column("metric").to_pylist()) == metric
    t = levels.column("t_s").to_numpy()[mask]
    v = levels.column("value").to_numpy()[mask]
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def measure_point(result: Any, *, rate_per_s: float, generation_duration_s: float | None) -> LoadPoint:
    """Steady-window figures of one run (``result`` is a ``RunResult``)."""
    reqs = result.tables["requests"]
    arrival = reqs.column("arrival_s").to_numpy()
    n = len(arrival)
    order = np.sort(arrival)
    a, b = float(order[n // 2]), float(order[-1])
    in_win = (arrival >= a) & (arrival <= b)
    done = in_win & (np.array(reqs.column("outcome").to_pylist()) == "completed")
    e2e = reqs.column("e2e_s").to_numpy(zero_copy_only=False)
    ttft = reqs.column("ttft_s").to_numpy(zero_copy_only=False)
    tpot = reqs.column("tpot_s").to_numpy(zero_copy_only=False)
    finish = reqs.column("finish_s").to_numpy(zero_copy_only=False)
    out_tok = reqs.column("output_tokens").to_numpy()
    levels = result.tables["levels"]
    run_s, wait_s = _series(levels, "running"), _series(levels, "waiting")
    running, waiting = time_weighted_mean(*run_s, a, b), time_weighted_mean(*wait_s, a, b)
    run_max = int(np.max(run_s[1][(run_s[0] >= a) & (run_s[0] <= b)], initial=0.0))
    kv_t, kv_v = _series(levels, "kv_usage")
    kv_mean = time_weighted_mean(kv_t, kv_v, a, b)
    kv_max = float(np.max(kv_v[(kv_t >= a) & (kv_t <= b)], initial=0.0))
    it = result.tables["iterations"]
    t0 = it.column("t_start_s").to_numpy()
    dur = it.column("elapsed_ms").to_numpy() / 1e3
    pre = it.column("ctx_tokens").to_numpy() > 0
    win = (t0 >= a) & (t0 + dur <= b)
    busy = float(np.sum(dur[win]))
    window = b - a
    rate_w = int(in_win.sum()) / window
    e2e_mean = float(np.mean(e2e[done])) if done.any() else float("nan")
    finished_in = (finish >= a) & (finish <= b)
    return LoadPoint(
        rate_per_s=rate_per_s, num_requests=n, window_s=window, window_arrivals=int(in_win.sum()),
        running_mean=running, waiting_mean=waiting, in_system_mean=running + waiting,
        littles_lambda_w=rate_w * e2e_mean,
        analytic_in_system=None if generation_duration_s is None else rate_per_s * generation_duration_s,
        e2e_mean_s=e2e_mean, tpot_p50_s=_q(tpot[done], 0.5), tpot_p95_s=_q(tpot[done], 0.95),
        ttft_p50_s=_q(ttft[done], 0.5), ttft_p99_s=_q(ttft[done], 0.99),
        output_tokens_per_s=float(np.sum(out_tok[finished_in])) / window,
        kv_usage_mean=kv_mean, kv_usage_max=kv_max,
        prefill_time_share=float(np.sum(dur[win & pre])) / busy if busy > 0 else 0.0,
        decode_only_step_mean_s=float(np.mean(dur[win & ~pre])) if (win & ~pre).any() else None,
        prefill_step_mean_s=float(np.mean(dur[win & pre])) if (win & pre).any() else None,
        prefix_cache_hit_rate=float(result.summary["prefix_cache_hit_rate"]),
        preemptions=int(result.summary["preemptions"]),
        unfinished=int(result.summary["requests"].get("unfinished", 0)),
        running_max=run_max, at_cap=(run_max >= result.scenario.replica.engine.max_num_seqs or kv_max >= 0.99
                                     or int(result.summary["preemptions"]) > 0), wall_s=float(result.summary["wall_s"]),
    )


def _q(x: np.ndarray, q: float) -> float:
    """Inverse-CDF quantile (docs/metrics.md): the smallest value whose cumulative share reaches q."""
    x = np.sort(x[~np.isnan(x)])
    return float(x[max(math.ceil(q * len(x)) - 1, 0)]) if len(x) else float("nan")


def at_target(points: list[LoadPoint], *, tpot_target_s: float, percentile: Literal["p50", "p95"]) -> AtTarget:
    """Walk up the ladder; keep the last point before the first whose TPOT percentile misses the target."""
    best: LoadPoint | None = None
    for p in sorted(points, key=lambda p: p.rate_per_s):
        if (p.tpot_p50_s if percentile == "p50" else p.tpot_p95_s) > tpot_target_s:
            break
        best = p
    if best is None:
        return AtTarget(percentile=percentile, rate_per_s=None, streams=None, tpot_s=None, output_tokens_per_s=None)
    return AtTarget(percentile=percentile, rate_per_s=best.rate_per_s, streams=best.running_mean,
                    tpot_s=best.tpot_p50_s if percentile == "p50" else best.tpot_p95_s,
                    output_tokens_per_s=best.output_tokens_per_s)


def target_bracket(points: list[LoadPoint], *, tpot_target_s: float,
                   percentile: Literal["p50", "p95"]) -> tuple[float, float] | None:
    """(rate of the at-target point, rate of the next point, which misses), or None if there is no such pair."""
    ordered = sorted(points, key=lambda p: p.rate_per_s)
    best = at_target(ordered, tpot_target_s=tpot_target_s, percentile=percentile)
    if best.rate_per_s is None:
        return None
    later = [p.rate_per_s for p in ordered if p.rate_per_s > best.rate_per_s]
    return (best.rate_per_s, later[0]) if later else None


def ttft_knee(points: list[LoadPoint], threshold_s: float) -> LoadPoint | None:
    """The first point (by rate) whose TTFT p99 exceeds ``threshold_s``."""
    return next((p for p in sorted(points, key=lambda p: p.rate_per_s) if p.ttft_p99_s > threshold_s), None)


def completion_rate(reqs: pa.Table) -> float:
    """Completions per second over the middle half of the completions (ramp-up and drain left out)."""
    finish = np.sort(reqs.column("finish_s").to_numpy(zero_copy_only=False))
    finish = finish[~np.isnan(finish)]
    lo, hi = len(finish) // 4, 3 * len(finish) // 4
    return (hi - lo) / float(finish[hi] - finish[lo])


def decode_only_streams(model: Any, *, context_tokens: float, tpot_target_s: float, limit: int = 8192) -> int:
    """Largest decode batch B whose decode-only step (every stream at ``context_tokens``) is ≤ the target."""
    from twin.engine_profiles import StepShape

    best = 0
    for b in range(1, limit + 1):
        shape = StepShape(decode_requests=b, decode_context_tokens=round(b * context_tokens))
        if model.step_time_s(shape) > tpot_target_s:
            break
        best = b
    return best


# --------------------------------------------------------------------------------------- the run


def run_crosscheck(inputs: CapacityInputs, capacity: CapacityResult, *, preset: str | None = None,
                   profile: str | None = None, seed: int = 1, arrival_span_s: float = 100.0,
                   min_requests: int = 400, max_requests: int = 4000,
                   fractions: tuple[float, ...] = LADDER_FRACTIONS,
                   refine_steps: int = REFINE_STEPS) -> CrossCheckReport:
    """Calibrate the saturation rate, run the ladder, measure, compare with ``capacity``."""
    from twin.engine_profiles import load_profile
    from twin.runner import run_scenario
    from twin.scenario import parse_scenario

    t_start, cpu_start = time.perf_counter(), time.process_time()
    profile_name, profile_note = choose_profile(inputs, profile)
    speed, speed_note = speed_target(inputs)
    target = 1.0 / speed
    prompt, output = inputs.prompt_tokens_per_turn, inputs.output_tokens_per_turn
    prefix_tokens, prefix_fraction = shared_prefix_for(prompt_tokens=prompt,
                                                       hit_fraction=inputs.prefix_cache_hit_fraction)
    slo = inputs.mean_ttft_s
    base = {"profile": profile_name, "prompt_tokens": prompt, "output_tokens": output, "prefix_tokens": prefix_tokens,
            "ttft_slo_s": slo if slo is not None else 1.0, "itl_s": target}

    def run(rate: float | None, n: int) -> Any:
        res = run_scenario(parse_scenario(scenario_dict(rate_per_s=rate, num_requests=n, **base)), seed=seed)
        if not res.ok:
            raise RuntimeError(f"simulation at rate {rate} failed: {res.manifest['exception']}")
        return res

    cal = run(None, 2 * 1024)  # max_num_seqs = 1024 (engine default): twice that in flight, then drained
    saturation = completion_rate(cal.tables["requests"])
    rates = {round(f * saturation, 4) for f in fractions}
    per_replica = capacity.peak_rps / capacity.replicas if capacity.replicas else None
    if per_replica is not None and per_replica < 1.2 * saturation:
        rates.add(round(per_replica, 4))
    points: list[LoadPoint] = []

    def measure(rate: float) -> None:
        n = min(max(math.ceil(rate * arrival_span_s), min_requests), max_requests)
        points.append(measure_point(run(rate, n), rate_per_s=rate,
                                    generation_duration_s=capacity.generation_duration_s))

    for rate in sorted(rates):
        measure(rate)
    for pct in ("p50", "p95"):
        for _ in range(refine_steps):
            bracket = target_bracket(points, tpot_target_s=target, percentile=pct)
            if bracket is None:
                break
            measure(round(sum(bracket) / 2, 4))
    light = min(points, key=lambda p: p.rate_per_s).ttft_p99_s
    knee_threshold = slo if slo is not None else TTFT_KNEE_FACTOR * light
    for _ in range(refine_steps - 1):  # one bisection fewer for the knee: the ladder's top points are the slowest
        knee = ttft_knee(points, knee_threshold)
        below = [p.rate_per_s for p in points if knee is not None and p.rate_per_s < knee.rate_per_s]
        if not below:
            break
        measure(round((max(below) + knee.rate_per_s) / 2, 4))
    points.sort(key=lambda p: p.rate_per_s)

    hit = sum(p.prefix_cache_hit_rate * p.num_requests for p in points) / sum(p.num_requests for p in points)
    p50 = at_target(points, tpot_target_s=target, percentile="p50")
    p95 = at_target(points, tpot_target_s=target, percentile="p95")
    knee_slo = ttft_knee(points, slo) if slo is not None else None
    lightest = min(points, key=lambda p: p.rate_per_s)
    knee_rel = ttft_knee(points, TTFT_KNEE_FACTOR * lightest.ttft_p99_s)
    model = load_profile(profile_name).step_time_model()
    decode_only = decode_only_streams(model, context_tokens=prompt + output / 2, tpot_target_s=target)
    kv_cap = int(cal.summary["num_gpu_blocks"]) // math.ceil((prompt + output) / BLOCK_SIZE)
    fields: dict[str, Any] = dict(
        preset=preset, profile=profile_name, profile_note=profile_note, prompt_tokens=prompt, output_tokens=output,
        prefix_tokens=prefix_tokens, prefix_fraction=prefix_fraction,
        prefix_hit_target=inputs.prefix_cache_hit_fraction, prefix_hit_achieved=hit,
        speed_target_tokens_per_s=speed, speed_target_note=speed_note, tpot_target_s=target, ttft_slo_s=slo,
        saturation_rate_per_s=saturation, points=points, at_target_p50=p50, at_target_p95=p95,
        ttft_knee_slo=None if knee_slo is None else knee_slo.rate_per_s,
        ttft_knee_slo_streams=None if knee_slo is None else knee_slo.running_mean,
        ttft_knee_factor=TTFT_KNEE_FACTOR,
        ttft_knee_relative=None if knee_rel is None else knee_rel.rate_per_s,
        ttft_knee_relative_streams=None if knee_rel is None else knee_rel.running_mean,
        analytic_streams_by_latency=capacity.streams_per_replica_by_latency,
        analytic_streams_by_memory=capacity.streams_per_replica_by_memory,
        analytic_active_streams_per_replica=(None if capacity.active_streams is None or not capacity.replicas
                                             else capacity.active_streams / capacity.replicas),
        analytic_rate_per_replica=per_replica, analytic_generation_duration_s=capacity.generation_duration_s,
        analytic_decode_capacity_per_replica_tokens_per_s=capacity.decode_capacity_per_replica_tokens_per_s,
        sim_kv_capacity_streams=kv_cap, decode_only_streams_at_target=decode_only, seed=seed,
    )
    fields["gap_explained"] = explain_gap(fields)
    fields["wall_s"] = time.perf_counter() - t_start
    fields["cpu_s"] = time.process_time() - cpu_start
    return CrossCheckReport(**fields)


# ---------------------------------------------------------------------------------- gap explained


def _near(points: list[LoadPoint], rate: float) -> LoadPoint:
    return min(points, key=lambda p: abs(p.rate_per_s - rate))


def explain_gap(f: dict[str, Any]) -> list[str]:
    """Sentences built from the measured and analytic figures (each states the numbers it rests on)."""
    pts: list[LoadPoint] = f["points"]
    p50: AtTarget = f["at_target_p50"]
    p95: AtTarget = f["at_target_p95"]
    tgt_ms = f["tpot_target_s"] * 1e3
    speed = f["speed_target_tokens_per_s"]
    lat = f["analytic_streams_by_latency"]
    lines = []
    if p50.streams is None:
        lines.append(f"Even the lightest load ({pts[0].rate_per_s:.3g} req/s) misses TPOT p50 <= {tgt_ms:.1f} ms "
                     f"({pts[0].tpot_p50_s * 1e3:.1f} ms): this replica cannot stream {speed:.3g} tok/s at all.")
        return lines
    at = _near(pts, p50.rate_per_s)
    head = (f"The capacity model assumes {lat} streams per replica at {speed:.3g} tok/s" if lat is not None
            else f"The capacity model states no stream cap at {speed:.3g} tok/s")
    lines.append(f"{head}; the simulated replica ({f['profile']}) holds {p50.streams:.0f}"
                 + (f" ({p50.streams / lat:.2f}x)" if lat else "")
                 + f" at TPOT p50 <= {tgt_ms:.1f} ms ({p50.rate_per_s:.3g} req/s) and "
                 + (f"{p95.streams:.0f} at TPOT p95 <= {tgt_ms:.1f} ms ({p95.rate_per_s:.3g} req/s)."
                    if p95.streams is not None else "none at p95."))
    dec = f["decode_only_streams_at_target"]
    ctx = f["prompt_tokens"] + f["output_tokens"] / 2
    why = (f"The profile's decode-only step meets {tgt_ms:.1f} ms up to {dec} streams at the mean context of "
           f"{ctx:.0f} tokens")
    if lat is not None:
        why += f" ({'more' if dec > lat else 'no more'} than the model's {lat})"
    uncached = f["prompt_tokens"] - f["prefix_tokens"] * f["prefix_fraction"]
    if at.prefill_step_mean_s is not None and at.decode_only_step_mean_s is not None:
        why += (f"; at {at.rate_per_s:.3g} req/s prefill chunks ({uncached:.0f} uncached tokens per request) share "
                f"steps with decodes: {at.prefill_time_share:.0%} of replica time is in prefill-carrying steps of "
                f"{at.prefill_step_mean_s * 1e3:.1f} ms mean against {at.decode_only_step_mean_s * 1e3:.1f} ms for "
                f"decode-only steps, which lifts TPOT p50 to {at.tpot_p50_s * 1e3:.1f} ms")
        nxt = [p for p in pts if p.rate_per_s > at.rate_per_s]
        if nxt:
            why += (f"; the next load ({nxt[0].rate_per_s:.3g} req/s, {nxt[0].running_mean:.0f} streams) "
                    f"gives {nxt[0].tpot_p50_s * 1e3:.1f} ms")
    lines.append(why + ".")
    dur = f["analytic_generation_duration_s"]
    if dur is not None:
        rr = f["analytic_rate_per_replica"]
        ref = _near(pts, rr) if rr is not None else at
        lines.append(f"Little's law: the model's stream lifetime is {dur:.3g} s; at {ref.rate_per_s:.3g} req/s the "
                     f"simulated mean E2E is {ref.e2e_mean_s:.3g} s, so {ref.in_system_mean:.0f} requests are in the "
                     f"replica (measured; rate x E2E gives {ref.littles_lambda_w:.0f}) against "
                     f"{ref.rate_per_s * dur:.0f} by the model"
                     + (f" ({f['analytic_active_streams_per_replica']:.0f} per replica at its "
                        f"{rr:.3g} req/s peak share)." if rr is not None and f["analytic_active_streams_per_replica"]
                        else "."))
    cap = f["analytic_decode_capacity_per_replica_tokens_per_s"]
    if cap is not None and p50.output_tokens_per_s is not None:
        lines.append(f"Output at the p50 target point: {p50.output_tokens_per_s:,.0f} tok/s per replica against the "
                     f"model's {cap:,.0f} ({p50.output_tokens_per_s / cap:.2f}x).")
    top = max(pts, key=lambda p: p.rate_per_s)
    mem = f["analytic_streams_by_memory"]
    lines.append(f"Memory: the simulated replica's KV blocks hold {f['sim_kv_capacity_streams']} unshared streams of "
                 f"{f['prompt_tokens'] + f['output_tokens']} tokens"
                 + (f" (the model's arithmetic: {mem})" if mem is not None else "")
                 + f"; at the highest load ({top.rate_per_s:.3g} req/s, {top.running_mean:.0f} running) KV use peaked "
                 f"at {top.kv_usage_max:.0%} with {top.preemptions} preemptions, so memory "
                 + ("binds there." if top.kv_usage_max >= 0.95 or top.preemptions > 0 else
                    f"does not bind: {top.running_max} running reached the batch cap (max_num_seqs) first."
                    if top.at_cap else "does not bind within the ladder: step time does."))
    if f["ttft_knee_slo"] is not None:
        lines.append(f"TTFT p99 first exceeds the {f['ttft_slo_s']:.3g} s target at {f['ttft_knee_slo']:.3g} req/s "
                     f"({f['ttft_knee_slo_streams']:.0f} streams), {f['ttft_knee_slo'] / p50.rate_per_s:.2f}x the "
                     f"load of the TPOT p50 point: the inter-token target binds first."
                     if f["ttft_knee_slo"] > p50.rate_per_s else
                     f"TTFT p99 first exceeds the {f['ttft_slo_s']:.3g} s target at {f['ttft_knee_slo']:.3g} req/s, "
                     f"at or below the TPOT p50 point: TTFT binds first.")
    return lines
