"""The engine's inter-token gaps written as runs (``twin.models.engine_gaps``) read back as the gaps one by one:
the same values and weights in the same order, whenever and however often they are read."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from benchmarks.single_replica import scenario
from twin.models.engine_gaps import GapColumns
from twin.runner import SingleReplicaRun


class _Cols(GapColumns):
    __slots__ = ("_itl_v", "_itl_w", "_gap_v", "_gap_w", "_gap_at", "_gap_n")


@pytest.mark.parametrize("seed", range(4))
def test_runs_read_back_as_single_gaps(seed):
    rng = np.random.default_rng(seed)
    cols = _Cols()
    cols._gaps_init()
    want_v, want_w, seen = [], [], []
    for _ in range(3000):
        x = float(rng.exponential(0.02))
        kind = rng.random()
        if kind < 0.4:  # a group step: n equal gaps
            n = int(rng.integers(1, 90))
            cols._gap_run(x, n)
            want_v += [x] * n
            want_w += [1] * n
        elif kind < 0.7:  # one request's gap
            cols._gap_v.append(x)
            cols._gap_w.append(1)
            want_v.append(x)
            want_w.append(1)
        else:  # a decode run's later steps: one gap a step, weighted by the batch
            k = int(rng.integers(1, 6))
            cols._gap_v.extend([x] * k)
            cols._gap_w.extend([int(rng.integers(2, 300))] * k)
            want_v += [x] * k
            want_w += list(cols._gap_w[-k:])
        if rng.random() < 0.02:  # a reader mid-run (the autoscaler's window) sees everything so far
            seen.append((len(cols.itl_values), len(want_v)))
    assert cols.itl_values == array("d", want_v) and cols.itl_weights == array("I", want_w)
    assert all(a == b for a, b in seen) and seen
    assert not cols._gap_v and not cols._gap_at  # nothing left pending after a read


def test_reading_during_a_run_changes_nothing():
    """A process that reads the gaps every 0.25 simulated s (each read flushes what is pending) ends with the
    arrays of a run read only at the end."""
    sc = scenario(n=150, profile="llama3-70b-fp8-tp4-h100", arrival={"kind": "poisson", "rate_per_s": 5.0})
    plain = SingleReplicaRun(sc, seed=1, replication=0)
    plain.start()
    plain.env.run(until=plain.all_done)
    read = SingleReplicaRun(sc, seed=1, replication=0)
    lengths = []

    def reader(env, eng):
        while True:
            yield env.timeout(0.25)
            lengths.append(len(eng.itl_values))

    read.start()
    read.env.process(reader(read.env, read.engine))
    read.env.run(until=read.all_done)
    assert len(set(lengths)) > 10, "the reader saw the gaps grow"
    assert read.engine.grp.steps > 0
    assert read.engine.itl_values == plain.engine.itl_values
    assert read.engine.itl_weights == plain.engine.itl_weights
    assert len(plain.engine.itl_values) > 1000
