"""The admission policies' common parts: the request and decision types, the protocol, the params and class
bases, the reasons and the registry (``twin.policies.admission`` holds the policies and re-exports all of this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from twin.policies.family import MonotoneClock, PolicyBase, PolicyParams
from twin.policies.types import check_request
from twin.registry import Registry

USER_RATE_LIMITED = "user_rate_limited"
REQUEST_EXCEEDS_BURST = "request_exceeds_burst"
TENANT_QUOTA_EXCEEDED = "tenant_quota_exceeded"
REQUEST_EXCEEDS_QUOTA = "request_exceeds_quota"
RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"

TOKEN_EPS = 1e-6
"""Tokens of slack when comparing a refilled (float) bucket with a cost, so that retrying exactly
``retry_after_s`` later succeeds despite float rounding. Negligible next to whole tokens."""
TIME_EPS_S = 1e-9
"""An entry of a sliding window leaves it once ``now_s - t_s >= window_s - TIME_EPS_S``."""
_PRUNE_EVERY = 4096  # the fewest commits between sweeps that drop state equal to a fresh one


class SweepSchedule:
    """When a policy sweeps its per-key state (users, tenants) for entries equal to fresh ones: after as many
    commits as entries the last sweep left, and at least ``_PRUNE_EVERY``. A sweep visits every entry, so a
    fixed period made its cost per commit grow with the keys remembered (per user, with the fleet and the
    run's length); this keeps it bounded (entries visited at most about twice the commits)."""

    __slots__ = ("commits", "next")

    def __init__(self) -> None:
        self.commits = 0
        self.next = _PRUNE_EVERY

    def commit(self) -> bool:
        """Count a commit; True when a sweep is due now (then call ``swept``)."""
        self.commits += 1
        return self.commits >= self.next

    def swept(self, left: int) -> None:
        """A sweep has run and left ``left`` entries."""
        self.next = self.commits + max(_PRUNE_EVERY, left)


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What the gateway knows about one attempt when it arrives.

    ``attempt`` counts from 1 (the first attempt); ``is_retry`` is true exactly when ``attempt > 1``.
    """

    request_id: str
    user_id: str
    tenant: str
    tier: str
    prompt_tokens: int
    expected_output_tokens: int
    is_retry: bool
    attempt: int

    def __post_init__(self) -> None:
        check_request(self.tier, self.prompt_tokens, self.expected_output_tokens)
        if self.attempt < 1:
            raise ValueError(f"attempt counts from 1, got {self.attempt}")
        if self.is_retry != (self.attempt > 1):
            raise ValueError(f"is_retry={self.is_retry} contradicts attempt={self.attempt}")

    @property
    def total_tokens(self) -> int:
        """Prompt plus expected output: what admission charges for the attempt."""
        return self.prompt_tokens + self.expected_output_tokens


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """Admitted or not, why not, and after how many seconds (from ``now_s``) a retry can succeed.

    ``retry_after_s`` is a delay, like HTTP ``Retry-After``: the earliest time the rejecting policy
    would admit the same request if nothing else arrived meanwhile. None when admitted, or when waiting
    cannot help (the request is larger than the bucket or quota, or nothing will ever refill).
    """

    admitted: bool
    reason: str | None = None
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        if self.admitted and (self.reason is not None or self.retry_after_s is not None):
            raise ValueError("an admitted decision carries no reason and no retry_after_s")
        if not self.admitted and not self.reason:
            raise ValueError("a rejection needs a reason")
        if self.retry_after_s is not None and not self.retry_after_s >= 0.0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")


ADMIT = AdmissionDecision(True)


@runtime_checkable
class AdmissionPolicy(Protocol):
    """What an admission policy offers the gateway. ``on_completed`` is called once per admitted
    request when it ends (any outcome) with the tokens it really used (prompt + generated)."""

    def admit(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision: ...

    def on_completed(self, request_id: str, actual_tokens: int, now_s: float) -> None: ...


class AdmissionParams(PolicyParams):
    """Base of every admission policy's params model: frozen, and a typo is an error."""


class BaseAdmission(MonotoneClock, PolicyBase[AdmissionParams]):
    """Shared skeleton: params type check, the monotone clock guard and ``admit = check + commit``."""

    Params: ClassVar[type[AdmissionParams]]

    def admit(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision:
        decision = self.check(req, now_s)
        if decision.admitted:
            self.commit(req, now_s)
        return decision

    def check(self, req: AdmissionRequest, now_s: float) -> AdmissionDecision:
        """Decide without consuming anything (state may only advance with time)."""
        self._tick(now_s)
        return ADMIT

    def commit(self, req: AdmissionRequest, now_s: float) -> None:
        """Consume what an admitted ``req`` costs; call only after ``check`` admitted it at ``now_s``."""
        self._tick(now_s)

    def on_completed(self, request_id: str, actual_tokens: int, now_s: float) -> None:
        """True-up hook; default: nothing. Unknown request ids are ignored."""
        self._tick(now_s)


ADMISSIONS: Registry[type[BaseAdmission]] = Registry("admission policy")
