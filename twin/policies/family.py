"""What every family of pluggable policies shares: the ``{kind: <key>, ...params}`` config and the
base-class skeleton.

A family (routers, admission, queue, ladder, autoscaling, canary) is a :class:`~twin.registry.Registry`
of policy classes, each carrying a frozen pydantic ``Params`` model whose ``kind`` is its key.
:class:`PolicyFamily` turns the registry into the discriminated union a scenario embeds, its
``TypeAdapter``, ``parse`` and ``build``; :class:`PolicyBase` and :class:`MonotoneClock` are the
constructor check and the clock guard the base classes used to repeat. Pure Python plus pydantic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

from twin.registry import Registry


class PolicyParams(BaseModel):
    """Base of every family's params base: frozen, a typo is an error, ``kind`` is the registry key."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str


P = TypeVar("P", bound=PolicyParams)


class PolicyBase(Generic[P]):
    """Shared constructor: ``params`` must be the class's own ``Params`` model; ``seed`` is kept."""

    Params: ClassVar[type[PolicyParams]]
    params: P

    def __init__(self, params: P, *, seed: int) -> None:
        if not isinstance(params, self.Params):
            raise TypeError(f"{type(self).__name__} needs {self.Params.__name__}, got {type(params).__name__}")
        self.params = params
        self.seed = seed


class MonotoneClock:
    """Mixin for a policy given ``now_s`` at each call: ``_tick(now_s)`` raises when time goes back."""

    _now_s: float = -math.inf

    def _tick(self, now_s: float) -> None:
        if now_s < self._now_s:
            raise ValueError(f"{type(self).__name__}: time went back from {self._now_s} to {now_s}")
        self._now_s = now_s


B = TypeVar("B", bound=PolicyBase[Any])


class PolicyFamily(Generic[P, B]):
    """The config side of one family, built from its registry once every member is registered.

    ``config_type``: ``Annotated[Union[<every Params>], Field(discriminator="kind"), <kind check>]``, to
    embed as a field type; a missing or unknown ``kind`` fails with the known keys (and a did-you-mean).
    ``adapter``: its ``TypeAdapter``, titled ``title`` when it is a real union (a single model keeps its
    own title). ``rebuild``: params models that refer to the config type by the name ``title`` (a
    composite of the same family), rebuilt before the adapter is made.
    """

    def __init__(self, registry: Registry[type[B]], base: type[P], *, title: str,
                 rebuild: Iterable[type[BaseModel]] = ()) -> None:
        self.registry = registry
        self.base = base
        family = registry.family
        self.noun = f"{'an' if family[:1] in 'aeiou' else 'a'} {family}"
        params = tuple(registry.get(k).Params for k in registry.keys())
        self.config_type: Any = Annotated[
            Union[params],  # type: ignore[valid-type]  # noqa: UP007  (built from the registry)
            Field(discriminator="kind"),
            BeforeValidator(self._check_kind),
        ]
        for model in rebuild:
            model.model_rebuild(_types_namespace={title: self.config_type})
        config = ConfigDict(title=title) if len(params) > 1 else None
        self.adapter: TypeAdapter[P] = TypeAdapter(self.config_type, config=config)

    def _check_kind(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            if "kind" not in value:
                raise ValueError(f"{self.noun} needs a 'kind' (known: {', '.join(self.registry.keys())})")
            if value["kind"] not in self.registry:
                raise ValueError(self.registry.unknown_message(str(value["kind"])))
        return value

    def parse(self, config: Mapping[str, Any] | P) -> P:
        """Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model (a params model
        of this family passes through)."""
        if isinstance(config, self.base):
            return config
        return self.adapter.validate_python(config)

    def build(self, config: Mapping[str, Any] | P, *, seed: int) -> B:
        """A fresh policy of the class registered under the config's ``kind``; ``seed`` is passed on."""
        params = self.parse(config)
        return self.registry.get(params.kind)(params, seed=seed)
