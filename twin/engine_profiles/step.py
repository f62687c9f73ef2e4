"""What the replica engine tells the step-time model about one engine step.

The engine (``twin.models.engine``) builds one ``StepShape`` per scheduled step; a step-time model
(``twin.engine_profiles``) turns it into seconds. This is the only contract between them, so the engine
never knows how time is modelled and a profile never knows how batches are formed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class StepShape:
    """The composition of one engine step (one forward pass).

    A *decode* item computes exactly one token for a request whose KV already covers all earlier
    tokens; a *prefill* item computes a chunk of ``chunk`` tokens after ``prefix`` tokens whose KV is
    already present (cached or computed in earlier steps). A resumed (preempted) request's re-prefill
    is a prefill item here, whatever vLLM's iteration log calls it.
    """

    decode_requests: int = 0
    decode_context_tokens: int = 0  # sum over decode items of the context they attend to (tokens)
    prefill_requests: int = 0
    prefill_tokens: int = 0  # sum of chunk lengths
    prefill_attention_pairs: int = 0  # sum over chunks of prefill_attention_work(prefix, chunk)
    # decode context tokens in KV blocks that another decode item of the step reads too, beyond each block's first
    # reader (counted by replays whose profile discounts them: ``DecodeCoefficients.shared_context_fraction``; the
    # fleet simulation never counts them, so it is 0 there)
    decode_shared_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.decode_requests + self.prefill_tokens

    @property
    def is_decode_only(self) -> bool:
        return self.prefill_requests == 0


def repeated_reads(block_lists: Iterable[Sequence[Hashable]]) -> int:
    """Given the KV blocks each decode item of a step reads (no block twice in one list), the reads of a block beyond
    its first reader: ``StepShape.decode_shared_tokens`` is this times the block size."""
    seen: set[Hashable] = set()
    again = 0
    for blocks in block_lists:
        k = len(seen)
        seen.update(blocks)
        again += len(blocks) - (len(seen) - k)
    return again


def prefill_attention_work(prefix: int, chunk: int) -> int:
    """Query-key pairs a causal prefill chunk attends over: chunk * prefix + chunk * (chunk + 1) / 2."""
    return chunk * prefix + (chunk * (chunk + 1)) // 2


class StepTimeModel(Protocol):
    """Turns step shapes into durations in seconds (model execution + per-step overhead)."""

    def step_time_s(self, shape: StepShape) -> float:
        """Duration of one step."""
        ...

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
        """Durations of ``num_steps`` consecutive decode-only steps of a fixed batch.

        Step i (0-based) has ``decode_context_tokens + i * decode_requests`` context tokens. Must equal
        calling ``step_time_s`` for each step, so the engine can jump many steps in one event.
        """
        ...
