"""The engine's inter-token gaps as entries (``twin.models.engine_gaps``): a decode-group step writes one
entry weighted by its members, so a run writes far fewer entries than gaps, and the figures read from
them are those of the gaps one by one, bit for bit."""

from __future__ import annotations

from benchmarks.single_replica import scenario
from enginekit import gap_sample
from twin.metrics import distribution
from twin.runner import SingleReplicaRun


def _run(use_group: bool) -> SingleReplicaRun:
    sc = scenario(n=150, profile="llama3-70b-fp8-tp4-h100", arrival={"kind": "poisson", "rate_per_s": 5.0})
    run = SingleReplicaRun(sc, seed=1, replication=0)
    run.engine.use_group = use_group
    run.start()
    run.env.run(until=run.all_done)
    return run


def test_group_entries_give_the_per_request_figures():
    grouped, plain = _run(True), _run(False)
    g, p = grouped.engine, plain.engine
    assert g.grp.steps > 0 and p.grp.steps == 0
    assert gap_sample(g) == gap_sample(p)
    assert sum(g.itl_weights) == g.generation_tokens - 150  # a gap per token after each request's first
    assert len(g.itl_values) * 5 < len(p.itl_values)  # the group's entries stand for many gaps each
    assert distribution(g.itl_values, g.itl_weights) == distribution(p.itl_values, p.itl_weights)
