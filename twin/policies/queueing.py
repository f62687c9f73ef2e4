"""The token-aware request queue's decisions: accept or shed, priority, an honest ETA, expiry.

The queue component (SimPy in the twin, a real gateway in production) owns the waiting requests and
measures its drain rate; it hands a :class:`QueueSnapshot` and the arriving :class:`QueueItem` to a
policy from :data:`QUEUES`, which returns a :class:`QueueDecision`. Policies are stateless: the same
item and snapshot always give the same decision. See ``docs/policies.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

from pydantic import Field, field_validator

from twin.policies.family import PolicyBase, PolicyFamily, PolicyParams
from twin.policies.types import TIERS, check_request
from twin.registry import Registry

QUEUE_FULL = "queue_full"
DEADLINE_UNREACHABLE = "deadline_unreachable"


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """The queue as its component sees it when an item arrives (the item itself not included).

    ``queued_tokens`` is prompt + expected output of everything waiting; ``queued_by_priority`` splits
    it by priority class as ``(priority, tokens)`` pairs (one per class present, any order, summing to
    ``queued_tokens``). ``capacity_tokens`` is the component's own bound (None: unbounded).
    ``drain_tokens_per_s`` is the fleet's recent completion rate in tokens/s, an EWMA the component
    measures; ``in_flight_tokens`` is what has left the queue and not yet completed.
    """

    now_s: float
    queued_tokens: int
    capacity_tokens: int | None
    queued_by_priority: tuple[tuple[int, int], ...]
    drain_tokens_per_s: float
    in_flight_tokens: int

    def __post_init__(self) -> None:
        if min(self.queued_tokens, self.in_flight_tokens) < 0 or not self.drain_tokens_per_s >= 0.0:
            raise ValueError("token counts and drain rate must be >= 0")
        if self.capacity_tokens is not None and self.capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0 or None")
        if not self.queued_by_priority:  # an empty queue: the usual case
            if self.queued_tokens != 0:
                raise ValueError("queued_by_priority must sum to queued_tokens")
            return
        # one pass over the (few) classes: a snapshot is built for every offered request
        seen: set[int] = set()
        total = 0
        for p, t in self.queued_by_priority:
            if p in seen or t < 0:
                raise ValueError(
                    f"queued_by_priority needs distinct classes and tokens >= 0: {self.queued_by_priority}")
            seen.add(p)
            total += t
        if total != self.queued_tokens:
            raise ValueError("queued_by_priority must sum to queued_tokens")

    def tokens_at_or_above(self, priority: int) -> int:
        """Queued tokens in classes served no later than ``priority`` (its own class included)."""
        total = 0  # a loop, not sum() over a generator: called for every offered request
        for p, t in self.queued_by_priority:
            if p <= priority:
                total += t
        return total


@dataclass(frozen=True, slots=True)
class QueueItem:
    """One request asking to wait. ``deadline_s`` is absolute: the latest time it may still leave the
    queue usefully (None: no deadline)."""

    request_id: str
    tier: str
    tenant: str
    prompt_tokens: int
    expected_output_tokens: int
    deadline_s: float | None
    arrival_s: float

    def __post_init__(self) -> None:
        check_request(self.tier, self.prompt_tokens, self.expected_output_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.expected_output_tokens


@dataclass(frozen=True, slots=True)
class QueueDecision:
    """Accept or not (``reason`` says why not), the item's priority class (lower is served first) and
    its ETA in seconds until it leaves the queue (``math.inf`` when nothing drains)."""

    accept: bool
    reason: str | None
    priority: int
    eta_s: float

    def __post_init__(self) -> None:
        if self.accept == (self.reason is not None):
            raise ValueError("a rejection needs a reason and an acceptance has none")
        if not self.eta_s >= 0.0:
            raise ValueError(f"eta_s must be >= 0, got {self.eta_s}")


def eta_s(tokens_ahead: int, drain_tokens_per_s: float) -> float:
    """``tokens_ahead / drain``; 0 when nothing is ahead, ``math.inf`` when something is and drain is 0."""
    if tokens_ahead <= 0:
        return 0.0
    return tokens_ahead / drain_tokens_per_s if drain_tokens_per_s > 0 else math.inf


@runtime_checkable
class QueuePolicy(Protocol):
    """What a queue policy offers its component."""

    capacity_tokens: int | None

    def decide(self, item: QueueItem, snapshot: QueueSnapshot) -> QueueDecision: ...

    def expired(self, item: QueueItem, now_s: float) -> bool: ...


class QueueParams(PolicyParams):
    """Base of every queue policy's params model: frozen, and a typo is an error."""


class BaseQueuePolicy(PolicyBase[QueueParams]):
    Params: ClassVar[type[QueueParams]]
    capacity_tokens: int | None = None

    def decide(self, item: QueueItem, snapshot: QueueSnapshot) -> QueueDecision:
        raise NotImplementedError

    def expired(self, item: QueueItem, now_s: float) -> bool:
        raise NotImplementedError


