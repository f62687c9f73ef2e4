"""A finished turn or session leaves nothing behind in the fleet world that no one reads again.

A fleet run simulates millions of turns; per-turn state kept after its last reader is gone (the turn's
idempotency record, the tool executor's entry, a session's history, the control plane's signal logs
without a control plane) grew the run's memory by about a kilobyte a turn. These tests run fleets with
retries, tool calls, cancellations and multi-turn sessions and look at what is left.
"""

from __future__ import annotations

import collections

from tests.test_fleet import check_invariants, scenario
from twin.runner import run_scenario

TERMINAL = {"request.finished", "request.rejected", "request.cancelled", "request.abandoned", "request.failed"}


def test_a_run_to_the_end_keeps_no_turn_record_history_or_tool_entry() -> None:
    res = run_scenario(scenario(**{"traffic.duration_s": 60}))
    check_invariants(res)  # every turn ended, so every session did
    w = res.world
    assert res.summary["requests"]["arrived"] > 50
    assert res.summary["requests"]["completed"] > 10, "completed multi-turn sessions should have had history"
    assert w.conversation.records == {}
    assert w.conversation.history == {}
    assert w.clients.tool_runs == {}


def test_a_run_cut_by_the_horizon_keeps_only_live_turns_and_sessions() -> None:
    res = run_scenario(scenario(**{"traffic.duration_s": 60}).model_copy(update={"horizon_s": 30.0}))
    assert res.ok, res.manifest.get("traceback")
    w = res.world
    ev = res.tables["events"].to_pydict()
    ended = {r for k, r in zip(ev["kind"], ev["request_id"]) if k in TERMINAL}
    arrived = [r for k, r in zip(ev["kind"], ev["request_id"]) if k == "request.arrived"]
    live = set(arrived) - ended
    assert live and ended, "the horizon should cut the run with turns both ended and in progress"
    assert set(w.conversation.records) <= live
    assert set(w.clients.tool_runs) <= live
    # a session ends after its last turn, or after a turn that did not complete
    outcome = {r: k for k, r in zip(ev["kind"], ev["request_id"]) if k in TERMINAL}
    over = set()
    for spec in w.sessions:
        for k in range(spec.turns):
            kind = outcome.get(f"{spec.session_id}-t{k}")
            if kind is not None and (kind != "request.finished" or k == spec.turns - 1):
                over.add(spec.session_id)
    assert over
    assert not over & set(w.conversation.history)
    assert w.conversation.history, "sessions between turns keep their history"


def test_turn_attributes_are_shared_and_signal_logs_kept_only_for_a_control_plane() -> None:
    res = run_scenario(scenario())
    check_invariants(res)
    w = res.world
    assert not w.control.active
    assert len(w.ttft_log) == 0 and len(w.outcome_log) == 0
    attrs = list(w.turn_attrs.values())
    distinct = collections.Counter(map(id, attrs))  # one object per distinct value
    assert len(distinct) == len(set(attrs)) < len(attrs)
