"""Alert rules: Prometheus ``for`` semantics over discrete evaluations."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from twin.policies import AlertEvaluator, AlertRule, AlertTransition

TTFT = {"name": "ttft_high", "metric": "ttft_p95_s", "op": ">", "threshold": 2.0, "for_s": 60.0}


def states(out: tuple[AlertTransition, ...]) -> list[tuple[str, str]]:
    return [(t.name, t.state) for t in out]


def test_rule_validation() -> None:
    with pytest.raises(ValidationError):
        AlertRule(name="x", metric="m", op=">=", threshold=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="extra"):
        AlertRule.model_validate({**TTFT, "for": 60})
    with pytest.raises(ValueError, match="distinct"):
        AlertEvaluator([TTFT, TTFT])
    t = AlertTransition("a", "fired", 0.0, 1.0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.state = "cleared"  # type: ignore[misc]
    ev = AlertEvaluator([TTFT])
    ev.evaluate({}, 10.0)
    with pytest.raises(ValueError, match="time went back"):
        ev.evaluate({}, 5.0)


def test_fires_only_after_for_s_and_clears() -> None:
    ev = AlertEvaluator([TTFT])
    assert ev.evaluate({"ttft_p95_s": 3.0}, 0.0) == () and ev.pending == ("ttft_high",)
    assert ev.evaluate({"ttft_p95_s": 3.0}, 30.0) == ()
    assert ev.evaluate({"ttft_p95_s": 3.0}, 59.9) == ()
    out = ev.evaluate({"ttft_p95_s": 2.5}, 60.0)
    assert out == (AlertTransition("ttft_high", "fired", 60.0, 2.5, 0.0),)
    assert ev.firing == ("ttft_high",) and ev.pending == ()
    assert ev.evaluate({"ttft_p95_s": 3.0}, 90.0) == ()  # fires once, not at every evaluation
    out = ev.evaluate({"ttft_p95_s": 1.0}, 120.0)
    assert out == (AlertTransition("ttft_high", "cleared", 120.0, 1.0, 0.0),) and ev.firing == ()


def test_a_dip_restarts_the_for_clock() -> None:
    ev = AlertEvaluator([TTFT])
    ev.evaluate({"ttft_p95_s": 3.0}, 0.0)
    ev.evaluate({"ttft_p95_s": 1.0}, 50.0)  # condition broke: pending resets
    assert ev.evaluate({"ttft_p95_s": 3.0}, 70.0) == ()
    assert ev.evaluate({"ttft_p95_s": 3.0}, 120.0) == ()
    assert states(ev.evaluate({"ttft_p95_s": 3.0}, 130.0)) == [("ttft_high", "fired")]


def test_missing_or_nan_value_does_not_hold() -> None:
    ev = AlertEvaluator([{**TTFT, "for_s": 0.0}])
    assert states(ev.evaluate({"ttft_p95_s": 5.0}, 0.0)) == [("ttft_high", "fired")]
    out = ev.evaluate({}, 1.0)
    assert states(out) == [("ttft_high", "cleared")] and out[0].value is None
    assert states(ev.evaluate({"ttft_p95_s": 5.0}, 2.0)) == [("ttft_high", "fired")]
    assert states(ev.evaluate({"ttft_p95_s": math.nan}, 3.0)) == [("ttft_high", "cleared")]
    assert ev.evaluate({"ttft_p95_s": None}, 4.0) == ()


def test_less_than_rules_and_rule_order() -> None:
    ev = AlertEvaluator([
        AlertRule(name="goodput_low", metric="goodput_ratio", op="<", threshold=0.9, for_s=0.0),
        AlertRule(name="backlog_high", metric="token_backlog", op=">", threshold=1e6, for_s=0.0),
    ])
    out = ev.evaluate({"token_backlog": 2e6, "goodput_ratio": 0.5}, 0.0)
    assert states(out) == [("goodput_low", "fired"), ("backlog_high", "fired")]
    assert ev.evaluate({"token_backlog": 2e6, "goodput_ratio": 0.9}, 1.0)[0].name == "goodput_low"  # 0.9 not < 0.9


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.floats(0.0, 4.0)), min_size=1, max_size=50),
       dts=st.lists(st.floats(0.0, 30.0), min_size=50, max_size=50), for_s=st.sampled_from([0.0, 15.0, 60.0]))
def test_fired_exactly_when_the_condition_held_for_for_s(values: list[float | None], dts: list[float],
                                                         for_s: float) -> None:
    """Against a direct restatement: at each evaluation the alert is firing iff the condition has held
    at every evaluation in a run that started at least for_s ago; transitions alternate."""
    ev = AlertEvaluator([{**TTFT, "for_s": for_s}])
    run_start: float | None = None
    firing = False
    t = 0.0
    for v, dt in zip(values, dts, strict=False):
        t += dt
        out = ev.evaluate({"ttft_p95_s": v}, t)
        holds = v is not None and v > 2.0
        run_start = (t if run_start is None else run_start) if holds else None
        expect = run_start is not None and t - run_start >= for_s
        assert states(out) == ([] if expect == firing else [("ttft_high", "fired" if expect else "cleared")])
        firing = expect
        assert ev.firing == (("ttft_high",) if firing else ())
