"""Release canary: staged rollouts on synthetic traffic (seeded SplitMix64), the tests against scipy."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from twin.policies import (
    CANARIES,
    BaseCanary,
    CanaryDecision,
    CanaryObservation,
    SplitMix64,
    build_canary,
)
from twin.policies.canary import SequentialCanary, margin_test, normal_sf

CFG: dict[str, Any] = {"kind": "sequential_canary", "start_share": 0.05, "step_share": 0.15, "max_share": 0.5,
                       "min_samples_per_arm": 100, "alpha": 0.01, "quality_margin": 0.02,
                       "latency_margin_ratio": 1.1, "error_margin": 0.02, "task_classes": ["chat", "code"],
                       "eval_interval_s": 60.0}
BASE = {"chat": 0.80, "code": 0.75}


def canary(**kw: Any) -> SequentialCanary:
    p = build_canary({**CFG, **kw}, seed=0)
    assert isinstance(p, SequentialCanary)
    return p


def normal(rng: SplitMix64) -> float:
    u1, u2 = rng.random(), rng.random()
    return math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)


def request(rng: SplitMix64, version: str, *, quality: dict[str, float], ttft_ratio: float = 1.0,
            error_rate: float = 0.01) -> CanaryObservation:
    cls = "chat" if rng.random() < 0.6 else "code"
    if rng.random() < error_rate:
        return CanaryObservation(version, cls, 0.0, None, None, True)
    q = min(1.0, max(0.0, quality[cls] + 0.05 * normal(rng)))
    ttft = 0.4 * ttft_ratio * math.exp(0.3 * normal(rng))
    itl = 0.03 * math.exp(0.2 * normal(rng))
    return CanaryObservation(version, cls, q, ttft, itl, False)


def rollout(policy: BaseCanary, *, seed: int, quality: dict[str, float] | None = None, ttft_ratio: float = 1.0,
            error_rate: float = 0.01, rate_per_s: float = 10.0, horizon_s: float = 7200.0,
            interval_s: float = 60.0) -> list[CanaryDecision]:
    """Route ``rate_per_s`` requests a second by the policy's current share; evaluate every interval."""
    rng = SplitMix64(seed)
    share = policy.evaluate(0.0).canary_share
    decisions = []
    t = 0.0
    while t < horizon_s:
        for _ in range(int(rate_per_s * interval_s)):
            if rng.random() < share:
                policy.observe(request(rng, "canary", quality=quality or BASE, ttft_ratio=ttft_ratio,
                                       error_rate=error_rate))
            else:
                policy.observe(request(rng, "stable", quality=BASE))
        t += interval_s
        d = policy.evaluate(t)
        decisions.append(d)
        share = d.canary_share
        if d.action in ("promote", "rollback"):
            break
    return decisions


def verdicts(d: CanaryDecision) -> dict[str, str]:
    return {m: v for m, _, v in d.per_metric}


