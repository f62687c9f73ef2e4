"""Workload specs for recording real vLLM runs, and the built-in calibration sweep and held-out set.

A :class:`WorkloadSpec` says what to send (prompt and output lengths, shared prefixes, arrivals) and how to
configure the engine (:class:`EngineSpec`). :func:`build_requests` turns a spec into exact prompt token id
lists, deterministically from ``spec.seed`` (numpy ``Generator`` on named ``SeedSequence`` streams, so the
prompt stream does not move when the arrival stream changes).

The *calibration sweep* (:data:`CALIBRATION_SWEEP`) varies one thing at a time: decode batch size, prefill
chunk size (small ``max_num_batched_tokens``), prompt length, KV pressure (a small
``num_gpu_blocks_override`` so preemptions happen) and prefix sharing. The *held-out* set
(:data:`HELD_OUT`) uses other arrival patterns, prefix mixes and KV pressure, for validation only.
:data:`FIXTURES` are the small workloads committed under ``tests/fixtures/recorded/``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Token ids 0..2 are the Llama special tokens (unk, bos, eos); prompts avoid them.
FIRST_TOKEN_ID = 3


def _stream(seed: int, name: str) -> np.random.Generator:
    """A named random stream: adding a stream never shifts another one."""
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0, key)))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LengthDist(_Frozen):
    """Integer lengths drawn uniformly in ``[min_tokens, max_tokens]`` (``log_uniform`` spreads them by ratio)."""

    min_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    log_uniform: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> LengthDist:
        if self.max_tokens < self.min_tokens:
            raise ValueError("max_tokens must be >= min_tokens")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.log_uniform:
            lo, hi = math.log(self.min_tokens), math.log(self.max_tokens + 1)
            vals = np.floor(np.exp(rng.uniform(lo, hi, size=n))).astype(int)
            return [int(min(max(v, self.min_tokens), self.max_tokens)) for v in vals]
        return [int(v) for v in rng.integers(self.min_tokens, self.max_tokens + 1, size=n)]


class SharedPrefix(_Frozen):
    """``num_prefixes`` distinct system prompts of ``prefix_tokens`` each; a request uses one with
    probability ``share_fraction`` (chosen uniformly, or by ``weights``), prepended to its own prompt."""

    num_prefixes: int = Field(ge=1)
    prefix_tokens: int = Field(ge=1)
    share_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    weights: tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _weights(self) -> SharedPrefix:
        if self.weights is not None and len(self.weights) != self.num_prefixes:
            raise ValueError("weights must have num_prefixes entries")
        return self


class Arrivals(_Frozen):
    """When requests are sent (server mode). ``all_at_once``: every request at t=0. ``poisson``:
    exponential gaps at ``rate_per_s``. ``gamma``: gamma gaps with mean ``1/rate_per_s`` and coefficient
    of variation ``cv`` (``cv > 1`` is burstier than Poisson)."""

    kind: Literal["all_at_once", "poisson", "gamma"] = "all_at_once"
    rate_per_s: float | None = Field(default=None, gt=0)
    cv: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _rate(self) -> Arrivals:
        if self.kind != "all_at_once" and self.rate_per_s is None:
            raise ValueError(f"arrivals of kind {self.kind!r} need rate_per_s")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> list[float]:
        if self.kind == "all_at_once" or n == 0:
            return [0.0] * n
        assert self.rate_per_s is not None
        mean = 1.0 / self.rate_per_s
        if self.kind == "poisson":
            gaps = rng.exponential(mean, size=n - 1)
        else:
            shape = 1.0 / (self.cv**2)
            gaps = rng.gamma(shape, mean / shape, size=n - 1)
        times = np.concatenate([[0.0], np.cumsum(gaps)])
        return [round(float(t), 6) for t in times]


class EngineSpec(_Frozen):
    """Engine arguments for one recording; ``None`` leaves vLLM's own default. The scheduler limits are
    always passed explicitly (defaults here are vLLM's CPU server defaults), so run.json states the
    values in force without reading them back from a log."""

    max_num_batched_tokens: int = Field(default=2048, ge=32)
    max_num_seqs: int = Field(default=128, ge=1)
    max_model_len: int = Field(default=2048, ge=64)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = Field(default=None, ge=2)
    block_size: int | None = Field(default=None, ge=32)
    # An explicit KV size keeps the block count independent of the machine's free memory (and skips the
    # CPU backend's start-up check of --gpu-memory-utilization against free RAM). 256 MiB = 1024 blocks of
    # 128 tokens for cpu-tiny-llama; num_gpu_blocks_override, when set, replaces the resulting count.
    kv_cache_memory_bytes: int | None = Field(default=256 * 2**20, ge=1)
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    seed: int = 0


class WorkloadSpec(_Frozen):
    """One recording: what to send and how the engine is configured."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str = ""
    model: str = "cpu-tiny-llama"
    mode: Literal["offline", "server"] = "offline"
    seed: int = 0
    num_requests: int = Field(ge=1)
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    shared_prefix: SharedPrefix | None = None
    arrivals: Arrivals = Arrivals()
    engine: EngineSpec = EngineSpec()

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadSpec:
        if self.mode == "offline" and self.arrivals.kind != "all_at_once":
            raise ValueError("offline mode queues every request before the first step: arrivals must be all_at_once")
        longest = self.prompt_tokens.max_tokens + self.output_tokens.max_tokens
        if self.shared_prefix is not None:
            longest += self.shared_prefix.prefix_tokens
        if longest > self.engine.max_model_len:
            raise ValueError(f"longest request ({longest} tokens) exceeds engine.max_model_len ({self.engine.max_model_len})")
        return self


class RequestSpec(BaseModel):
    """One request to send (frozen)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    prefix_index: int | None = None


def build_requests(spec: WorkloadSpec, vocab_size: int = 32000) -> list[RequestSpec]:
    """The exact requests of ``spec``, in send order; the same spec always gives the same list."""
    n = spec.num_requests
    lengths = spec.prompt_tokens.sample(_stream(spec.seed, "workload.prompt_len"), n)
    outputs = spec.output_tokens.sample(_stream(spec.seed, "workload.output_len"), n)
    arrivals = spec.arrivals.sample(_stream(spec.seed, "workload.arrivals"), n)
    token_rng = _stream(spec.seed, "workload.tokens")
    prefixes: list[list[int]] = []
    choice: list[int | None] = [None] * n
    if spec.shared_prefix is not None:
        sp = spec.shared_prefix
        prefix_rng = _stream(spec.seed, "workload.prefixes")
        prefixes = [
            [int(t) for t in prefix_rng.integers(FIRST_TOKEN_ID, vocab_size, size=sp.prefix_tokens)]
            for _ in range(sp.num_prefixes)
        ]
        share_rng = _stream(spec.seed, "workload.prefix_choice")
        shares = share_rng.random(n) < sp.share_fraction
        p = None if sp.weights is None else np.asarray(sp.weights, dtype=float) / sum(sp.weights)
        picks = share_rng.choice(sp.num_prefixes, size=n, p=p)
        choice = [int(k) if s else None for k, s in zip(picks, shares, strict=True)]
    out = []
    for i in range(n):
        own = [int(t) for t in token_rng.integers(FIRST_TOKEN_ID, vocab_size, size=lengths[i])]
        k = choice[i]
        ids = (prefixes[k] + own) if k is not None else own
        out.append(
            RequestSpec(
                request_id=f"{spec.name}-{i:04d}",
                arrival_s=arrivals[i],
                prompt_token_ids=tuple(ids),
                max_tokens=outputs[i],
                prefix_index=k,
            )
        )
    return out


def describe(spec: WorkloadSpec) -> dict:
    """The run.json ``workload`` object: the spec itself (enough to rebuild the requests)."""
    return {"spec": spec.model_dump(mode="json"), "generator": "twin.calibration.workloads.build_requests"}


def _w(name: str, **kw) -> WorkloadSpec:
    return WorkloadSpec(name=name, **kw)


# ---------------------------------------------------------------------------------------------------
# Committed fixtures (cpu-tiny-llama; small so a recording takes well under a minute after start-up).
FIXTURES: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "offline-mixed",
            description="(a) plain mixed prefill/decode, all queued at t=0, budget 1024",
            seed=1,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=768),
            output_tokens=LengthDist(min_tokens=8, max_tokens=96),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024),
        ),
        _w(
            "offline-chunked-256",
            description="(b) chunked prefill at a small budget (max_num_batched_tokens 256)",
            seed=2,
            num_requests=24,
            prompt_tokens=LengthDist(min_tokens=200, max_tokens=1000),
            output_tokens=LengthDist(min_tokens=8, max_tokens=48),
            engine=EngineSpec(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1280),
        ),
        _w(
            "offline-kv-pressure",
            description="(c) KV pressure: 12 blocks of 128 tokens (11 usable) so running requests get preempted",
            seed=3,
            num_requests=24,
            prompt_tokens=LengthDist(min_tokens=100, max_tokens=300),
            output_tokens=LengthDist(min_tokens=96, max_tokens=200),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024, num_gpu_blocks_override=12),
        ),
        _w(
            "offline-prefix",
            description="(d) three shared 512-token system prompts (80% of requests), prefix caching on",
            seed=4,
            num_requests=40,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
            output_tokens=LengthDist(min_tokens=8, max_tokens=48),
            shared_prefix=SharedPrefix(num_prefixes=3, prefix_tokens=512, share_fraction=0.8),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024),
        ),
        _w(
            "offline-no-chunking",
            description="(e) chunked prefill off: whole prompts only, head-of-line blocking at budget 1536",
            seed=5,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=100, max_tokens=1200),
            output_tokens=LengthDist(min_tokens=8, max_tokens=64),
            engine=EngineSpec(
                max_num_batched_tokens=1536, max_num_seqs=32, max_model_len=1536, enable_chunked_prefill=False
            ),
        ),
        _w(
            "server-poisson-low",
            description="server, Poisson arrivals at 4 req/s",
            mode="server",
            seed=6,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=512),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=4.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "server-poisson-high",
            description="server, Poisson arrivals at 16 req/s",
            mode="server",
            seed=7,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=512),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=16.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "server-prefix",
            description="server, Poisson 8 req/s, two shared 384-token system prompts (75% of requests)",
            mode="server",
            seed=8,
            num_requests=40,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
            output_tokens=LengthDist(min_tokens=16, max_tokens=64),
            shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=384, share_fraction=0.75),
            arrivals=Arrivals(kind="poisson", rate_per_s=8.0),
            engine=EngineSpec(max_model_len=1024),
        ),
    ]
}

# ---------------------------------------------------------------------------------------------------
# Calibration sweep: one axis at a time, offline (exact step composition) on cpu-tiny-llama, plus two server
# runs at two arrival rates for the server front end.
CALIBRATION_SWEEP: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "sweep-decode-batch",
            description="decode batch size sweeps 48 -> 1: short prompts, output lengths spread 8..256",
            seed=101,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=64),
            output_tokens=LengthDist(min_tokens=8, max_tokens=256),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=512),
        ),
        _w(
            "sweep-prefill-chunk-128",
            description="prefill chunk size 128 (max_num_batched_tokens 128)",
            seed=102,
            num_requests=16,
            prompt_tokens=LengthDist(min_tokens=256, max_tokens=1024),
            output_tokens=LengthDist(min_tokens=4, max_tokens=16),
            engine=EngineSpec(max_num_batched_tokens=128, max_num_seqs=16, max_model_len=1088),
        ),
        _w(
            "sweep-prefill-chunk-512",
            description="prefill chunk size 512",
            seed=103,
            num_requests=16,
            prompt_tokens=LengthDist(min_tokens=256, max_tokens=1024),
            output_tokens=LengthDist(min_tokens=4, max_tokens=16),
            engine=EngineSpec(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=1088),
        ),
        _w(
            "sweep-prefill-chunk-2048",
            description="prefill chunk size 2048",
            seed=104,
            num_requests=16,
            prompt_tokens=LengthDist(min_tokens=256, max_tokens=1024),
            output_tokens=LengthDist(min_tokens=4, max_tokens=16),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=1088),
        ),
        _w(
            "sweep-prompt-length",
            description="prompt length 16..1500 (log-uniform), one request at a time (max_num_seqs 1)",
            seed=105,
            num_requests=24,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=1500, log_uniform=True),
            output_tokens=LengthDist(min_tokens=4, max_tokens=8),
            engine=EngineSpec(max_num_batched_tokens=2048, max_num_seqs=1, max_model_len=1536),
        ),
        _w(
            "sweep-kv-pressure",
            description="KV pressure: 16 blocks (15 usable) for 32 requests with long outputs -> preemptions",
            seed=106,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=64, max_tokens=384),
            output_tokens=LengthDist(min_tokens=64, max_tokens=256),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024, num_gpu_blocks_override=16),
        ),
        _w(
            "sweep-prefix-sharing",
            description="prefix sharing: four 640-token system prompts on 90% of requests",
            seed=107,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=256),
            output_tokens=LengthDist(min_tokens=8, max_tokens=32),
            shared_prefix=SharedPrefix(num_prefixes=4, prefix_tokens=640, share_fraction=0.9),
            engine=EngineSpec(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1024),
        ),
        # Server mode (the OpenAI API server in front of the engine): only these fit the profile's server
        # section (front-end time, server step time; twin.calibration.server). Offline steps fit the rest.
        _w(
            "sweep-server-rate-6",
            description="server, Poisson 6 req/s: few concurrent streams, front end mostly idle",
            mode="server",
            seed=108,
            num_requests=40,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=640),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=6.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "sweep-server-rate-14",
            description="server, Poisson 14 req/s: tens of concurrent streams, front end busy",
            mode="server",
            seed=109,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=640),
            output_tokens=LengthDist(min_tokens=16, max_tokens=96),
            arrivals=Arrivals(kind="poisson", rate_per_s=14.0),
            engine=EngineSpec(max_model_len=1024),
        ),
    ]
}

# ---------------------------------------------------------------------------------------------------
# Held-out validation workloads: arrival patterns, prefix mixes and KV pressure the sweep does not use.
HELD_OUT: dict[str, WorkloadSpec] = {
    w.name: w
    for w in [
        _w(
            "heldout-server-bursty",
            description="server, bursty gamma arrivals (mean 10 req/s, cv 3), mixed lengths",
            mode="server",
            seed=201,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=900, log_uniform=True),
            output_tokens=LengthDist(min_tokens=8, max_tokens=128),
            arrivals=Arrivals(kind="gamma", rate_per_s=10.0, cv=3.0),
            engine=EngineSpec(max_model_len=1152),
        ),
        _w(
            "heldout-server-prefix-mix",
            description="server, Poisson 12 req/s, two 512-token prefixes weighted 3:1, on 60% of requests",
            mode="server",
            seed=202,
            num_requests=48,
            prompt_tokens=LengthDist(min_tokens=16, max_tokens=192),
            output_tokens=LengthDist(min_tokens=8, max_tokens=64),
            shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=512, share_fraction=0.6, weights=(3.0, 1.0)),
            arrivals=Arrivals(kind="poisson", rate_per_s=12.0),
            engine=EngineSpec(max_model_len=1024),
        ),
        _w(
            "heldout-offline-kv-prefix",
            description="offline, KV pressure (20 blocks) together with shared prefixes and budget 512",
            seed=203,
            num_requests=32,
            prompt_tokens=LengthDist(min_tokens=32, max_tokens=256),
            output_tokens=LengthDist(min_tokens=64, max_tokens=192),
            shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=256, share_fraction=0.7),
            engine=EngineSpec(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=768, num_gpu_blocks_override=20),
        ),
    ]
}

SETS: dict[str, dict[str, WorkloadSpec]] = {
    "calibration": CALIBRATION_SWEEP,
    "held-out": HELD_OUT,
    "fixtures": FIXTURES,
}


def get_workload(name: str) -> WorkloadSpec:
    """A built-in workload by name (from any set)."""
    for group in SETS.values():
        if name in group:
            return group[name]
    known = sorted(n for g in SETS.values() for n in g)
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(known)}")
