"""The step shapes the compact coefficients are fitted over: the range a replica actually runs in."""

from __future__ import annotations

from twin.engine_profiles.memory import derive_num_gpu_blocks
from twin.engine_profiles.profile import EngineProfile
from twin.engine_profiles.step import StepShape, prefill_attention_work

DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
DECODE_CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_CHUNKS = (16, 64, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_PREFIXES = (0, 2048, 8192)
MIXED_DECODES = (0, 8, 32, 128, 256)
MIXED_CONTEXTS = (1024, 4096)
MAX_NUM_BATCHED_TOKENS = 8192


def fit_grid(profile: EngineProfile) -> list[StepShape]:
    """Decode-only batches up to 512 and mixed steps up to 8,192 tokens, within the replica's KV capacity."""
    capacity = 16 * derive_num_gpu_blocks(profile, block_size=16, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    shapes = [
        StepShape(decode_requests=n, decode_context_tokens=n * c)
        for n in DECODE_BATCHES
        for c in DECODE_CONTEXTS
        if n * c <= capacity
    ]
    for n in MIXED_DECODES:
        for c in MIXED_CONTEXTS if n else (0,):
            for chunk in PREFILL_CHUNKS:
                chunk = min(chunk, MAX_NUM_BATCHED_TOKENS - n)
                for prefix in PREFILL_PREFIXES:
                    if n * c + prefix + chunk > capacity:
                        continue
                    shapes.append(
                        StepShape(
                            decode_requests=n,
                            decode_context_tokens=n * c,
                            prefill_requests=1,
                            prefill_tokens=chunk,
                            prefill_attention_pairs=prefill_attention_work(prefix, chunk),
                        )
                    )
    return sorted(set(shapes), key=lambda s: (s.prefill_requests, s.decode_requests, s.decode_context_tokens,
                                              s.prefill_tokens, s.prefill_attention_pairs))
