"""The release canary in the fleet: a version worse on one class only, or slower, is rolled back in time."""

from __future__ import annotations

import pytest

from twin.runner import run_scenario
from twin.scenario import load_scenario


def _canary_events(res):
    ev = res.tables["events"].to_pydict()
    return [(t, k, v, r) for t, k, v, r in zip(ev["t_s"], ev["kind"], ev["value"], ev["reason"])
            if k.startswith("canary.")]


def test_canary_worse_on_one_class_only_is_rolled_back_before_max_share():
    res = run_scenario(load_scenario("scenarios/bad-canary.yaml"))
    assert res.ok, res.manifest.get("traceback")
    c = res.summary["canary"]
    events = _canary_events(res)
    assert events and events[-1][1] == "canary.rolled_back"
    assert "retrieval" in events[-1][3]  # the class it is worse on is the one named
    assert c["final_share"] == 0.0 and c["max_share_before_decision"] <= 0.5
    assert c["canary_turns"] > 0


@pytest.mark.slow
def test_slower_canary_is_rolled_back_on_latency():
    res = run_scenario(load_scenario("scenarios/bad-canary.yaml", overrides=[
        "fleet.models.v2.profile=llama3-70b-bf16-tp2-h100", "fleet.canary.canary.quality={}"]))
    events = _canary_events(res)
    assert events and events[-1][1] == "canary.rolled_back"
    assert "ttft" in events[-1][3] or "itl" in events[-1][3]
