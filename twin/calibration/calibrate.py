"""Fit an engine profile (step-time coefficients + per-step overhead) from recorded real-engine runs.

    from twin.calibration.calibrate import calibrate
    result = calibrate(["runs/cal/sweep-decode-batch", ...], name="cpu-tiny-llama", command="twin calibrate ...")
    result.spec            # an EngineProfileSpec, ready for derive.write_spec
    result.refused         # runs left out, with the reason

How, per run:

1. Replay it in the twin with the *recorded* step times (step i of the twin takes ``elapsed_ms[i]``), so
   the twin's steps line up one-to-one with the recorded steps. The twin's step composition
   ``(ctx_requests, ctx_tokens, gen_requests, gen_tokens)`` must equal the recorded one step for step;
   a run where it does not is refused (its shapes would be paired with the wrong durations).
2. Collect the ``StepShape`` the engine built for each step with the recorded duration of that step.
3. Estimate the per-step time outside model execution (scheduling, output processing; ``elapsed_ms``
   covers model execution and sampling only): each streamed token is assigned to the twin step that
   emitted it (the composition matches, so it is the same step in the real run); a step's real end time
   is the median time of its tokens; for consecutive token-emitting steps a < b the gap is
   ``T_b - T_a - sum(elapsed[a+1..b])`` over ``b - a`` steps. The overhead is the sum of all gaps over the
   sum of the steps they span (a split of one interval between two steps' ``elapsed_ms`` cancels out).

Then both step-time regimes are fitted to the recorded ``elapsed_ms`` by ``fit_step_time`` (relative-error
NNLS) with that overhead, refitted without outlier steps (``robust_fit``). Chosen over fitting every step,
and over scaling the robust fit to the recorded mean, by fidelity on recordings outside the sweep (the
committed fixtures under tests/fixtures/recorded; docs/calibration.md). Block size and block count are
not fitted: replays take them from each run's
run.json; the profile's memory section is set so ``derive_num_gpu_blocks`` gives back the recorded count of
a run without ``--num-gpu-blocks-override``.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twin.calibration.recorded import RecordedRun, load_recorded_run
from twin.calibration.server import (
    IDLE_AFTER_S,
    ReconstructionError,
    ServerSteps,
    arrival_bounds,
    decode_shared_tokens,
    fit_arrival_s,
    fit_front_end,
    fit_shared_fraction,
    front_end_samples,
    front_end_sent,
    idle_wake_excess_s,
    idle_wakes,
    reconstruct,
    step_front_end_s,
)
from twin.calibration.witness import fit_host_witness
from twin.engine_profiles.profile import (
    EngineProfile,
    EngineProfileSpec,
    Hardware,
    MemoryAssumptions,
    ModelShape,
    Provenance,
    ServerFrontEnd,
    StepTimeCoefficients,
    step_time_model_of,
)
from twin.calibration.regimes import (
    TRIM_FLOOR_RATIO,
    TRIM_MADS,
    FitOptions,
    fit_quality,
    predict_model_s,
    robust_fit,
    step_time_noise,
)
from twin.engine_profiles.step import StepShape
from twin.replay import COMPOSITION, RecordedStepTimes, replay_scenario, request_specs
from twin.runner import RunResult, run_scenario

DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
          "float32": "fp32", "float": "fp32", "fp32": "fp32"}


class CalibrationError(ValueError):
    """Recorded runs that cannot be used to fit a profile; the message says why."""


class ShapeRecorder(RecordedStepTimes):
    """Recorded step times that also keep the ``StepShape`` of every step the twin runs."""

    def __init__(self, elapsed_ms: np.ndarray, *, overhead_s: float) -> None:
        super().__init__(elapsed_ms, overhead_s=overhead_s, fallback=None)
        self.shapes: list[StepShape] = []

    def step_time_s(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return super().step_time_s(shape)


def replay_recorded(rec: RecordedRun, *, overhead_s: float) -> tuple[RunResult, ShapeRecorder]:
    """Replay ``rec`` with its recorded step times plus ``overhead_s`` per step (one event per step).

    Unlike ``replay(step_times="recorded")`` the overhead is passed in, not read from a profile object.
    """
    if rec.iterations is None or len(rec.iterations) == 0:
        raise CalibrationError(f"{rec.path}: no iterations.csv, so there are no recorded step times")
    sc = replay_scenario(rec, None)
    sc = sc.model_copy(update={"replica": sc.replica.model_copy(update={"max_decode_run_steps": 1})})
    model = ShapeRecorder(rec.iterations.elapsed_ms, overhead_s=overhead_s)
    result = run_scenario(sc, specs=request_specs(rec), step_model=model)
    if not result.ok:
        raise CalibrationError(f"{rec.path}: the replay failed: {result.manifest['exception']}")
    return result, model


def composition_mismatch(rec: RecordedRun, result: RunResult) -> str | None:
    """None when the twin's step composition equals the recording's, else a sentence saying where not."""
    assert rec.iterations is not None
    real = rec.iterations.composition()
    it = result.tables["iterations"].to_pydict()
    twin = list(zip(*(it[c] for c in COMPOSITION), strict=True))
    for i, (a, b) in enumerate(zip(real, twin, strict=False)):
        if tuple(a) != tuple(b):
            return (f"step composition differs at step {i}: real {list(a)} twin {list(b)} "
                    f"({', '.join(COMPOSITION)})")
    if len(real) != len(twin):
        return f"step count differs: real {len(real)} twin {len(twin)} (composition equal up to the shorter)"
    return None


def overhead_samples(rec: RecordedRun, result: RunResult, *, with_first: bool = False) -> Any:
    """Time outside model execution between consecutive token-emitting steps a < b, from streamed token
    times vs recorded step durations: ``(gaps_s, spans)`` with ``gaps_s = T_b - T_a - sum(elapsed[a+1..b])``
    and ``spans = b - a`` steps. ``gaps_s / spans`` are per-step samples.

    Needs a replay whose steps align with the recording (``composition_mismatch`` is None). ``with_first``: also
    return ``(step, time)`` of the first token-emitting step (None when no token was streamed).
    """
    assert rec.iterations is not None
    elapsed = rec.iterations.elapsed_ms / 1000.0
    it = result.tables["iterations"].to_pydict()
    ends = np.asarray(it["t_start_s"], dtype=np.float64) + np.asarray(it["elapsed_ms"]) / 1000.0
    twin_req = result.tables["requests"].to_pydict()
    twin_times = dict(zip(twin_req["request_id"], twin_req["token_times_s"], strict=True))
    twin_arrival = dict(zip(twin_req["request_id"], twin_req["arrival_s"], strict=True))
    per_step: dict[int, list[float]] = {}
    for r in rec.requests:
        real_t, tw = r.token_times_s, twin_times.get(r.request_id)
        if not real_t or not tw or len(tw) != len(real_t):
            continue
        tw_abs = np.asarray(tw, dtype=np.float64) + float(twin_arrival[r.request_id])
        # the step whose end is nearest each twin token time (the twin stamps tokens at step ends)
        idx = np.clip(np.searchsorted(ends, tw_abs), 0, ends.size - 1)
        left = np.clip(idx - 1, 0, ends.size - 1)
        idx = np.where(np.abs(ends[left] - tw_abs) < np.abs(ends[idx] - tw_abs), left, idx)
        for k, t in zip(idx.tolist(), real_t, strict=True):
            per_step.setdefault(k, []).append(r.arrival_s + t)
    steps = sorted(per_step)
    t_end = {k: float(np.median(per_step[k])) for k in steps}
    cum = np.concatenate([[0.0], np.cumsum(elapsed)])
    gaps, spans = [], []
    for a, b in zip(steps, steps[1:], strict=False):
        if b >= elapsed.size:
            break
        gaps.append(t_end[b] - t_end[a] - (cum[b + 1] - cum[a + 1]))  # minus elapsed of steps a+1 .. b
        spans.append(b - a)
    out = np.asarray(gaps, dtype=np.float64), np.asarray(spans, dtype=np.int64)
    if not with_first:
        return out
    return (*out, (steps[0], t_end[steps[0]]) if steps else None)


@dataclass
class RunSamples:
    path: Path
    shapes: list[StepShape]
    elapsed_s: np.ndarray
    overhead_gaps_s: np.ndarray
    overhead_spans: np.ndarray
    first_token_step: int | None = None  # the first step that emitted a token, and the median time of its tokens
    first_token_end_s: float | None = None


def run_samples(rec: RecordedRun) -> RunSamples:
    """The (StepShape, elapsed_s) pairs and overhead samples of one run; raises if the steps do not align."""
    result, model = replay_recorded(rec, overhead_s=0.0)
    why = composition_mismatch(rec, result)
    if why is not None:
        raise CalibrationError(f"{rec.path}: {why}; its step shapes cannot be paired with recorded durations"
                               + (" (server runs depend on arrival timing)" if rec.run.mode == "server" else ""))
    assert rec.iterations is not None and len(model.shapes) == len(rec.iterations)
    gaps, spans, first = overhead_samples(rec, result, with_first=True)
    return RunSamples(path=rec.path, shapes=model.shapes, elapsed_s=rec.iterations.elapsed_ms / 1000.0,
                      overhead_gaps_s=gaps, overhead_spans=spans,
                      first_token_step=None if first is None else first[0],
                      first_token_end_s=None if first is None else first[1])


def model_shape(rec: RecordedRun) -> ModelShape:
    mc = rec.run.model_config_
    try:
        hidden, heads = int(mc["hidden_size"]), int(mc["num_attention_heads"])
        return ModelShape(
            name=str((rec.run.workload.get("spec") or {}).get("model") or mc.get("_name_or_path")
                     or mc.get("model_type") or "model"),
            num_layers=int(mc["num_hidden_layers"]), hidden_size=hidden,
            intermediate_size=int(mc["intermediate_size"]), num_attention_heads=heads,
            num_kv_heads=int(mc.get("num_key_value_heads") or heads),
            head_dim=int(mc.get("head_dim") or hidden // heads), vocab_size=int(mc["vocab_size"]),
            tie_word_embeddings=bool(mc.get("tie_word_embeddings", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationError(f"{rec.path}: run.json model_config lacks a Llama-style shape: {exc}") from exc


def _dtype(value: str, *, fallback: str, where: str) -> str:
    v = fallback if value == "auto" else value
    if v not in DTYPES:
        raise CalibrationError(f"{where}: dtype {value!r} has no profile equivalent (bf16, fp8 or fp32)")
    return DTYPES[v]


def memory_section(recs: Sequence[RecordedRun], shape: ModelShape, *, weight_dtype: str, kv_dtype: str
                   ) -> tuple[Hardware, MemoryAssumptions, str]:
    """Hardware + memory so ``derive_num_gpu_blocks`` returns the recorded block count (see module doc)."""
    from twin.engine_profiles.memory import weight_bytes
    from twin.engine_profiles.profile import DTYPE_BYTES

    natural = [r for r in recs if "--num-gpu-blocks-override" not in r.run.engine_args] or list(recs)
    (blocks, block_size), _ = Counter((r.run.num_gpu_blocks, r.run.block_size) for r in natural).most_common(1)[0]
    per_block = shape.num_layers * shape.num_kv_heads * block_size * 2 * shape.head_dim * DTYPE_BYTES[kv_dtype]
    weights = weight_bytes(shape, weight_dtype_bytes=DTYPE_BYTES[weight_dtype])
    hw = Hardware(name=recs[0].run.hardware, gpu_memory_bytes=weights + blocks * per_block, gpus_per_node=1)
    mem = MemoryAssumptions(
        gpu_memory_utilization=1.0, non_torch_bytes_per_gpu=0, activation_bytes_per_batched_token=0,
        cudagraph_bytes_per_gpu=0,
        notes=(f"CPU backend: the KV cache is a fixed size (--kv-cache-memory-bytes), recorded as {blocks} blocks of "
               f"{block_size} tokens; 'gpu_memory_bytes' = weights + that KV space, so derive_num_gpu_blocks gives "
               f"{blocks} back. Replays take block size and count from each run's run.json, not from here."))
    return hw, mem, f"{blocks} blocks x {block_size} tokens"


@dataclass
class CalibrationResult:
    spec: EngineProfileSpec
    used: list[Path]
    refused: list[str] = field(default_factory=list)  # "path: reason"
    overhead_samples_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shared_context_runs: list[Path] = field(default_factory=list)  # server runs that fitted the fraction alone


def _run_index(lengths: Sequence[int]) -> np.ndarray:
    """Each step's run (0, 1, ...), for runs of ``lengths`` steps concatenated in order."""
    return np.repeat(np.arange(len(lengths)), lengths)