# --------------------------------------------------------------------------------------------- basics
def test_registry_types_and_validation() -> None:
    assert CANARIES.keys() == ["sequential_canary"]
    with pytest.raises(ValidationError, match="did you mean 'sequential_canary'"):
        build_canary({"kind": "sequential_canar"}, seed=0)
    with pytest.raises(ValidationError, match="start_share"):
        build_canary({"kind": "sequential_canary", "start_share": 0.6, "max_share": 0.5}, seed=0)
    with pytest.raises(ValidationError):
        build_canary({"kind": "sequential_canary", "min_samples_per_arm": 5}, seed=0)
    o = CanaryObservation("canary", "chat", 0.9, 0.3, 0.02, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.quality = 0.1  # type: ignore[misc]
    with pytest.raises(ValueError, match="version"):
        CanaryObservation("beta", "chat", 0.9, 0.3, 0.02, False)
    with pytest.raises(ValueError, match="quality"):
        CanaryObservation("canary", "chat", 1.5, 0.3, 0.02, False)
    with pytest.raises(ValueError, match="action"):
        CanaryDecision("ship", 0.1, "x")
    p = canary()
    p.evaluate(10.0)
    with pytest.raises(ValueError, match="time went back"):
        p.evaluate(5.0)


def test_normal_tail_and_margin_test() -> None:
    assert normal_sf(0.0) == 0.5
    assert normal_sf(1.959963984540054) == pytest.approx(0.025, rel=1e-9)
    assert normal_sf(6.0) == pytest.approx(9.865876450377e-10, rel=1e-6)  # erfc keeps the far tail
    assert margin_test(0.10, 0.01, 0.02, 0.001)[0] == "worse"
    assert margin_test(0.00, 0.005, 0.02, 0.001)[0] == "ok"
    assert margin_test(0.02, 0.01, 0.02, 0.001) == ("inconclusive", 0.5)
    assert margin_test(0.03, 0.0, 0.02, 0.001) == ("worse", 0.0)
    assert margin_test(0.01, 0.0, 0.02, 0.001) == ("ok", 0.0)


def test_quality_p_value_matches_scipy_welch() -> None:
    """Against scipy's one-sided Welch t-test: with 1000+ per arm, t and z agree to < 1e-3."""
    from scipy import stats

    rng = SplitMix64(7)
    p = canary(quality_margin=0.0, task_classes=["chat"], min_samples_per_arm=100)
    stable, cand = [], []
    for i in range(3000):
        version = "canary" if i % 3 == 0 else "stable"
        q = min(1.0, max(0.0, (0.795 if version == "canary" else 0.80) + 0.1 * normal(rng)))
        (cand if version == "canary" else stable).append(q)
        p.observe(CanaryObservation(version, "chat", q, 0.4, 0.03, False))
    d = p.evaluate(0.0)
    pv, verdict = next((pv, v) for m, pv, v in d.per_metric if m == "quality[chat]")
    assert verdict == "inconclusive"
    ref = stats.ttest_ind(stable, cand, equal_var=False, alternative="greater").pvalue
    assert 0.01 < ref < 0.5 and pv == pytest.approx(ref, abs=1e-3)


# ------------------------------------------------------------------------------------------ rollouts
def test_equal_canary_is_promoted_through_every_step() -> None:
    ds = rollout(canary(), seed=1)
    assert ds[-1].action == "promote" and ds[-1].canary_share == 1.0
    increases = [d.canary_share for d in ds if d.action == "increase"]
    assert increases == pytest.approx([0.2, 0.35, 0.5])
    assert all(d.canary_share <= 0.5 for d in ds[:-1])
    assert set(verdicts(ds[-1]).values()) == {"ok"}


@pytest.mark.parametrize("seed", range(2, 8))
def test_equal_canary_is_never_rolled_back(seed: int) -> None:
    assert rollout(canary(), seed=seed)[-1].action == "promote"


def test_canary_worse_on_one_task_class_only_is_rolled_back() -> None:
    ds = rollout(canary(), seed=3, quality={"chat": 0.80, "code": 0.68})
    last = ds[-1]
    assert last.action == "rollback" and last.canary_share == 0.0
    v = verdicts(last)
    assert v["quality[code]"] == "worse" and v["quality[chat]"] != "worse"
    assert "quality[code]" in last.reason
    assert all(d.canary_share <= 0.05 for d in ds)  # caught at the first stage


def test_pooled_quality_would_hide_the_one_class_regression() -> None:
    """The control for the test above: the same traffic with one pooled class is not caught at the
    first look (the class regression is diluted below the margin)."""
    p = canary(task_classes=["all"])
    rng = SplitMix64(3)
    for _ in range(600):
        for version in ("stable", "canary"):
            o = request(rng, version, quality={"chat": 0.80, "code": 0.68} if version == "canary" else BASE)
            p.observe(dataclasses.replace(o, task_class="all"))
    pooled = verdicts(p.evaluate(0.0))["quality[all]"]
    q = canary()
    rng = SplitMix64(3)
    for _ in range(600):
        for version in ("stable", "canary"):
            q.observe(request(rng, version, quality={"chat": 0.80, "code": 0.68} if version == "canary" else BASE))
    assert pooled != "worse" and verdicts(q.evaluate(0.0))["quality[code]"] == "worse"


def test_slower_canary_is_rolled_back_on_ttft() -> None:
    ds = rollout(canary(), seed=4, ttft_ratio=1.35)
    v = verdicts(ds[-1])
    assert ds[-1].action == "rollback" and v["ttft"] == "worse" and v["itl"] != "worse"


def test_erroring_canary_is_rolled_back() -> None:
    ds = rollout(canary(), seed=5, error_rate=0.12)
    assert ds[-1].action == "rollback" and verdicts(ds[-1])["error"] == "worse"


def test_holds_until_enough_samples_and_between_looks() -> None:
    p = canary()
    d = p.evaluate(0.0)
    assert (d.action, d.canary_share) == ("hold", 0.05) and "min_samples" in d.reason and p.looks == 0
    rng = SplitMix64(9)
    for _ in range(1500):
        for version in ("stable", "canary"):
            p.observe(request(rng, version, quality=BASE))
    d = p.evaluate(10.0)
    assert p.looks == 1 and d.action == "hold"  # first stage not yet held for eval_interval_s
    d = p.evaluate(30.0)
    assert p.looks == 1 and d.reason.startswith("next look at 70.0")
    d = p.evaluate(70.0)
    assert p.looks == 2 and d.action == "increase" and d.canary_share == pytest.approx(0.2)
    d = p.evaluate(130.0)  # no new canary samples at the new share
    assert d.action == "hold" and "new canary samples" in d.reason


def test_terminal_decisions_are_final() -> None:
    p = canary()
    ds = rollout(p, seed=3, quality={"chat": 0.80, "code": 0.60})
    assert ds[-1].action == "rollback"
    assert p.evaluate(1e6) == ds[-1]


# --------------------------------------------------------------------------------------------- properties
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), drop=st.sampled_from([0.0, 0.02, 0.05, 0.2]),
       ttft_ratio=st.sampled_from([1.0, 1.1, 1.5]), max_share=st.sampled_from([0.1, 0.3, 0.5]),
       step=st.sampled_from([0.05, 0.25, 1.0]))
def test_canary_share_never_exceeds_max_share_before_a_decision(seed: int, drop: float, ttft_ratio: float,
                                                                max_share: float, step: float) -> None:
    p = canary(max_share=max_share, step_share=step, start_share=min(0.05, max_share), min_samples_per_arm=50)
    ds = rollout(p, seed=seed, quality={"chat": BASE["chat"] - drop, "code": BASE["code"]}, ttft_ratio=ttft_ratio,
                 rate_per_s=4.0, horizon_s=3600.0)
    for d in ds:
        if d.action == "promote":
            assert d.canary_share == 1.0
        elif d.action == "rollback":
            assert d.canary_share == 0.0
        else:
            assert d.canary_share <= max_share + 1e-12
    shares_before = [min(0.05, max_share)] + [d.canary_share for d in ds[:-1]]
    for before, d in zip(shares_before, ds, strict=True):
        if d.action == "promote":  # promotion only from max_share
            assert before == pytest.approx(max_share)
    if drop >= 0.2:
        assert ds[-1].action == "rollback"
