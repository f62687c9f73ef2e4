"""vLLM scheduler/cache knobs of one replica (shared by the single-replica and fleet scenario sections)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PosInt = Annotated[int, Field(gt=0)]
# The twin keeps ~16 bytes of state per KV block (its hash slot and its state word), allocated up front: a given
# block count above this (800 MB of state; a real H200 holds ~10^5 to 10^6 blocks of 16 tokens) is refused as a
# scenario error rather than left to exhaust memory (hypothesis drew 1,838,534,478 once: the run was killed).
MAX_GPU_BLOCKS = 50_000_000


def cpu_hardware(name: str) -> bool:
    """A hardware name (a profile's ``hardware.name``, a recording's ``hardware``) that is a CPU: it begins with "cpu",
    as every CPU profile's and CPU recording's does. vLLM's CPU backend forces ``async_scheduling`` off; on a GPU its
    default is on."""
    return name.strip().lower().startswith("cpu")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineSettings(_Model):
    """vLLM scheduler/cache knobs, with vLLM 0.33's GPU server defaults on H100-class GPUs."""

    block_size: PosInt = 16
    # None: derived from the profile's memory, as vLLM derives it; at least 2 (block 0 is the null block)
    num_gpu_blocks: Annotated[int, Field(ge=2, le=MAX_GPU_BLOCKS)] | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.92
    max_num_batched_tokens: PosInt = 8192
    max_num_seqs: PosInt = 1024
    max_model_len: PosInt = 32768
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: Annotated[int, Field(ge=0)] = 0
    long_prefill_token_threshold_adaptive: bool = False
    policy: Literal["fcfs", "priority"] = "fcfs"
    scheduler_reserve_full_isl: bool = True
    watermark: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    # form step N+1 while step N runs, so an arrival during step N is first scheduled in N+2 (semantics §2.12).
    # None: as vLLM resolves it, on with a GPU profile, off with a CPU profile (the CPU backend forces it off) or a
    # fixed step time (docs/engine.md)
    async_scheduling: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> EngineSettings:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("with enable_chunked_prefill false, max_num_batched_tokens must be >= max_model_len")
        return self