def _first_steps(lengths: Sequence[int]) -> np.ndarray:
    """Mask of the first step of each run, over the runs' steps concatenated."""
    mask = np.zeros(int(sum(lengths)), dtype=bool)
    mask[np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)] = True
    return mask


def first_step_excess_s(elapsed_s: np.ndarray, predicted_s: float, *, first_token_s: float, token_step: int,
                        fixed_s: np.ndarray) -> float:
    """How much later a run's first tokens came than a twin step sequence puts them, less what later steps explain.

    ``(first_token_s - sum over steps 0..token_step of (elapsed + fixed))``, the start's time outside the recorded
    steps and their modelled fixed time (overhead; server: front end), ``+ (elapsed[0] - predicted_s)``, the first
    step's model time beyond the fit. ``first_token_s`` is measured from when the twin's first step can start.
    """
    b = int(token_step)
    return float(first_token_s - np.sum(elapsed_s[: b + 1]) - np.sum(fixed_s[: b + 1]) + (elapsed_s[0] - predicted_s))


def fit_first_step_s(excess_s: Sequence[float]) -> float:
    """``first_step_s``: the median over runs of ``first_step_excess_s``, floored at 0."""
    return max(float(np.median(excess_s)), 0.0) if len(excess_s) else 0.0


def calibrate(run_dirs: Sequence[str | Path], *, name: str, command: str, generated_on: str | None = None,
              source_label: Callable[[Path], str] | None = None, options: FitOptions = FitOptions()
              ) -> CalibrationResult:
    """Fit a profile named ``name`` from recorded runs (see the module doc). ``source_label(path) -> str`` names
    each run in the provenance (default: the path as given). ``options``: the optional model terms."""
    if not run_dirs:
        raise CalibrationError("no run folders given")
    recs = [load_recorded_run(p) for p in run_dirs]
    shape = model_shape(recs[0])
    for r in recs[1:]:
        if model_shape(r) != shape:
            raise CalibrationError(f"{r.path}: a different model shape from {recs[0].path}; fit one model at a time")
    versions = sorted({r.run.engine_version for r in recs})
    hardware = sorted({r.run.hardware for r in recs})
    if len(hardware) > 1:
        raise CalibrationError(f"runs come from different hardware ({hardware}); fit one machine at a time")
    samples: list[RunSamples] = []
    refused: list[str] = []
    server_recs = [r for r in recs if r.run.mode == "server"]
    for r in recs:
        if r.run.mode == "server":  # server runs fit the server section only (their batches follow arrival timing)
            continue
        try:
            samples.append(run_samples(r))
        except CalibrationError as exc:
            refused.append(str(exc))
    if not samples and not refused:
        raise CalibrationError("no offline run given: server-mode runs fit only the profile's server section, the "
                               "step-time regimes need offline runs")
    if not samples:
        raise CalibrationError("no usable run (every run was refused):\n  " + "\n  ".join(refused))
    gaps = np.concatenate([s.overhead_gaps_s for s in samples])
    spans = np.concatenate([s.overhead_spans for s in samples])
    if gaps.size == 0:
        raise CalibrationError("no overhead samples: the runs have no streamed token times")
    per_step = gaps / spans
    overhead_s = max(float(gaps.sum() / spans.sum()), 0.0)
    shapes = [sh for s in samples for sh in s.shapes]
    elapsed = np.concatenate([s.elapsed_s for s in samples])
    lengths = [len(s.shapes) for s in samples]
    firsts = _first_steps(lengths) if options.first_step else None
    try:
        fit, keep = robust_fit(shapes, elapsed, overhead_s=overhead_s, exclude=firsts, options=options,
                               runs=_run_index(lengths))
    except ValueError as exc:  # too few steps of a regime, non-positive durations
        raise CalibrationError(f"cannot fit the step-time regimes: {exc}") from exc
    coefficients = fit.coefficients
    first_note = ""
    if options.first_step:
        excess = [first_step_excess_s(s.elapsed_s, float(predict_model_s(coefficients, s.shapes[:1])[0]),
                                      first_token_s=s.first_token_end_s, token_step=s.first_token_step,
                                      fixed_s=np.full(s.elapsed_s.size, overhead_s))
                  for s in samples if s.first_token_step is not None and s.first_token_end_s is not None]
        coefficients = coefficients.model_copy(update={"first_step_s": fit_first_step_s(excess)})
        first_note = (f" first_step_s: median of the {len(excess)} runs' first-step excess "
                      f"({', '.join(f'{e * 1e3:.1f}' for e in excess)} ms), the first steps left out of the regimes.")
    r0 = recs[0].run
    weight_dtype = _dtype(r0.dtype, fallback="bfloat16", where=str(recs[0].path))
    kv_dtype = _dtype(r0.kv_cache_dtype, fallback=r0.dtype, where=str(recs[0].path))
    hw, mem, blocks = memory_section(recs, shape, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    label = source_label or (lambda p: str(p))
    generated_on = generated_on or dt.datetime.now(dt.UTC).date().isoformat()
    server = fit_server(server_recs, command=command, generated_on=generated_on, source_label=label,
                        options=options, offline=coefficients) if server_recs else None
    if server is not None:
        refused += server.refused
    q25, q50, q75 = np.percentile(per_step, [25, 50, 75])
    notes = (
        f"engine {', '.join(versions)} on '{hardware[0]}'. Fitted to {elapsed.size} recorded steps of "
        f"{len(samples)} runs ({blocks} in the runs without an override). overhead_s = (token-time interval - "
        f"recorded elapsed) summed over {gaps.size} consecutive token-emitting step pairs / the steps they span: "
        f"{overhead_s * 1e3:.3f} ms per step (per-pair median {q50 * 1e3:.3f}, IQR {q25 * 1e3:.3f}..{q75 * 1e3:.3f} ms). "
        f"Regimes: relative-error NNLS without {int((~keep).sum())} of {keep.size} outlier steps "
        f"(|log(measured/fitted)| beyond {TRIM_MADS:g} scaled MADs of their regime and {TRIM_FLOOR_RATIO:g}x; a shared "
        f"CPU often splits one interval between consecutive steps as e.g. 24 ms + 1 ms, and other processes "
        f"slow whole stretches of a run). fit_quality is on every step with a positive duration, trimmed ones "
        f"included." + first_note
    )
    if refused:
        notes += " Refused: " + " | ".join(refused)
    spec = EngineProfileSpec(
        name=name, model=shape, hardware=hw, tp=int(r0.tensor_parallel_size), weight_dtype=weight_dtype,
        kv_dtype=kv_dtype, memory=mem, step_time=coefficients,
        fit_quality=fit_quality(coefficients, shapes, elapsed,
                                target=f"recorded vLLM step durations (iterations.csv elapsed_ms), {len(samples)} runs"),
        provenance=Provenance(sources=[label(s.path) for s in samples], command=command,
                              generated_on=generated_on, notes=notes),
        server=None if server is None else server.front_end,
        step_time_noise=step_time_noise(coefficients, shapes, elapsed, exclude=firsts),
    )
    used = [s.path for s in samples] + ([] if server is None else server.used)
    term = fit_host_witness([r for r in recs if r.path in used], EngineProfile(spec))
    if term is not None:
        spec = spec.model_copy(update={"host_witness": term})
    return CalibrationResult(spec=spec, used=used,
                             refused=refused, overhead_samples_s=per_step,
                             shared_context_runs=[] if server is None else server.shared_context_runs)



def _scaled_offline(offline: StepTimeCoefficients, shapes: Sequence[StepShape], elapsed: np.ndarray, *,
                    overhead_s: float, exclude: np.ndarray | None) -> tuple[StepTimeCoefficients, np.ndarray, float]:
    """Server step time as ``offline``'s decode and prefill terms times one factor: the median of measured over
    predicted model time on the steps with both positive (the first steps left out where ``exclude`` marks them).
    The engine core runs the same model on either side of the API server; what differs on a server is the host's
    speed during the run and the front end (fitted apart), and one factor from ~2,000 steps is better conditioned
    than five terms from two runs. Returns the coefficients (overhead = ``overhead_s``, no first-step term), the steps
    used and the factor."""
    scale, keep = _speed_against(offline, shapes, elapsed, exclude=exclude, regime=None,
                                 what="cannot scale the offline regimes")

    def times(c):  # every term of a regime is a time: scale them all
        return type(c)(**{k: v * scale for k, v in c.model_dump().items()})

    coefficients = StepTimeCoefficients(overhead_s=overhead_s, decode=times(offline.decode),
                                        prefill=times(offline.prefill))
    return coefficients, keep, scale


# The server terms ``fit_server`` can take from the offline fit: per regime, the coefficient, its name in the notes
# and the option that asks for it.
_OFFLINE_TERMS = {"prefill": ("per_attention_pair_s", "per_attention_pair_s", "server_offline_attention"),
                  "decode": ("per_context_token_s", "decode per_context_token_s", "server_offline_context")}


def _offline_term(offline: StepTimeCoefficients, shapes: Sequence[StepShape], elapsed: np.ndarray, *,
                  exclude: np.ndarray | None, regime: str) -> tuple[float, str]:
    """A server section's fixed term taken from the offline fit (``FitOptions.server_offline_attention``: the prefill
    ``per_attention_pair_s``; ``server_offline_context``: the decode ``per_context_token_s``): the offline fit's times
    the server runs' speed on their steps of that regime (``_speed_against``). The offline sweep has a shared-prefix
    run, which separates attention work from tokens, and the server sweep's prompts share nothing; in the server
    sweep's rate runs a decode step's context follows its batch. Returns the term and the note that says so."""
    attr, label, option = _OFFLINE_TERMS[regime]
    speed, keep = _speed_against(offline, shapes, elapsed, exclude=exclude, regime=regime, what=option)
    note = (f"; {label} the offline fit's times {speed:.4f}, the median of measured / offline-predicted model time "
            f"over {int(keep.sum())} {regime} steps ({option})")
    return getattr(getattr(offline, regime), attr) * speed, note


def _speed_against(offline: StepTimeCoefficients, shapes: Sequence[StepShape], elapsed: np.ndarray, *,
                   exclude: np.ndarray | None, regime: str | None, what: str) -> tuple[float, np.ndarray]:
    """The server runs' speed against the offline model: the median of measured over offline-predicted model time
    on the steps with both positive (of ``regime``, ``"prefill"``-carrying or ``"decode"``-only ones, when given;
    ``exclude``d ones left out), and the mask of those steps."""
    pred = predict_model_s(offline, shapes)
    keep = (elapsed > 0) & (pred > 0)
    if regime is not None:
        keep &= np.array([(s.prefill_requests > 0) == (regime == "prefill") for s in shapes], dtype=bool)
    if exclude is not None:
        keep &= ~exclude
    if not keep.any():
        raise CalibrationError(f"{what}: no server {regime + ' ' if regime else ''}step with a positive duration")
    return float(np.median(elapsed[keep] / pred[keep])), keep


_SharedRuns = list[tuple[RecordedRun, ServerSteps, np.ndarray]]  # a run, its steps, each step's shared tokens


def _set_apart_shared(used: list[RecordedRun], steps: list[ServerSteps]
                      ) -> tuple[list[RecordedRun], list[ServerSteps], _SharedRuns]:
    """``FitOptions.server_shared_context``: the server runs whose decode steps read no shared prefix (they fit every
    other term), and those that do, with each step's shared tokens (they fit the fraction alone)."""
    counts = [decode_shared_tokens(r, s) for r, s in zip(used, steps, strict=True)]
    shared = [(r, s, c) for r, s, c in zip(used, steps, counts, strict=True) if c.any()]
    kept = [(r, s) for r, s, c in zip(used, steps, counts, strict=True) if not c.any()]
    if not kept:
        raise CalibrationError("server_shared_context fits the other server terms on the server runs whose decode "
                               f"steps read no shared prefix, and all {len(shared)} given do")
    return [r for r, _ in kept], [s for _, s in kept], shared


def _with_shared_fraction(coefficients: StepTimeCoefficients, shared_runs: _SharedRuns,
                          source_label: Callable[[Path], str]) -> tuple[StepTimeCoefficients, str]:
    """``coefficients`` with the decode ``shared_context_fraction`` that ``shared_runs`` give against them
    (``fit_shared_fraction``; unchanged without such a run), and the note that says so."""
    if not shared_runs:
        return coefficients, " shared_context_fraction: not fitted, no server run given reads a shared prefix in its " \
                             "decode steps."
    try:
        f, n, k = fit_shared_fraction(
            step_time_model_of(coefficients), [sh for _, s, _ in shared_runs for sh in s.shapes],
            np.concatenate([s.elapsed_s for _, s, _ in shared_runs]), np.concatenate([c for _, _, c in shared_runs]),
            np.concatenate([np.full(len(s.shapes), j) for j, (_, s, _) in enumerate(shared_runs)]))
    except ValueError as exc:
        raise CalibrationError(f"cannot fit server_shared_context: {exc}") from exc
    labels = ", ".join(source_label(r.path) for r, _, _ in shared_runs)
    note = (f" shared_context_fraction: {f:.2f}, least squared log error over {n} decode-only steps with shared "
            f"context in {k} run{'' if k == 1 else 's'} ({labels}; kept out of the other terms), each run's "
            f"decode-only steps at the run's own speed level.")
    return coefficients.model_copy(update={
        "decode": coefficients.decode.model_copy(update={"shared_context_fraction": f})}), note


@dataclass
class ServerFit:
    front_end: ServerFrontEnd
    used: list[Path]
    refused: list[str] = field(default_factory=list)
    shared_context_runs: list[Path] = field(default_factory=list)  # (in ``used`` too)


def _median_excess(excess: Sequence[float] | np.ndarray) -> tuple[float, str]:
    """A fitted extra time: the median of the measured excesses (none below 0; 0 without any), and the note's end
    giving their quartiles in ms."""
    x = np.asarray(excess, dtype=np.float64)
    if not x.size:
        return 0.0, "."
    q = ", ".join(f"{v * 1e3:.2f}" for v in np.quantile(x, [0.25, 0.75]))
    return max(float(np.median(x)), 0.0), f" (quartiles {q} ms)."


def fit_server(recs: Sequence[RecordedRun], *, command: str, generated_on: str,
               source_label: Callable[[Path], str], options: FitOptions = FitOptions(),
               offline: StepTimeCoefficients | None = None) -> ServerFit:
    """The profile's ``server`` section from server-mode runs (``twin.calibration.server`` says how).

    Per-step front-end time: ``fit_front_end`` (non-negative least squares) of the client-side gap between
    consecutive streaming steps of a busy engine (less the later step's recorded model time) on ``[1, chunks]``. Server step time:
    ``robust_fit`` of the reconstructed step shapes against ``elapsed_ms`` with that base as the overhead.
    Arrival time: the value consistent with most requests' arrival bounds, pooled over the runs.
    With ``options.server_scaled_offline`` the step time is ``offline``'s regimes times one factor instead
    (``_scaled_offline``). With ``options.server_shared_context`` the runs whose decode steps read shared prefixes
    (``decode_shared_tokens``) fit the decode ``shared_context_fraction`` alone (``fit_shared_fraction``, against the
    terms the other runs give) and nothing else.
    """
    steps: list[ServerSteps] = []
    used: list[RecordedRun] = []
    refused: list[str] = []
    for r in recs:
        try:
            steps.append(reconstruct(r))
            used.append(r)
        except ReconstructionError as exc:
            refused.append(str(exc))
    if not steps:
        raise CalibrationError("no usable server run:\n  " + "\n  ".join(refused))
    shared_runs: _SharedRuns = []
    if options.server_shared_context:  # runs whose decode steps read shared prefixes fit the fraction alone
        used, steps, shared_runs = _set_apart_shared(used, steps)
    samples = [front_end_samples(s) for s in steps]
    gaps, chunks, s_firsts, s_lasts = (np.concatenate([x[i] for x in samples]) for i in range(4))
    s_sent = np.concatenate([front_end_sent(s) for s in steps])
    base_s, per_chunk_s, per_first_s, per_last_s, per_in_s = fit_front_end(
        gaps, chunks, (s_firsts, s_lasts) if options.stream_ends else None,
        sent=s_sent if options.intake else None)
    fixed = [step_front_end_s(s, base_s=base_s, per_chunk_s=per_chunk_s, per_first_s=per_first_s,
                              per_last_s=per_last_s, per_in_s=per_in_s) for s in steps]  # each step's front-end time
    shapes = [sh for s in steps for sh in s.shapes]
    elapsed = np.concatenate([s.elapsed_s for s in steps])
    lengths = [len(s.shapes) for s in steps]
    firsts = _first_steps(lengths) if options.first_step else None
    bounds = [arrival_bounds(r, s, front_end_s=base_s,
                             step_front_s=f if (options.stream_ends or options.intake) else None)
              for r, s, f in zip(used, steps, fixed, strict=True)]
    lower = np.concatenate([lo for lo, _ in bounds])
    upper = np.concatenate([hi for _, hi in bounds])
    arrival_s, consistent = fit_arrival_s(lower, upper)
    wakes = [idle_wakes(r, s, arrival_s=arrival_s) for r, s in zip(used, steps, strict=True)] \
        if options.idle_wake else None
    if wakes is not None:  # the idle wakes' steps out of the regimes (and the noise), as the first steps above
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        woken = np.zeros(int(sum(lengths)), dtype=bool)
        for off, w in zip(offsets, wakes, strict=True):
            woken[[off + k for k, _, _ in w]] = True
        firsts = woken if firsts is None else firsts | woken
    busy_in: list[np.ndarray] | None = None
    if options.intake_step:  # steps during which the client sent requests: out of the regimes (and the noise)
        busy_in = [s.sent > 0 for s in steps]
        taken = np.concatenate(busy_in)
        firsts = taken if firsts is None else firsts | taken
    if options.server_scaled_offline:
        if offline is None:
            raise CalibrationError("server_scaled_offline needs the offline fit's coefficients")
        coefficients, keep, scale = _scaled_offline(offline, shapes, elapsed, overhead_s=float(base_s), exclude=firsts)
        regime_note = (f"Step regimes: the offline fit's terms times {scale:.4f}, the median of measured / offline-"
                       f"predicted model time over {int(keep.sum())} of {keep.size} steps (server_scaled_offline)")
    else:
        from_offline: dict[str, float] = {}
        offline_note = ""
        for regime, on in (("prefill", options.server_offline_attention), ("decode", options.server_offline_context)):
            if on:
                if offline is None:
                    raise CalibrationError(f"{_OFFLINE_TERMS[regime][2]} needs the offline fit's coefficients")
                from_offline[regime], note = _offline_term(offline, shapes, elapsed, exclude=firsts, regime=regime)
                offline_note += note
        try:
            fit, keep = robust_fit(shapes, elapsed, overhead_s=float(base_s), exclude=firsts, options=options,
                                   runs=_run_index(lengths), fixed_attention_pair_s=from_offline.get("prefill"),
                                   fixed_decode_context_s=from_offline.get("decode"))
        except ValueError as exc:
            raise CalibrationError(f"cannot fit the server step-time regimes: {exc}") from exc
        coefficients = fit.coefficients
        regime_note = (f"Step regimes: relative-error NNLS without {int((~keep).sum())} of {keep.size} outlier steps"
                       + offline_note)
    first_note = ""
    if options.first_step:  # the first request sent: its first token, from its send plus the arrival time
        excess = []
        for r, s, f in zip(used, steps, fixed, strict=True):
            q = min(r.requests, key=lambda x: (x.arrival_s, x.request_id))
            assert q.token_times_s
            excess.append(first_step_excess_s(
                s.elapsed_s, float(predict_model_s(coefficients, s.shapes[:1])[0]),
                first_token_s=q.token_times_s[0] - arrival_s, token_step=int(s.token_steps[q.request_id][0]),
                fixed_s=f))
        coefficients = coefficients.model_copy(update={"first_step_s": fit_first_step_s(excess)})
        first_note = (f" first_step_s: median of the {len(excess)} runs' first-step excess "
                      f"({', '.join(f'{e * 1e3:.1f}' for e in excess)} ms), the first steps left out of the regimes.")
    idle_wake_s = 0.0
    idle_note = ""
    if wakes is not None:  # requests sent to an idle engine: their first token against the model just fitted
        excess = [e for w, s, f in zip(wakes, steps, fixed, strict=True)
                  for e in idle_wake_excess_s(w, predict_model_s(coefficients, s.shapes), f)]
        idle_wake_s, quartiles = _median_excess(excess)
        idle_note = (f" idle_wake_s: median excess of the first token of {len(excess)} requests sent to an engine idle "
                     f"for at least {IDLE_AFTER_S * 1e3:.0f} ms, their steps left out of the regimes{quartiles}")
    per_in_step_s = 0.0
    in_step_note = ""
    if busy_in is not None:  # their excess over the regimes just fitted, per request sent
        per = np.concatenate([(s.elapsed_s[m] - predict_model_s(coefficients, s.shapes)[m]) / s.sent[m]
                              for s, m in zip(steps, busy_in, strict=True)])
        per_in_step_s, quartiles = _median_excess(per)
        in_step_note = (f" per_request_in_step_s: median excess over the regimes, per request sent, of the {per.size} "
                        f"steps during which the client sent requests, left out of the regimes{quartiles}")
    shared_note = ""
    if options.server_shared_context:
        coefficients, shared_note = _with_shared_fraction(coefficients, shared_runs, source_label)
    resid = gaps - (base_s + per_chunk_s * chunks + per_first_s * s_firsts + per_last_s * s_lasts
                    + per_in_s * s_sent)
    ends_note = (f" + {per_first_s * 1e3:.3f} ms per stream opened + {per_last_s * 1e3:.3f} ms per stream closed "
                 f"(stream_ends)" if options.stream_ends else "")
    if options.intake:
        ends_note += f" + {per_in_s * 1e3:.3f} ms per request sent while the step ran (intake)"
    notes = (
        f"Fitted to {len(steps)} server runs, {elapsed.size} steps reconstructed from the iteration logs (FCFS walk "
        f"over the requests in send order, checked against every step's gen_requests). Front end per step: "
        f"{base_s * 1e3:.3f} ms + {per_chunk_s * 1e3:.3f} ms per streamed chunk{ends_note}, least squares over "
        f"{gaps.size} pairs of consecutive streaming steps with the engine busy in between (gap = client interval "
        f"- recorded elapsed; median {np.median(gaps) * 1e3:.3f} ms, mean {np.mean(gaps) * 1e3:.3f} ms, max "
        f"{np.max(gaps) * 1e3:.1f} ms; residual RMS {np.sqrt(np.mean(resid ** 2)) * 1e3:.3f} ms). "
        f"Arrival: {arrival_s * 1e3:.1f} ms is within "
        f"the bounds of {consistent} of {upper.size} requests (upper bound median {np.median(upper) * 1e3:.1f} ms). "
        f"{regime_note}; fit_quality on every step with a positive duration."
        + first_note + idle_note + in_step_note + shared_note
    )
    if refused:
        notes += " Refused: " + " | ".join(refused)
    front_end = ServerFrontEnd(
        arrival_s=arrival_s, per_chunk_s=float(per_chunk_s), step_time=coefficients,
        fit_quality=fit_quality(coefficients, shapes, elapsed,
                                target=f"recorded vLLM server step durations (iterations.csv elapsed_ms), "
                                       f"{len(steps)} runs"),
        provenance=Provenance(sources=[source_label(r.path) for r in [*used, *(r for r, _, _ in shared_runs)]],
                              command=command,
                              generated_on=generated_on, notes=notes),
        step_time_noise=step_time_noise(coefficients, shapes, elapsed, exclude=firsts),
        idle_wake_s=idle_wake_s, per_first_chunk_s=per_first_s, per_last_chunk_s=per_last_s,
        per_request_in_s=per_in_s, per_request_in_step_s=per_in_step_s,
    )
    return ServerFit(front_end=front_end, used=[r.path for r in [*used, *(r for r, _, _ in shared_runs)]],
                     refused=refused, shared_context_runs=[r.path for r, _, _ in shared_runs])
