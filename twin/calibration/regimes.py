"""Fitting the step-time regimes of recorded runs: a robust (outlier-trimmed) fit, its quality, and the noise
table of measured / fitted step times. Used by ``twin calibrate`` for the offline regimes and by the server
front end's refit (``twin.calibration.calibrate``); docs/calibration.md, "What calibrate does"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from twin.engine_profiles.fit import StepTimeFit, fit_step_time, regime_quality
from twin.engine_profiles.profile import (
    FitQuality,
    StepTimeCoefficients,
    StepTimeNoise,
    decode_batch_changed,
    step_time_model_of,
)
from twin.engine_profiles.step import StepShape


@dataclass(frozen=True)
class FitOptions:
    """Optional model terms of a fit; all off by default (docs/calibration.md, "Cross-validation", says how each
    was judged). ``prefill_per_request``: a per-request column in the prefill regime
    (``PrefillCoefficients.per_request_s``). ``first_step``: the extra time of a run's first step
    (``StepTimeCoefficients.first_step_s``, and the server section's), with that step left out of the regimes.
    ``decode_single_request`` / ``decode_context_sq`` / ``decode_batch_change``: the decode regime's optional columns
    (``DecodeCoefficients.single_request_s`` / ``per_context_token_sq_s`` / ``batch_change_s``; ``fit_step_time``).
    ``run_levels``: no new term; each run gets its own speed level while the coefficients are fitted
    (``robust_fit``), so a difference in the host's speed between two runs is not read as a difference between
    their step shapes; the profile keeps the runs' average level. ``server_scaled_offline``: the server section's
    step-time regimes are the offline fit's terms times one factor fitted on the server runs' steps (``fit_server``)
    instead of regimes of their own, which two server runs leave poorly conditioned. ``idle_wake``: the extra time
    of the first step after the engine sat idle (``ServerFrontEnd.idle_wake_s``, fitted on the server runs, whose
    idle wakes it leaves out of the server regimes). ``server_offline_attention``: the server section's
    ``per_attention_pair_s`` is the offline fit's times the server runs' speed against the offline model (the median
    of measured over offline-predicted model time on their prefill steps), and the server runs fit the other terms:
    two server runs without a shared prefix leave the attention term nearly collinear with the token term.
    ``stream_ends``: the server front end's time per stream opened and closed in a step (``ServerFrontEnd.
    per_first_chunk_s`` / ``per_last_chunk_s``), fitted with the per-step and per-chunk terms (``fit_front_end``).
    ``intake``: the server front end's time per request the client sent while a step ran (``ServerFrontEnd.
    per_request_in_s``), fitted the same way on the requests sent between the pair's tokens (``front_end_sent``).
    ``intake_step``: the engine's own step time per request the client sent while the step ran (``ServerFrontEnd.
    per_request_in_step_s``: the API server's intake slows the engine on the cores they share), the median excess of
    those steps over the server regimes, which are fitted without them.
    ``decode_floor``: the decode regime's batch floor (``DecodeCoefficients.floor_requests``, chosen by
    ``fit_step_time``), in the offline fit and the server section's alike. ``server_offline_context``: the server
    section's decode ``per_context_token_s`` is the offline fit's times the server runs' speed against the offline
    model on their decode steps (``fit_server``), as ``server_offline_attention`` does for the prefill attention
    term: in the server sweep a decode step's context grows with its batch, so the two terms trade off.
    ``server_shared_context``: the server section's decode ``shared_context_fraction``, fitted on the server runs
    whose decode steps read shared prefixes (``fit_server``), which are kept out of the other terms' fit."""

    prefill_per_request: bool = False
    first_step: bool = False
    decode_single_request: bool = False
    decode_context_sq: bool = False
    decode_batch_change: bool = False
    run_levels: bool = False
    server_scaled_offline: bool = False
    idle_wake: bool = False
    server_offline_attention: bool = False
    stream_ends: bool = False
    intake: bool = False
    intake_step: bool = False
    decode_floor: bool = False
    server_offline_context: bool = False
    server_shared_context: bool = False


