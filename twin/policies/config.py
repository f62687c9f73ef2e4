"""``RouterConfig`` (the scenario's router section) and ``build_router``.

``RouterConfig`` is a pydantic discriminated union over every registered router's params model, built
from :data:`ROUTERS` by :class:`~twin.policies.family.PolicyFamily`, so adding a router touches only the
module that defines it (plus its import below). An unknown ``kind`` fails validation with a did-you-mean
and the list of known kinds.
"""

from __future__ import annotations

from twin.policies import cache_aware, long_context, routing  # noqa: F401  (registers the routers)
from twin.policies.family import PolicyFamily
from twin.policies.routing import ROUTERS, BaseRouter, RouterParams

ROUTER_FAMILY: PolicyFamily[RouterParams, BaseRouter] = PolicyFamily(
    ROUTERS, RouterParams, title="RouterConfig", rebuild=[long_context.LongContextPoolParams])

RouterConfig = ROUTER_FAMILY.config_type
"""Embed as a field type in the scenario schema: ``router: RouterConfig``."""

ROUTER_CONFIG = ROUTER_FAMILY.adapter
parse_router_config = ROUTER_FAMILY.parse
"""Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
build_router = ROUTER_FAMILY.build
"""A fresh router from its config; ``seed`` drives its pseudo-random choices (if any)."""
