"""``RouterConfig`` (the scenario's router section) and ``build_router``.

``RouterConfig`` is a pydantic discriminated union over every registered router's params model, built
from :data:`ROUTERS`, so adding a router touches only the module that defines it (plus its import
below). An unknown ``kind`` fails validation with a did-you-mean and the list of known kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Union

from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter

from twin.policies import cache_aware, long_context, routing  # noqa: F401  (registers the routers)
from twin.policies.routing import ROUTERS, BaseRouter, RouterParams


def _check_kind(value: Any) -> Any:
    if isinstance(value, Mapping):
        if "kind" not in value:
            raise ValueError(f"a router needs a 'kind' (known: {', '.join(ROUTERS.keys())})")
        if value["kind"] not in ROUTERS:
            raise ValueError(ROUTERS.unknown_message(str(value["kind"])))
    return value


_PARAMS: tuple[type[RouterParams], ...] = tuple(ROUTERS.get(k).Params for k in ROUTERS.keys())

RouterConfig = Annotated[
    Union[_PARAMS],  # type: ignore[valid-type]  # noqa: UP007  (built from the registry)
    Field(discriminator="kind"),
    BeforeValidator(_check_kind),
]
"""Embed as a field type in the scenario schema: ``router: RouterConfig``."""

long_context.LongContextPoolParams.model_rebuild(_types_namespace={"RouterConfig": RouterConfig})

ROUTER_CONFIG: TypeAdapter[RouterParams] = TypeAdapter(RouterConfig, config=ConfigDict(title="RouterConfig"))


def parse_router_config(config: Mapping[str, Any] | RouterParams) -> RouterParams:
    """Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
    if isinstance(config, RouterParams):
        return config
    return ROUTER_CONFIG.validate_python(config)


def build_router(config: Mapping[str, Any] | RouterParams, *, seed: int) -> BaseRouter:
    """A fresh router from its config; ``seed`` drives its pseudo-random choices (if any)."""
    params = parse_router_config(config)
    return ROUTERS.get(params.kind)(params, seed=seed)
