"""A weighted sample's figures do not depend on how repeated values are split into entries or on their order:
an engine writes a decode-group step's gaps as one entry weighted by its member count, where a request
decoding on its own writes one entry per gap (``twin.models.engine_gaps``)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from twin.metrics import distribution, exact_weighted_sum, weighted_mean


def _collapsed(v: np.ndarray, w: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same sample with every value's entries merged into one (summed weight), shuffled."""
    vals, inv = np.unique(v, return_inverse=True)
    wts = np.bincount(inv, weights=w)
    perm = rng.permutation(vals.size)
    return vals[perm], wts[perm].astype(np.uint32)


@pytest.mark.parametrize("seed", range(6))
def test_entries_merged_and_shuffled_give_the_same_distribution(seed):
    rng = np.random.default_rng(seed)
    pool = rng.exponential(0.03, size=300)
    reps = rng.integers(1, 90, size=4000)
    v = np.repeat(rng.choice(pool, size=reps.size), reps)
    w = np.where(rng.random(v.size) < 0.9, 1, rng.integers(2, 500, size=v.size)).astype(np.uint32)
    mv, mw = _collapsed(v, w, rng)
    assert mv.size < v.size / 10
    a, b = distribution(v, w), distribution(mv, mw)
    assert a == b
    # and the mean is the exact sum rounded once, divided by the weight (a pairwise float sum of the products
    # is not that, in general)
    exact = sum((Fraction(x) * int(k) for x, k in zip(mv.tolist(), mw.tolist())), Fraction(0))
    assert a["mean"] == float(exact) / int(w.sum())


def test_exact_sum_where_a_float_sum_is_not():
    v = np.array([1e16, 1.0, -1e16, 1.0])
    w = np.array([3.0, 1.0, 3.0, 1.0])
    assert float(np.sum(v * w)) != 2.0  # the products' float sum loses the ones
    assert exact_weighted_sum(v, w) == 2.0
    assert exact_weighted_sum(v[::-1], w[::-1]) == 2.0


def test_weighted_mean_edge_cases():
    assert weighted_mean([0.5, 0.25], [1, 3]) == (0.5 + 0.75) / 4
    assert np.isnan(weighted_mean([np.nan, 1.0], [1, 1]))  # non-finite: np.average's answer
    assert weighted_mean([np.inf, 1.0], [1, 1]) == np.inf
    with pytest.raises(ZeroDivisionError):
        weighted_mean([1.0], [0])
    d = distribution([], [])
    assert d["count"] == 0 and np.isnan(d["mean"])
