"""Pure routing decision logic shared by the twin and production routers.

Imports no simpy, pandas, streamlit or ``twin.models`` (a test checks this in a fresh interpreter).
See ``docs/policies.md`` for the contract.
"""

from twin.policies.cache_aware import ApproxPrefixIndex
from twin.policies.config import ROUTER_CONFIG, RouterConfig, build_router, parse_router_config
from twin.policies.eligibility import LONG_CONTEXT_POOL, candidate_replicas, eligible_replicas, is_eligible
from twin.policies.prng import SplitMix64
from twin.policies.routing import NO_ELIGIBLE_REPLICA, ROUTERS, BaseRouter, RouterParams
from twin.policies.types import ReplicaSnapshot, RequestFacts, RouterPolicy, RoutingDecision

__all__ = [
    "LONG_CONTEXT_POOL",
    "NO_ELIGIBLE_REPLICA",
    "ROUTERS",
    "ROUTER_CONFIG",
    "ApproxPrefixIndex",
    "BaseRouter",
    "ReplicaSnapshot",
    "RequestFacts",
    "RouterConfig",
    "RouterParams",
    "RouterPolicy",
    "RoutingDecision",
    "SplitMix64",
    "build_router",
    "candidate_replicas",
    "eligible_replicas",
    "is_eligible",
    "parse_router_config",
]
