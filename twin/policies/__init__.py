"""Pure routing decision logic shared by the twin and production routers.

Imports no simpy, pandas, streamlit or ``twin.models`` (a test checks this in a fresh interpreter).
See ``docs/policies.md`` for the contract.
"""

from twin.policies.admission import (
    ADMISSION_CONFIG,
    ADMISSIONS,
    AdmissionConfig,
    AdmissionDecision,
    AdmissionParams,
    AdmissionPolicy,
    AdmissionRequest,
    BaseAdmission,
    build_admission,
    parse_admission_config,
)
from twin.policies.cache_aware import ApproxPrefixIndex
from twin.policies.config import ROUTER_CONFIG, RouterConfig, build_router, parse_router_config
from twin.policies.eligibility import LONG_CONTEXT_POOL, candidate_replicas, eligible_replicas, is_eligible
from twin.policies.prng import SplitMix64
from twin.policies.queueing import (
    QUEUE_CONFIG,
    QUEUES,
    BaseQueuePolicy,
    QueueConfig,
    QueueDecision,
    QueueItem,
    QueueParams,
    QueuePolicy,
    QueueSnapshot,
    build_queue_policy,
    parse_queue_config,
)
from twin.policies.routing import NO_ELIGIBLE_REPLICA, ROUTERS, BaseRouter, RouterParams
from twin.policies.types import ReplicaSnapshot, RequestFacts, RouterPolicy, RoutingDecision

__all__ = [
    "ADMISSIONS",
    "ADMISSION_CONFIG",
    "LONG_CONTEXT_POOL",
    "NO_ELIGIBLE_REPLICA",
    "QUEUES",
    "QUEUE_CONFIG",
    "ROUTERS",
    "ROUTER_CONFIG",
    "AdmissionConfig",
    "AdmissionDecision",
    "AdmissionParams",
    "AdmissionPolicy",
    "AdmissionRequest",
    "ApproxPrefixIndex",
    "BaseAdmission",
    "BaseQueuePolicy",
    "BaseRouter",
    "QueueConfig",
    "QueueDecision",
    "QueueItem",
    "QueueParams",
    "QueuePolicy",
    "QueueSnapshot",
    "ReplicaSnapshot",
    "RequestFacts",
    "RouterConfig",
    "RouterParams",
    "RouterPolicy",
    "RoutingDecision",
    "SplitMix64",
    "build_admission",
    "build_queue_policy",
    "build_router",
    "candidate_replicas",
    "eligible_replicas",
    "is_eligible",
    "parse_admission_config",
    "parse_queue_config",
    "parse_router_config",
]
