"""Autoscaling decisions: how many replicas to add or remove, and how much new traffic to burst out.

The host (the twin's SimPy fleet, or a production controller) measures :class:`ScalingSignals`, asks an
autoscaler from :data:`AUTOSCALERS` for a :class:`ScalingDecision` and applies it: it starts ``add``
replicas (which sit in provisioning until ready), drains ``remove`` ready replicas, and sends
``burst_share`` of new requests to the external API provider. Autoscalers keep only their own history
(the time of their last action); ``now_s`` is given and must not go back. Pure Python, no I/O, no
randomness. See ``docs/policies.md`` ("Autoscaling").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from twin.policies.family import MonotoneClock, PolicyBase, PolicyFamily, PolicyParams
from twin.registry import Registry


@dataclass(frozen=True, slots=True)
class ScalingSignals:
    """The fleet as the autoscaler sees it at one evaluation.

    ``token_backlog``: queued prompt + expected output tokens. ``queue_eta_s``: the queue's ETA for a
    newly queued request. ``replicas_ready`` serve traffic; ``replicas_provisioning`` were asked for and
    are not ready yet. ``drain_tokens_per_s``: the fleet's recent completion rate (the load it is
    keeping up with). ``gpu_utilization`` (0..1, fraction of time a step is running) is here only for
    the known-bad ``gpu_utilization`` baseline: with continuous batching it reads ~1.0 at almost any load.
    """

    now_s: float
    token_backlog: int
    queue_eta_s: float
    replicas_ready: int
    replicas_provisioning: int
    gpu_utilization: float
    drain_tokens_per_s: float

    def __post_init__(self) -> None:
        if min(self.token_backlog, self.replicas_ready, self.replicas_provisioning) < 0:
            raise ValueError("token_backlog and replica counts must be >= 0")
        if not self.queue_eta_s >= 0.0 or not self.drain_tokens_per_s >= 0.0:
            raise ValueError("queue_eta_s and drain_tokens_per_s must be >= 0")
        if not 0.0 <= self.gpu_utilization <= 1.0:
            raise ValueError(f"gpu_utilization must be in [0, 1], got {self.gpu_utilization}")

    @property
    def replicas_total(self) -> int:
        """Ready plus provisioning: what the fleet will have without a new decision."""
        return self.replicas_ready + self.replicas_provisioning


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """Start ``add`` replicas, drain ``remove`` ready ones (never both), and send ``burst_share`` (0..1)
    of new requests to the external API provider. ``reason`` is for logs."""

    add: int
    remove: int
    burst_share: float
    reason: str

    def __post_init__(self) -> None:
        if self.add < 0 or self.remove < 0 or (self.add and self.remove):
            raise ValueError(f"add and remove must be >= 0 and not both set: {self.add}, {self.remove}")
        if not 0.0 <= self.burst_share <= 1.0:
            raise ValueError(f"burst_share must be in [0, 1], got {self.burst_share}")


class AutoscalerParams(PolicyParams):
    """Base of every autoscaler's params: frozen, and a typo is an error; ``min_replicas <= max_replicas`` where a
    policy has both."""

    @model_validator(mode="after")
    def _replica_bounds(self) -> AutoscalerParams:
        lo, hi = getattr(self, "min_replicas", None), getattr(self, "max_replicas", None)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_replicas ({lo}) > max_replicas ({hi})")
        return self


class BaseAutoscaler(MonotoneClock, PolicyBase[AutoscalerParams]):
    """Shared skeleton: params type check, the monotone clock guard and the time of the last action."""

    Params: ClassVar[type[AutoscalerParams]]

    def __init__(self, params: AutoscalerParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._last_action_s = -math.inf

    def _cooled(self, now_s: float, cooldown_s: float) -> bool:
        return now_s - self._last_action_s >= cooldown_s

    def _act(self, decision: ScalingDecision, now_s: float) -> ScalingDecision:
        if decision.add or decision.remove:
            self._last_action_s = now_s
        return decision

    def evaluate(self, signals: ScalingSignals) -> ScalingDecision:
        raise NotImplementedError


AUTOSCALERS: Registry[type[BaseAutoscaler]] = Registry("autoscaler")


# --------------------------------------------------------------------------------------------- backlog
class BacklogParams(AutoscalerParams):
    kind: Literal["backlog"] = "backlog"
    target_queue_eta_s: float = Field(10.0, gt=0.0, description="clear the backlog within this long")
    tokens_per_replica_per_s: float = Field(2000.0, gt=0.0, description="one replica's drain capacity")
    max_replicas: int = Field(64, ge=1, description="cap on reserved capacity")
    min_replicas: int = Field(1, ge=0)
    scale_down_eta_s: float = Field(1.0, ge=0.0, description="scale down only while queue_eta_s is below")
    cooldown_s: float = Field(300.0, ge=0.0, description="between a scaling action and a scale-down")
    burst_when_capped: bool = Field(True, description="send the excess to the external API at the cap")
    burst_max_share: float = Field(0.5, ge=0.0, le=1.0, description="most new traffic ever burst out")


@AUTOSCALERS.register("backlog")
class BacklogAutoscaler(BaseAutoscaler):
    """Scale on the work waiting, not on how busy the GPUs look.

    ``desired = ceil((token_backlog / target_queue_eta_s + drain_tokens_per_s) / tokens_per_replica_per_s)``:
    enough replicas to keep up with the load being served and clear the backlog within the target ETA.
    Replicas still provisioning count as capacity, so a burst of evaluations while they boot does not
    ask again for the same replicas. ``target = clamp(desired, min_replicas, max_replicas)``.

    * Up: ``add = target - (ready + provisioning)`` whenever positive, at once (no cooldown: counting
      provisioning replicas is what prevents overshoot).
    * Down: ``remove = (ready + provisioning) - target`` ready replicas, only while nothing is
      provisioning, ``queue_eta_s < scale_down_eta_s``, and ``cooldown_s`` has passed since the last
      action (up or down), so a brief lull does not hand back replicas a surge will want again.
    * Burst: when ``desired > max_replicas`` and ``burst_when_capped``, ``burst_share = min(burst_max_share,
      (desired - max_replicas) / desired)``: the share of the needed capacity the cap cannot give.
    """

    Params = BacklogParams
    params: BacklogParams

    def desired_replicas(self, signals: ScalingSignals) -> int:
        """Replicas needed for the signals, before the min/max clamp."""
        p = self.params
        need_per_s = signals.token_backlog / p.target_queue_eta_s + signals.drain_tokens_per_s
        return math.ceil(need_per_s / p.tokens_per_replica_per_s - 1e-9)

    def evaluate(self, signals: ScalingSignals) -> ScalingDecision:
        self._tick(signals.now_s)
        p, now = self.params, signals.now_s
        desired = self.desired_replicas(signals)
        target = min(p.max_replicas, max(p.min_replicas, desired))
        total = signals.replicas_total
        burst = 0.0
        if p.burst_when_capped and desired > p.max_replicas:
            burst = min(p.burst_max_share, (desired - p.max_replicas) / desired)
        why = f"desired {desired} (target {target}), have {signals.replicas_ready}+{signals.replicas_provisioning}"
        if burst > 0.0:
            why += f"; capped at {p.max_replicas}, burst {burst:.2f}"
        if target > total:
            return self._act(ScalingDecision(target - total, 0, burst, f"up: {why}"), now)
        if target < total:
            if signals.replicas_provisioning:
                return ScalingDecision(0, 0, burst, f"hold: {why}; replicas still provisioning")
            if not signals.queue_eta_s < p.scale_down_eta_s:
                return ScalingDecision(0, 0, burst, f"hold: {why}; queue_eta_s {signals.queue_eta_s:.1f} "
                                                    f">= {p.scale_down_eta_s:g}")
            if not self._cooled(now, p.cooldown_s):
                return ScalingDecision(0, 0, burst, f"hold: {why}; cooldown until "
                                                    f"{self._last_action_s + p.cooldown_s:.1f} s")
            return self._act(ScalingDecision(0, min(total - target, signals.replicas_ready), burst,
                                             f"down: {why}"), now)
        return ScalingDecision(0, 0, burst, f"hold: {why}")


# ------------------------------------------------------------------------------------- gpu utilization
class GpuUtilizationParams(AutoscalerParams):
    kind: Literal["gpu_utilization"] = "gpu_utilization"
    target_utilization: float = Field(0.7, gt=0.0, le=1.0)
    max_replicas: int = Field(64, ge=1)
    min_replicas: int = Field(1, ge=0)
    cooldown_s: float = Field(300.0, ge=0.0, description="between two scaling actions")


@AUTOSCALERS.register("gpu_utilization")
class GpuUtilizationAutoscaler(BaseAutoscaler):
    """The known-bad baseline: a Kubernetes-HPA-style rule on GPU utilisation.

    ``target = clamp(ceil(total * gpu_utilization / target_utilization), min_replicas, max_replicas)``
    with ``total = ready + provisioning``, applied at most once per ``cooldown_s``. It scales up whenever
    utilisation is above the target. With continuous batching an engine runs a step whenever anything
    is in flight, so utilisation reads ~1.0 at almost any load: every cooldown the fleet grows by
    ``1 / target_utilization`` until it sits at ``max_replicas``, at light load as at peak, and it never
    scales down. It never bursts.
    """

    Params = GpuUtilizationParams
    params: GpuUtilizationParams

    def evaluate(self, signals: ScalingSignals) -> ScalingDecision:
        self._tick(signals.now_s)
        p, now, total = self.params, signals.now_s, signals.replicas_total
        target = min(p.max_replicas, max(p.min_replicas,
                                         math.ceil(total * signals.gpu_utilization / p.target_utilization - 1e-9)))
        if signals.gpu_utilization > p.target_utilization and total < p.max_replicas:
            target = max(target, total + 1)  # above target always asks for more (also from 0 replicas)
        why = f"utilization {signals.gpu_utilization:.2f} vs {p.target_utilization:g}, target {target}, have {total}"
        if target == total:
            return ScalingDecision(0, 0, 0.0, f"hold: {why}")
        if not self._cooled(now, p.cooldown_s):
            return ScalingDecision(0, 0, 0.0, f"hold: {why}; cooldown until {self._last_action_s + p.cooldown_s:.1f} s")
        if target > total:
            return self._act(ScalingDecision(target - total, 0, 0.0, f"up: {why}"), now)
        remove = min(total - target, signals.replicas_ready)
        if remove == 0:
            return ScalingDecision(0, 0, 0.0, f"hold: {why}; nothing ready to remove")
        return self._act(ScalingDecision(0, remove, 0.0, f"down: {why}"), now)


# ---------------------------------------------------------------------------------------------- config
AUTOSCALER_FAMILY: PolicyFamily[AutoscalerParams, BaseAutoscaler] = PolicyFamily(
    AUTOSCALERS, AutoscalerParams, title="AutoscalerConfig")

AutoscalerConfig = AUTOSCALER_FAMILY.config_type
"""Embed as a field type in the scenario schema: ``autoscaler: AutoscalerConfig``."""

AUTOSCALER_CONFIG = AUTOSCALER_FAMILY.adapter
parse_autoscaler_config = AUTOSCALER_FAMILY.parse
"""Validate a ``{kind: <key>, ...params}`` mapping into its frozen params model."""
build_autoscaler = AUTOSCALER_FAMILY.build
"""A fresh autoscaler from its config (``seed`` is passed on; no built-in autoscaler is random)."""
