"""Gateway admission policies: per-user token buckets, per-tenant quotas, a retry budget, composites.

Every policy is registered in :data:`ADMISSIONS` (the request and decision types, bases and registry live in
``twin.policies.admission_base`` and are re-exported here) under its snake_case key with a frozen pydantic
``Params`` model (``kind`` = the key); :data:`AdmissionConfig` is the discriminated union over them and
:func:`build_admission` builds one. Pure Python: no clock (``now_s`` is given and must not go back), no
I/O, no randomness (the seed is taken for a uniform constructor). See ``docs/policies.md``.

Two-phase contract: ``check`` decides without consuming anything and ``commit`` consumes; ``admit`` is
``check`` then, when admitted, ``commit``. A composite checks its children in order and commits all of
them only when every child admits, so a request rejected by one child consumes nothing from any other.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The common parts live in admission_base and are re-exported here (AdmissionPolicy, for instance, is not used below):
# a production gateway imports every admission name from this module.
from twin.policies.admission_base import (  # noqa: F401
    ADMISSIONS,
    ADMIT,
    REQUEST_EXCEEDS_BURST,
    REQUEST_EXCEEDS_QUOTA,
    RETRY_BUDGET_EXHAUSTED,
    TENANT_QUOTA_EXCEEDED,
    TIME_EPS_S,
    TOKEN_EPS,
    USER_RATE_LIMITED,
    AdmissionDecision,
    AdmissionParams,
    AdmissionPolicy,
    AdmissionRequest,
    BaseAdmission,
    SweepSchedule,
)
from twin.policies.family import PolicyFamily
from twin.policies.prng import mix64, stable_hash_str


# ------------------------------------------------------------------------------------------- allow all
class AllowAllParams(AdmissionParams):
    kind: Literal["allow_all"] = "allow_all"


@ADMISSIONS.register("allow_all")
class AllowAllAdmission(BaseAdmission):
    """Admits every request; ``on_completed`` does nothing."""

    Params = AllowAllParams


# ---------------------------------------------------------------------------------------- token bucket
class BucketLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens_per_s: float = Field(ge=0.0, description="refill rate (0: the burst is all a user ever gets)")
    burst_tokens: float = Field(gt=0.0, description="bucket size; a new user starts with a full bucket")


class TokenBucketParams(AdmissionParams):
    kind: Literal["token_bucket"] = "token_bucket"
    tokens_per_s: float = Field(2000.0, ge=0.0, description="refill rate per user")
    burst_tokens: float = Field(64000.0, gt=0.0, description="bucket size per user")
    tier_overrides: dict[Literal["free", "paid", "enterprise"], BucketLimits] = Field(
        default_factory=dict, description="limits for users of these tiers instead of the defaults")
    true_up: bool = Field(True, description="on completion, refund (or charge) actual - charged tokens")


@dataclass(slots=True)
class _Bucket:
    level: float
    t_s: float
    tier: str


@ADMISSIONS.register("token_bucket")
class TokenBucketAdmission(BaseAdmission):
    """One bucket per ``user_id`` holding up to ``burst_tokens``, refilled at ``tokens_per_s``.

    An attempt costs prompt + expected output tokens and is admitted when the bucket holds that many.
    A rejection's ``retry_after_s`` is ``(cost - level) / tokens_per_s``: exactly when the bucket will
    hold enough. A cost above ``burst_tokens`` can never pass (``request_exceeds_burst``, no retry
    time). Limits follow the attempt's tier (``tier_overrides``), so a user who changes tier keeps the
    level, capped at the new burst. ``on_completed`` (``true_up``) adds back ``charged - actual``: a
    refund when the reply was shorter than expected (capped at burst), a debt (negative level, which
    delays the user's next attempts) when it was longer.
    """

    Params = TokenBucketParams
    params: TokenBucketParams

    def __init__(self, params: AdmissionParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._buckets: dict[str, _Bucket] = {}
        self._charged: dict[str, tuple[str, str, int]] = {}  # request_id -> (user_id, tier, tokens)
        self._sweeps = SweepSchedule()

    def limits(self, tier: str) -> tuple[float, float]:
        """``(tokens_per_s, burst_tokens)`` for a tier."""
        over = self.params.tier_overrides.get(tier)  # type: ignore[call-overload]
        if over is not None:
            return over.tokens_per_s, over.burst_tokens
        return self.params.tokens_per_s, self.params.burst_tokens

    def level(self, user_id: str, tier: str, now_s: float) -> float:
        """Tokens in ``user_id``'s bucket at ``now_s`` (a new user's bucket is full)."""
        return self._level(user_id, *self.limits(tier), now_s)

    def _level(self, user_id: str, rate: float, burst: float, now_s: float) -> float:
        """:meth:`level` with the tier's limits already looked up (the gateway asks ~3 times per turn)."""
        b = self._buckets.get(user_id)
        if b is None:
            return burst
        return min(burst, b.level + (now_s - b.t_s) * rate)

    def check(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision:
        self._tick(now_s)
        rate, burst = self.limits(req.tier)
        cost = req.prompt_tokens + req.expected_output_tokens  # req.total_tokens
        if cost > burst:
            return AdmissionDecision(False, REQUEST_EXCEEDS_BURST)
        level = self._level(req.user_id, rate, burst, now_s)
        if level + TOKEN_EPS >= cost:
            return ADMIT
        return AdmissionDecision(False, USER_RATE_LIMITED, (cost - level) / rate if rate > 0 else None)

    def commit(self, req: AdmissionRequest, now_s: float) -> None:
        self._tick(now_s)
        level = self._level(req.user_id, *self.limits(req.tier), now_s)
        self._set(req.user_id, req.tier, level - (req.prompt_tokens + req.expected_output_tokens), now_s)
        if self.params.true_up:
            self._charged[req.request_id] = (req.user_id, req.tier, req.total_tokens)
        if self._sweeps.commit():
            self._prune(now_s)
            self._sweeps.swept(len(self._buckets))

    def on_completed(self, request_id: str, actual_tokens: int, now_s: float) -> None:
        self._tick(now_s)
        charged = self._charged.pop(request_id, None)
        if charged is None:
            return
        user_id, tier, tokens = charged
        rate, burst = self.limits(tier)
        self._set(user_id, tier, min(burst, self._level(user_id, rate, burst, now_s) + tokens - actual_tokens), now_s)

    def _set(self, user_id: str, tier: str, level: float, now_s: float) -> None:
        b = self._buckets.get(user_id)
        if b is None:
            self._buckets[user_id] = _Bucket(level, now_s, tier)
        else:
            b.level, b.t_s, b.tier = level, now_s, tier

    def _prune(self, now_s: float) -> None:
        """Forget buckets that are full again under their last tier's limits: such a bucket is the same
        as a fresh one (except that a user coming back on a bigger tier then starts full)."""
        # level(u, tier) >= burst with each tier's limits looked up once: one pass per 4,096 commits over every
        # user the gateway remembers
        full = []
        tier_limits: dict[str, tuple[float, float]] = {}
        for u, b in self._buckets.items():
            lim = tier_limits.get(b.tier)
            if lim is None:
                lim = tier_limits[b.tier] = self.limits(b.tier)
            rate, burst = lim
            if self._level(u, rate, burst, now_s) >= burst:
                full.append(u)
        for user_id in full:
            del self._buckets[user_id]


# ---------------------------------------------------------------------------------------- tenant quota
class TenantQuotaParams(AdmissionParams):
    kind: Literal["tenant_quota"] = "tenant_quota"
    tokens_per_minute: int = Field(1_000_000, ge=1, description="per tenant, over a sliding 60 s window")
    tenant_overrides: dict[str, int] = Field(default_factory=dict, description="tenant -> tokens per minute")
    true_up: bool = Field(True, description="on completion, count actual tokens instead of the charge")

    @model_validator(mode="after")
    def _positive(self) -> TenantQuotaParams:
        bad = sorted(t for t, v in self.tenant_overrides.items() if v < 1)
        if bad:
            raise ValueError(f"tenant_overrides must be >= 1 tokens per minute: {bad}")
        return self


@dataclass(slots=True)
class _Entry:
    t_s: float
    tokens: int
    tenant: str
    request_id: str


@dataclass(slots=True)
class _Window:
    log: deque[_Entry]
    used: int


@ADMISSIONS.register("tenant_quota")
class TenantQuotaAdmission(BaseAdmission):
    """Per-tenant tokens per minute over a **sliding** 60 s window (a log of admitted attempts).

    Sliding rather than fixed so a tenant cannot pass twice its quota across a minute boundary. An
    attempt is admitted when the tokens its tenant was charged in ``(now_s - 60, now_s]`` plus its own
    cost fit the quota. A rejection's ``retry_after_s`` is when enough of the oldest entries will have
    left the window (an entry charged at ``t`` leaves at ``t + 60``). A cost above the quota can never
    pass (``request_exceeds_quota``). ``on_completed`` (``true_up``) replaces the entry's charge with the
    actual tokens, at its original time, if it is still in the window.
    """

    Params = TenantQuotaParams
    params: TenantQuotaParams
    window_s: ClassVar[float] = 60.0

    def __init__(self, params: AdmissionParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._windows: dict[str, _Window] = {}
        self._entries: dict[str, _Entry] = {}
        self._sweeps = SweepSchedule()

    def quota(self, tenant: str) -> int:
        return self.params.tenant_overrides.get(tenant, self.params.tokens_per_minute)

    def used(self, tenant: str, now_s: float) -> int:
        """Tokens charged to ``tenant`` in the window ending at ``now_s``."""
        w = self._expire(tenant, now_s)
        return 0 if w is None else w.used

    def check(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision:
        self._tick(now_s)
        quota, cost = self.quota(req.tenant), req.total_tokens
        if cost > quota:
            return AdmissionDecision(False, REQUEST_EXCEEDS_QUOTA)
        w = self._expire(req.tenant, now_s)
        if w is None or w.used + cost <= quota:
            return ADMIT
        need, freed = w.used + cost - quota, 0
        for e in w.log:
            freed += e.tokens
            if freed >= need:
                return AdmissionDecision(False, TENANT_QUOTA_EXCEEDED, max(0.0, e.t_s + self.window_s - now_s))
        raise AssertionError("a cost within quota always fits an empty window")  # pragma: no cover

    def commit(self, req: AdmissionRequest, now_s: float) -> None:
        self._tick(now_s)
        w = self._expire(req.tenant, now_s) or self._windows.setdefault(req.tenant, _Window(deque(), 0))
        entry = _Entry(now_s, req.total_tokens, req.tenant, req.request_id)
        w.log.append(entry)
        w.used += entry.tokens
        if self.params.true_up:
            self._entries[req.request_id] = entry
        if self._sweeps.commit():
            for tenant in list(self._windows):
                self._expire(tenant, now_s)
            self._sweeps.swept(len(self._windows))

    def on_completed(self, request_id: str, actual_tokens: int, now_s: float) -> None:
        self._tick(now_s)
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        w = self._windows[entry.tenant]
        w.used += actual_tokens - entry.tokens
        entry.tokens = actual_tokens

    def _expire(self, tenant: str, now_s: float) -> _Window | None:
        w = self._windows.get(tenant)
        if w is None:
            return None
        while w.log and now_s - w.log[0].t_s >= self.window_s - TIME_EPS_S:
            e = w.log.popleft()
            w.used -= e.tokens
            if self._entries.get(e.request_id) is e:
                del self._entries[e.request_id]
        if not w.log:
            del self._windows[tenant]
            return None
        return w


# ---------------------------------------------------------------------------------------- retry budget
class RetryBudgetParams(AdmissionParams):
    kind: Literal["retry_budget"] = "retry_budget"
    ratio: float = Field(0.2, ge=0.0, description="retries allowed per first attempt in the window")
    min_retries_per_window: int = Field(10, ge=0, description="retries allowed in any window regardless")
    window_s: float = Field(10.0, gt=0.0, description="sliding window length")
    scope: Literal["global", "tenant", "user"] = Field("global", description="one budget per gateway, "
                                                       "tenant or user")


@ADMISSIONS.register("retry_budget")
class RetryBudgetAdmission(BaseAdmission):
    """A Finagle / Envoy style retry budget: first attempts always pass and deposit; a retry passes
    only while, counting it, retries in the sliding window stay within ``min_retries_per_window +
    ratio * first_attempts`` in that window. So under an outage retries add at most ``ratio`` load
    (plus the floor) instead of multiplying it. Only admitted attempts count. A rejection's
    ``retry_after_s`` is when, as old attempts leave the window and nothing new arrives, a retry would
    fit (None when it never would: a zero floor with no first attempts). ``on_completed`` does nothing.
    """

    Params = RetryBudgetParams
    params: RetryBudgetParams

    def __init__(self, params: AdmissionParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._firsts: dict[str, deque[float]] = {}
        self._retries: dict[str, deque[float]] = {}
        self._sweeps = SweepSchedule()

    def _key(self, req: AdmissionRequest) -> str:
        scope = self.params.scope
        return "" if scope == "global" else req.tenant if scope == "tenant" else req.user_id

    def _fits(self, retries: int, firsts: int) -> bool:
        return retries + 1 <= self.params.min_retries_per_window + self.params.ratio * firsts + 1e-9

    def counts(self, key: str, now_s: float) -> tuple[int, int]:
        """``(first_attempts, retries)`` in the window ending at ``now_s`` for a scope key."""
        firsts, retries = self._expire(key, now_s)
        return len(firsts), len(retries)

    def check(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision:
        self._tick(now_s)
        if not req.is_retry:
            return ADMIT
        firsts, retries = self._expire(self._key(req), now_s)
        if self._fits(len(retries), len(firsts)):
            return ADMIT
        w = self.params.window_s
        nf, nr, i, j = len(firsts), len(retries), 0, 0
        while i < len(firsts) or j < len(retries):  # replay expiries in time order
            t = min(firsts[i] if i < len(firsts) else math.inf, retries[j] if j < len(retries) else math.inf)
            while i < len(firsts) and firsts[i] <= t:
                i, nf = i + 1, nf - 1
            while j < len(retries) and retries[j] <= t:
                j, nr = j + 1, nr - 1
            if self._fits(nr, nf):
                return AdmissionDecision(False, RETRY_BUDGET_EXHAUSTED, max(0.0, t + w - now_s))
        return AdmissionDecision(False, RETRY_BUDGET_EXHAUSTED)

    def commit(self, req: AdmissionRequest, now_s: float) -> None:
        self._tick(now_s)
        key = self._key(req)
        store = self._retries if req.is_retry else self._firsts
        q = store.get(key)
        if q is None:
            q = store[key] = deque()
        q.append(now_s)
        if self._sweeps.commit():
            for k in sorted(set(self._firsts) | set(self._retries)):
                self._expire(k, now_s)
            self._sweeps.swept(len(self._firsts.keys() | self._retries.keys()))

    def _expire(self, key: str, now_s: float) -> tuple[deque[float], deque[float]]:
        edge = self.params.window_s - TIME_EPS_S
        out = []
        for store in (self._firsts, self._retries):
            q = store.get(key)
            while q and now_s - q[0] >= edge:
                q.popleft()
            if q is not None and not q:
                del store[key]
            out.append(q or deque())
        return out[0], out[1]


# ------------------------------------------------------------------------------------------- composite
class CompositeParams(AdmissionParams):
    kind: Literal["composite"] = "composite"
    policies: list[AdmissionConfig] = Field(min_length=1, description="applied in order; first rejection wins")


@ADMISSIONS.register("composite")
class CompositeAdmission(BaseAdmission):
    """Children checked in order; the first rejection is the decision (its reason and retry time) and
    nothing is committed anywhere; when all admit, all commit. ``on_completed`` goes to every child."""

    Params = CompositeParams
    params: CompositeParams

    def __init__(self, params: AdmissionParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self.children = [build_admission(p, seed=mix64(seed ^ stable_hash_str(f"composite.{i}")))
                         for i, p in enumerate(self.params.policies)]

    def check(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision:
        self._tick(now_s)
        for child in self.children:
            decision = child.check(req, now_s)
            if not decision.admitted:
                return decision
        return ADMIT

    def commit(self, req: AdmissionRequest, now_s: float) -> None:
        self._tick(now_s)
        for child in self.children:
            child.commit(req, now_s)

    def on_completed(self, request_id: str, actual_tokens: int, now_s: float) -> None:
        self._tick(now_s)
        for child in self.children:
            child.on_completed(request_id, actual_tokens, now_s)


# ---------------------------------------------------------------------------------------------- config
ADMISSION_FAMILY: PolicyFamily[AdmissionParams, BaseAdmission] = PolicyFamily(
    ADMISSIONS, AdmissionParams, title="AdmissionConfig", rebuild=[CompositeParams])

AdmissionConfig = ADMISSION_FAMILY.config_type
"""Embed as a field type in the scenario schema: ``admission: AdmissionConfig``."""

ADMISSION_CONFIG = ADMISSION_FAMILY.adapter
parse_admission_config = ADMISSION_FAMILY.parse
"""Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
build_admission = ADMISSION_FAMILY.build
"""A fresh admission policy from its config (``seed`` is passed on; no built-in policy is random)."""
