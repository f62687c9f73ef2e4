"""The capacity model: the two founding design notes' back-of-envelope arithmetic, step by step.

Pure and deterministic: no simpy, no clock, no file access. ``compute_capacity(inputs)`` turns a
validated ``CapacityInputs`` into a ``CapacityResult``; every step is a small function below whose
docstring names the note line it reproduces ("1M" is ``seeds/000_…``, "10M" is ``seeds/001_…``).
Where a note rounds an intermediate figure, the rounding is an explicit input (``round_*``), never a
hard-coded output. ``docs/capacity.md`` describes every field and where this arithmetic is known to
be wrong (queueing, tails, KV limits).

The only non-pure hook is ``load_named_profile``, which the command calls to turn a ``profile`` name
into the memory facts of ``twin.engine_profiles``; ``compute_capacity`` itself only reads an object.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

SECONDS_PER_DAY = 86_400.0
PREFIX_HIT_STEP_FRACTION = 0.10  # "each +10 points of prefix-cache hit rate"
_CEIL_REL_EPS = 1e-9  # so that 412.0000000001 (float noise) is 412 replicas, not 413


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CapacityInputs(_Frozen):
    """What a capacity estimate is computed from. ``None`` means "not stated": outputs that need it are null."""

    # workload
    daily_users: int = Field(gt=0)
    turns_per_user_per_day: float = Field(gt=0)
    peak_factor: float = Field(ge=1, description="peak request rate / daily average")
    prompt_tokens_per_turn: int = Field(ge=0)
    output_tokens_per_turn: int = Field(gt=0)
    prefix_cache_hit_fraction: float = Field(default=0.0, ge=0, lt=1, description="prompt tokens served from cache")
    # latency targets and lifetimes
    mean_ttft_s: float | None = Field(default=None, ge=0)
    stream_decode_speed_target_tokens_per_s: float | None = Field(default=None, gt=0)
    mean_generation_duration_s: float | None = Field(
        default=None, gt=0, description="stated stream lifetime; else mean_ttft_s + output / speed target"
    )
    # per-replica decode capacity: one of measured tokens/s, a measured stream cap, or an affine step model
    decode_capacity_per_replica_tokens_per_s: float | None = Field(default=None, gt=0)
    max_streams_per_replica_at_target: int | None = Field(default=None, gt=0)
    decode_step_base_s: float | None = Field(default=None, ge=0)
    decode_step_per_stream_s: float | None = Field(default=None, gt=0)
    # memory (whole replica unless named per GPU); a profile name can fill these
    profile: str | None = None
    kv_bytes_per_token: int | None = Field(default=None, gt=0)
    kv_tokens_per_stream: int | None = Field(default=None, gt=0, description="default prompt + output per turn")
    weight_bytes: int | None = Field(default=None, ge=0)
    gpu_memory_bytes: int | None = Field(default=None, gt=0, description="per GPU")
    gpu_memory_utilisation_fraction: float = Field(default=1.0, gt=0, le=1)
    tp: int | None = Field(default=None, gt=0, description="tensor-parallel degree = GPUs per replica")
    gpus_per_node: int | None = Field(default=None, gt=0)
    # prefill cost (for the prefix-hit sensitivity): measured, or from FLOPs
    prefill_capacity_per_replica_tokens_per_s: float | None = Field(default=None, gt=0)
    model_params: float | None = Field(default=None, gt=0)
    gpu_peak_flops_per_s: float | None = Field(default=None, gt=0)
    prefill_mfu_fraction: float | None = Field(default=None, gt=0, le=1)
    # planning
    planning_utilisation_fraction: float = Field(default=1.0, gt=0, le=1)
    failover_reserve_fraction: float = Field(default=0.0, ge=0)
    regions: int = Field(default=1, gt=0)
    survive_region_loss: bool = False
    # money and calendar
    usd_per_gpu_hour: float | None = Field(default=None, ge=0)
    hours_per_month: float = Field(default=730.0, gt=0)
    days_per_month: float = Field(default=30.0, gt=0)
    # long-context pool
    long_context_tokens: int | None = Field(default=None, gt=0)
    # the rounding a note does between steps (None = keep full precision)
    round_peak_rps_to: float | None = Field(default=None, gt=0)
    round_peak_output_tokens_per_s_to: float | None = Field(default=None, gt=0)
    round_generation_duration_s_to: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> CapacityInputs:
        if (self.decode_step_base_s is None) != (self.decode_step_per_stream_s is None):
            raise ValueError("decode_step_base_s and decode_step_per_stream_s go together")
        if self.survive_region_loss and self.regions < 2:
            raise ValueError("survive_region_loss needs regions >= 2")
        return self


class CapacityResult(_Frozen):
    """Every figure of the estimate; ``None`` where the inputs do not determine it (see docs/capacity.md)."""

    turns_per_day: float
    avg_rps: float
    peak_rps: float
    peak_prompt_tokens_per_s: float
    peak_uncached_prompt_tokens_per_s: float
    peak_output_tokens_per_s: float
    generation_duration_s: float | None
    active_streams: float | None
    kv_tokens_per_stream: int
    kv_bytes_per_stream: int | None
    free_kv_bytes_per_replica: int | None
    streams_per_replica_by_memory: int | None
    streams_per_replica_by_latency: int | None
    streams_per_replica: int | None
    binding_constraint: Literal["latency", "memory"] | None
    decode_capacity_per_replica_tokens_per_s: float | None
    decode_capacity_per_gpu_tokens_per_s: float | None
    replicas_at_saturation: int | None
    replicas: int | None
    replicas_by_concurrency: int | None
    replicas_with_reserve: int | None
    gpus: int | None
    gpus_with_reserve: int | None
    nodes: int | None
    output_tokens_per_month: float
    usd_per_month: float | None
    usd_per_m_output_tokens: float | None
    prefill_capacity_per_replica_tokens_per_s: float | None
    prefill_share_of_replica_time: float | None
    replicas_with_prefill: int | None
    fleet_fraction_saved_per_10pt_prefix_hit: float | None
    long_context_kv_ratio: float | None
    long_context_kv_bytes_per_stream: int | None
    long_context_streams_per_replica_by_memory: int | None
    usd_per_stream_hour: float | None
    usd_per_long_context_stream_hour: float | None


# ---------------------------------------------------------------------------------------- helpers


def ceil_count(x: float) -> int:
    """Round a required count up, ignoring float noise a billionth above a whole number."""
    return math.ceil(x - abs(x) * _CEIL_REL_EPS)


def round_to(x: float, step: float | None) -> float:
    """Round ``x`` to the nearest multiple of ``step`` (unchanged when ``step`` is None): a note's "≈"."""
    return x if step is None else round(x / step) * step


