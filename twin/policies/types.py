"""Value types a routing policy reads and returns, and the protocol every router implements.

These are the hot-path types: plain frozen, slotted dataclasses (not pydantic), built once per request
or per scrape by whoever hosts the policy (the twin's SimPy router, or a production router).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Tier = Literal["free", "paid", "enterprise"]
TIERS: tuple[str, ...] = ("free", "paid", "enterprise")


def check_request(tier: str, prompt_tokens: int, expected_output_tokens: int) -> None:
    """The checks every request-shaped value type makes (routing facts, admission requests, queue items)."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if prompt_tokens < 0 or expected_output_tokens < 0:
        raise ValueError("token counts must be >= 0")


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the router knows about one request when it must place it.

    ``block_hashes`` are the chained hashes of the prompt's *full* KV blocks, computed with the engine's
    block size (which policies that need it take as a parameter). ``region`` is where the gateway
    steered the user; ``allowed_regions`` is a hard data-residency constraint (None: anywhere).
    """

    request_id: str
    tenant: str
    tier: str
    session_id: str | None
    prompt_tokens: int
    expected_output_tokens: int
    block_hashes: tuple[int, ...]
    model: str
    region: str | None
    allowed_regions: tuple[str, ...] | None
    needs_long_context: bool

    def __post_init__(self) -> None:
        check_request(self.tier, self.prompt_tokens, self.expected_output_tokens)

    @property
    def total_tokens(self) -> int:
        """Prompt plus expected output: the context length the request will reach."""
        return self.prompt_tokens + self.expected_output_tokens


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One replica as the router sees it.

    ``num_running``, ``num_waiting`` and ``kv_usage`` are scraped from the engine's metrics endpoint at
    ``scraped_at_s`` and may be seconds old. ``outstanding_tokens`` is the router's own live count of
    prompt + expected output tokens it sent there and has not yet seen complete, so it is fresh.
    """

    replica_id: str
    region: str
    model: str
    pool: str
    healthy: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    outstanding_tokens: int
    max_model_len: int
    scraped_at_s: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if min(self.num_running, self.num_waiting, self.outstanding_tokens) < 0:
            raise ValueError("counts must be >= 0")

    @property
    def queue_depth(self) -> int:
        """Requests the engine holds (running + waiting), as last scraped."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where a request goes, and why.

    ``replica_id`` is None when no replica is eligible (the caller rejects or queues the request).
    ``scores`` optionally lists ``(replica_id, score)`` for every candidate considered, for logs and the
    dashboard; its meaning (higher-is-better score or lower-is-better cost) is stated in ``reason``.
    """

    replica_id: str | None
    reason: str
    scores: tuple[tuple[str, float], ...] = ()


class CandidateList(list):
    """A host's list of replica snapshots with a promise, for routers that keep per-list work.

    ``epoch`` is a number the host changes whenever the list's members, their order, or any field of a
    listed replica except ``outstanding_tokens`` may have changed (a real router knows when it scraped,
    marked a replica down or added one); epochs are never reused. ``removed`` names the replicas taken
    out since the epoch began (a real router knows which it stopped sending to), oldest first. Two lists
    with the same epoch are the list the epoch began with less their ``removed``, in the same order with the
    same scraped fields, and a later list's ``removed`` extends an earlier one's. So a router may keep what it
    derived from those fields (eligibility, scraped-signal scores) and update it as replicas leave; it must
    still read ``outstanding_tokens`` afresh. A plain list promises nothing, and a router that does not use
    the promise treats this as a plain list.
    """

    __slots__ = ("epoch", "removed")


@runtime_checkable
class RouterPolicy(Protocol):
    """What a router offers its host. Implementations get params and a seed in the constructor.

    Rules: ``route`` never reads a clock (``now_s`` is given), does no I/O, breaks ties explicitly, and
    only ever returns a replica that :func:`twin.policies.eligibility.eligible_replicas` admits. The host
    calls ``on_routed`` once the request is actually sent, and ``on_completed`` exactly once per routed
    request when it ends (success, error, timeout or replica crash), so the policy's own history stays
    true.
    """

    def route(self, request: RequestFacts, replicas: Sequence[ReplicaSnapshot], now_s: float) -> RoutingDecision: ...

    def on_routed(self, request: RequestFacts, replica_id: str, now_s: float) -> None: ...

    def on_completed(self, request_id: str, replica_id: str, now_s: float) -> None: ...
