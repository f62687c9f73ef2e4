"""Memory arithmetic of a replica: KV bytes per token, weight bytes, and vLLM's ``num_gpu_blocks``.

Pure functions of the model shape and the profile's memory assumptions (§3.3 and §8 of
``reference/vllm-engine-semantics.md``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twin.engine_profiles.profile import EngineProfile

BF16_BYTES = 2


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for every layer, all KV heads (whole replica): 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_heads_per_rank(*, num_kv_heads: int, tp: int) -> int:
    """KV heads one TP rank stores (replicated when TP exceeds the KV head count)."""
    return max(1, num_kv_heads // tp)


def linear_params_per_layer(model: Any) -> int:
    """Parameters of the QKV, O, gate/up and down projections of one layer (no biases)."""
    h, hd = model.hidden_size, model.head_dim
    q = model.num_attention_heads * hd
    kv = model.num_kv_heads * hd
    return h * (q + 2 * kv) + q * h + 3 * h * model.intermediate_size


def param_counts(model: Any) -> tuple[int, int]:
    """(linear-layer parameters, embedding + lm_head + norm parameters) of the whole model."""
    linear = model.num_layers * linear_params_per_layer(model)
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    norms = (2 * model.num_layers + 1) * model.hidden_size
    return linear, embeddings + norms


def weight_bytes(model: Any, *, weight_dtype_bytes: int) -> int:
    """Whole-replica weight bytes. Linear layers in the weight dtype; embeddings, lm_head and norms in BF16, or in
    the weight dtype where it is wider (how FP8 checkpoints are stored; for BF16 this is simply params * 2, for FP32
    params * 4)."""
    linear, other = param_counts(model)
    return linear * weight_dtype_bytes + other * max(weight_dtype_bytes, BF16_BYTES)


def weight_bytes_per_gpu(model: Any, *, weight_dtype_bytes: int, tp: int) -> int:
    """Largest per-rank share: linear layers and the vocab-parallel embedding/lm_head are split over TP ranks;
    norms are replicated (both in BF16 or the wider weight dtype, as ``weight_bytes``)."""
    linear, other = param_counts(model)
    norms = (2 * model.num_layers + 1) * model.hidden_size
    embeddings = other - norms
    unquantized = max(weight_dtype_bytes, BF16_BYTES)
    return (
        math.ceil(linear / tp) * weight_dtype_bytes
        + math.ceil(embeddings / tp) * unquantized
        + norms * unquantized
    )


def derive_num_gpu_blocks(
    profile: EngineProfile,
    *,
    block_size: int,
    gpu_memory_utilization: float | None = None,
    max_num_batched_tokens: int,
) -> int:
    """KV blocks per replica as vLLM derives them at startup (an estimate: prefer the real startup log).

    Per GPU: ``ceil(total * util) - weights/GPU - non-torch - activation peak - CUDA graphs``, divided by
    the bytes of one block on that GPU; the minimum over ranks (all ranks are identical here).
    """
    if block_size <= 0 or max_num_batched_tokens <= 0:
        raise ValueError("block_size and max_num_batched_tokens must be positive")
    mem = profile.memory
    util = mem.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
    if not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    from twin.engine_profiles.profile import DTYPE_BYTES

    model, tp = profile.model, profile.tp
    requested = math.ceil(profile.hardware.gpu_memory_bytes * util)
    weights = weight_bytes_per_gpu(model, weight_dtype_bytes=DTYPE_BYTES[profile.weight_dtype], tp=tp)
    non_kv = (
        mem.non_torch_bytes_per_gpu
        + mem.activation_bytes_per_batched_token * max_num_batched_tokens
        + mem.cudagraph_bytes_per_gpu
    )
    available = requested - weights - non_kv
    bytes_per_block = (
        model.num_layers
        * kv_heads_per_rank(num_kv_heads=model.num_kv_heads, tp=tp)
        * block_size
        * 2
        * model.head_dim
        * DTYPE_BYTES[profile.kv_dtype]
    )
    if available < bytes_per_block:
        raise ValueError(
            f"{profile.name}: no room for KV cache ({available / 2**30:.2f} GiB left per GPU after weights and overheads)"
        )
    return available // bytes_per_block