# ------------------------------------------------------------------------------------ demand steps


def turns_per_day(*, daily_users: int, turns_per_user_per_day: float) -> float:
    """1M: "Ten million turns per day"; 10M: "10M DAU × 15 messages = 150M requests/day"."""
    return daily_users * turns_per_user_per_day


def average_rps(turns: float) -> float:
    """1M: "average 115.74 requests/second"; 10M: "150M / 86,400 ≈ 1,736 average"."""
    return turns / SECONDS_PER_DAY


def peak_rps(avg: float, *, peak_factor: float, round_to_step: float | None) -> float:
    """1M: "At an assumed 8× peak, plan for about 925.93 requests/second"; 10M: "peak 3× ≈ 5,200 QPS"."""
    return round_to(avg * peak_factor, round_to_step)


def token_rate(rps: float, tokens_per_turn: float, *, round_to_step: float | None = None) -> float:
    """1M: "roughly 1.852 million prompt tokens/second and 462,963 output tokens/second";
    10M: "Output tokens/s at peak: 5,200 × 400 ≈ 2.1M tok/s"."""
    return round_to(rps * tokens_per_turn, round_to_step)


def uncached_tokens(tokens: float, hit_fraction: float) -> float:
    """Prompt tokens that must be prefilled: 10M "average prompt 1,500 tokens (~70% prefix-cached)"."""
    return tokens * (1.0 - hit_fraction)


