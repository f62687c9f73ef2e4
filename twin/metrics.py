"""Metric names and formulas, defined once (see docs/metrics.md)."""

from __future__ import annotations

import math
from enum import StrEnum
from itertools import chain

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


# Veltkamp's splitting constant for float64: x * _SPLIT locates the top 26 significant bits of x
_SPLIT = 134217729.0  # 2**27 + 1
_SPLIT_MAX = 2.0 ** 996  # above this x * _SPLIT could overflow


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x == hi + lo`` exactly, each with at most 26 significant bits (Veltkamp's split), so the product of
    a half of one value and a half of another is exact (barring underflow)."""
    c = x * _SPLIT
    hi = c - (c - x)
    return hi, x - hi


def exact_weighted_sum(values, weights) -> float | None:
    """``sum(values * weights)`` computed exactly and rounded once (``math.fsum`` of the exact partial
    products), so it does not depend on the order of the entries or on how a repeated value is split into
    entries. None when a value or weight is not finite or too large to split."""
    return exact_weighted_sum_of([(values, weights)])


def exact_weighted_sum_of(pairs) -> float | None:
    """``exact_weighted_sum`` of the (values, weights) pairs taken together (one rounding for all: the sum
    of each pair's rounded sum would round more than once)."""
    bad = False

    def products():
        nonlocal bad
        for values, weights in pairs:
            v = np.asarray(values, dtype=np.float64)
            w = np.asarray(weights, dtype=np.float64)
            if v.size == 0:
                continue
            if (not (np.isfinite(v).all() and np.isfinite(w).all())
                    or max(np.abs(v).max(), np.abs(w).max()) >= _SPLIT_MAX):
                bad = True
                return
            vh, vl = _halves(v)
            wh, wl = _halves(w)
            for x, y in ((vh, wh), (vh, wl), (vl, wh), (vl, wl)):
                yield from (x * y).tolist()  # one product list at a time (32 bytes a value as Python floats)

    s = math.fsum(products())
    return None if bad else s


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


def weighted_mean(values, weights) -> float:
    """``sum(values * weights) / sum(weights)``, each sum exact and rounded once, so the mean of n entries of
    weight 1 and of one entry of weight n agree bit for bit, in any order (``np.average`` sums pairwise in
    the given order). Non-finite values fall back on ``np.average``. ZeroDivisionError when the weights sum
    to zero, as ``np.average`` raises."""
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    return weighted_mean_of(lambda: [(v, w)])


def weighted_mean_of(pairs) -> float:
    """``weighted_mean`` of the (values, weights) pairs taken together (``pairs``: a callable returning an
    iterable of them, read up to twice)."""
    s = exact_weighted_sum_of(pairs())
    if s is None:
        v = np.concatenate([np.asarray(x, dtype=np.float64) for x, _ in pairs()])
        w = np.concatenate([np.asarray(y, dtype=np.float64) for _, y in pairs()])
        return float(np.average(v, weights=w))
    total = math.fsum(chain.from_iterable(np.asarray(w, dtype=np.float64).tolist() for _, w in pairs()))
    if total == 0:
        raise ZeroDivisionError("Weights sum to zero, can't be normalized")
    return s / total


def distribution(values, weights=None) -> dict[str, float | int]:
    """p50/p90/p95/p99/mean/count of a (weighted) sample; NaN when empty. A weighted sample's mean is
    ``weighted_mean`` (exact sums); an unweighted one's is ``np.mean``'s."""
    v = np.asarray(values, dtype=np.float64)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    qs = weighted_quantiles(v, w, tuple(p / 100 for p in PERCENTILES))
    out: dict[str, float | int] = {f"p{p}": q for p, q in zip(PERCENTILES, qs)}
    if v.size:
        out["mean"] = float(np.average(v)) if w is None else weighted_mean(v, w)
        out["count"] = int(v.size if w is None else w.sum())
    else:
        out["mean"] = float("nan")
        out["count"] = 0
    return out


# ---- quantiles of a sample held in parts ------------------------------------------------------------

_BUCKET_BITS = 16
_SUB_BITS = 12  # a second level inside a wanted bucket: only the values of one sub-bucket are collected
_SIGN = np.uint64(1 << 63)


def _order_keys(v: np.ndarray) -> np.ndarray:
    """uint64 keys whose unsigned order is the float64 values' order (for values that are not NaN)."""
    b = v.view(np.uint64)
    return np.where(b >= _SIGN, ~b, b | _SIGN)


def _key_value(key: int) -> float:
    b = key & ~(1 << 63) if key >> 63 else ~key & 0xFFFF_FFFF_FFFF_FFFF
    return float(np.array([b], dtype=np.uint64).view(np.float64)[0])


def grouped_weighted_quantiles(parts, n_groups: int, qs: tuple[float, ...]) -> list[list[float]] | None:
    """``weighted_quantiles`` of the whole sample and of each group in it, where the sample is held in parts
    and never concatenated: ``parts()`` returns an iterable of (values, weights, group ids 0..n_groups-1),
    read twice. Returns ``[whole, group 0, group 1, ...]``, each exactly what ``weighted_quantiles`` gives
    on the concatenated values and weights, or None when a value is NaN or -0.0 (there the sorted order of
    equal values decides the answer; the caller concatenates instead).

    Why: a fleet's inter-token gaps are ~300 M weighted values at full scale; sorting them needs an index
    and sorted copies (~24 bytes a value). Here a first pass histograms the weight by the top 16 bits of
    each value's order key, which locates each quantile's bucket; a second pass histograms the next 12
    bits inside those buckets, which locates its sub-bucket; a third takes out only those sub-buckets'
    distinct values with their summed weights, which are sorted. (Taking out whole 16-bit buckets, as
    this did before, held ~12 bytes a gap at the end of a fleet run: gaps cluster in a few buckets.) The
    answer is the smallest value whose cumulative weight reaches ``q * total`` (as ``weighted_quantiles``'
    search finds it); weights are whole numbers, so the weight sums are exact in any order."""
    bins = 1 << _BUCKET_BITS
    shift = np.uint64(64 - _BUCKET_BITS)
    hist_w = np.zeros(n_groups * bins, dtype=np.float64)
    hist_n = np.zeros(n_groups * bins, dtype=np.int64)
    for v, w, g in parts():
        if v.size == 0:
            continue
        if np.isnan(v).any() or (np.signbit(v) & (v == 0)).any():
            return None
        cell = (_order_keys(v) >> shift).astype(np.int64) + np.asarray(g, dtype=np.int64) * bins
        hist_w += np.bincount(cell, weights=w, minlength=n_groups * bins)
        hist_n += np.bincount(cell, minlength=n_groups * bins)
    hist_w, hist_n = hist_w.reshape(n_groups, bins), hist_n.reshape(n_groups, bins)
    samples = [(hist_w.sum(axis=0), hist_n.sum(axis=0))] + list(zip(hist_w, hist_n))
    # per sample and quantile: the bucket holding the answer, the weight below it, and the target
    wanted: list[list[tuple[int, float, float] | None]] = []
    for hw, hn in samples:
        nonempty = np.flatnonzero(hn)
        if nonempty.size == 0:
            wanted.append([None] * len(qs))
            continue
        cum = np.cumsum(hw)
        total = cum[-1]
        row = []
        for q in qs:
            target = q * total
            reach = nonempty[cum[nonempty] >= target]
            d = int(reach[0]) if reach.size else int(nonempty[-1])  # none reach: the largest value
            row.append((d, float(cum[d] - hw[d]), target))
        wanted.append(row)
    buckets = sorted({(s, x[0]) for s, row in enumerate(wanted) for x in row if x is not None})
    # Second pass: within each wanted bucket, the weight by the next _SUB_BITS bits of the key, which
    # locates each quantile's sub-bucket (weights are whole numbers: every sum below is exact).
    sub_bins = 1 << _SUB_BITS
    sub_shift, sub_mask = np.uint64(64 - _BUCKET_BITS - _SUB_BITS), np.uint64(sub_bins - 1)
    sub_w = {b: np.zeros(sub_bins, dtype=np.float64) for b in buckets}
    sub_n = {b: np.zeros(sub_bins, dtype=np.int64) for b in buckets}
    for k, w, sel_of in _bucket_parts(parts, buckets, shift):
        for b, sel in sel_of:
            sub = ((k[sel] >> sub_shift) & sub_mask).astype(np.int64)
            sub_w[b] += np.bincount(sub, weights=w[sel], minlength=sub_bins)
            sub_n[b] += np.bincount(sub, minlength=sub_bins)
    final: list[list[tuple[tuple[int, int, int], float, float] | None]] = []
    for s, row in enumerate(wanted):
        out_row = []
        for x in row:
            if x is None:
                out_row.append(None)
                continue
            d, below, target = x
            hw, nonempty = sub_w[(s, d)], np.flatnonzero(sub_n[(s, d)])
            cum = np.cumsum(hw) + below
            reach = nonempty[cum[nonempty] >= target]
            d2 = int(reach[0]) if reach.size else int(nonempty[-1])  # none reach: the largest value
            out_row.append(((s, d, d2), float(cum[d2] - hw[d2]), target))
        final.append(out_row)
    # Third pass: the distinct keys of each wanted sub-bucket and their weights. Equal values (gaps repeat)
    # are merged: the answer is a value, and the first merged key whose cumulative weight reaches the
    # target is the value of the first single one that does.
    cells = sorted({x[0] for row in final for x in row if x is not None})
    got: dict[tuple[int, int, int], tuple[list, list]] = {c: ([], []) for c in cells}
    for k, w, sel_of in _bucket_parts(parts, buckets, shift):
        by_bucket = dict(sel_of)
        for s, d, d2 in cells:
            sel = by_bucket.get((s, d))
            if sel is None:
                continue
            kk = k[sel]
            inner = ((kk >> sub_shift) & sub_mask) == np.uint64(d2)
            keys, inv = np.unique(kk[inner], return_inverse=True)
            got[(s, d, d2)][0].append(keys)
            got[(s, d, d2)][1].append(np.bincount(inv, weights=w[sel][inner], minlength=keys.size))
    out = []
    for row in final:
        vals = []
        for x in row:
            if x is None:
                vals.append(float("nan"))
                continue
            cell, below, target = x
            keys, inv = np.unique(np.concatenate(got[cell][0]), return_inverse=True)
            wts = np.bincount(inv, weights=np.concatenate(got[cell][1]), minlength=keys.size)
            cw = np.cumsum(wts) + below
            idx = int(np.searchsorted(cw, target, side="left"))
            vals.append(_key_value(int(keys[min(idx, keys.size - 1)])))
        out.append(vals)
    return out


def _bucket_parts(parts, buckets: list[tuple[int, int]], shift: np.uint64):
    """Per part with values: its order keys, its weights as floats, and for each wanted (sample, bucket)
    that holds some of its values the mask selecting them (sample 0 is the whole, s > 0 group s - 1)."""
    for v, w, g in parts():
        if v.size == 0:
            continue
        k = _order_keys(v)
        top = (k >> shift).astype(np.int64)
        g = np.asarray(g)
        in_d: dict[int, np.ndarray] = {}
        sel_of = []
        for s, d in buckets:
            m = in_d.get(d)
            if m is None:
                m = in_d[d] = top == d
            sel = m if s == 0 else m & (g == s - 1)
            if sel.any():
                sel_of.append(((s, d), sel))
        yield k, np.asarray(w, dtype=np.float64), sel_of
