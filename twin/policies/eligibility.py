"""The one eligibility rule every router applies before choosing.

Hard constraints (never relaxed): the replica is healthy, serves the request's model, lies inside the
request's residency constraint, and its ``max_model_len`` fits prompt + expected output.

Then two steering preferences, each applied only when it leaves at least one replica, so that a
request is refused (``None``) exactly when no replica meets the hard constraints:

1. a request that needs long context goes to the long-context pool when that pool has an eligible
   replica (the other half of the rule, keeping short requests off that pool, is the
   ``long_context_pool`` router);
2. a request steered to a region stays in that region when the region has a candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from twin.policies.types import ReplicaSnapshot, RequestFacts

LONG_CONTEXT_POOL = "long_context"
_REPLICA_ID = attrgetter("replica_id")


def is_eligible(request: RequestFacts, replica: ReplicaSnapshot) -> bool:
    """The hard constraints for one replica."""
    if not replica.healthy or replica.model != request.model:
        return False
    if request.allowed_regions is not None and replica.region not in request.allowed_regions:
        return False
    return replica.max_model_len >= request.total_tokens


def eligible_replicas(request: RequestFacts, replicas: Sequence[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
    """Replicas meeting the hard constraints, sorted by ``replica_id`` (the tie-break order)."""
    # is_eligible inlined into one comprehension: this runs over every replica for every decision
    model, regions, need = request.model, request.allowed_regions, request.total_tokens
    if regions is None:
        out = [r for r in replicas if r.healthy and r.model == model and r.max_model_len >= need]
    else:
        out = [r for r in replicas
               if r.healthy and r.model == model and r.region in regions and r.max_model_len >= need]
    out.sort(key=_REPLICA_ID)
    return out


def candidate_replicas(
    request: RequestFacts,
    replicas: Sequence[ReplicaSnapshot],
    *,
    long_context_pool: str = LONG_CONTEXT_POOL,
) -> list[ReplicaSnapshot]:
    """Eligible replicas after the steering preferences; empty exactly when none is eligible."""
    region = request.region
    if region is not None and not request.needs_long_context:
        # The usual case, cheaper: the eligible replicas of the steered region are the eligible replicas
        # of all that lie there, so test the region first (one cheap test per replica) and sort only
        # there; the whole fleet is checked only when that region has none. This is
        # eligible_replicas(request, [r for r in replicas if r.region == region]) in one pass: for a
        # replica in ``region``, "its region is allowed" is "``region`` is allowed".
        regions = request.allowed_regions
        if regions is None or region in regions:
            model, need = request.model, request.total_tokens
            local = [r for r in replicas if r.region == region and r.healthy and r.model == model
                     and r.max_model_len >= need]
            if local:
                local.sort(key=_REPLICA_ID)
                return local
    out = eligible_replicas(request, replicas)
    if request.needs_long_context:
        in_pool = [r for r in out if r.pool == long_context_pool]
        if in_pool:
            out = in_pool
    if region is not None:
        local = [r for r in out if r.region == region]
        if local:
            out = local
    return out