def generation_duration_s(
    *, ttft_s: float, output_tokens: float, speed_tokens_per_s: float, round_to_step: float | None
) -> float:
    """10M: "a request lives ~0.5 s TTFT + 400/30 ≈ 14 s"."""
    return round_to(ttft_s + output_tokens / speed_tokens_per_s, round_to_step)


def littles_law(rate_per_s: float, duration_s: float) -> float:
    """Mean number in system L = λW. 1M: "about 13,889 active generations"; 10M: "≈ 73k live streams"."""
    return rate_per_s * duration_s


# ------------------------------------------------------------------------------------ memory steps


def kv_bytes_per_stream(*, kv_bytes_per_token: int, tokens: int) -> int:
    """10M: "~160 KB/token × ~1,900 tokens ≈ 300 MB per stream" (a stream's KV at its longest)."""
    return kv_bytes_per_token * tokens


def free_kv_bytes_per_replica(*, tp: int, gpu_memory_bytes: int, utilisation: float, weight_bytes: int) -> int:
    """10M: "A replica has ~250 GB free after weights" (4 × 80 GB − 70 GB of FP8 weights)."""
    return int(tp * gpu_memory_bytes * utilisation) - weight_bytes


def streams_by_memory(free_bytes: int, per_stream_bytes: int) -> int:
    """10M: "→ ~800 streams by memory"."""
    return max(free_bytes, 0) // per_stream_bytes


def streams_at_speed_from_step_model(*, base_s: float, per_stream_s: float, speed_tokens_per_s: float) -> int:
    """Largest decode batch B whose step time base_s + per_stream_s·B still gives each stream the target
    speed (step ≤ 1/speed). Not in the notes, which state the cap ("caps it near 170 streams")."""
    return max(math.floor((1.0 / speed_tokens_per_s - base_s) / per_stream_s + _CEIL_REL_EPS), 0)


def decode_capacity_from_streams(streams: int, speed_tokens_per_s: float) -> float:
    """10M: "caps it near 170 streams (≈5,100 tok/s per replica"."""
    return streams * speed_tokens_per_s


def per_gpu(per_replica: float, tp: int) -> float:
    """10M: "≈1,275 tok/s per GPU"."""
    return per_replica / tp


# ------------------------------------------------------------------------------------- fleet steps


def replicas_needed(output_tokens_per_s: float, capacity_tokens_per_s: float, utilisation: float) -> int:
    """1M: "at least 463 replicas at full saturation, or 662 at a 70% planning utilization";
    10M: "GPUs: 2.1M / 1,275 ≈ 1,650" (at replica granularity: 412 replicas × 4)."""
    return ceil_count(output_tokens_per_s / (capacity_tokens_per_s * utilisation))


def replicas_with_reserve(replicas: int, *, reserve_fraction: float, regions: int, survive_region_loss: bool) -> int:
    """10M: "+30% for failover and skew ≈ 2,150 H100s"; with ``survive_region_loss``, 10M follow-up 3:
    "Run each of three regions at ≤70% of its peak so N-1 absorbs the loss" — the surviving regions
    carry the whole load, so each region holds load / (regions − 1). The two factors compound."""
    need = replicas * (1.0 + reserve_fraction)
    carrying = regions - 1 if survive_region_loss else regions
    return regions * ceil_count(need / carrying)


def nodes_needed(gpus: int, gpus_per_node: int) -> int:
    """10M: "≈ 270 nodes" (8 GPUs per node)."""
    return ceil_count(gpus / gpus_per_node)


