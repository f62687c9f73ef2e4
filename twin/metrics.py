"""Metric names and formulas, defined once (see docs/metrics.md)."""

from __future__ import annotations

from enum import StrEnum

import numpy as np

PERCENTILES = (50, 90, 95, 99)


class Metric(StrEnum):
    TTFT_S = "ttft_s"  # first token time - arrival time (includes queueing, as vLLM's frontend measures it)
    ITL_S = "itl_s"  # gap between consecutive streamed tokens of one request, all gaps of all requests
    TPOT_S = "tpot_s"  # per request: (last token - first token) / (output tokens - 1), outputs > 1
    E2E_S = "e2e_s"  # finish - arrival
    QUEUE_S = "queue_s"  # first scheduled - arrival (engine queue only)
    OUTPUT_TOKENS_PER_S = "output_tokens_per_s"
    GOODPUT_RPS = "goodput_rps"
    SLO_ATTAINMENT = "slo_attainment"
    PREFIX_CACHE_HIT_RATE = "prefix_cache_hit_rate"
    PREEMPTIONS = "preemptions"
    KV_USAGE_MEAN = "kv_usage_mean"


def weighted_quantiles(values: np.ndarray, weights: np.ndarray | None, qs: tuple[float, ...]) -> list[float]:
    """Inverse-CDF quantiles (the smallest value whose cumulative weight reaches q) of a weighted sample."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return [float("nan")] * len(qs)
    order = np.argsort(v, kind="stable")
    # The cumulative weight in value order, computed in place, and the values read through ``order`` at
    # the few quantile positions only: a fleet's inter-token gaps are hundreds of millions of values, and
    # sorted copies of values and weights would double this function's memory.
    if weights is None:
        cw = np.arange(1, v.size + 1, dtype=np.float64)  # the running sum of ones, exactly
    else:
        cw = np.asarray(weights, dtype=np.float64)[order]
        np.cumsum(cw, out=cw)
    total = cw[-1]
    out = []
    for q in qs:
        idx = int(np.searchsorted(cw, q * total, side="left"))
        out.append(float(v[order[min(idx, v.size - 1)]]))
    return out


def distribution(values, weights=None) -> dict[str, float | int]:
    """p50/p90/p95/p99/mean/count of a (weighted) sample; NaN when empty."""
    v = np.asarray(values, dtype=np.float64)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    qs = weighted_quantiles(v, w, tuple(p / 100 for p in PERCENTILES))
    out: dict[str, float | int] = {f"p{p}": q for p, q in zip(PERCENTILES, qs)}
    if v.size:
        out["mean"] = float(np.average(v, weights=w))
        out["count"] = int(v.size if w is None else w.sum())
    else:
        out["mean"] = float("nan")
        out["count"] = 0
    return out
