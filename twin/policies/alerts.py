"""Alert rules with Prometheus-style ``for`` semantics, evaluated on metric values the host supplies.

The host (the twin's metrics process, or a real evaluator loop) calls :meth:`AlertEvaluator.evaluate`
with the current value of every metric it knows and ``now_s`` (never going back); the evaluator returns
the alerts that fired or cleared at that evaluation. Pure Python, no clock, no I/O.
See ``docs/policies.md`` ("Alerts").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FIRED = "fired"
CLEARED = "cleared"


class AlertRule(BaseModel):
    """``metric op threshold`` held continuously for ``for_s`` seconds fires the alert ``name``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1)
    metric: str = Field(min_length=1)
    op: Literal[">", "<"]
    threshold: float
    for_s: float = Field(0.0, ge=0.0)

    def holds(self, value: float | None) -> bool:
        """Whether the condition holds for ``value`` (a missing or NaN value never holds)."""
        if value is None or math.isnan(value):
            return False
        return value > self.threshold if self.op == ">" else value < self.threshold


@dataclass(frozen=True, slots=True)
class AlertTransition:
    """An alert that fired or cleared at ``t_s``. ``value`` is the metric's value then (None: absent);
    ``active_since_s`` is when the condition started holding."""

    name: str
    state: str
    t_s: float
    value: float | None
    active_since_s: float

    def __post_init__(self) -> None:
        if self.state not in (FIRED, CLEARED):
            raise ValueError(f"state must be {FIRED!r} or {CLEARED!r}, got {self.state!r}")


class AlertEvaluator:
    """Prometheus ``for`` semantics over discrete evaluations, per rule:

    * inactive -> pending at the first evaluation where the condition holds (``active_since_s = now_s``);
    * pending -> firing (a ``fired`` transition) at the first evaluation with ``now_s - active_since_s
      >= for_s`` while the condition has held at every evaluation since (``for_s = 0`` fires at once);
    * any evaluation where it does not hold resets a pending rule to inactive, and clears a firing one
      (a ``cleared`` transition). A metric missing from ``values``, None or NaN does not hold, as an
      absent series resolves a Prometheus alert.

    Transitions come out in rule order. Rule names must be distinct.
    """

    def __init__(self, rules: Sequence[AlertRule | Mapping[str, Any]]) -> None:
        self.rules: tuple[AlertRule, ...] = tuple(r if isinstance(r, AlertRule) else AlertRule.model_validate(r)
                                                  for r in rules)
        names = [r.name for r in self.rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"alert rule names must be distinct: {dupes}")
        self._since: dict[str, float] = {}  # name -> active_since_s, for pending and firing rules
        self._firing: set[str] = set()
        self._now_s = -math.inf

    @property
    def firing(self) -> tuple[str, ...]:
        """Names of the firing alerts, in rule order."""
        return tuple(r.name for r in self.rules if r.name in self._firing)

    @property
    def pending(self) -> tuple[str, ...]:
        """Names of the rules whose condition holds but not yet for ``for_s``, in rule order."""
        return tuple(r.name for r in self.rules if r.name in self._since and r.name not in self._firing)

    def evaluate(self, values: Mapping[str, float | None], now_s: float) -> tuple[AlertTransition, ...]:
        if now_s < self._now_s:
            raise ValueError(f"AlertEvaluator: time went back from {self._now_s} to {now_s}")
        self._now_s = now_s
        out: list[AlertTransition] = []
        for rule in self.rules:
            value = values.get(rule.metric)
            value = None if value is None else float(value)
            if rule.holds(value):
                since = self._since.setdefault(rule.name, now_s)
                if rule.name not in self._firing and now_s - since >= rule.for_s:
                    self._firing.add(rule.name)
                    out.append(AlertTransition(rule.name, FIRED, now_s, value, since))
            else:
                since = self._since.pop(rule.name, None)
                if rule.name in self._firing:
                    self._firing.discard(rule.name)
                    out.append(AlertTransition(rule.name, CLEARED, now_s, value, since if since is not None else now_s))
        return tuple(out)
