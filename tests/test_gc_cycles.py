"""A fleet run leaves no per-turn reference cycles.

Every turn used to leave its engine request, stream, queue entry and their closures in reference cycles
(the request's callbacks closed over the stream, which points back at the request), so only the cyclic
garbage collector could free them: at scale 0.08 the first collection after the run walked ~0.7 M such
objects (~2 CPU-s). Reference counting frees a finished turn now; this test keeps it that way by running a
fleet with cancellations, disconnects and resumes, retries, abandonment and a replica crash, and looking at
what the collector would have had to free.
"""

from __future__ import annotations

import collections
import copy
import gc

import pytest

from tests.test_fleet import BASE
from twin.models.fleet import FleetWorld
from twin.scenario import load_scenario, parse_scenario

# Objects made per turn or per generation; any of them in a cycle means every turn leaks one to the collector.
PER_TURN = {"EngineRequest", "Stream", "QueueEntry", "RequestFacts", "TokenSeq", "Turn", "TurnRecord", "Event",
            "Timeout", "Process", "Outcome", "generator", "cell", "function"}


def _garbage_of(scenario) -> collections.Counter:
    gc.unfreeze()  # worlds of earlier runs in this process (twin.runner freezes them), and their cycles
    # A first run of some parts leaves one-time garbage (a lazily built signature parses a string with
    # ast.literal_eval, whose closures are cycles): run the scenario briefly first, so what is counted below is
    # what a run leaves per turn.
    FleetWorld(scenario, seed=scenario.seed, replication=0).run(5.0)
    gc.collect()
    was = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector frees in gc.garbage, to look at
    try:
        world = FleetWorld(scenario, seed=scenario.seed, replication=0)
        world.run(scenario.horizon_s)
        gc.collect()
        counts = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(was)
        gc.garbage.clear()
    return counts, world


def _base(duration_s: float):
    cfg = copy.deepcopy(BASE)  # cancellations, disconnects and resumes, retries, patience, two models
    cfg["fleet"]["traffic"]["duration_s"] = duration_s
    return parse_scenario(cfg)


@pytest.mark.parametrize("make", [
    lambda: _base(60),
    lambda: load_scenario("scenarios/replica-crash.yaml", overrides=["fleet.traffic.duration_s=40"]),
    # (twin.runner keeps the collector off during a run on the strength of this test: the autoscaler and the
    # degradation ladder, and prefill/decode pools with their KV hand-offs, must leave nothing per turn either)
    lambda: load_scenario("scenarios/launch-day-10x.yaml", overrides=["fleet.traffic.duration_s=30"]),
    lambda: load_scenario("scenarios/disaggregated-vs-colocated.yaml", overrides=["fleet.traffic.duration_s=30"]),
], ids=["chat-with-cancels-and-retries", "replica-crash", "launch-day-autoscaling-ladder", "disaggregated"])
def test_a_finished_turn_is_freed_without_the_cyclic_collector(make):
    counts, world = _garbage_of(make())
    assert len(world.rec.ev_t) > 1000, "the run should be busy enough to show a per-turn leak"
    leaked = {k: v for k, v in counts.items() if k in PER_TURN}
    assert not leaked, f"per-turn objects left to the cyclic collector: {leaked}"


def _frozen_world(scenario):
    """Run ``scenario`` and drop the result: a weak reference to its world, which the run left frozen."""
    import weakref

    from twin.runner import run_scenario

    first = run_scenario(scenario)
    assert first.ok
    world = weakref.ref(first.world)
    del first
    gc.collect()  # (the collector skips frozen objects: the world is still there)
    assert world() is not None
    return world


def test_the_next_run_frees_a_large_world_of_the_one_before(monkeypatch) -> None:
    """A run leaves its world frozen (out of the collector's reach, and the collector is off during a run):
    the next ``run_scenario`` in the process must free a large one before building its own, or a sweep or a
    benchmark holds every earlier world at once. (Here any world counts as large.)"""
    import twin.runner
    from twin.runner import run_scenario

    monkeypatch.setattr(twin.runner, "_COLLECT_WORLDS_FROM", 1)
    scenario = _base(10)
    world = _frozen_world(scenario)
    seen = []  # whether the earlier world was gone when the next run started building its own
    real_init = FleetWorld.__init__

    def init(self, *args, **kwargs):
        seen.append(world() is None)
        real_init(self, *args, **kwargs)

    FleetWorld.__init__ = init
    try:
        assert run_scenario(scenario).ok
    finally:
        FleetWorld.__init__ = real_init
    assert seen and seen[0], "the earlier world was still alive when the next run started building"


def test_small_worlds_are_collected_once_together_they_are_large(monkeypatch) -> None:
    """A full collection walks the whole process, so small worlds are not collected one by one: they wait until
    the worlds released since the last collection together pass the threshold (``twin.runner``), and are all
    freed then."""
    import weakref

    import twin.runner
    from twin.runner import release_finished_worlds, run_scenario

    scenario = _base(5)
    release_finished_worlds(collect=True)
    monkeypatch.setattr(twin.runner, "_COLLECT_WORLDS_FROM", 10**12)
    worlds, sizes = [], []
    for _ in range(4):
        res = run_scenario(scenario)
        assert res.ok
        worlds.append(weakref.ref(res.world))
        sizes.append(twin.runner._frozen_world[0])
        del res
        gc.collect()  # (the collector skips frozen objects, and the next run freezes what an earlier one left)
    assert min(sizes) > 1000
    # three worlds released, none collected: their cycles keep them
    assert all(w() is not None for w in worlds)
    assert twin.runner._uncollected[0] == sum(sizes[:3])
    # the next release passes the threshold: every earlier world is gone, the last one is frozen
    monkeypatch.setattr(twin.runner, "_COLLECT_WORLDS_FROM", sum(sizes))
    res = run_scenario(scenario)
    assert [w() is None for w in worlds] == [True] * 4 and twin.runner._uncollected[0] == 0
    assert res.ok and twin.runner._frozen_world


def test_a_benchmark_frees_the_earlier_world_before_its_clocks_start() -> None:
    """``benchmarks.common.measure`` collects an earlier case's frozen world before it reads the clocks, so the
    next case's CPU time does not include freeing the world of the case before it."""
    from benchmarks.common import measure

    world = _frozen_world(_base(10))
    gone, _ = measure(lambda: world() is None)
    assert gone, "the earlier world was still alive when the measured case started"
