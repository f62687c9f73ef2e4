"""The token bucket's prune visits only buckets whose refill time has come (twin/policies/refill.py) and
forgets exactly the buckets a pass over all of them would: checked against that pass after every call."""

from __future__ import annotations

import math
import random

import pytest

import twin.policies.admission as admission
from twin.policies.admission import AdmissionRequest, TokenBucketAdmission, build_admission
from twin.policies.refill import earliest_full_s


def full_pass(p: TokenBucketAdmission, now_s: float) -> list[str]:
    """The buckets a pass over every bucket forgets at ``now_s`` (the former ``_prune``)."""
    return [u for u, b in p._buckets.items() if p.level(u, b.tier, now_s) >= p.limits(b.tier)[1]]


def state(p: TokenBucketAdmission) -> list[tuple[str, float, float, str]]:
    return [(u, b.level, b.t_s, b.tier) for u, b in p._buckets.items()]


@pytest.mark.parametrize("seed", range(6))
def test_prune_forgets_what_a_full_pass_would(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "_PRUNE_EVERY", 7)  # sweep often
    monkeypatch.setattr(admission, "_REFILL_SLACK", 8)  # and rebuild the schedule often
    rng = random.Random(seed)
    cfg = {"kind": "token_bucket", "tokens_per_s": rng.choice([0.0, 3.0, 200.0, 1e-7]), "burst_tokens": 4000.0,
           "tier_overrides": {"free": {"tokens_per_s": 50.0, "burst_tokens": 1500.0},
                              "enterprise": {"tokens_per_s": 0.0, "burst_tokens": 9000.0}}}
    p = build_admission(cfg, seed=0)
    assert isinstance(p, TokenBucketAdmission)
    now = 0.0
    open_ids: list[tuple[str, int]] = []
    forgotten_somewhere = 0
    for i in range(3000):
        now += rng.choice([0.0, 0.0, 1e-9, rng.expovariate(2.0), rng.expovariate(0.05)])
        user = f"u{rng.randrange(40)}"
        tier = rng.choice(["free", "paid", "enterprise"])
        if open_ids and rng.random() < 0.4:
            rid, cost = open_ids.pop(rng.randrange(len(open_ids)))
            p.on_completed(rid, max(0, cost + rng.randint(-cost, 3000)), now)
            continue
        cost = rng.randint(1, 2500)
        expected = None
        if p._commits % admission._PRUNE_EVERY == admission._PRUNE_EVERY - 1:
            expected = (state(p), full_pass(p, now))  # this admit may commit, and then sweeps
        d = p.admit(AdmissionRequest(request_id=f"r{i}", user_id=user, tenant="t", tier=tier, prompt_tokens=cost,
                                     expected_output_tokens=0, is_retry=False, attempt=1), now)
        if d.admitted:
            open_ids.append((f"r{i}", cost))
            if expected is not None and p._commits % admission._PRUNE_EVERY == 0:
                # the sweep ran right after this commit: no bucket that is full now may remain, none other gone
                assert not full_pass(p, now)
                before = {u for u, *_ in expected[0]} | {user}
                gone = before - set(p._buckets)
                assert gone == set(expected[1]) - {user}  # the committing user's bucket is not full
                forgotten_somewhere += len(gone)
                for u, b in p._buckets.items():
                    assert p.level(u, b.tier, now) < p.limits(b.tier)[1]
                assert len(p._refill) <= 2 * len(p._buckets) + 8
        # every bucket has an entry no later than the first time it can be full
        for u, b in p._buckets.items():
            rate, burst = p.limits(b.tier)
            assert b.due_s <= earliest_full_s(b.level, b.t_s, rate, burst) or b.due_s == math.inf
    if cfg["tokens_per_s"] >= 3.0:
        assert forgotten_somewhere > 0  # the test exercised forgetting


def test_earliest_full_is_never_after_the_exact_test_passes() -> None:
    rng = random.Random(5)
    for _ in range(20000):
        level = rng.choice([rng.uniform(-5e4, 4e4), 3999.999999, -1e-9, 0.0])
        t_s = rng.choice([0.0, rng.uniform(0, 1e6), 1e9 + rng.random()])
        rate = rng.choice([200.0, 3.0, 1e-7, 7.3e5, rng.uniform(1e-3, 1e3)])
        burst = 4000.0
        due = earliest_full_s(level, t_s, rate, burst)
        # the first float time that passes the exact test, found from the real-valued answer
        exact = t_s + (burst - level) / rate
        for now in (math.nextafter(exact, -math.inf), exact, math.nextafter(exact, math.inf)):
            if now >= t_s and min(burst, level + (now - t_s) * rate) >= burst:
                assert due <= now