TRIM_MADS = 3.0  # outlier threshold in scaled median absolute deviations of log(measured / fitted)
TRIM_FLOOR_RATIO = 1.25  # never trim a step within this factor of the fit
TRIM_ROUNDS = 5


def predict_model_s(coefficients: StepTimeCoefficients, shapes: Sequence[StepShape]) -> np.ndarray:
    """Model-execution time of each step (the overhead left out). ``shapes`` are steps in run order (runs one after
    the other: each starts with a prefill step, so the batch-change term never spans two runs)."""
    model = step_time_model_of(coefficients)
    out = np.array([model.step_time_s(s) for s in shapes]) - coefficients.overhead_s
    if coefficients.decode.batch_change_s:
        out = out + coefficients.decode.batch_change_s * decode_batch_changed(shapes)
    return out


# ``run_levels``: alternations of (levels, coefficients) per trimming round, until no level moves by more than
# RUN_LEVEL_TOL (relative); alternating converges slowly where levels and terms trade off (~100-300 rounds on
# tests/test_run_levels.py's two runs), so the cap is generous
RUN_LEVEL_ROUNDS = 1000
RUN_LEVEL_TOL = 1e-7


def robust_fit(shapes: Sequence[StepShape], elapsed_s: np.ndarray, *, overhead_s: float,
               prefill_per_request: bool = False, exclude: np.ndarray | None = None,
               options: FitOptions | None = None, runs: Sequence[int] | None = None,
               fixed_attention_pair_s: float | None = None,
               fixed_decode_context_s: float | None = None) -> tuple[StepTimeFit, np.ndarray]:
    """``fit_step_time`` on the recorded durations, refitted without outlier steps until the kept set is stable.

    Returns the fit and the mask of steps it used. A step is an outlier when ``|log(measured / fitted)|``
    is more than ``TRIM_MADS`` scaled MADs (and more than ``log(TRIM_FLOOR_RATIO)``) from its regime's
    median; steps with a zero duration, and those ``exclude`` marks (a run's first step when ``first_step_s`` is
    fitted), are never used. ``prefill_per_request``: ``fit_step_time``'s fifth prefill column; ``options`` (its
    ``prefill_per_request`` counts too): the decode regime's optional columns, the batch-change flags taken over the
    whole ``shapes`` sequence (runs in order). ``fixed_attention_pair_s``, ``fixed_decode_context_s``:
    ``fit_step_time``'s, not fitted.

    With ``options.run_levels`` (``runs``: each step's run, required then), every run's durations are divided by
    that run's level before the coefficients are fitted, and the levels (the median of measured / fitted over the
    run's kept steps, normalised to a geometric mean of 1 over the runs, each run one vote) and the coefficients
    are refitted in turn; outliers are judged on ``log(measured / (level * fitted))``. The coefficients so describe
    a run at the runs' average speed, and each term is set by the differences between steps *within* runs.
    """
    elapsed_s = np.asarray(elapsed_s, dtype=np.float64)
    decode = np.array([s.is_decode_only for s in shapes], dtype=bool)
    usable = elapsed_s > 0
    if exclude is not None:
        usable &= ~exclude
    keep = usable.copy()
    opts = options or FitOptions()
    changed = decode_batch_changed(shapes) if opts.decode_batch_change else None
    if opts.run_levels:
        if runs is None or len(runs) != len(shapes):
            raise ValueError("run_levels needs the run of every step")
        run_of = np.asarray(runs, dtype=np.int64)
    level = np.ones(len(shapes))  # each step's run level (1 without run_levels)
    fit = None
    for _ in range(TRIM_ROUNDS):
        idx = np.flatnonzero(keep)
        for _ in range(RUN_LEVEL_ROUNDS if opts.run_levels else 1):
            fit = fit_step_time([shapes[i] for i in idx], elapsed_s[idx] / level[idx] + overhead_s,
                                overhead_s=overhead_s,
                                prefill_per_request=prefill_per_request or opts.prefill_per_request,
                                decode_single_request=opts.decode_single_request,
                                decode_context_sq=opts.decode_context_sq,
                                decode_batch_changed=None if changed is None else changed[idx],
                                decode_floor=opts.decode_floor, fixed_decode_context_s=fixed_decode_context_s,
                                fixed_attention_pair_s=fixed_attention_pair_s)
            if opts.run_levels:
                before = level
                level = _run_levels(elapsed_s / predict_model_s(fit.coefficients, shapes), run_of, keep)
                if np.max(np.abs(level / before - 1.0)) <= RUN_LEVEL_TOL:
                    break
        r = np.log(np.where(elapsed_s > 0, elapsed_s, np.nan) / (level * predict_model_s(fit.coefficients, shapes)))
        new_keep = usable.copy()
        for regime in (decode, ~decode):
            sel = regime & keep
            med = np.median(r[sel])
            thr = max(TRIM_MADS * 1.4826 * np.median(np.abs(r[sel] - med)), np.log(TRIM_FLOOR_RATIO))
            new_keep &= ~regime | (np.abs(r - med) <= thr)
        if np.array_equal(new_keep, keep):
            break
        keep = new_keep
    assert fit is not None
    return fit, keep


