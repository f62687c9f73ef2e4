"""The token-aware queue's decisions on hand-made snapshots, and hypothesis properties."""

from __future__ import annotations

import dataclasses
import math
from itertools import count
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from twin.policies import (
    QUEUES,
    BaseQueuePolicy,
    QueueDecision,
    QueueItem,
    QueuePolicy,
    QueueSnapshot,
    build_queue_policy,
    parse_queue_config,
)
from twin.policies.queueing import DEADLINE_UNREACHABLE, QUEUE_FULL, TokenAwareQueue

_N = count()


def item(tokens: int = 100, *, tier: str = "paid", deadline_s: float | None = None, now_s: float = 0.0) -> QueueItem:
    return QueueItem(request_id=f"r{next(_N)}", tier=tier, tenant="acme", prompt_tokens=tokens // 2,
                     expected_output_tokens=tokens - tokens // 2, deadline_s=deadline_s, arrival_s=now_s)


def snap(by_priority: dict[int, int] | None = None, *, now_s: float = 0.0, drain: float = 100.0,
         capacity: int | None = None, in_flight: int = 0) -> QueueSnapshot:
    pairs = tuple(sorted((by_priority or {}).items()))
    return QueueSnapshot(now_s=now_s, queued_tokens=sum(t for _, t in pairs), capacity_tokens=capacity,
                         queued_by_priority=pairs, drain_tokens_per_s=drain, in_flight_tokens=in_flight)


def token_aware(**kw: Any) -> TokenAwareQueue:
    p = build_queue_policy({"kind": "token_aware", **kw}, seed=0)
    assert isinstance(p, TokenAwareQueue)
    return p


# ------------------------------------------------------------------------------------------ value types
def test_value_types_are_frozen_and_validated() -> None:
    s = snap({1: 500, 2: 300})
    assert s.tokens_at_or_above(1) == 500 and s.tokens_at_or_above(2) == 800 and s.tokens_at_or_above(0) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.queued_tokens = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="sum"):
        dataclasses.replace(s, queued_tokens=801)
    with pytest.raises(ValueError, match="distinct"):
        dataclasses.replace(s, queued_by_priority=((1, 400), (1, 400)))
    with pytest.raises(ValueError, match="drain"):
        dataclasses.replace(s, drain_tokens_per_s=-1.0)
    with pytest.raises(ValueError, match="tier"):
        item(tier="gold")
    with pytest.raises(ValueError, match="reason"):
        QueueDecision(False, None, 0, 0.0)
    with pytest.raises(ValueError, match="reason"):
        QueueDecision(True, QUEUE_FULL, 0, 0.0)
    assert item(10).total_tokens == 10


# -------------------------------------------------------------------------------------------- the bound
def test_accepts_until_the_token_bound() -> None:
    q = token_aware(capacity_tokens=1000)
    queued: dict[int, int] = {}
    accepted = 0
    for _ in range(20):
        d = q.decide(item(300), snap(queued))
        if not d.accept:
            assert d.reason == QUEUE_FULL
            break
        queued[d.priority] = queued.get(d.priority, 0) + 300
        accepted += 1
    assert accepted == 3  # 900 queued; a fourth 300 would make 1200 > 1000
    assert q.decide(item(100), snap(queued)).accept  # exactly 1000 still fits
    assert not q.decide(item(101), snap(queued)).accept


def test_component_bound_applies_when_smaller() -> None:
    q = token_aware(capacity_tokens=1000)
    assert q.capacity_tokens == 1000
    assert q.decide(item(600), snap(capacity=5000)).accept
    assert q.decide(item(600), snap(capacity=500)).reason == QUEUE_FULL


# ------------------------------------------------------------------------------------------ priorities
def test_priority_by_tier_default_and_configurable() -> None:
    q = token_aware()
    assert [q.decide(item(tier=t), snap()).priority for t in ("enterprise", "paid", "free")] == [0, 1, 2]
    q = token_aware(tier_priorities={"enterprise": 0, "paid": 0, "free": 5})
    assert [q.decide(item(tier=t), snap()).priority for t in ("enterprise", "paid", "free")] == [0, 0, 5]
    with pytest.raises(ValidationError, match=r"missing \['free'\]"):
        parse_queue_config({"kind": "token_aware", "tier_priorities": {"enterprise": 0, "paid": 1}})
    with pytest.raises(ValidationError, match=r"unknown \['gold'\]"):
        parse_queue_config({"kind": "token_aware", "tier_priorities": {"enterprise": 0, "paid": 1, "free": 2,
                                                                        "gold": 0}})


# ------------------------------------------------------------------------------------------------- ETA
def test_eta_counts_its_own_class_and_higher_over_the_drain_rate() -> None:
    q = token_aware()
    s = snap({0: 1000, 1: 2000, 2: 4000}, drain=500.0, in_flight=9999)
    assert q.decide(item(tier="enterprise"), s).eta_s == pytest.approx(2.0)  # 1000 / 500
    assert q.decide(item(tier="paid"), s).eta_s == pytest.approx(6.0)  # (1000 + 2000) / 500
    assert q.decide(item(tier="free"), s).eta_s == pytest.approx(14.0)  # 7000 / 500
    assert q.decide(item(tier="enterprise"), snap({2: 4000}, drain=500.0)).eta_s == 0.0  # only lower classes wait


def test_eta_when_nothing_drains_and_the_floor() -> None:
    q = token_aware(reject_if_eta_exceeds_deadline=False)
    assert q.decide(item(), snap({1: 100}, drain=0.0)).eta_s == math.inf
    assert q.decide(item(), snap({}, drain=0.0)).eta_s == 0.0  # nothing ahead: leaves at once
    floored = token_aware(min_drain_tokens_per_s=50.0)
    assert floored.decide(item(), snap({1: 100}, drain=0.0)).eta_s == pytest.approx(2.0)
    assert floored.decide(item(), snap({1: 100}, drain=200.0)).eta_s == pytest.approx(0.5)  # measured wins


