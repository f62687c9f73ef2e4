"""Gateway admission policies: unit tests on hand-made request sequences, and hypothesis properties."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from twin.policies import (
    ADMISSIONS,
    AdmissionDecision,
    AdmissionPolicy,
    AdmissionRequest,
    BaseAdmission,
    build_admission,
    parse_admission_config,
)
from twin.policies.admission import (
    REQUEST_EXCEEDS_BURST,
    REQUEST_EXCEEDS_QUOTA,
    RETRY_BUDGET_EXHAUSTED,
    TENANT_QUOTA_EXCEEDED,
    TOKEN_EPS,
    USER_RATE_LIMITED,
    RetryBudgetAdmission,
    TenantQuotaAdmission,
    TokenBucketAdmission,
)

REPO = Path(__file__).resolve().parent.parent
_N = count()


def req(tokens: int = 100, *, user: str = "u1", tenant: str = "acme", tier: str = "paid", attempt: int = 1,
        prompt: int | None = None) -> AdmissionRequest:
    """An attempt of ``tokens`` tokens (prompt + expected output; ``prompt`` defaults to half)."""
    p = tokens // 2 if prompt is None else prompt
    return AdmissionRequest(request_id=f"r{next(_N)}", user_id=user, tenant=tenant, tier=tier, prompt_tokens=p,
                            expected_output_tokens=tokens - p, is_retry=attempt > 1, attempt=attempt)


def bucket(rate: float = 100.0, burst: float = 1000.0, **kw: Any) -> TokenBucketAdmission:
    p = build_admission({"kind": "token_bucket", "tokens_per_s": rate, "burst_tokens": burst, **kw}, seed=0)
    assert isinstance(p, TokenBucketAdmission)
    return p


# ------------------------------------------------------------------------------------------ value types
def test_request_and_decision_are_frozen_and_validated() -> None:
    r = req()
    assert r.total_tokens == 100
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.tier = "free"  # type: ignore[misc]
    with pytest.raises(ValueError, match="tier"):
        req(tier="gold")
    with pytest.raises(ValueError, match="is_retry"):
        dataclasses.replace(r, is_retry=True)  # attempt 1 cannot be a retry
    with pytest.raises(ValueError, match="attempt"):
        dataclasses.replace(r, attempt=0)
    with pytest.raises(ValueError, match="reason"):
        AdmissionDecision(False)
    with pytest.raises(ValueError, match="admitted"):
        AdmissionDecision(True, "x")
    assert not hasattr(r, "__dict__")  # slots


# ----------------------------------------------------------------------------------------- token bucket
def test_new_user_gets_the_full_burst_then_is_rate_limited() -> None:
    p = bucket(rate=100.0, burst=1000.0)
    assert p.admit(req(600), 0.0).admitted
    assert p.admit(req(400), 0.0).admitted
    d = p.admit(req(1), 0.0)
    assert (d.admitted, d.reason) == (False, USER_RATE_LIMITED)
    assert d.retry_after_s == pytest.approx(0.01)


def test_bucket_refills_at_the_stated_rate_and_retry_after_is_exact() -> None:
    p = bucket(rate=250.0, burst=1000.0)
    assert p.admit(req(1000), 10.0).admitted
    assert p.level("u1", "paid", 12.0) == pytest.approx(500.0)  # 2 s x 250 tokens/s
    assert p.level("u1", "paid", 100.0) == 1000.0  # capped at burst
    d = p.admit(req(700), 12.0)
    assert d.reason == USER_RATE_LIMITED and d.retry_after_s == pytest.approx(0.8)  # 200 missing / 250
    assert d.retry_after_s is not None
    t = 12.0 + d.retry_after_s
    assert not p.admit(req(700), t - 1e-6).admitted  # a microsecond early is still too early
    assert p.admit(req(700), t).admitted  # exactly then it fits
    assert p.level("u1", "paid", t) == pytest.approx(0.0, abs=1e-6)


def test_a_rejected_attempt_consumes_nothing() -> None:
    p = bucket(rate=10.0, burst=100.0)
    assert p.admit(req(90), 0.0).admitted
    for _ in range(5):
        assert not p.admit(req(50), 1.0).admitted
    assert p.level("u1", "paid", 1.0) == pytest.approx(20.0)


def test_users_have_separate_buckets() -> None:
    p = bucket(rate=1.0, burst=100.0)
    assert p.admit(req(100, user="a"), 0.0).admitted
    assert not p.admit(req(100, user="a"), 0.0).admitted
    assert p.admit(req(100, user="b"), 0.0).admitted


def test_tier_overrides_apply_to_users_of_that_tier() -> None:
    p = bucket(rate=10.0, burst=100.0, tier_overrides={"enterprise": {"tokens_per_s": 1000.0, "burst_tokens": 5000.0}})
    assert p.limits("free") == (10.0, 100.0) and p.limits("enterprise") == (1000.0, 5000.0)
    assert p.admit(req(5000, user="big", tier="enterprise"), 0.0).admitted
    d = p.admit(req(500, user="big", tier="enterprise"), 0.0)
    assert d.retry_after_s == pytest.approx(0.5)  # refills at the enterprise rate
    d = p.admit(req(200, user="small", tier="free"), 0.0)
    assert (d.admitted, d.reason, d.retry_after_s) == (False, REQUEST_EXCEEDS_BURST, None)


def test_zero_rate_bucket_gives_no_retry_time() -> None:
    p = bucket(rate=0.0, burst=100.0)
    assert p.admit(req(100), 0.0).admitted
    d = p.admit(req(1), 1e6)
    assert (d.reason, d.retry_after_s) == (USER_RATE_LIMITED, None)


def test_true_up_refunds_short_replies_and_charges_long_ones() -> None:
    p = bucket(rate=10.0, burst=1000.0)
    a, b = req(600), req(400)
    assert p.admit(a, 0.0).admitted and p.admit(b, 0.0).admitted
    p.on_completed(a.request_id, 200, 0.0)  # charged 600, used 200: 400 back
    assert p.level("u1", "paid", 0.0) == pytest.approx(400.0)
    p.on_completed(a.request_id, 200, 0.0)  # a second completion is ignored
    p.on_completed("never-admitted", 0, 0.0)
    assert p.level("u1", "paid", 0.0) == pytest.approx(400.0)
    p.on_completed(b.request_id, 1400, 0.0)  # charged 400, used 1400: 1000 debt
    assert p.level("u1", "paid", 0.0) == pytest.approx(-600.0)
    d = p.admit(req(100), 0.0)
    assert d.retry_after_s == pytest.approx(70.0)  # (100 + 600) / 10
    off = bucket(rate=10.0, burst=1000.0, true_up=False)
    c = req(600)
    off.admit(c, 0.0)
    off.on_completed(c.request_id, 0, 0.0)
    assert off.level("u1", "paid", 0.0) == pytest.approx(400.0)


def test_refund_never_overfills_the_bucket() -> None:
    p = bucket(rate=10.0, burst=1000.0)
    a = req(500)
    p.admit(a, 0.0)
    p.on_completed(a.request_id, 0, 100.0)  # bucket already full again by then
    assert p.level("u1", "paid", 100.0) == 1000.0


def test_time_must_not_go_back() -> None:
    p = bucket()
    p.admit(req(), 5.0)
    with pytest.raises(ValueError, match="time went back"):
        p.admit(req(), 4.0)


def test_full_buckets_are_pruned_and_behave_as_new() -> None:
    p = bucket(rate=1000.0, burst=1000.0)
    for i in range(4096):
        assert p.admit(req(10, user=f"u{i}"), float(i) * 1e-3).admitted
    assert len(p._buckets) < 4096  # the early users' buckets were full again and were dropped
    assert p.level("u0", "paid", 5.0) == 1000.0


def test_sweeps_cost_a_bounded_time_per_commit() -> None:
    """A sweep passes over every bucket, so sweeps are spaced by at least as many commits as buckets: the
    buckets visited stay within twice the commits however many users are remembered (one sweep every 4,096
    commits visited ~7 per commit at 60,000 users, and more as users grow)."""
    p = bucket(rate=1e-3, burst=1000.0)  # nobody's bucket refills in this test: every user is remembered
    visited = []
    sweep = p._prune

    def counting(now_s: float) -> None:
        visited.append(len(p._buckets))
        sweep(now_s)

    p._prune = counting  # type: ignore[method-assign]
    n = 60_000
    for i in range(n):
        assert p.admit(req(10, user=f"u{i}"), float(i) * 1e-3).admitted
    assert len(p._buckets) == n and len(visited) >= 3
    assert sum(visited) <= 2 * n


def test_retry_budget_per_user_sweeps_on_the_same_schedule() -> None:
    """The retry budget scoped per user keeps a window per user: its sweeps follow the same schedule."""
    from twin.policies.admission import RetryBudgetAdmission

    p = build_admission({"kind": "retry_budget", "scope": "user", "window_s": 1e9}, seed=0)
    assert isinstance(p, RetryBudgetAdmission)
    n = 40_000
    for i in range(n):
        assert p.admit(req(10, user=f"u{i}"), float(i)).admitted
    # every window is kept (the window never ends), so the sweeps at 4,096, 8,192, 16,384 and 32,768 commits each
    # left as many windows as commits, and the next one is due at 65,536 (a fixed period: 40,960)
    assert len(p._firsts) == n and p._sweeps.next == 65_536


# ----------------------------------------------------------------------------------------- tenant quota
def quota(tpm: int = 1000, **kw: Any) -> TenantQuotaAdmission:
    p = build_admission({"kind": "tenant_quota", "tokens_per_minute": tpm, **kw}, seed=0)
    assert isinstance(p, TenantQuotaAdmission)
    return p


def test_tenant_window_slides() -> None:
    p = quota(1000)
    assert p.admit(req(400), 0.0).admitted
    assert p.admit(req(400), 30.0).admitted
    d = p.admit(req(400), 45.0)
    # a fixed minute would reset at 60; the sliding window frees the t=0 charge at exactly 60
    assert (d.reason, d.retry_after_s) == (TENANT_QUOTA_EXCEEDED, pytest.approx(15.0))
    assert not p.admit(req(400), 59.999).admitted
    assert p.admit(req(400), 60.0).admitted
    assert p.used("acme", 60.0) == 800
    d = p.admit(req(800), 61.0)  # needs both the t=30 and the t=60 charges gone: t=120
    assert d.retry_after_s == pytest.approx(59.0)
    assert p.used("acme", 200.0) == 0


def test_quota_is_per_tenant_with_overrides() -> None:
    p = quota(1000, tenant_overrides={"bigco": 10_000})
    assert p.admit(req(1000, tenant="acme"), 0.0).admitted
    assert not p.admit(req(1, tenant="acme"), 0.0).admitted
    assert p.admit(req(9000, tenant="bigco"), 0.0).admitted
    assert p.admit(req(1000, tenant="other"), 0.0).admitted
    d = p.admit(req(1001, tenant="acme"), 500.0)
    assert (d.reason, d.retry_after_s) == (REQUEST_EXCEEDS_QUOTA, None)


def test_quota_true_up_counts_actual_tokens() -> None:
    p = quota(1000)
    a = req(900)
    assert p.admit(a, 0.0).admitted
    assert not p.admit(req(500), 1.0).admitted
    p.on_completed(a.request_id, 300, 2.0)
    assert p.used("acme", 2.0) == 300
    assert p.admit(req(500), 2.0).admitted
    assert p.used("acme", 70.0) == 0


# ----------------------------------------------------------------------------------------- retry budget
def budget(**kw: Any) -> RetryBudgetAdmission:
    p = build_admission({"kind": "retry_budget", **kw}, seed=0)
    assert isinstance(p, RetryBudgetAdmission)
    return p


def test_retry_budget_admits_ratio_times_first_attempts_then_rejects() -> None:
    p = budget(ratio=0.2, min_retries_per_window=0, window_s=10.0)
    for _ in range(50):
        assert p.admit(req(attempt=1), 0.0).admitted  # first attempts always pass
    results = [p.admit(req(attempt=2), 1.0) for _ in range(12)]
    assert [d.admitted for d in results] == [True] * 10 + [False] * 2  # 0.2 x 50
    assert results[-1].reason == RETRY_BUDGET_EXHAUSTED
    assert p.counts("", 1.0) == (50, 10)
    # the window then forgets both: first attempts at 0 leave at 10 and no retry would fit any more
    assert results[-1].retry_after_s is None
    # a new wave of first attempts makes room again
    for _ in range(5):
        p.admit(req(attempt=1), 5.0)
    assert p.admit(req(attempt=3), 5.0).admitted  # 11 <= 0.2 x 55


def test_retry_budget_floor_and_retry_after() -> None:
    p = budget(ratio=0.5, min_retries_per_window=2, window_s=10.0)
    assert p.admit(req(attempt=2), 0.0).admitted
    assert p.admit(req(attempt=2), 4.0).admitted
    d = p.admit(req(attempt=2), 5.0)
    assert d.reason == RETRY_BUDGET_EXHAUSTED and d.retry_after_s == pytest.approx(5.0)  # t=0 retry leaves at 10
    assert d.retry_after_s is not None
    assert not p.admit(req(attempt=2), 5.0 + d.retry_after_s - 1e-6).admitted
    assert p.admit(req(attempt=2), 5.0 + d.retry_after_s).admitted
    p2 = budget(ratio=0.5, min_retries_per_window=0, window_s=10.0)
    p2.admit(req(attempt=1), 0.0)
    p2.admit(req(attempt=1), 0.0)
    p2.admit(req(attempt=1), 3.0)
    assert p2.admit(req(attempt=2), 3.0).admitted  # 1 <= 0.5 x 3
    d = p2.admit(req(attempt=2), 4.0)
    # firsts leaving at 10 drop the allowance to 0.5; nothing fits until the retry at 3 leaves at 13,
    # and then the one first attempt left (3 -> 13) leaves too: never
    assert d.retry_after_s is None


def test_retry_budget_scope_per_tenant() -> None:
    p = budget(ratio=0.0, min_retries_per_window=1, scope="tenant")
    assert p.admit(req(attempt=2, tenant="a"), 0.0).admitted
    assert not p.admit(req(attempt=2, tenant="a"), 0.0).admitted
    assert p.admit(req(attempt=2, tenant="b"), 0.0).admitted


# ---------------------------------------------------------------------------------------------- composite
def test_composite_first_rejection_wins_in_order() -> None:
    tb = {"kind": "token_bucket", "tokens_per_s": 1.0, "burst_tokens": 100.0}
    tq = {"kind": "tenant_quota", "tokens_per_minute": 100}
    p = build_admission({"kind": "composite", "policies": [tq, tb]}, seed=0)
    assert p.admit(req(100), 0.0).admitted
    assert p.admit(req(1), 0.0).reason == TENANT_QUOTA_EXCEEDED  # both would reject; the first one speaks
    q = build_admission({"kind": "composite", "policies": [tb, tq]}, seed=0)
    assert q.admit(req(100), 0.0).admitted
    assert q.admit(req(1), 0.0).reason == USER_RATE_LIMITED


def test_composite_rejection_consumes_nothing_from_the_others() -> None:
    tb = {"kind": "token_bucket", "tokens_per_s": 1.0, "burst_tokens": 1000.0}
    p = build_admission({"kind": "composite", "policies": [
        {"kind": "retry_budget", "ratio": 0.0, "min_retries_per_window": 1},
        {"kind": "tenant_quota", "tokens_per_minute": 600}, tb]}, seed=0)
    assert p.admit(req(400, user="a"), 0.0).admitted
    # rejected by the quota (second): the retry budget (first) must not count the retry, nor the bucket
    # (third) be charged
    assert p.admit(req(400, user="a", attempt=2), 0.0).reason == TENANT_QUOTA_EXCEEDED
    budget_, quota_, bucket_ = p.children  # type: ignore[attr-defined]
    assert budget_.counts("", 0.0) == (1, 0)
    assert quota_.used("acme", 0.0) == 400
    assert bucket_.level("a", "paid", 0.0) == pytest.approx(600.0)
    assert p.admit(req(100, user="a", attempt=2), 0.0).admitted  # the retry budget still has its one
    a = req(50, user="a")
    assert p.admit(a, 1.0).admitted
    p.on_completed(a.request_id, 0, 1.0)  # reaches every child
    assert quota_.used("acme", 1.0) == 500
    assert bucket_.level("a", "paid", 1.0) == pytest.approx(501.0)


# -------------------------------------------------------------------------------------- registry/config
def test_registry_config_and_protocol() -> None:
    assert ADMISSIONS.keys() == ["allow_all", "composite", "retry_budget", "tenant_quota", "token_bucket"]
    for key in ADMISSIONS.keys():
        cfg: dict[str, Any] = {"kind": key}
        if key == "composite":
            cfg["policies"] = [{"kind": "allow_all"}]
        p = build_admission(cfg, seed=3)
        assert isinstance(p, AdmissionPolicy) and isinstance(p, BaseAdmission)
        assert p.params.kind == key
        assert p.admit(req(10), 0.0).admitted
    with pytest.raises(ValidationError, match=r"did you mean 'token_bucket'.*known: allow_all, composite"):
        parse_admission_config({"kind": "token_buckett"})
    with pytest.raises(ValidationError, match="needs a 'kind'"):
        parse_admission_config({"tokens_per_s": 1.0})
    with pytest.raises(ValidationError, match="burst_tokenz"):
        parse_admission_config({"kind": "token_bucket", "burst_tokenz": 1})
    with pytest.raises(ValidationError, match=r"policies\.0"):
        parse_admission_config({"kind": "composite", "policies": [{"kind": "nope"}]})
    with pytest.raises(ValidationError, match="gold"):
        parse_admission_config({"kind": "token_bucket", "tier_overrides": {"gold": {"tokens_per_s": 1,
                                                                                     "burst_tokens": 1}}})
    params = parse_admission_config({"kind": "retry_budget"})
    with pytest.raises(ValidationError):
        params.ratio = 1.0  # type: ignore[attr-defined,misc]
    with pytest.raises(TypeError, match="needs TokenBucketParams"):
        TokenBucketAdmission(params, seed=0)


def test_no_numpy_or_simulator_module_imported() -> None:
    probe = (
        "import sys\n"
        "from twin.policies import build_admission, build_queue_policy\n"
        "build_admission({'kind': 'composite', 'policies': [{'kind': 'token_bucket'}, {'kind': 'retry_budget'}]},"
        " seed=1)\n"
        "build_queue_policy({'kind': 'token_aware'}, seed=1)\n"
        "bad = ('numpy', 'simpy', 'pandas', 'streamlit', 'twin.models')\n"
        "print(','.join(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in bad))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
    done = subprocess.run([sys.executable, "-c", "import numpy\n" + probe], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert "numpy" in done.stdout.strip().split(",")  # the probe can fail


# ------------------------------------------------------------------------------------------- properties
RUN = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
arrivals = st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 600), st.sampled_from(("a", "b")),
                              st.integers(1, 3), st.sampled_from(("acme", "globex"))), min_size=1, max_size=60)


def _requests(steps: list[tuple[float, int, str, int, str]]) -> list[tuple[float, AdmissionRequest]]:
    out, t = [], 0.0
    for i, (dt, tokens, user, attempt, tenant) in enumerate(steps):
        t += dt
        out.append((t, AdmissionRequest(request_id=f"q{i}", user_id=user, tenant=tenant, tier="paid",
                                        prompt_tokens=tokens // 3, expected_output_tokens=tokens - tokens // 3,
                                        is_retry=attempt > 1, attempt=attempt)))
    return out


@RUN
@given(arrivals, st.floats(0.0, 500.0), st.floats(1.0, 2000.0))
def test_bucket_never_admits_more_than_burst_plus_rate_times_elapsed(steps: Any, rate: float,
                                                                     burst: float) -> None:
    p = bucket(rate=rate, burst=burst)
    admitted: dict[str, list[tuple[float, int]]] = {"a": [], "b": []}
    for t, r in _requests(steps):
        if p.admit(r, t).admitted:
            admitted[r.user_id].append((t, r.total_tokens))
    for log in admitted.values():
        for i in range(len(log)):
            total = 0
            for j in range(i, len(log)):
                total += log[j][1]
                assert total <= burst + rate * (log[j][0] - log[i][0]) + (j - i + 1) * TOKEN_EPS


CONFIGS: list[dict[str, Any]] = [
    {"kind": "allow_all"},
    {"kind": "token_bucket", "tokens_per_s": 100.0, "burst_tokens": 800.0},
    {"kind": "tenant_quota", "tokens_per_minute": 3000},
    {"kind": "retry_budget", "ratio": 0.3, "min_retries_per_window": 1, "window_s": 2.0},
    {"kind": "composite", "policies": [
        {"kind": "retry_budget", "ratio": 0.3, "min_retries_per_window": 1, "window_s": 2.0},
        {"kind": "token_bucket", "tokens_per_s": 100.0, "burst_tokens": 800.0},
        {"kind": "tenant_quota", "tokens_per_minute": 3000}]},
]
KNOWN_REASONS = {USER_RATE_LIMITED, REQUEST_EXCEEDS_BURST, TENANT_QUOTA_EXCEEDED, REQUEST_EXCEEDS_QUOTA,
                 RETRY_BUDGET_EXHAUSTED}


def _run(config: dict[str, Any], reqs: list[tuple[float, AdmissionRequest]], *, seed: int,
         complete: bool) -> list[AdmissionDecision]:
    p = build_admission(config, seed=seed)
    out = []
    for t, r in reqs:
        d = p.admit(r, t)
        out.append(d)
        if complete and d.admitted and len(r.request_id) % 2:
            p.on_completed(r.request_id, r.total_tokens // 2, t)
    return out


@RUN
@given(arrivals, st.booleans())
@pytest.mark.parametrize("config", CONFIGS, ids=[c["kind"] for c in CONFIGS])
def test_every_attempt_gets_one_well_formed_decision_deterministically(config: dict[str, Any], steps: Any,
                                                                       complete: bool) -> None:
    reqs = _requests(steps)
    decisions = _run(config, reqs, seed=1, complete=complete)
    assert len(decisions) == len(reqs)
    admitted = sum(d.admitted for d in decisions)
    rejected = sum(not d.admitted and d.reason in KNOWN_REASONS for d in decisions)
    assert admitted + rejected == len(reqs)
    for d in decisions:
        assert d.admitted or d.retry_after_s is None or d.retry_after_s >= 0.0
    assert _run(config, reqs, seed=1, complete=complete) == decisions  # same sequence, same decisions
    assert _run(config, reqs, seed=99, complete=complete) == decisions  # no built-in policy is random


@RUN
@given(arrivals)
def test_composite_children_see_exactly_the_admitted_requests(steps: Any) -> None:
    """A child fed only what the composite admitted admits all of it: rejected attempts consumed nothing."""
    composite = CONFIGS[-1]
    reqs = _requests(steps)
    decisions = _run(composite, reqs, seed=0, complete=False)
    kept = [(t, r) for (t, r), d in zip(reqs, decisions, strict=True) if d.admitted]
    for child in composite["policies"]:
        assert all(d.admitted for d in _run(child, kept, seed=0, complete=False))


@RUN
@given(arrivals)
def test_retry_after_is_a_time_at_which_the_rejecting_policy_admits(steps: Any) -> None:
    for config in CONFIGS[1:4]:
        reqs = _requests(steps)
        p = build_admission(config, seed=0)
        for t, r in reqs:
            d = p.admit(r, t)
            if not d.admitted and d.retry_after_s is not None:
                later = build_admission(config, seed=0)  # replay the same history, then ask at the retry time
                for t2, r2 in reqs:
                    if r2 is r:
                        break
                    later.admit(r2, t2)
                if d.retry_after_s > 1e-3:
                    assert not later.check(r, t + d.retry_after_s - 1e-3).admitted, (config, d)
                assert later.check(r, t + d.retry_after_s).admitted, (config, d)