QUEUES: Registry[type[BaseQueuePolicy]] = Registry("queue policy")


# -------------------------------------------------------------------------------------- fifo unbounded
class FifoUnboundedParams(QueueParams):
    kind: Literal["fifo_unbounded"] = "fifo_unbounded"


@QUEUES.register("fifo_unbounded")
class FifoUnboundedQueue(BaseQueuePolicy):
    """The baseline: accepts everything (ignoring any component bound), one class (priority 0), never
    expires an item (clients still give up on their own timeouts). ETA = all queued tokens / drain."""

    Params = FifoUnboundedParams

    def decide(self, item: QueueItem, snapshot: QueueSnapshot) -> QueueDecision:
        return QueueDecision(True, None, 0, eta_s(snapshot.queued_tokens, snapshot.drain_tokens_per_s))

    def expired(self, item: QueueItem, now_s: float) -> bool:
        return False


# ------------------------------------------------------------------------------------------ token aware
class TokenAwareParams(QueueParams):
    kind: Literal["token_aware"] = "token_aware"
    capacity_tokens: int = Field(2_000_000, ge=0, description="bound on queued prompt + expected output")
    tier_priorities: dict[str, int] = Field(
        default_factory=lambda: {"enterprise": 0, "paid": 1, "free": 2},
        description="tier -> priority class, lower is served first; every tier needs one")
    reject_if_eta_exceeds_deadline: bool = Field(True, description="shed items that would miss their deadline")
    min_drain_tokens_per_s: float = Field(0.0, ge=0.0, description="floor under the measured drain for the ETA")

    @field_validator("tier_priorities")
    @classmethod
    def _every_tier(cls, v: dict[str, int]) -> dict[str, int]:
        missing, unknown = sorted(set(TIERS) - set(v)), sorted(set(v) - set(TIERS))
        if missing or unknown:
            raise ValueError(f"tier_priorities needs exactly the tiers {sorted(TIERS)}; missing {missing}, "
                             f"unknown {unknown}")
        return v


@QUEUES.register("token_aware")
class TokenAwareQueue(BaseQueuePolicy):
    """Bounded by tokens, prioritised by tier, shedding what cannot make its deadline.

    * **Bound**: accepted only if ``queued_tokens + item tokens <= bound``, where bound is
      ``capacity_tokens`` (or the snapshot's, if smaller); else ``queue_full``.
    * **Priority**: ``tier_priorities[item.tier]``; classes are served in order, FIFO within a class.
    * **ETA**: ``tokens_at_or_above(priority) / max(drain_tokens_per_s, min_drain_tokens_per_s)``:
      the tokens that leave the queue before this item, at the measured drain rate. 0 when nothing is
      ahead; ``inf`` when something is and the (floored) drain is 0. It is optimistic for lower classes:
      higher-priority arrivals after this one will also go first.
    * **Deadline**: with ``reject_if_eta_exceeds_deadline``, an item whose ``now_s + eta_s`` is past its
      deadline is shed as ``deadline_unreachable`` (checked before the bound).
    * **Expiry**: an item with a deadline is expired once ``now_s >= deadline_s``.
    """

    Params = TokenAwareParams
    params: TokenAwareParams

    def __init__(self, params: QueueParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self.capacity_tokens = self.params.capacity_tokens

    def priority(self, tier: str) -> int:
        return self.params.tier_priorities[tier]

    def decide(self, item: QueueItem, snapshot: QueueSnapshot) -> QueueDecision:
        priority = self.priority(item.tier)
        drain = max(snapshot.drain_tokens_per_s, self.params.min_drain_tokens_per_s)
        eta = eta_s(snapshot.tokens_at_or_above(priority), drain)
        if (self.params.reject_if_eta_exceeds_deadline and item.deadline_s is not None
                and snapshot.now_s + eta > item.deadline_s):
            return QueueDecision(False, DEADLINE_UNREACHABLE, priority, eta)
        bound = self.params.capacity_tokens
        if snapshot.capacity_tokens is not None:
            bound = min(bound, snapshot.capacity_tokens)
        if snapshot.queued_tokens + item.total_tokens > bound:
            return QueueDecision(False, QUEUE_FULL, priority, eta)
        return QueueDecision(True, None, priority, eta)

    def expired(self, item: QueueItem, now_s: float) -> bool:
        return item.deadline_s is not None and now_s >= item.deadline_s


# ---------------------------------------------------------------------------------------------- config
QUEUE_FAMILY: PolicyFamily[QueueParams, BaseQueuePolicy] = PolicyFamily(QUEUES, QueueParams, title="QueueConfig")

QueueConfig = QUEUE_FAMILY.config_type
"""Embed as a field type in the scenario schema: ``queue: QueueConfig``."""

QUEUE_CONFIG = QUEUE_FAMILY.adapter
parse_queue_config = QUEUE_FAMILY.parse
"""Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
build_queue_policy = QUEUE_FAMILY.build
"""A fresh queue policy from its config (``seed`` is passed on; no built-in policy is random)."""
