"""Scenario sections for faults: scheduled faults, fault rates, and failover timing."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReplicaCrash(_Model):
    """Replicas matching ``replica`` (a glob over scopes, e.g. ``fleet.us-east.*.r0``) crash: live streams drop."""

    kind: Literal["replica_crash"]
    at_s: NonNegFloat
    replica: str
    count: Annotated[int, Field(ge=1)] = 1  # the first ``count`` matches, in scope order
    recover: bool = True


class NodeLoss(_Model):
    """Every replica on the matching nodes crashes (a whole 8-GPU host)."""

    kind: Literal["node_loss"]
    at_s: NonNegFloat
    node: str  # glob over node scopes, e.g. fleet.us-east.large-default-n0000
    count: Annotated[int, Field(ge=1)] = 1
    recover: bool = True


class XidSlowdown(_Model):
    """A GPU Xid fault: the node's replicas run ``factor`` times slower; no health signal changes."""

    kind: Literal["xid_slowdown"]
    at_s: NonNegFloat
    node: str
    count: Annotated[int, Field(ge=1)] = 1
    factor: Annotated[float, Field(ge=1.0, le=100.0)] = 2.0
    until_s: PosFloat | None = None


class RegionLoss(_Model):
    """A region loses its GPUs; DNS/anycast moves its users after the failover delay."""

    kind: Literal["region_loss"]
    at_s: NonNegFloat
    region: str
    recover_at_s: PosFloat | None = None


class SlowNetwork(_Model):
    """Requests steered to ``region`` pay ``extra_latency_s`` at the gateway (each way, once per attempt)."""

    kind: Literal["slow_network"]
    at_s: NonNegFloat
    region: str
    extra_latency_s: PosFloat = 0.2
    until_s: PosFloat | None = None


FaultConfig = Annotated[ReplicaCrash | NodeLoss | XidSlowdown | RegionLoss | SlowNetwork, Field(discriminator="kind")]


class FaultRates(_Model):
    """Faults drawn at random (Poisson per replica), from the named stream ``failures.<kind>``."""

    replica_crash_per_replica_hour: NonNegFloat = 0.0
    xid_per_node_hour: NonNegFloat = 0.0


class FailoverConfig(_Model):
    dns_failover_s: NonNegFloat = 30.0  # until then users homed in a lost region cannot reach it
    recover_after_s: NonNegFloat = 120.0  # a crashed replica (not a lost region) comes back after this
    warmup_s: NonNegFloat = 60.0  # loading weights and warming up before it serves again