def output_tokens_per_month(turns: float, *, days_per_month: float, output_tokens_per_turn: float) -> float:
    """10M: "Output = 150M × 30 × 400 = 1.8T tokens/month"."""
    return turns * days_per_month * output_tokens_per_turn


def usd_per_month(gpus: int, *, hours_per_month: float, usd_per_gpu_hour: float) -> float:
    """10M: "2,150 × 730 h × $2.50 ≈ $3.9M/month"."""
    return gpus * hours_per_month * usd_per_gpu_hour


def usd_per_million(usd: float, tokens: float) -> float:
    """10M: "≈ $2.2 per M output tokens of GPU cost"."""
    return usd / (tokens / 1e6)


# ---------------------------------------------------------------------------- prefix-hit sensitivity


def prefill_capacity_from_flops(*, tp: int, gpu_peak_flops_per_s: float, mfu: float, model_params: float) -> float:
    """Uncached prompt tokens/s one replica could prefill if it did nothing else: tp·peak·MFU / (2·params).
    Not in the notes; ignores attention FLOPs (a few % at 2k context, much more at 100k)."""
    return tp * gpu_peak_flops_per_s * mfu / (2.0 * model_params)


def busy_replicas(*, output_tokens_per_s: float, decode_capacity: float, prefill_tokens_per_s: float,
                  prefill_capacity: float) -> float:
    """Replica-equivalents of work when prefill time-shares the replica with decode (chunked prefill):
    decode seconds per second plus prefill seconds per second. The assumption behind the 10M line
    "Each +10 points of prefix-cache hit rate is worth roughly 3–5% of the fleet"."""
    return output_tokens_per_s / decode_capacity + prefill_tokens_per_s / prefill_capacity


def fleet_fraction_saved(*, prompt_tokens_per_s: float, hit_fraction: float, output_tokens_per_s: float,
                         decode_capacity: float, prefill_capacity: float) -> float:
    """Relative fleet shrink when the prefix hit rate rises 10 points from ``hit_fraction`` (10M: "roughly
    3–5% of the fleet"). Capped at a hit rate of 1."""
    def load(hit: float) -> float:
        return busy_replicas(output_tokens_per_s=output_tokens_per_s, decode_capacity=decode_capacity,
                             prefill_tokens_per_s=uncached_tokens(prompt_tokens_per_s, hit),
                             prefill_capacity=prefill_capacity)

    before = load(hit_fraction)
    return (before - load(min(hit_fraction + PREFIX_HIT_STEP_FRACTION, 1.0))) / before


# --------------------------------------------------------------------------------- long context


def usd_per_stream_hour(*, usd_per_gpu_hour: float, tp: int, streams: int, utilisation: float) -> float:
    """Price by the scarce resource (10M: "A 100k-context user holds ~50× the KV of a 2k chat user"):
    one replica-hour shared by the streams it holds at the planned utilisation."""
    return usd_per_gpu_hour * tp / (streams * utilisation)


# ------------------------------------------------------------------------------------ profile hook


class _HardwareLike(Protocol):
    gpu_memory_bytes: int
    gpus_per_node: int


class ProfileLike(Protocol):
    """What the capacity model reads from ``twin.engine_profiles.EngineProfile``."""

    kv_bytes_per_token: int
    weight_bytes: int
    tp: int
    hardware: _HardwareLike


def load_named_profile(name: str) -> ProfileLike:
    """``twin.engine_profiles.load_profile(name)``; a clear error if that module is not available."""
    try:
        module = importlib.import_module("twin.engine_profiles")
        loader = module.load_profile
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"profile {name!r}: twin.engine_profiles.load_profile is not available ({exc})") from exc
    try:
        return loader(name)
    except (KeyError, OSError, ValueError) as exc:  # unknown name, unreadable or invalid profile file
        raise ValueError(f"profile: {exc}") from exc


