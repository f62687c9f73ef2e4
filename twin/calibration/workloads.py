"""Workload specs for recording real vLLM runs.

A :class:`WorkloadSpec` says what to send (prompt and output lengths, shared prefixes, arrivals) and how to
configure the engine (:class:`EngineSpec`). :func:`build_requests` turns a spec into exact prompt token id
lists, deterministically from ``spec.seed`` (numpy ``Generator`` on named ``SeedSequence`` streams, so the
prompt stream does not move when the arrival stream changes).

The built-in sets (the calibration sweep, the held-out set and the committed fixtures) are in
:mod:`twin.calibration.workload_sets`.
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
