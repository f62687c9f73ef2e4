"""Autoscalers: the backlog scaler tracks the work waiting, the GPU-utilisation baseline runs to the cap."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from twin.policies import AUTOSCALERS, BaseAutoscaler, ScalingDecision, ScalingSignals, build_autoscaler
from twin.policies.autoscaling import BacklogAutoscaler, BacklogParams, GpuUtilizationAutoscaler, GpuUtilizationParams


def sig(t: float, *, backlog: int = 0, eta: float = 0.0, ready: int = 1, prov: int = 0, util: float = 0.98,
        drain: float = 0.0) -> ScalingSignals:
    return ScalingSignals(now_s=t, token_backlog=backlog, queue_eta_s=eta, replicas_ready=ready,
                          replicas_provisioning=prov, gpu_utilization=util, drain_tokens_per_s=drain)


def backlog(**kw: Any) -> BacklogAutoscaler:
    cfg = {"kind": "backlog", "target_queue_eta_s": 10.0, "tokens_per_replica_per_s": 1000.0, "max_replicas": 20,
           "min_replicas": 1, "scale_down_eta_s": 1.0, "cooldown_s": 300.0, **kw}
    p = build_autoscaler(cfg, seed=0)
    assert isinstance(p, BacklogAutoscaler)
    return p


def gpu(**kw: Any) -> GpuUtilizationAutoscaler:
    p = build_autoscaler({"kind": "gpu_utilization", "target_utilization": 0.7, "max_replicas": 20,
                          "cooldown_s": 60.0, **kw}, seed=0)
    assert isinstance(p, GpuUtilizationAutoscaler)
    return p


def simulate(policy: BaseAutoscaler, *, load_tokens_per_s: float, steps: int = 40, dt: float = 60.0,
             boot_s: float = 120.0, util: float = 0.98, start: int = 2) -> list[int]:
    """A toy fleet at a steady load: replicas take ``boot_s`` to become ready; the fleet completes what
    arrives (drain = load), with no backlog. Returns the ready+provisioning count after each step."""
    ready, booting, out = start, [], []
    for i in range(steps):
        t = i * dt
        ready += sum(1 for b in booting if b <= t)
        booting = [b for b in booting if b > t]
        d = policy.evaluate(sig(t, ready=ready, prov=len(booting), util=util, drain=load_tokens_per_s))
        booting += [t + boot_s] * d.add
        ready -= d.remove
        out.append(ready + len(booting))
    return out


# --------------------------------------------------------------------------------------------- basics
def test_registry_types_and_validation() -> None:
    assert AUTOSCALERS.keys() == ["backlog", "gpu_utilization"]
    s = sig(0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.token_backlog = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="gpu_utilization"):
        sig(0.0, util=1.5)
    with pytest.raises(ValueError, match="not both"):
        ScalingDecision(1, 1, 0.0, "x")
    with pytest.raises(ValidationError, match="did you mean 'backlog'"):
        build_autoscaler({"kind": "backlogg"}, seed=0)
    with pytest.raises(ValidationError, match="min_replicas"):
        build_autoscaler({"kind": "backlog", "min_replicas": 5, "max_replicas": 2}, seed=0)
    with pytest.raises(ValidationError, match="extra"):
        build_autoscaler({"kind": "gpu_utilization", "target": 0.7}, seed=0)
    p = backlog()
    p.evaluate(sig(5.0))
    with pytest.raises(ValueError, match="time went back"):
        p.evaluate(sig(4.0))


# ------------------------------------------------------------------------------------ the headline pair
def test_gpu_utilization_scaler_saturates_at_the_cap_at_light_load() -> None:
    """Continuous batching keeps utilisation ~1.0 even at a tenth of one replica's capacity, so the
    HPA-style rule keeps asking for more until it sits at max_replicas, and never gives them back."""
    counts = simulate(gpu(), load_tokens_per_s=100.0, util=0.98)
    assert counts[-1] == 20 and max(counts) == 20
    assert counts == sorted(counts)  # never scales down
    assert simulate(gpu(), load_tokens_per_s=30_000.0, util=0.98)[-1] == 20  # same answer at 300x the load


def test_backlog_scaler_tracks_the_load() -> None:
    light = simulate(backlog(cooldown_s=120.0), load_tokens_per_s=100.0)
    assert light[-1] == 1  # scaled down from 2 to min_replicas
    heavy = simulate(backlog(cooldown_s=120.0), load_tokens_per_s=7_500.0)
    assert heavy[-1] == 8 and max(heavy) == 8  # ceil(7500 / 1000), no overshoot while replicas boot


def test_backlog_desired_replicas_formula() -> None:
    p = backlog()
    # 50k tokens to clear in 10 s = 5000 tok/s, plus 2500 tok/s being served = 7.5 replicas -> 8
    assert p.desired_replicas(sig(0.0, backlog=50_000, drain=2_500.0)) == 8
    assert p.desired_replicas(sig(0.0, backlog=0, drain=3_000.0)) == 3  # exact: no extra replica
    d = p.evaluate(sig(0.0, backlog=50_000, eta=20.0, ready=3, drain=2_500.0))
    assert (d.add, d.remove, d.burst_share) == (5, 0, 0.0) and d.reason.startswith("up:")


def test_provisioning_replicas_are_counted() -> None:
    p = backlog()
    s = dict(backlog=50_000, eta=20.0, drain=2_500.0)
    assert p.evaluate(sig(0.0, ready=3, prov=0, **s)).add == 5  # type: ignore[arg-type]
    assert p.evaluate(sig(10.0, ready=3, prov=5, **s)).add == 0  # type: ignore[arg-type]
    assert p.evaluate(sig(20.0, ready=3, prov=3, **s)).add == 2  # type: ignore[arg-type]
    # and nothing is removed while replicas are still booting, even when the load has vanished
    d = p.evaluate(sig(1000.0, ready=3, prov=5))
    assert (d.add, d.remove) == (0, 0) and "provisioning" in d.reason


def test_scale_down_waits_for_cooldown_and_a_calm_queue() -> None:
    p = backlog(cooldown_s=300.0)
    assert p.evaluate(sig(0.0, backlog=90_000, eta=30.0, ready=2, drain=1_000.0)).add == 8
    d = p.evaluate(sig(100.0, ready=10, drain=1_000.0))
    assert d.remove == 0 and "cooldown until 300.0" in d.reason
    d = p.evaluate(sig(300.0, ready=10, eta=2.0, drain=1_000.0))
    assert d.remove == 0 and "queue_eta_s" in d.reason
    d = p.evaluate(sig(300.0, ready=10, eta=0.5, drain=1_000.0))
    assert (d.add, d.remove) == (0, 9) and d.reason.startswith("down:")
    assert p.evaluate(sig(310.0, ready=1, eta=0.5)).remove == 0  # at min_replicas


def test_burst_share_grows_with_the_excess_when_capped() -> None:
    p = backlog(max_replicas=10, burst_max_share=0.5)
    shares = []
    for i, drain in enumerate([9_000.0, 10_000.0, 12_500.0, 15_000.0, 40_000.0]):
        d = p.evaluate(sig(float(i), ready=10, eta=5.0, drain=drain))
        assert d.add == 0
        shares.append(d.burst_share)
    assert shares[:2] == [0.0, 0.0]
    assert shares[2] == pytest.approx((13 - 10) / 13) and shares[3] == pytest.approx(5 / 15)
    assert shares[4] == 0.5  # capped at burst_max_share
    no_burst = backlog(max_replicas=10, burst_when_capped=False)
    assert no_burst.evaluate(sig(0.0, ready=10, eta=5.0, drain=40_000.0)).burst_share == 0.0


def test_gpu_utilization_scaler_scales_down_when_utilization_really_drops() -> None:
    """The rule itself works; its trouble is the signal. At 0.35 utilisation it halves the fleet."""
    p = gpu(cooldown_s=0.0)
    d = p.evaluate(sig(0.0, ready=10, util=0.35))
    assert d.remove == 5
    assert p.evaluate(sig(1.0, ready=5, util=0.7)).add == 0  # exactly at target: hold
    assert gpu().evaluate(sig(0.0, ready=0, util=0.9)).add == 1  # from zero replicas still asks for one
    assert gpu().evaluate(sig(0.0, ready=4, util=0.98)).add == math.ceil(4 * 0.98 / 0.7) - 4


# --------------------------------------------------------------------------------------------- properties
@settings(max_examples=200, deadline=None)
@given(backlog_tokens=st.integers(0, 10**7), drain=st.floats(0.0, 1e6), ready=st.integers(0, 40),
       prov=st.integers(0, 40), eta=st.floats(0.0, 100.0), util=st.floats(0.0, 1.0))
def test_decisions_stay_within_bounds(backlog_tokens: int, drain: float, ready: int, prov: int, eta: float,
                                      util: float) -> None:
    s = sig(0.0, backlog=backlog_tokens, eta=eta, ready=ready, prov=prov, util=util, drain=drain)
    for p, lo, hi in ((backlog(max_replicas=25, min_replicas=2, cooldown_s=0.0), 2, 25),
                      (gpu(max_replicas=25, min_replicas=2, cooldown_s=0.0), 2, 25)):
        d = p.evaluate(s)
        total = ready + prov
        assert d.remove <= ready
        if d.add:  # never adds past the cap
            assert total + d.add <= hi
        if d.remove:  # never removes below the floor
            assert total - d.remove >= lo
        assert 0.0 <= d.burst_share <= 0.5


@pytest.mark.parametrize("params", [BacklogParams, GpuUtilizationParams])
def test_min_replicas_above_max_is_refused_by_every_autoscaler(params):
    with pytest.raises(ValueError, match=r"min_replicas \(5\) > max_replicas \(2\)"):
        params(min_replicas=5, max_replicas=2)
    assert params(min_replicas=2, max_replicas=2).max_replicas == 2
