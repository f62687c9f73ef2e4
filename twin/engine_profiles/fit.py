"""Least-squares fitting of the compact step-time coefficients (non-negative, relative error).

Used by ``derive`` (fitting to the operator-level H100 model) and by the calibration work (fitting to
step durations recorded from a real vLLM). Minimises the squared *relative* error of each step, so short
decode steps and long prefill steps count alike. Non-negativity keeps the model monotone: more tokens,
more context or more attention work never make a step faster.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from twin.engine_profiles.profile import (
    DecodeCoefficients,
    PrefillCoefficients,
    RegimeFitQuality,
    StepTimeCoefficients,
)
from twin.engine_profiles.step import StepShape


@dataclass(frozen=True, slots=True)
class StepTimeFit:
    coefficients: StepTimeCoefficients
    decode_quality: RegimeFitQuality
    prefill_quality: RegimeFitQuality


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: the best unconstrained solution over every
    subset of active columns whose coefficients are all >= 0 (2**k small solves; k <= 5 here)."""
    k = a.shape[1]
    best, best_cost = np.zeros(k), float(b @ b)
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            resid = b - sub @ x
            cost = float(resid @ resid)
            if cost < best_cost - 1e-18 * max(1.0, best_cost):
                best = np.zeros(k)
                best[list(cols)] = x
                best_cost = cost
    return best


def regime_quality(pred: np.ndarray, y: np.ndarray) -> RegimeFitQuality:
    rel = np.abs(pred - y) / y
    return RegimeFitQuality(
        num_samples=int(y.size),
        rmse_s=float(np.sqrt(np.mean((pred - y) ** 2))),
        mean_abs_rel_error=float(rel.mean()),
        max_abs_rel_error=float(rel.max()),
    )


def _fit_regime(features: np.ndarray, y: np.ndarray, name: str, *, fixed: tuple[int, float] | None = None
                ) -> tuple[np.ndarray, RegimeFitQuality]:
    """Relative-error NNLS of ``y`` on ``features``; ``fixed = (column, value)`` holds that coefficient at the value
    (its time taken off ``y``, the weights still ``1 / y``) and fits the others."""
    free = features if fixed is None else np.delete(features, fixed[0], axis=1)
    if y.size < free.shape[1]:
        raise ValueError(f"{name}: need at least {free.shape[1]} steps to fit, got {y.size}")
    if np.any(y <= 0):
        raise ValueError(f"{name}: step durations (after overhead) must be positive")
    w = 1.0 / y  # relative error
    if fixed is None:
        x = nnls(features * w[:, None], y * w)
    else:
        col, value = fixed
        if value < 0:
            raise ValueError(f"{name}: a fixed coefficient must be >= 0")
        x = np.insert(nnls(free * w[:, None], (y - value * features[:, col]) * w), col, value)
    return x, regime_quality(features @ x, y)


MAX_FLOOR_REQUESTS = 32  # the batch floors tried by ``fit_step_time(decode_floor=True)``


def _fit_floor(features: np.ndarray, y: np.ndarray, *, fixed: tuple[int, float] | None = None
               ) -> tuple[np.ndarray, RegimeFitQuality, int]:
    """The decode regime fitted with each batch floor k (column 1 = ``max(decode_requests, k)``): the coefficients,
    their quality, and the k with the least squared relative error (0 when that is 1). ``fixed``: ``_fit_regime``'s."""
    batch = features[:, 1]
    best: tuple[float, np.ndarray, RegimeFitQuality, int] | None = None
    for k in range(1, int(min(batch.max(), MAX_FLOOR_REQUESTS)) + 1):
        f = features.copy()
        f[:, 1] = np.maximum(batch, k)
        x, quality = _fit_regime(f, y, "decode-only steps", fixed=fixed)
        err = float(np.sum(((f @ x - y) / y) ** 2))
        if best is None or err < best[0]:
            best = (err, x, quality, k)
    assert best is not None
    _, x, quality, k = best
    return x, quality, (k if k > 1 else 0)