def _run_levels(ratio: np.ndarray, run_of: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Each step's run level: the median of ``ratio`` (measured / fitted) over its run's kept steps, the levels
    normalised to a geometric mean of 1 over the runs that have kept steps (a run with none: 1)."""
    levels: dict[int, float] = {}
    for j in np.unique(run_of):
        sel = keep & (run_of == j) & (ratio > 0)
        if sel.any():
            levels[int(j)] = float(np.median(ratio[sel]))
    if not levels:
        return np.ones(ratio.size)
    norm = float(np.exp(np.mean(np.log(list(levels.values())))))
    table = np.array([levels.get(int(j), norm) / norm for j in range(int(run_of.max()) + 1)])
    return table[run_of]


def fit_quality(coefficients: StepTimeCoefficients, shapes: Sequence[StepShape], elapsed_s: np.ndarray, *,
                target: str) -> FitQuality:
    """Quality per regime on every recorded step with a positive duration (trimmed steps included); ``shapes`` are
    every step, in run order (the batch-change term depends on it), zero-duration ones included."""
    y = np.asarray(elapsed_s, dtype=np.float64)
    pred = predict_model_s(coefficients, shapes)
    decode = np.array([s.is_decode_only for s in shapes], dtype=bool)
    ok = y > 0
    return FitQuality(target=target, decode=regime_quality(pred[decode & ok], y[decode & ok]),
                      prefill=regime_quality(pred[~decode & ok], y[~decode & ok]))


NOISE_PERCENTILES = np.arange(101)


def step_time_noise(coefficients: StepTimeCoefficients, shapes: Sequence[StepShape], elapsed_s: np.ndarray,
                    exclude: np.ndarray | None = None) -> StepTimeNoise:
    """Percentiles 0..100 of ``measured / fitted`` model-execution time per regime, over every step with a
    positive duration (the trimmed outliers included: real steps do stall, and a replay should see it), less
    the steps ``exclude`` marks (first steps, when ``first_step_s`` models them)."""
    y = np.asarray(elapsed_s, dtype=np.float64)
    ratio = y / predict_model_s(coefficients, shapes)
    decode = np.array([s.is_decode_only for s in shapes], dtype=bool)
    ok = (y > 0) & np.isfinite(ratio)
    if exclude is not None:
        ok &= ~exclude
    q = {name: [round(float(v), 6) for v in np.percentile(ratio[sel & ok], NOISE_PERCENTILES)]
         for name, sel in (("decode", decode), ("prefill", ~decode))}
    counts = {"decode": int((decode & ok).sum()), "prefill": int((~decode & ok).sum())}
    notes = "; ".join(
        f"{name}: median {np.median(ratio[sel & ok]):.3f}, mean {np.mean(ratio[sel & ok]):.3f}, p10 {p[10]:.3f}, "
        f"p90 {p[90]:.3f}, sigma(log) {np.std(np.log(ratio[sel & ok])):.3f}"
        for (name, sel), p in zip((("decode", decode), ("prefill", ~decode)), (q["decode"], q["prefill"]), strict=True))
    return StepTimeNoise(decode=q["decode"], prefill=q["prefill"], num_samples=counts,
                         notes=f"measured / fitted model-execution time of the calibration steps: {notes}")
