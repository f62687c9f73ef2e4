"""Operator-level step time of a Llama-shape replica on H100, summed from measured kernel tables.

Per layer, at the per-rank shapes of tensor parallelism: QKV, O, gate/up and down GEMMs at m = tokens in
the step; decode attention by (batch, mean KV length); prefill attention by causal query-key pairs; two
all-reduces of tokens x hidden bf16 values; RMSNorm/RoPE/SiLU/residual elementwise ops. Plus the lm_head
GEMM for the sampled rows (one per request in the step). Model execution only: the per-step overhead
outside the forward pass is added by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.engine_profiles.kernels import KernelTables
from twin.engine_profiles.memory import kv_heads_per_rank
from twin.engine_profiles.profile import ModelShape
from twin.engine_profiles.step import StepShape

CUDA_GRAPH_MAX_TOKENS = 512  # vLLM V1 captures full CUDA graphs for decode batches up to this size


def rank_layout(model: ModelShape, tp: int) -> tuple[int, int, list[tuple[int, int]]]:
    """Per-rank attention heads, KV heads and the (n, k) of the QKV, O, gate+up and down GEMMs at TP ``tp``."""
    if model.num_attention_heads % tp:
        raise ValueError(f"TP {tp} does not divide {model.num_attention_heads} attention heads")
    heads = model.num_attention_heads // tp
    kv_heads = kv_heads_per_rank(num_kv_heads=model.num_kv_heads, tp=tp)
    h, hd, inter = model.hidden_size, model.head_dim, model.intermediate_size // tp
    return heads, kv_heads, [((heads + 2 * kv_heads) * hd, h), (h, heads * hd), (2 * inter, h), (h, inter)]


@dataclass(frozen=True)
class OperatorStepModel:
    model: ModelShape
    tp: int
    weight_dtype: str
    kv_dtype: str
    tables: KernelTables

    def components_s(self, shape: StepShape) -> dict[str, float]:
        m, tp, t = self.model, self.tp, self.tables
        heads, kv_heads, gemms = rank_layout(m, tp)
        h, hd, inter = m.hidden_size, m.head_dim, m.intermediate_size // tp
        tokens = shape.total_tokens
        gemm = sum(t.gemm_s(m=tokens, n=n, k=k, dtype=self.weight_dtype) for n, k in gemms)
        attn_args = {"heads": heads, "kv_heads": kv_heads, "head_dim": hd, "kv_dtype": self.kv_dtype}
        attention = 0.0
        if shape.decode_requests:
            attention += t.decode_attention_s(
                batch=shape.decode_requests,
                kv_len=shape.decode_context_tokens / shape.decode_requests,
                **attn_args,
            )
        if shape.prefill_attention_pairs:
            attention += t.prefill_attention_s(pairs=shape.prefill_attention_pairs, **attn_args)
        graph = shape.is_decode_only and tokens <= CUDA_GRAPH_MAX_TOKENS
        all_reduce = 2 * t.all_reduce_s(elements=tokens * h, tp=tp, cuda_graph=graph)
        elementwise = t.elementwise_s(
            tokens=tokens, hidden=h, intermediate_per_rank=inter, qk_dim_per_rank=(heads + kv_heads) * hd
        )
        sampled = shape.decode_requests + shape.prefill_requests
        lm_head = t.gemm_s(m=sampled, n=-(-m.vocab_size // tp), k=h, dtype="bf16")
        layers = m.num_layers
        return {
            "gemm": layers * gemm,
            "attention": layers * attention,
            "all_reduce": layers * all_reduce,
            "elementwise": layers * elementwise,
            "lm_head": lm_head,
        }

    def model_s(self, shape: StepShape) -> float:
        return sum(self.components_s(shape).values())
