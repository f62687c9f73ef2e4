"""Degradation ladder and model fallback: unit tests on hand-made signal sequences, and properties."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from twin.policies import (
    LADDERS,
    RUNGS,
    LadderDecision,
    LadderParams,
    LadderPolicy,
    LadderSignals,
    ModelNeeds,
    ModelOption,
    build_ladder,
    fallback_model,
)
from twin.policies.ladder import StaticLadder, ThresholdLadder, model_fits

# Every rung on queue_eta_s; on_above 10, 20, 30, 40, 50 and off_below half of it; no hold unless asked.
STEPS = {r: (10.0 * (i + 1), 5.0 * (i + 1)) for i, r in enumerate(RUNGS)}


def ladder(hold_s: float = 0.0, **kw: Any) -> LadderPolicy:
    triggers = {r: {"metric": "queue_eta_s", "on_above": a, "off_below": b, "min_hold_s": hold_s}
                for r, (a, b) in STEPS.items()}
    triggers.update(kw.pop("triggers", {}))
    return build_ladder({"kind": "threshold_ladder", "triggers": triggers, **kw}, seed=0)


def sig(t: float, eta: float, *, backlog: int = 0, itl: float | None = None,
        ttft: float | None = None) -> LadderSignals:
    return LadderSignals(now_s=t, token_backlog=backlog, queue_eta_s=eta, itl_p95_s=itl, ttft_p95_s=ttft)


def run(policy: LadderPolicy, etas: list[float], dt: float = 10.0) -> list[LadderDecision]:
    return [policy.evaluate(sig(i * dt, e)) for i, e in enumerate(etas)]


# --------------------------------------------------------------------------------------------- basics
def test_rungs_and_registry() -> None:
    assert RUNGS == ("cap_output", "free_tier_small_model", "speculative_decoding", "queue_eta", "shed")
    assert LADDERS.keys() == ["static", "threshold_ladder"]
    assert isinstance(build_ladder({"kind": "threshold_ladder"}, seed=1), ThresholdLadder)
    d = LadderSignals(now_s=0.0, token_backlog=1, queue_eta_s=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.queue_eta_s = 2.0  # type: ignore[misc]
    assert not hasattr(d, "gpu_utilization")  # on purpose: it reads ~100 % at almost any load


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="did you mean 'threshold_ladder'"):
        build_ladder({"kind": "threshold_ladder_"}, seed=0)
    with pytest.raises(ValidationError, match="off_below"):
        ladder(triggers={"shed": {"on_above": 10.0, "off_below": 20.0}})
    with pytest.raises(ValidationError, match="missing"):
        LadderParams(triggers={"shed": {"on_above": 10.0, "off_below": 5.0}})  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="extra"):
        build_ladder({"kind": "threshold_ladder", "cap_output_token": 512}, seed=0)
    with pytest.raises(ValidationError):
        build_ladder({"kind": "threshold_ladder", "overrides": [{"rung": "shedd", "at_s": 0, "state": "on"}]}, seed=0)
    with pytest.raises(ValueError, match="ladder order"):
        LadderDecision(on=("shed", "cap_output"))


def test_clock_must_not_go_back() -> None:
    p = ladder()
    p.evaluate(sig(10.0, 0.0))
    with pytest.raises(ValueError, match="time went back"):
        p.evaluate(sig(9.0, 0.0))


# --------------------------------------------------------------------------------- climb and descend
def test_rungs_climb_in_order_one_threshold_at_a_time() -> None:
    ds = run(ladder(), [0, 15, 25, 35, 45, 55])
    assert [d.on for d in ds] == [tuple(RUNGS[:k]) for k in range(6)]
    assert ds[3].changed == (("speculative_decoding", True),)
    assert ds[3].reason("speculative_decoding") == "auto: queue_eta_s 35.0 > 30.0"


def test_a_spike_climbs_several_rungs_at_once_but_still_in_order() -> None:
    ds = run(ladder(), [0, 45])
    assert ds[1].on == RUNGS[:4]
    assert [r for r, _ in ds[1].changed] == list(RUNGS[:4])


def test_strict_order_blocks_a_rung_whose_predecessor_is_off() -> None:
    # shed listens to TTFT, which spikes while the queue ETA is calm: shed must not skip the ladder.
    trig = {"shed": {"metric": "ttft_p95_s", "on_above": 5.0, "off_below": 1.0, "min_hold_s": 0.0}}
    strict = ladder(triggers=trig)
    d = strict.evaluate(sig(0.0, 0.0, ttft=9.0))
    assert d.on == ()
    assert d.reason("shed") is not None and d.reason("shed").startswith("blocked: waits for cap_output")
    loose = ladder(triggers=trig, order_strict=False)
    assert loose.evaluate(sig(0.0, 0.0, ttft=9.0)).on == ("shed",)


def test_descends_last_on_first_off() -> None:
    # shed is on a metric that stays high; the queue-ETA rungs below it must stay on while it does.
    trig = {"shed": {"metric": "ttft_p95_s", "on_above": 5.0, "off_below": 1.0, "min_hold_s": 0.0}}
    p = ladder(triggers=trig)
    assert p.evaluate(sig(0.0, 45.0, ttft=9.0)).on == RUNGS
    d = p.evaluate(sig(10.0, 0.0, ttft=9.0))
    assert d.on == RUNGS and d.changed == ()
    assert d.reason("queue_eta") is not None and "stays while shed is on" in d.reason("queue_eta")
    d = p.evaluate(sig(20.0, 0.0, ttft=0.5))
    assert d.on == () and [r for r, _ in d.changed] == list(RUNGS)


def test_descent_in_steps_follows_the_thresholds_top_down() -> None:
    ds = run(ladder(), [55, 22, 12, 7, 0])
    assert [d.on for d in ds] == [RUNGS, RUNGS[:4], RUNGS[:2], RUNGS[:1], ()]


def test_hysteresis_prevents_flapping() -> None:
    # cap_output: on above 10, off below 5. A metric hovering around 10 flips it once, not every time.
    etas = [11, 9, 11, 9, 11, 9, 6, 11, 4, 9, 11]
    ds = run(ladder(), etas)
    flips = [(i, c) for i, d in enumerate(ds) for c in d.changed]
    assert flips == [(0, ("cap_output", True)), (8, ("cap_output", False)), (10, ("cap_output", True))]


def test_without_hysteresis_the_same_signal_flaps() -> None:
    """The control for the test above: off_below == on_above flips at every crossing."""
    p = ladder(triggers={"cap_output": {"on_above": 10.0, "off_below": 10.0, "min_hold_s": 0.0}})
    ds = run(p, [11, 9, 11, 9, 11])
    assert sum(len(d.changed) for d in ds) == 5


def test_min_hold_keeps_a_rung_on_and_off() -> None:
    p = ladder(hold_s=60.0)
    assert p.evaluate(sig(0.0, 12.0)).on == ("cap_output",)
    d = p.evaluate(sig(30.0, 0.0))  # wants off, held
    assert d.on == ("cap_output",)
    assert d.reason("cap_output") is not None and d.reason("cap_output").startswith("held: on until 60.0")
    assert p.evaluate(sig(59.9, 0.0)).on == ("cap_output",)
    assert p.evaluate(sig(60.0, 0.0)).changed == (("cap_output", False),)
    assert p.evaluate(sig(100.0, 12.0)).on == ()  # held off until 120
    assert p.evaluate(sig(120.0, 12.0)).on == ("cap_output",)


def test_no_data_is_no_evidence() -> None:
    trig = {r: {"metric": "itl_p95_s", "on_above": 0.1, "off_below": 0.05, "min_hold_s": 0.0} for r in RUNGS}
    p = ladder(triggers=trig)
    assert p.evaluate(sig(0.0, 0.0, itl=0.2)).on == RUNGS
    assert p.evaluate(sig(10.0, 0.0, itl=None)).on == RUNGS  # no completions: keep state
    assert p.evaluate(sig(20.0, 0.0, itl=0.01)).on == ()


def test_token_backlog_trigger() -> None:
    p = ladder(triggers={"cap_output": {"metric": "token_backlog", "on_above": 1e6, "off_below": 5e5,
                                        "min_hold_s": 0.0}})
    assert p.evaluate(sig(0.0, 0.0, backlog=2_000_000)).reason("cap_output") == "auto: token_backlog 2000000.0 > 1000000.0"


# --------------------------------------------------------------------------------------------- overrides
def test_override_at_a_time_wins_and_auto_releases() -> None:
    p = ladder(hold_s=300.0, overrides=[
        {"rung": "speculative_decoding", "at_s": 100.0, "state": "off"},
        {"rung": "speculative_decoding", "at_s": 200.0, "state": "auto"},
        {"rung": "cap_output", "at_s": 50.0, "state": "on"},
        {"rung": "cap_output", "at_s": 150.0, "state": "auto"},
    ])
    assert p.evaluate(sig(0.0, 35.0)).on == RUNGS[:3]
    d = p.evaluate(sig(50.0, 35.0))
    assert d.on == RUNGS[:3] and d.reason("cap_output") == "override: on"
    d = p.evaluate(sig(100.0, 35.0))  # forced off despite the 300 s hold and the high metric
    assert d.on == ("cap_output", "free_tier_small_model")
    assert d.changed == (("speculative_decoding", False),) and d.reason("speculative_decoding") == "override: off"
    # spec decoding forced off stands outside the order: queue_eta may still climb past it
    d = p.evaluate(sig(110.0, 45.0))
    assert d.on == ("cap_output", "free_tier_small_model", "queue_eta")
    d = p.evaluate(sig(150.0, 0.0))  # cap_output back to auto: wants off, but rungs above it are on
    assert d.on == ("cap_output", "free_tier_small_model", "queue_eta")
    assert d.reason("cap_output") is not None and "stays while free_tier_small_model is on" in d.reason("cap_output")
    d = p.evaluate(sig(200.0, 45.0))  # auto again: the trigger turns spec decoding back on at once
    assert d.on == RUNGS[:4] and d.changed == (("speculative_decoding", True),)


def test_auto_hands_back_to_the_trigger_without_a_leftover_hold() -> None:
    p = ladder(hold_s=300.0, overrides=[{"rung": "cap_output", "at_s": 0.0, "state": "on"},
                                        {"rung": "cap_output", "at_s": 10.0, "state": "auto"}])
    assert p.evaluate(sig(0.0, 0.0)).on == ("cap_output",)
    d = p.evaluate(sig(10.0, 0.0))
    assert d.on == () and d.changed == (("cap_output", False),)
    assert p.evaluate(sig(20.0, 12.0)).on == ()  # the trigger's own flip at 10 s starts its hold
    assert p.evaluate(sig(310.0, 12.0)).on == ("cap_output",)


def test_forced_on_rung_ignores_order_and_metrics() -> None:
    p = ladder(overrides=[{"rung": "shed", "at_s": 0.0, "state": "on"}])
    d = p.evaluate(sig(0.0, 0.0))
    assert d.on == ("shed",) and d.shed_tiers == ("free",)


def test_same_time_overrides_the_last_listed_wins() -> None:
    p = ladder(overrides=[{"rung": "shed", "at_s": 10.0, "state": "on"},
                          {"rung": "shed", "at_s": 10.0, "state": "off"}])
    assert p.evaluate(sig(10.0, 99.0)).on == RUNGS[:4]


# --------------------------------------------------------------------------------------- shed and helpers
def test_shed_sheds_free_first_and_paid_only_past_twice_the_threshold() -> None:
    p = ladder()  # shed on_above 50
    d = p.evaluate(sig(0.0, 60.0))
    assert p.shed_tier("free", d) and not p.shed_tier("paid", d) and not p.shed_tier("enterprise", d)
    d = p.evaluate(sig(10.0, 100.0))  # exactly 2x: not above
    assert not p.shed_tier("paid", d)
    d = p.evaluate(sig(20.0, 101.0))
    assert p.shed_tier("free", d) and p.shed_tier("paid", d) and not p.shed_tier("enterprise", d)
    d = p.evaluate(sig(30.0, 0.0))
    assert not p.shed_tier("free", d) and d.shed_tiers == ()


def test_spec_decode_speedup_is_linear_to_the_knee() -> None:
    p = build_ladder({"kind": "threshold_ladder"}, seed=0)
    assert p.spec_decode_speedup(1) == 2.0 and p.spec_decode_speedup(0) == 2.0
    assert p.spec_decode_speedup(64) == pytest.approx(1.1) and p.spec_decode_speedup(512) == pytest.approx(1.1)
    assert p.spec_decode_speedup(32) == pytest.approx(2.0 + (1.1 - 2.0) * 31 / 63)
    speeds = [p.spec_decode_speedup(b) for b in range(1, 100)]
    assert all(a >= b for a, b in zip(speeds, speeds[1:], strict=False))
    assert p.cap_output_tokens == 1024


def test_static_ladder() -> None:
    p = build_ladder({"kind": "static", "on": ["shed", "cap_output"], "shed_tiers": ["free"]}, seed=0)
    assert isinstance(p, StaticLadder)
    d0 = p.evaluate(sig(0.0, 999.0))
    assert d0.on == ("cap_output", "shed") and d0.changed == (("cap_output", True), ("shed", True))
    d1 = p.evaluate(sig(1.0, 0.0))
    assert d1.on == d0.on and d1.changed == ()
    assert p.shed_tier("free", d1) and not p.shed_tier("paid", d1)


# --------------------------------------------------------------------------------------------- properties
etas = st.lists(st.floats(min_value=0.0, max_value=120.0, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(etas=etas, hold=st.sampled_from([0.0, 15.0, 60.0]), strict=st.booleans(),
       dts=st.lists(st.floats(min_value=0.0, max_value=40.0), min_size=60, max_size=60))
def test_ladder_is_deterministic_and_keeps_its_invariants(etas: list[float], hold: float, strict: bool,
                                                          dts: list[float]) -> None:
    times = [sum(dts[:i + 1]) for i in range(len(etas))]
    overrides = [{"rung": "queue_eta", "at_s": times[len(times) // 2], "state": "off"}]
    a, b = (ladder(hold_s=hold, order_strict=strict, overrides=overrides) for _ in range(2))
    prev: tuple[str, ...] = ()
    for t, e in zip(times, etas, strict=True):
        da, db = a.evaluate(sig(t, e)), b.evaluate(sig(t, e))
        assert da == db
        flipped = {r for r, _ in da.changed}
        assert flipped == set(prev) ^ set(da.on)
        if strict:  # among rungs under their triggers, the on-set is always a prefix of the ladder
            auto_on = [r in da.on for r in RUNGS if r != "queue_eta" or t < overrides[0]["at_s"]]
            assert auto_on == sorted(auto_on, reverse=True)
        prev = da.on


models = st.builds(ModelOption, name=st.sampled_from(["big", "small", "tools", "eu-only", "long"]),
                   max_context_tokens=st.sampled_from([8_000, 32_000, 128_000]), supports_tools=st.booleans(),
                   regions=st.lists(st.sampled_from(["us", "eu", "ap"]), max_size=3, unique=True).map(tuple),
                   preference=st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(needs=st.builds(ModelNeeds, context_tokens=st.integers(0, 150_000), needs_tools=st.booleans()),
       candidates=st.lists(models, max_size=6),
       tenant=st.none() | st.lists(st.sampled_from(["us", "eu", "ap"]), max_size=2, unique=True).map(tuple))
def test_fallback_never_violates_capability_or_residency(needs: ModelNeeds, candidates: list[ModelOption],
                                                         tenant: tuple[str, ...] | None) -> None:
    name = fallback_model(needs, candidates, tenant_regions=tenant)
    fitting = [c for c in candidates if c.max_context_tokens >= needs.context_tokens
               and (c.supports_tools or not needs.needs_tools)
               and (tenant is None or set(c.regions) & set(tenant))]
    if not fitting:
        assert name is None
        return
    chosen = [c for c in fitting if c.name == name]
    assert chosen, "picked a model that lacks a capability or the tenant's residency"
    best = min((c.preference, c.name) for c in fitting)
    assert (min(c.preference for c in chosen), name) == best
    assert fallback_model(needs, list(reversed(candidates)), tenant_regions=tenant) == name


def test_fallback_examples() -> None:
    big = ModelOption("big", 128_000, True, ("us", "eu"), 0)
    small = ModelOption("small", 8_000, False, ("us",), 1)
    eu_small = ModelOption("eu-small", 32_000, False, ("eu",), 1)
    assert fallback_model(ModelNeeds(4_000, False), [small, eu_small], tenant_regions=None) == "eu-small"
    assert fallback_model(ModelNeeds(4_000, False), [small, eu_small], tenant_regions=("us",)) == "small"
    assert fallback_model(ModelNeeds(4_000, True), [small, eu_small], tenant_regions=None) is None
    assert fallback_model(ModelNeeds(64_000, False), [big, small], tenant_regions=("eu",)) == "big"
    assert fallback_model(ModelNeeds(64_000, False), [big], tenant_regions=("ap",)) is None
    assert fallback_model(ModelNeeds(0, False), [], tenant_regions=None) is None
    assert not model_fits(ModelNeeds(0, False), ModelOption("x", 1, True, (), 0), tenant_regions=("us",))
