"""``weighted_quantiles`` merges runs of repeated values (whole-number weights) before sorting: the answers
must be exactly those of the unmerged sort (``twin.metrics._merge_repeats``)."""

from __future__ import annotations

import numpy as np
import pytest

from twin.metrics import _MERGE_MIN, distribution, weighted_quantiles

QS = (0.0, 0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)


def _reference(v: np.ndarray, w: np.ndarray) -> list[float]:
    # float weights take the unmerged path: the definition
    return weighted_quantiles(v, w.astype(np.float64), QS)


def _runs(rng: np.random.Generator, n_runs: int, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vals = rng.choice(pool, size=n_runs)
    reps = rng.integers(1, 80, size=n_runs)
    v = np.repeat(vals, reps)
    # mostly weight 1 (a group step's gaps), some large weights (a decode run's later steps, one per step)
    w = np.where(rng.random(v.size) < 0.9, 1, rng.integers(2, 500, size=v.size)).astype(np.uint32)
    return v, w


@pytest.mark.parametrize("seed", range(6))
def test_merged_quantiles_are_the_unmerged_ones(seed):
    rng = np.random.default_rng(seed)
    # few distinct values (many ties across runs) and signed zeros, NaN and infinities among them
    pool = np.concatenate([np.round(rng.exponential(0.03, size=40), 3), [0.0, -0.0, np.nan, np.inf, -np.inf]])
    v, w = _runs(rng, 3000, pool)
    assert v.size >= _MERGE_MIN
    got = weighted_quantiles(v, w, QS)
    want = _reference(v, w)
    assert np.array(got).view(np.uint64).tolist() == np.array(want).view(np.uint64).tolist()


def test_signed_zeros_in_one_run_are_not_merged():
    # -0.0 == 0.0, but the answer is a value: a run of 0.0 then -0.0 must stay two entries
    n = _MERGE_MIN
    v = np.concatenate([np.full(n, 0.0), np.full(n, -0.0), np.full(n, 1.0)])
    w = np.ones(v.size, dtype=np.uint32)
    got = weighted_quantiles(v, w, (0.5,))
    assert np.signbit(got[0]) and got[0] == 0.0  # the middle element is one of the -0.0 copies
    assert np.signbit(_reference(v, w)[QS.index(0.5)])  # (the definition agrees)


def test_distribution_of_engine_style_gaps_is_unchanged():
    rng = np.random.default_rng(7)
    v, w = _runs(rng, 2000, rng.exponential(0.02, size=500))
    d = distribution(v, w)
    ref_q = _reference(v, w)
    assert [d["p50"], d["p90"], d["p95"], d["p99"]] == [ref_q[3], ref_q[4], ref_q[5], ref_q[6]]
    assert d["mean"] == float(np.average(v, weights=w.astype(np.float64)))
    assert d["count"] == int(w.sum())
