"""Float sums that reach a result are exact sums rounded once (``math.fsum``), so a run's tables are the same on
every Python that pyproject admits. Python 3.12 changed the built-in ``sum`` of floats to a compensated
summation, so the same scenario and seed gave summaries that differed in their last digits between 3.11 and
3.12/3.13 (the fleet's GPU-hours and the dollars computed from them: docs/performance-rounds.md, round 22)."""

from __future__ import annotations

from benchmarks.reference_runs import RUNS
from twin.runner import run_scenario
from twin.scenario import load_scenario


def test_gpu_hours_of_identical_replicas_are_their_count_times_one() -> None:
    # the reference runs' fleet benchmark: 12 replicas at TP 4 for 60 simulated seconds, none added or removed.
    # Left to right, twelve 0.0666... add up to 0.7999999999999999 (Python 3.11's sum); the exact sum rounded
    # once is n times one replica's share (a product is rounded once too): 0.8 on every Python
    path, overrides = RUNS["fleet-bench"]
    res = run_scenario(load_scenario(path, overrides=overrides))
    assert res.ok, res.manifest.get("traceback")
    w, fleet = res.world, res.summary["fleet"]
    assert all(h.removed_s is None and h.started_s == 0.0 for h in w.handles)
    one = {w.model_info[h.model]["tp"] * ((res.summary["sim_time_s"] - h.started_s) / 3600.0) for h in w.handles}
    assert len(one) == 1 and len(w.handles) == 12
    assert fleet["gpu_hours"] == len(w.handles) * one.pop() == 0.8
    assert fleet["usd"] == 0.8 * fleet["usd_per_gpu_hour"]