# -------------------------------------------------------------------------------------- deadline/expiry
def test_deadline_rejection() -> None:
    q = token_aware()
    s = snap({1: 1000}, now_s=10.0, drain=100.0)  # ETA 10 s
    assert q.decide(item(deadline_s=20.0), s).accept  # leaves at 20: just in time
    d = q.decide(item(deadline_s=19.9), s)
    assert (d.accept, d.reason, d.eta_s) == (False, DEADLINE_UNREACHABLE, pytest.approx(10.0))
    assert q.decide(item(deadline_s=19.9, tier="enterprise"), s).accept  # nothing ahead of enterprise
    assert q.decide(item(deadline_s=None), s).accept
    assert not q.decide(item(deadline_s=1e9), snap({1: 1}, drain=0.0)).accept  # never drains: unreachable
    assert token_aware(reject_if_eta_exceeds_deadline=False).decide(item(deadline_s=19.9), s).accept


def test_expiry() -> None:
    q = token_aware()
    it = item(deadline_s=30.0)
    assert not q.expired(it, 29.999)
    assert q.expired(it, 30.0)
    assert not q.expired(item(deadline_s=None), 1e12)


# ------------------------------------------------------------------------------------------ fifo baseline
def test_fifo_unbounded_baseline() -> None:
    q = build_queue_policy({"kind": "fifo_unbounded"}, seed=0)
    s = snap({0: 10**9}, drain=1000.0, capacity=10)
    d = q.decide(item(10**6, tier="free", deadline_s=0.0), s)
    assert (d.accept, d.reason, d.priority, d.eta_s) == (True, None, 0, pytest.approx(10**6))
    assert q.capacity_tokens is None
    assert not q.expired(item(deadline_s=1.0), 100.0)


# ------------------------------------------------------------------------------------------ registry
def test_registry_and_config() -> None:
    assert QUEUES.keys() == ["fifo_unbounded", "token_aware"]
    for key in QUEUES.keys():
        p = build_queue_policy({"kind": key}, seed=1)
        assert isinstance(p, QueuePolicy) and isinstance(p, BaseQueuePolicy) and p.params.kind == key
    with pytest.raises(ValidationError, match=r"did you mean 'token_aware'.*known: fifo_unbounded, token_aware"):
        parse_queue_config({"kind": "token_awar"})
    with pytest.raises(ValidationError, match="capacity_tokenz"):
        parse_queue_config({"kind": "token_aware", "capacity_tokenz": 1})
    params = parse_queue_config({"kind": "token_aware", "capacity_tokens": 5})
    assert build_queue_policy(params, seed=0).capacity_tokens == 5
    with pytest.raises(ValidationError):
        params.capacity_tokens = 6  # type: ignore[attr-defined,misc]


# ------------------------------------------------------------------------------------------ properties
RUN = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ops = st.lists(st.tuples(st.booleans(), st.integers(0, 3000), st.sampled_from(("free", "paid", "enterprise")),
                         st.floats(0.0, 2.0)), min_size=1, max_size=80)


@RUN
@given(ops, st.integers(0, 20_000), st.floats(0.0, 5000.0))
def test_a_queue_run_by_the_policy_never_exceeds_its_bound(steps: Any, capacity: int, drain: float) -> None:
    """A tiny queue: arrivals ask the policy, departures pop the best class; tokens stay within the bound
    and every arrival is either queued or refused."""
    q = token_aware(capacity_tokens=capacity, reject_if_eta_exceeds_deadline=False)
    waiting: list[tuple[int, int, int]] = []  # (priority, seq, tokens)
    offered = accepted = refused = 0
    now = 0.0
    for i, (arrive, tokens, tier, dt) in enumerate(steps):
        now += dt
        if arrive or not waiting:
            by: dict[int, int] = {}
            for p, _, t in waiting:
                by[p] = by.get(p, 0) + t
            s = snap(by, now_s=now, drain=drain)
            d = q.decide(item(tokens, tier=tier), s)
            offered += 1
            assert d.eta_s == (0.0 if not s.tokens_at_or_above(d.priority) else
                               s.tokens_at_or_above(d.priority) / drain if drain else math.inf)
            if d.accept:
                waiting.append((d.priority, i, tokens))
                accepted += 1
            else:
                assert d.reason == QUEUE_FULL and s.queued_tokens + tokens > capacity
                refused += 1
        else:
            waiting.remove(min(waiting))
        assert sum(t for _, _, t in waiting) <= capacity
    assert accepted + refused == offered


@RUN
@given(st.dictionaries(st.integers(0, 3), st.integers(0, 10**6), max_size=4), st.floats(0.0, 1e5),
       st.floats(0.0, 1e5))
def test_eta_is_monotone_in_priority_and_drain(by: dict[int, int], drain: float, extra: float) -> None:
    q = token_aware(tier_priorities={"enterprise": 0, "paid": 1, "free": 2})
    s = snap(by, drain=drain)
    etas = [q.decide(item(tier=t), s).eta_s for t in ("enterprise", "paid", "free")]
    assert etas == sorted(etas)
    faster = snap(by, drain=drain + extra)
    assert all(q.decide(item(tier=t), faster).eta_s <= e for t, e in zip(("enterprise", "paid", "free"), etas,
                                                                            strict=True))
    again = token_aware(tier_priorities={"enterprise": 0, "paid": 1, "free": 2})
    assert [again.decide(item(tier=t), s).eta_s for t in ("enterprise", "paid", "free")] == etas