def apply_profile(inputs: CapacityInputs, profile: ProfileLike) -> CapacityInputs:
    """Fill kv_bytes_per_token, weight_bytes, gpu_memory_bytes, tp and gpus_per_node from a profile.
    A field stated both in the inputs and (differently) by the profile is an error, not a silent pick."""
    facts: dict[str, Any] = {
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "weight_bytes": profile.weight_bytes,
        "gpu_memory_bytes": profile.hardware.gpu_memory_bytes,
        "tp": profile.tp,
        "gpus_per_node": profile.hardware.gpus_per_node,
    }
    for field, value in facts.items():
        stated = getattr(inputs, field)
        if stated is not None and stated != value:
            raise ValueError(f"{field}: inputs say {stated}, profile {inputs.profile!r} says {value}; state one")
    return CapacityInputs.model_validate({**inputs.model_dump(), **facts})


# -------------------------------------------------------------------------------------- the model


def compute_capacity(inputs: CapacityInputs, *, profile: ProfileLike | None = None) -> CapacityResult:
    """Run every step in the notes' order. ``profile`` (or ``inputs.profile``, loaded by name) fills memory facts."""
    if profile is None and inputs.profile is not None:
        profile = load_named_profile(inputs.profile)
    i = apply_profile(inputs, profile) if profile is not None else inputs

    turns = turns_per_day(daily_users=i.daily_users, turns_per_user_per_day=i.turns_per_user_per_day)
    avg = average_rps(turns)
    peak = peak_rps(avg, peak_factor=i.peak_factor, round_to_step=i.round_peak_rps_to)
    prompt_rate = token_rate(peak, i.prompt_tokens_per_turn)
    uncached_rate = uncached_tokens(prompt_rate, i.prefix_cache_hit_fraction)
    output_rate = token_rate(peak, i.output_tokens_per_turn, round_to_step=i.round_peak_output_tokens_per_s_to)
    speed = i.stream_decode_speed_target_tokens_per_s

    duration = i.mean_generation_duration_s
    if duration is None and i.mean_ttft_s is not None and speed is not None:
        duration = generation_duration_s(ttft_s=i.mean_ttft_s, output_tokens=i.output_tokens_per_turn,
                                         speed_tokens_per_s=speed, round_to_step=i.round_generation_duration_s_to)
    active = None if duration is None else littles_law(peak, duration)

    # memory
    kv_tokens = i.kv_tokens_per_stream or i.prompt_tokens_per_turn + i.output_tokens_per_turn
    kv_stream = None if i.kv_bytes_per_token is None else kv_bytes_per_stream(
        kv_bytes_per_token=i.kv_bytes_per_token, tokens=kv_tokens)
    free = None
    if None not in (i.tp, i.gpu_memory_bytes, i.weight_bytes):
        free = free_kv_bytes_per_replica(tp=i.tp, gpu_memory_bytes=i.gpu_memory_bytes,
                                         utilisation=i.gpu_memory_utilisation_fraction, weight_bytes=i.weight_bytes)
    by_memory = None if free is None or kv_stream is None else streams_by_memory(free, kv_stream)

    # latency: a stated stream cap, else the step model, else a measured capacity divided by the speed target
    by_latency = i.max_streams_per_replica_at_target
    if by_latency is None and i.decode_step_base_s is not None and speed is not None:
        by_latency = streams_at_speed_from_step_model(base_s=i.decode_step_base_s,
                                                      per_stream_s=i.decode_step_per_stream_s, speed_tokens_per_s=speed)
    if by_latency is None and i.decode_capacity_per_replica_tokens_per_s is not None and speed is not None:
        by_latency = math.floor(i.decode_capacity_per_replica_tokens_per_s / speed)
    known = [s for s in (by_latency, by_memory) if s is not None]
    streams = min(known) if known else None
    binding = None
    if by_latency is not None and by_memory is not None:
        binding = "memory" if by_memory < by_latency else "latency"

    capacity = i.decode_capacity_per_replica_tokens_per_s
    if capacity is None and streams is not None and speed is not None:
        capacity = decode_capacity_from_streams(streams, speed)
    elif capacity is not None and binding == "memory" and speed is not None:
        capacity = min(capacity, decode_capacity_from_streams(streams, speed))
    capacity_gpu = None if capacity is None or i.tp is None else per_gpu(capacity, i.tp)

    util = i.planning_utilisation_fraction
    at_saturation = None if capacity is None else replicas_needed(output_rate, capacity, 1.0)
    replicas = None if capacity is None else replicas_needed(output_rate, capacity, util)
    by_concurrency = None if active is None or streams is None else ceil_count(active / (streams * util))
    reserved = None if replicas is None else replicas_with_reserve(
        replicas, reserve_fraction=i.failover_reserve_fraction, regions=i.regions,
        survive_region_loss=i.survive_region_loss)
    gpus = None if replicas is None or i.tp is None else replicas * i.tp
    gpus_reserved = None if reserved is None or i.tp is None else reserved * i.tp
    nodes = None if gpus_reserved is None or i.gpus_per_node is None else nodes_needed(gpus_reserved, i.gpus_per_node)

    tokens_month = output_tokens_per_month(turns, days_per_month=i.days_per_month,
                                           output_tokens_per_turn=i.output_tokens_per_turn)
    usd_month = None
    if gpus_reserved is not None and i.usd_per_gpu_hour is not None:
        usd_month = usd_per_month(gpus_reserved, hours_per_month=i.hours_per_month, usd_per_gpu_hour=i.usd_per_gpu_hour)
    usd_per_m = None if usd_month is None else usd_per_million(usd_month, tokens_month)

    # prefix-hit sensitivity
    prefill_cap = i.prefill_capacity_per_replica_tokens_per_s
    if prefill_cap is None and None not in (i.tp, i.gpu_peak_flops_per_s, i.prefill_mfu_fraction, i.model_params):
        prefill_cap = prefill_capacity_from_flops(tp=i.tp, gpu_peak_flops_per_s=i.gpu_peak_flops_per_s,
                                                  mfu=i.prefill_mfu_fraction, model_params=i.model_params)
    prefill_share = with_prefill = saved = None
    if prefill_cap is not None and capacity is not None:
        busy = busy_replicas(output_tokens_per_s=output_rate, decode_capacity=capacity,
                             prefill_tokens_per_s=uncached_rate, prefill_capacity=prefill_cap)
        prefill_share = (uncached_rate / prefill_cap) / busy
        with_prefill = ceil_count(busy / util)
        saved = fleet_fraction_saved(prompt_tokens_per_s=prompt_rate, hit_fraction=i.prefix_cache_hit_fraction,
                                     output_tokens_per_s=output_rate, decode_capacity=capacity,
                                     prefill_capacity=prefill_cap)

    # long-context pool and per-stream prices
    long_ratio = long_stream = long_streams = None
    if i.long_context_tokens is not None:
        long_ratio = i.long_context_tokens / kv_tokens
        if i.kv_bytes_per_token is not None:
            long_stream = kv_bytes_per_stream(kv_bytes_per_token=i.kv_bytes_per_token, tokens=i.long_context_tokens)
            long_streams = None if free is None else streams_by_memory(free, long_stream)
    usd_stream_h = usd_long_h = None
    if i.usd_per_gpu_hour is not None and i.tp is not None:
        if streams:
            usd_stream_h = usd_per_stream_hour(usd_per_gpu_hour=i.usd_per_gpu_hour, tp=i.tp, streams=streams,
                                               utilisation=util)
        long_cap = min(s for s in (long_streams, by_latency) if s is not None) if long_streams is not None else None
        if long_cap:
            usd_long_h = usd_per_stream_hour(usd_per_gpu_hour=i.usd_per_gpu_hour, tp=i.tp, streams=long_cap,
                                             utilisation=util)

    return CapacityResult(
        turns_per_day=turns, avg_rps=avg, peak_rps=peak, peak_prompt_tokens_per_s=prompt_rate,
        peak_uncached_prompt_tokens_per_s=uncached_rate, peak_output_tokens_per_s=output_rate,
        generation_duration_s=duration, active_streams=active, kv_tokens_per_stream=kv_tokens,
        kv_bytes_per_stream=kv_stream, free_kv_bytes_per_replica=free, streams_per_replica_by_memory=by_memory,
        streams_per_replica_by_latency=by_latency, streams_per_replica=streams, binding_constraint=binding,
        decode_capacity_per_replica_tokens_per_s=capacity, decode_capacity_per_gpu_tokens_per_s=capacity_gpu,
        replicas_at_saturation=at_saturation, replicas=replicas, replicas_by_concurrency=by_concurrency,
        replicas_with_reserve=reserved, gpus=gpus, gpus_with_reserve=gpus_reserved, nodes=nodes,
        output_tokens_per_month=tokens_month, usd_per_month=usd_month, usd_per_m_output_tokens=usd_per_m,
        prefill_capacity_per_replica_tokens_per_s=prefill_cap, prefill_share_of_replica_time=prefill_share,
        replicas_with_prefill=with_prefill, fleet_fraction_saved_per_10pt_prefix_hit=saved,
        long_context_kv_ratio=long_ratio, long_context_kv_bytes_per_stream=long_stream,
        long_context_streams_per_replica_by_memory=long_streams, usd_per_stream_hour=usd_stream_h,
        usd_per_long_context_stream_hour=usd_long_h,
    )


