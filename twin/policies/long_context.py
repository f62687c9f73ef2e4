"""The long-context pool rule: a router that reserves the ``long_context`` pool and delegates the pick.

Shared eligibility already sends a request that needs long context to that pool when the pool has an
eligible replica; this rule adds the other half, keeping ordinary requests off the pool so its KV room
is there when a long prompt arrives. The pick within the allowed set is the inner router's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from twin.policies.eligibility import LONG_CONTEXT_POOL, eligible_replicas
from twin.policies.prng import mix64, stable_hash_str
from twin.policies.routing import ROUTERS, BaseRouter, LeastOutstandingTokensParams, RouterParams
from twin.policies.types import ReplicaSnapshot, RequestFacts, RoutingDecision

if TYPE_CHECKING:
    from twin.policies.config import RouterConfig


class LongContextPoolParams(RouterParams):
    kind: Literal["long_context_pool"] = "long_context_pool"
    inner: RouterConfig = Field(default_factory=LeastOutstandingTokensParams,
                                description="the router that picks within the allowed replicas")
    spill_short_to_long_pool: bool = Field(
        True, description="let an ordinary request use the long-context pool when nothing else is eligible")


@ROUTERS.register("long_context_pool")
class LongContextPoolRouter(BaseRouter):
    """Long-context requests: the ``long_context`` pool when it has an eligible replica, else any
    replica long enough. Other requests: replicas outside that pool; when none is eligible, the pool
    (``spill_short_to_long_pool``) or no replica."""

    Params = LongContextPoolParams
    params: LongContextPoolParams
    chooses_from_candidates = False  # it filters the replicas by pool before its inner router sees them

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        from twin.policies.config import build_router  # config imports this module to build the union

        self.inner = build_router(self.params.inner, seed=mix64(seed ^ stable_hash_str("long_context_pool.inner")))

    def omit_scores(self) -> None:
        super().omit_scores()
        self.inner.omit_scores()

    def route(self, request: RequestFacts, replicas: Sequence[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        if request.needs_long_context:
            allowed, note = replicas, "long request"
        else:
            allowed = [r for r in replicas if r.pool != LONG_CONTEXT_POOL]
            note = "short request, long-context pool reserved"
            if self.params.spill_short_to_long_pool and not eligible_replicas(request, allowed):
                allowed, note = replicas, "short request spilled to long-context pool"
        d = self.inner.route(request, allowed, now_s)
        if d.replica_id is None and not eligible_replicas(request, replicas):
            return d
        return RoutingDecision(d.replica_id, f"{d.reason} [{note}]", d.scores)

    def on_routed(self, request: RequestFacts, replica_id: str, now_s: float) -> None:
        self.inner.on_routed(request, replica_id, now_s)

    def on_completed(self, request_id: str, replica_id: str, now_s: float) -> None:
        self.inner.on_completed(request_id, replica_id, now_s)