def fit_step_time(
    shapes: Sequence[StepShape], elapsed_s: Sequence[float], *, overhead_s: float | None = None,
    prefill_per_request: bool = False, decode_single_request: bool = False, decode_context_sq: bool = False,
    decode_batch_changed: Sequence[bool] | None = None, fixed_attention_pair_s: float | None = None,
    decode_floor: bool = False, fixed_decode_context_s: float | None = None,
) -> StepTimeFit:
    """Fit both regimes to measured (or modelled) step durations.

    ``overhead_s`` is the per-step time outside model execution. Step durations alone cannot separate it
    from the regimes' ``base_s`` (they are added together), so pass it when it is known (e.g. from CPU-side
    timings); when None it is 0 and each regime's ``base_s`` carries it. ``prefill_per_request``: the prefill
    regime gets a fifth column, the requests computed in the step (decode + prefill; one sampled row each),
    fitted into ``PrefillCoefficients.per_request_s``; off, that term is 0 as in every profile before it.
    The decode regime's optional columns (``DecodeCoefficients``; each 0 when off): ``decode_single_request``,
    ``[decode_requests == 1]`` into ``single_request_s``; ``decode_context_sq``, ``decode_context_tokens**2 /
    decode_requests`` into ``per_context_token_sq_s``; ``decode_batch_changed``, one flag per step (from
    ``profile.decode_batch_changed`` over the run's full step sequence, since ``shapes`` may be a subset), into
    ``batch_change_s``; ``decode_floor``, the batch floor ``floor_requests``: the decode regime is fitted with
    ``max(decode_requests, k)`` in place of ``decode_requests`` for every k from 1 up to the largest batch (at most
    ``MAX_FLOOR_REQUESTS``), and the k with the least squared relative error kept (1: no floor, written as 0).
    ``fixed_attention_pair_s``: the prefill regime's ``per_attention_pair_s`` is this value, not fitted (its time is
    taken off the prefill steps' durations before the other terms are fitted); ``fixed_decode_context_s`` does the
    same for the decode regime's ``per_context_token_s``.
    """
    if len(shapes) != len(elapsed_s):
        raise ValueError("shapes and elapsed_s must have the same length")
    ovh = 0.0 if overhead_s is None else float(overhead_s)
    if ovh < 0:
        raise ValueError("overhead_s must be >= 0")
    y_all = np.asarray(elapsed_s, dtype=np.float64) - ovh
    dec = [i for i, s in enumerate(shapes) if s.is_decode_only]
    pre = [i for i, s in enumerate(shapes) if not s.is_decode_only]
    if decode_batch_changed is not None and len(decode_batch_changed) != len(shapes):
        raise ValueError("decode_batch_changed must have one flag per shape")
    extra = [(decode_single_request, lambda i: float(shapes[i].decode_requests == 1)),
             (decode_context_sq, lambda i: shapes[i].decode_context_tokens ** 2 / max(shapes[i].decode_requests, 1)),
             (decode_batch_changed is not None, lambda i: float(bool(decode_batch_changed[i])))]  # type: ignore[index]
    used = [f for on, f in extra if on]
    fd = np.array([[1.0, shapes[i].decode_requests, shapes[i].decode_context_tokens] + [f(i) for f in used]
                   for i in dec]).reshape(-1, 3 + len(used))
    floor = 0
    fixed_ctx = None if fixed_decode_context_s is None else (2, fixed_decode_context_s)
    if decode_floor and dec:
        xd, qd, floor = _fit_floor(fd, y_all[dec], fixed=fixed_ctx)
    else:
        xd, qd = _fit_regime(fd, y_all[dec], "decode-only steps", fixed=fixed_ctx)
    xe = iter(xd[3:])
    terms = {name: (float(next(xe)) if on else 0.0) for name, (on, _) in
             zip(("single_request_s", "per_context_token_sq_s", "batch_change_s"), extra, strict=True)}
    fp = np.array(
        [
            [1.0, shapes[i].total_tokens, shapes[i].prefill_attention_pairs, shapes[i].decode_context_tokens]
            + ([shapes[i].decode_requests + shapes[i].prefill_requests] if prefill_per_request else [])
            for i in pre
        ]
    ).reshape(-1, 5 if prefill_per_request else 4)
    xp, _ = _fit_regime(fp, y_all[pre], "prefill-carrying steps",
                        fixed=None if fixed_attention_pair_s is None else (2, fixed_attention_pair_s))
    coefficients = StepTimeCoefficients(
        overhead_s=ovh,
        decode=DecodeCoefficients(base_s=xd[0], per_request_s=xd[1], per_context_token_s=xd[2], floor_requests=floor,
                                  **terms),
        prefill=PrefillCoefficients(
            base_s=xp[0], per_token_s=xp[1], per_attention_pair_s=xp[2], per_decode_context_token_s=xp[3],
            per_request_s=xp[4] if prefill_per_request else 0.0,
        ),
    )
    # prefill quality is measured on the model as used (floored at the decode-only time of its decodes)
    from twin.engine_profiles.profile import step_time_model_of

    model = step_time_model_of(coefficients)
    pred_p = np.array([model.step_time_s(shapes[i]) for i in pre]) - ovh
    qp = regime_quality(pred_p, y_all[pre])
    return StepTimeFit(coefficients=coefficients, decode_quality=qd, prefill_quality=qp)