# ------------------------------------------------------------------------------------------ presets

PRESETS: dict[str, CapacityInputs] = {
    # seeds/000: the 1M-daily-user note and its Python snippet. "before caching" -> hit rate 0.
    "seed-1m": CapacityInputs(
        daily_users=1_000_000, turns_per_user_per_day=10, peak_factor=8,
        prompt_tokens_per_turn=2_000, output_tokens_per_turn=500,
        mean_generation_duration_s=15,  # "a mean active generation duration of 15 seconds"
        decode_capacity_per_replica_tokens_per_s=1_000,  # "hypothetical measured decode capacity"
        planning_utilisation_fraction=0.70,
    ),
    # seeds/001: the 10M-daily-user note, "Assumptions (illustrative, Oct 2026)" and the "Day-one defaults".
    "seed-10m": CapacityInputs(
        daily_users=10_000_000, turns_per_user_per_day=15, peak_factor=3, round_peak_rps_to=100,
        prompt_tokens_per_turn=1_500, output_tokens_per_turn=400, prefix_cache_hit_fraction=0.70,
        round_peak_output_tokens_per_s_to=100_000,  # "5,200 × 400 ≈ 2.1M", then used as 2.1M
        mean_ttft_s=0.5, stream_decode_speed_target_tokens_per_s=30, round_generation_duration_s_to=1,  # "≈ 14 s"
        max_streams_per_replica_at_target=170,  # "the 30 tok/s target caps it near 170 streams"
        # Llama-3-70B FP8 KV: K and V × 80 layers × 8 KV heads × 128 dims × 1 byte ("~160 KB/token")
        kv_bytes_per_token=2 * 80 * 8 * 128 * 1,
        weight_bytes=70 * 10**9, gpu_memory_bytes=80 * 10**9, tp=4, gpus_per_node=8,  # "~250 GB free"
        # Not in the note: prefill cost for the prefix-hit sensitivity. H100 SXM dense FP8 peak
        # 1,979 TFLOP/s at an assumed 60% MFU, 2 FLOP per parameter per token (docs/capacity.md).
        model_params=70e9, gpu_peak_flops_per_s=1.979e15, prefill_mfu_fraction=0.60,
        failover_reserve_fraction=0.30, usd_per_gpu_hour=2.50, hours_per_month=730, days_per_month=30,
        long_context_tokens=100_000,  # "A 100k-context user holds ~50× the KV of a 2k chat user"
    ),
}
