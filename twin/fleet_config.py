"""Scenario sections of the fleet world: topology, traffic, client, gateway, conversations, queue, router.

Part of the scenario schema (``twin.scenario`` embeds ``FleetScenarioConfig``); split out to keep each
module in its room. Frozen pydantic models, ``extra="forbid"``, defaults here only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from twin.engine_settings import EngineSettings
from twin.failures.config import FailoverConfig, FaultConfig, FaultRates
from twin.models.traces import TraceWorkload
from twin.policies import RouterConfig
from twin.policies.admission import AdmissionConfig
from twin.policies.alerts import AlertRule
from twin.policies.autoscaling import AutoscalerConfig
from twin.policies.canary import CanaryConfig
from twin.policies.ladder import LadderConfig
from twin.policies.queueing import QueueConfig as QueuePolicyConfig


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Tier = Literal["free", "paid", "enterprise"]


# ---- topology -------------------------------------------------------------------------------------
class ModelTierConfig(_Model):
    """One served model: its profile (hardware, TP, step times) and engine settings."""

    profile: str
    engine: EngineSettings = EngineSettings()
    max_context_tokens: PosInt | None = None  # capability: longest prompt+output it serves (default: max_model_len)
    supports_tools: bool = True


class PoolConfig(_Model):
    model: str
    nodes: PosInt
    pool: str = "default"  # "default", "long_context", ...
    max_model_len: PosInt | None = None  # override the model's engine max_model_len in this pool


class RegionConfig(_Model):
    name: str
    share: Fraction = 1.0  # share of users steered here by DNS/anycast (normalised over regions)
    pools: list[PoolConfig]


class TopologyConfig(_Model):
    gpus_per_node: PosInt = 8
    regions: list[RegionConfig]
    scrape_interval_s: PosFloat = 1.0  # how stale the router's replica signals may be

    @model_validator(mode="after")
    def _names(self) -> TopologyConfig:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError("region names must be unique")
        if not self.regions:
            raise ValueError("at least one region is needed")
        return self


# ---- traffic --------------------------------------------------------------------------------------
class DiurnalConfig(_Model):
    """Rate shape over the day: exp(k·cos(2π(h − peak_hour)/24)) / I0(k), mean 1, peak/mean = peak_factor."""

    peak_factor: Annotated[float, Field(ge=1.0, le=20.0)] = 3.0
    peak_hour: Annotated[float, Field(ge=0.0, lt=24.0)] = 14.0


class SurgeConfig(_Model):
    """A scheduled surge: rate × multiplier, ramped linearly over ``ramp_s`` from ``start_s``."""

    start_s: NonNegFloat
    ramp_s: NonNegFloat = 60.0
    hold_s: PosFloat = 600.0
    multiplier: PosFloat = 10.0
    tenant: str | None = None  # only this tenant's traffic surges (e.g. an app whose prompt went viral)


class ClassMix(_Model):
    """Request classes (shares are normalised)."""

    chat: NonNegFloat = 0.75
    retrieval: NonNegFloat = 0.1
    tool: NonNegFloat = 0.05
    background: NonNegFloat = 0.05
    long_context: NonNegFloat = 0.05


class TenantConfig(_Model):
    name: str
    share: Fraction
    tier: Tier = "free"
    residency: list[str] | None = None  # allowed regions; None = anywhere
    system_prompt_tokens: NonNegInt = 800
    tools_tokens: NonNegInt = 0
    prompt_version: str = "v1"
    classes: ClassMix | None = None  # this tenant's class mix (default: the traffic's)


class LengthConfig(_Model):
    """A lognormal length with the given mean (tokens), clipped to [min, max]."""

    mean: PosFloat
    sigma: NonNegFloat = 0.8
    min: PosInt = 1
    max: PosInt = 100_000


class PopulationTraffic(_Model):
    """Daily users and turns per user through a diurnal curve, with surges, tiers, tenants, conversations."""

    kind: Literal["population"] = "population"
    daily_users: PosInt = 10_000_000
    turns_per_user: PosFloat = 15.0
    scale: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0  # share of the population simulated
    start_hour: Annotated[float, Field(ge=0.0, lt=24.0)] = 14.0  # hour of day at simulated time 0
    duration_s: PosFloat = 600.0  # sessions start during this window
    diurnal: DiurnalConfig = DiurnalConfig()
    surges: list[SurgeConfig] = []
    tenants: list[TenantConfig] = [TenantConfig(name="consumer-free", share=0.7, tier="free"),
                                   TenantConfig(name="consumer-plus", share=0.25, tier="paid"),
                                   TenantConfig(name="acme-eu", share=0.05, tier="enterprise", residency=["eu-west"])]
    classes: ClassMix = ClassMix()
    turns_per_session: PosFloat = 3.0  # geometric mean
    think_time_s: PosFloat = 20.0  # exponential mean between a reply and the next message
    message_tokens: LengthConfig = LengthConfig(mean=150, sigma=1.0, max=8000)
    output_tokens: LengthConfig = LengthConfig(mean=400, sigma=0.8, max=4096)
    retrieval_tokens: PosInt = 2000
    retrieval_latency_s: NonNegFloat = 0.15
    long_context_tokens: LengthConfig = LengthConfig(mean=60_000, sigma=0.4, min=20_000, max=120_000)
    background_output_tokens: PosInt = 2000
    tool_result_tokens: PosInt = 400
    tool_approval_share: Fraction = 0.3  # tool calls needing a user approval
    tool_approval_deny_share: Fraction = 0.1
    tool_approval_timeout_share: Fraction = 0.05
    tool_exec_s: NonNegFloat = 0.5


class TraceTraffic(_Model):
    """Replay a public trace (``docs/traces.md``) through the whole request path: each request is a
    one-turn session with the trace's prompt content and output length, assigned a tenant by share and a
    region by the tenant's residency and the regions' shares."""

    kind: Literal["trace_replay"]
    trace: TraceWorkload
    tenants: list[TenantConfig] = [TenantConfig(name="consumer", share=1.0, tier="free", system_prompt_tokens=0)]
    surges: list[SurgeConfig] = []  # not used by trace replay (the trace carries its own rate); kept empty


def _traffic_kind(v) -> str:
    """``kind`` may be left out for the population model (the common case)."""
    if isinstance(v, dict):
        return v.get("kind", "population")
    return getattr(v, "kind", "population")


Traffic = Annotated[Annotated[PopulationTraffic, Tag("population")] | Annotated[TraceTraffic, Tag("trace_replay")],
                    Discriminator(_traffic_kind)]


# ---- request path ---------------------------------------------------------------------------------
class ClientConfig(_Model):
    patience_s: PosFloat = 30.0  # abandon (and cancel) if no first token by then
    cancel_share: Fraction = 0.02  # turns the user cancels mid-stream
    disconnect_share: Fraction = 0.01  # turns whose stream drops and reconnects
    reconnect_delay_s: NonNegFloat = 2.0
    max_retries: NonNegInt = 2
    honour_retry_after: bool = True
    retry_backoff_s: NonNegFloat = 1.0  # used when not honouring retry-after (or none was given)
    connect_timeout_s: NonNegFloat = 1.0  # how long a connection to an unreachable region takes to fail


class GatewayConfig(_Model):
    auth_latency_s: NonNegFloat = 0.002
    admission: AdmissionConfig = Field(default={"kind": "allow_all"}, validate_default=True)


class ConversationConfig(_Model):
    history_load_s: NonNegFloat = 0.005
    persist_every_tokens: PosInt = 32  # streamed tokens are persisted in batches of this size
    persist_latency_s: NonNegFloat = 0.01
    context_budget_tokens: PosInt = 32_000  # prompt budget; oldest turns are dropped beyond it
    moderation_cut_share: Fraction = 0.0  # streams the output moderator cuts


class QueueSectionConfig(_Model):
    policy: QueuePolicyConfig = Field(default={"kind": "fifo_unbounded"}, validate_default=True)
    max_waiting_per_replica: NonNegInt = 4  # dispatch only while some eligible replica has fewer waiting
    deadline_s: PosFloat | None = 60.0  # a queued turn is rejected past this wait


class PolicyConfig(_Model):
    router: RouterConfig = Field(default={"kind": "least_outstanding_tokens"}, validate_default=True)


class LadderSection(_Model):
    """The degradation ladder: a ``twin.policies`` ladder and the model the free tier falls back to."""

    policy: LadderConfig = Field(default={"kind": "threshold_ladder"}, validate_default=True)
    small_model: str | None = None  # the free tier's fallback model when that rung is on


class ProviderConfig(_Model):
    """An external API provider the gateway can burst to."""

    ttft_s: NonNegFloat = 0.6
    tokens_per_s: PosFloat = 60.0  # per stream
    max_rps: PosFloat = 50.0  # its rate limit (turns per second)
    usd_per_m_output_tokens: NonNegFloat = 10.0


class AutoscalingSection(_Model):
    policy: AutoscalerConfig
    provisioning_delay_s: NonNegFloat = 600.0  # new capacity: order, boot, load weights, warm up
    region: str | None = None  # where new nodes go (default: the first region)
    model: str | None = None  # which model they serve (default: the default model)
    provider: ProviderConfig = ProviderConfig()


class VersionConfig(_Model):
    """A model version's quality per task class (mean of a per-request score in [0, 1]), output lengths
    (a scale on the drawn output tokens) and error rate."""

    quality: dict[str, Fraction] = {}
    quality_default: Fraction = 0.8
    output_scale: PosFloat = 1.0
    error_rate: Fraction = 0.0


class CanarySection(_Model):
    """A release canary: ``canary_model`` (its own profile) takes a growing share of ``task_classes``
    from ``model`` under a ``twin.policies`` canary policy that promotes or rolls back."""

    model: str
    canary_model: str
    quality_noise: NonNegFloat = 0.1
    stable: VersionConfig = VersionConfig()
    canary: VersionConfig = VersionConfig()
    policy: CanaryConfig


class DisaggregationConfig(_Model):
    """Split prefill and decode pools (DistServe): a model whose regions have pools named ``prefill`` and
    ``decode`` prefills on the first, then hands the KV over after ``overhead + prompt KV bytes / bandwidth``."""

    kv_transfer_bytes_per_s: PosFloat = 25e9  # ~200 Gb/s RDMA between the pools
    transfer_overhead_s: NonNegFloat = 0.002


class FleetSection(_Model):
    # scales node counts (rounded, >= 1) and traffic together; above 1.0 a bigger fleet and population than
    # written (the speed benchmark's 4x case), capped where one process's memory would not hold it anyway
    scale: Annotated[float, Field(gt=0.0, le=16.0)] = 1.0
    topology: TopologyConfig
    models: dict[str, ModelTierConfig]
    traffic: Traffic = PopulationTraffic()
    client: ClientConfig = ClientConfig()
    gateway: GatewayConfig = GatewayConfig()
    conversation: ConversationConfig = ConversationConfig()
    queue: QueueSectionConfig = QueueSectionConfig()
    policy: PolicyConfig = PolicyConfig()
    control_interval_s: PosFloat = 5.0  # how often the ladder, autoscaler and alerts evaluate
    signal_window_s: PosFloat = 30.0  # the window of the latency percentiles they read
    ladder: LadderSection | None = None
    autoscaling: AutoscalingSection | None = None
    alerts: list[AlertRule] = []
    canary: CanarySection | None = None
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    faults: list[FaultConfig] = []
    fault_rates: FaultRates = FaultRates()
    failover: FailoverConfig = FailoverConfig()
    default_model: str = "large"
    free_tier_model: str | None = None  # route the free tier here (a ladder rung can switch it on)

    @model_validator(mode="after")
    def _models_known(self) -> FleetSection:
        for region in self.topology.regions:
            for pool in region.pools:
                if pool.model not in self.models:
                    raise ValueError(f"region {region.name}: pool model {pool.model!r} is not in models "
                                     f"({', '.join(sorted(self.models))})")
        if self.default_model not in self.models:
            raise ValueError(f"default_model {self.default_model!r} is not in models")
        if self.free_tier_model is not None and self.free_tier_model not in self.models:
            raise ValueError(f"free_tier_model {self.free_tier_model!r} is not in models")
        regions = {r.name for r in self.topology.regions}
        if self.ladder is not None and self.ladder.small_model is not None and self.ladder.small_model not in self.models:
            raise ValueError(f"ladder.small_model {self.ladder.small_model!r} is not in models")
        if self.canary is not None:
            for m in (self.canary.model, self.canary.canary_model):
                if m not in self.models:
                    raise ValueError(f"canary model {m!r} is not in models")
        if self.autoscaling is not None:
            if self.autoscaling.region is not None and self.autoscaling.region not in regions:
                raise ValueError(f"autoscaling.region {self.autoscaling.region!r} is not a topology region")
            if self.autoscaling.model is not None and self.autoscaling.model not in self.models:
                raise ValueError(f"autoscaling.model {self.autoscaling.model!r} is not in models")
        for f in self.faults:
            if getattr(f, "region", None) is not None and f.region not in regions:
                raise ValueError(f"fault {f.kind}: region {f.region!r} is not a topology region")
        tenants = {t.name for t in self.traffic.tenants}
        for sg in self.traffic.surges:
            if sg.tenant is not None and sg.tenant not in tenants:
                raise ValueError(f"surge tenant {sg.tenant!r} is not a traffic tenant")
        for t in self.traffic.tenants:
            for r in t.residency or []:
                if r not in regions:
                    raise ValueError(f"tenant {t.name}: residency region {r!r} is not a topology region")
        return self
