"""Request routers: the registry, the shared base class and the load/affinity routers.

Every router is registered in :data:`ROUTERS` under its snake_case key and carries its pydantic
``Params`` model (``kind`` = the key). Cache-aware routers live in :mod:`twin.policies.cache_aware`, the
long-context rule in :mod:`twin.policies.long_context`; :mod:`twin.policies.config` builds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter
from typing import ClassVar, Literal

from pydantic import Field

from twin.policies.eligibility import candidate_replicas
from twin.policies.family import PolicyBase, PolicyParams
from twin.policies.prng import SplitMix64, combine_hashes, mix64, stable_hash_str
from twin.policies.types import ReplicaSnapshot, RequestFacts, RoutingDecision
from twin.registry import Registry

NO_ELIGIBLE_REPLICA = "no_eligible_replica"
_REPLICA_ID = attrgetter("replica_id")


class RouterParams(PolicyParams):
    """Base of every router's params model: frozen, and a typo is an error."""


class BaseRouter(PolicyBase[RouterParams]):
    """Shared skeleton: eligibility, the no-eligible case, and a guard on what ``_choose`` returns.

    Subclasses implement ``_choose(request, candidates, now_s)`` where ``candidates`` is non-empty,
    eligible, and sorted by ``replica_id``. The seed feeds the router's own :class:`SplitMix64`.
    """

    Params: ClassVar[type[RouterParams]]
    # ``route`` chooses among ``candidate_replicas(request, replicas)`` alone and looks at nothing else in
    # ``replicas`` but unhealthy snapshots (``_observe``). So a host that passes only healthy replicas may
    # pass, for a request that needs no long context and is steered to a region with an eligible
    # replica, only that region's replicas: the candidates, and so the decision, are the same, and the
    # router reads fewer snapshots. It must still pass each replica that went down at least once, so that
    # ``_observe`` sees it. A router that filters the replicas itself sets this False.
    chooses_from_candidates: ClassVar[bool] = True

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self.rng = SplitMix64(seed)
        # RoutingDecision.scores lists every candidate by default (for logs and the dashboard). A host
        # that never reads them calls omit_scores(); a router may then leave scores empty and choose
        # without scoring every candidate. The choice is the same either way.
        self.keep_scores = True

    def omit_scores(self) -> None:
        """The host never reads ``RoutingDecision.scores``: decisions may leave them empty (same choice)."""
        self.keep_scores = False

    def route(self, request: RequestFacts, replicas: Sequence[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        self._observe(replicas, now_s)
        candidates = candidate_replicas(request, replicas)
        if not candidates:
            return RoutingDecision(None, NO_ELIGIBLE_REPLICA)
        decision = self._choose(request, candidates, now_s)
        if decision.replica_id not in map(_REPLICA_ID, candidates):  # a scan in C, stops at the pick
            raise RuntimeError(f"{type(self).__name__} chose ineligible replica {decision.replica_id!r}")
        return decision

    def on_routed(self, request: RequestFacts, replica_id: str, now_s: float) -> None:
        """The request was sent to ``replica_id``; default: no history kept."""

    def on_completed(self, request_id: str, replica_id: str, now_s: float) -> None:
        """The request ended on ``replica_id`` (any outcome); default: no history kept."""

    def _observe(self, replicas: Sequence[ReplicaSnapshot], now_s: float) -> None:
        """See every snapshot (eligible or not) before choosing; default: nothing."""

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        raise NotImplementedError


ROUTERS: Registry[type[BaseRouter]] = Registry("router")


def rendezvous_order(key: int, candidates: Sequence[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
    """Candidates in highest-random-weight order for ``key`` (consistent hashing, rendezvous form).

    Removing a replica only moves the keys whose first choice it was; ties break by ``replica_id``.
    """
    return sorted(candidates, key=lambda r: (-mix64(key ^ stable_hash_str(r.replica_id)), r.replica_id))


def _least_outstanding(candidates: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
    return min(candidates, key=lambda r: (r.outstanding_tokens, r.replica_id))


# --------------------------------------------------------------------------------------------- round robin
class RoundRobinParams(RouterParams):
    kind: Literal["round_robin"] = "round_robin"


@ROUTERS.register("round_robin")
class RoundRobinRouter(BaseRouter):
    """Cycles through eligible replicas in ``replica_id`` order; a replica joining or leaving does not
    reset the cycle (the next pick is the first id after the last one chosen)."""

    Params = RoundRobinParams

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._last: str | None = None

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        pick = candidates[0]
        if self._last is not None:
            pick = next((c for c in candidates if c.replica_id > self._last), candidates[0])
        self._last = pick.replica_id
        return RoutingDecision(pick.replica_id, "round_robin")


# ------------------------------------------------------------------------------- least outstanding tokens
class LeastOutstandingTokensParams(RouterParams):
    kind: Literal["least_outstanding_tokens"] = "least_outstanding_tokens"


@ROUTERS.register("least_outstanding_tokens")
class LeastOutstandingTokensRouter(BaseRouter):
    """Picks the replica with the fewest tokens the router has in flight there (fresh, not scraped)."""

    Params = LeastOutstandingTokensParams

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        pick = _least_outstanding(candidates)
        scores = tuple((c.replica_id, float(c.outstanding_tokens)) for c in candidates)
        return RoutingDecision(pick.replica_id, "least_outstanding_tokens (score = tokens, lower wins)", scores)


# ------------------------------------------------------------------------------------------ power of two
class PowerOfTwoParams(RouterParams):
    kind: Literal["power_of_two"] = "power_of_two"


@ROUTERS.register("power_of_two")
class PowerOfTwoRouter(BaseRouter):
    """Samples two distinct eligible replicas and keeps the one with fewer outstanding tokens, then the
    shorter scraped queue, then the smaller ``replica_id``."""

    Params = PowerOfTwoParams

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        if len(candidates) == 1:
            return RoutingDecision(candidates[0].replica_id, "power_of_two (single candidate)")
        i, j = self.rng.sample2(len(candidates))
        a, b = candidates[i], candidates[j]
        pick = min((a, b), key=lambda r: (r.outstanding_tokens, r.queue_depth, r.replica_id))
        scores = ((a.replica_id, float(a.outstanding_tokens)), (b.replica_id, float(b.outstanding_tokens)))
        return RoutingDecision(pick.replica_id, "power_of_two (score = tokens, lower wins)", scores)


# --------------------------------------------------------------------------------------- session affinity
class SessionAffinityParams(RouterParams):
    kind: Literal["session_affinity"] = "session_affinity"


@ROUTERS.register("session_affinity")
class SessionAffinityRouter(BaseRouter):
    """Consistent hash of ``session_id`` over eligible replicas: a session sticks to one replica, and
    moves (alone) to its next choice when that replica is unhealthy or otherwise ineligible. Requests
    without a session go to the least outstanding tokens."""

    Params = SessionAffinityParams

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        if request.session_id is None:
            pick = _least_outstanding(candidates)
            return RoutingDecision(pick.replica_id, "session_affinity: no session, least tokens")
        order = rendezvous_order(stable_hash_str(request.session_id), candidates)
        return RoutingDecision(order[0].replica_id, "session_affinity")


# ---------------------------------------------------------------------------------------- prefix affinity
class PrefixAffinityParams(RouterParams):
    kind: Literal["prefix_affinity"] = "prefix_affinity"
    prefix_blocks: int = Field(4, ge=1, description="K: the key hashes the first K full prompt blocks")
    capacity_factor: float = Field(1.25, ge=1.0, description="c: no replica takes more than c x average load")


@ROUTERS.register("prefix_affinity")
class PrefixAffinityRouter(BaseRouter):
    """Consistent hashing with bounded loads (Mirrokni, Thorup & Zadimoghaddam, SODA 2018).

    The key hashes the first K block hashes (prompts with no full block hash their request id, as they
    share nothing). Replicas are tried in rendezvous order for the key and the first whose in-flight
    request count is below ``ceil(c * (m + 1) / n)`` wins, where m counts this router's in-flight
    requests on the n candidates. At least one replica always has room, so the result is never None
    while a replica is eligible. In-flight counts come from ``on_routed`` / ``on_completed``.
    """

    Params = PrefixAffinityParams
    params: PrefixAffinityParams

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._inflight: dict[str, int] = {}
        self._request_replica: dict[str, str] = {}

    def capacity(self, candidates: Sequence[ReplicaSnapshot]) -> int:
        """The per-replica in-flight bound for the next request."""
        m = sum(self._inflight.get(c.replica_id, 0) for c in candidates)
        return math.ceil(self.params.capacity_factor * (m + 1) / len(candidates) - 1e-9)

    def in_flight(self, replica_id: str) -> int:
        return self._inflight.get(replica_id, 0)

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        if request.block_hashes:
            key = combine_hashes(request.block_hashes[: self.params.prefix_blocks])
        else:
            key = stable_hash_str(request.request_id)
        cap = self.capacity(candidates)
        order = rendezvous_order(key, candidates)
        scores = tuple((c.replica_id, float(self.in_flight(c.replica_id))) for c in order)
        for rank, c in enumerate(order):
            if self.in_flight(c.replica_id) < cap:
                reason = "prefix_affinity" if rank == 0 else f"prefix_affinity: spilled to choice {rank + 1}"
                return RoutingDecision(c.replica_id, f"{reason} (capacity {cap})", scores)
        raise AssertionError("bounded-load invariant broken: no replica below capacity")  # pragma: no cover

    def on_routed(self, request: RequestFacts, replica_id: str, now_s: float) -> None:
        if request.request_id in self._request_replica:
            return
        self._request_replica[request.request_id] = replica_id
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1

    def on_completed(self, request_id: str, replica_id: str, now_s: float) -> None:
        where = self._request_replica.pop(request_id, None)
        if where is None:
            return
        left = self._inflight[where] - 1
        if left:
            self._inflight[where] = left
        else:
            del self._inflight[where]
