"""Measured H100 kernel tables (public data under ``../shared/calibration/raw``) as interpolating lookups.

Only ``derive`` imports this module (it needs pandas/pyarrow to read Parquet). All returned times are
seconds for one kernel call on one GPU.

* GEMM (aiconfigurator, vLLM 0.19.0 default kernels): latency by (m tokens, n, k), bf16 and fp8 per-tensor;
  linear interpolation in m, then in n and k between grid values (linear extrapolation beyond).
* decode attention (aiconfigurator ``generation_attention``): bilinear in (batch, KV length) per head layout.
* prefill attention (aiconfigurator ``context_attention``, batch 1): linear in causal query-key pairs.
* all-reduce (aiconfigurator vLLM custom all-reduce, graph and eager; NCCL): linear in message size.
* elementwise ops (vidur, Llama-2 FP16 on H100): RMSNorm, RoPE, SiLU*mul, residual add per layer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from twin.paths import shared_dir

AIC = "calibration/raw/aiconfigurator/systems/data/h100_sxm"
GEMM_FILE = f"{AIC}/gemm/vllm/0.19.0/gemm_perf.parquet"
GEN_ATTN_FILE = f"{AIC}/attention/vllm/0.19.0/generation_attention_perf.parquet"
CTX_ATTN_FILE = f"{AIC}/attention/vllm/0.19.0/context_attention_perf.parquet"
CUSTOM_AR_FILE = f"{AIC}/comm/vllm/0.19.0/custom_allreduce_perf.parquet"
NCCL_FILE = f"{AIC}/comm/nccl/2.27.3/nccl_perf.parquet"
VIDUR_70B_FILE = "calibration/raw/vidur/data/profiling/compute/h100/meta-llama/Llama-2-70b-hf/mlp.csv"
KERNEL_SOURCES = [GEMM_FILE, GEN_ATTN_FILE, CTX_ATTN_FILE, CUSTOM_AR_FILE, NCCL_FILE, VIDUR_70B_FILE]
MS = 1e-3


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear interpolation with linear extrapolation at both ends."""
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = int(np.searchsorted(xs, x)) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return float(max(y, min(y0, y1) if x < x0 else y))


def _bracket(v: float, grid: list[int]) -> tuple[int, int, float]:
    """Two grid neighbours of v and the weight of the upper one (linear extrapolation allowed)."""
    if v in grid:
        return v, v, 0.0
    j = bisect.bisect_left(grid, v)
    lo, hi = (grid[0], grid[1]) if j == 0 else (grid[-2], grid[-1]) if j == len(grid) else (grid[j - 1], grid[j])
    return lo, hi, (v - lo) / (hi - lo)


def _nearest_layout(table: dict, heads: int, kv_heads: int, head_dim: int, kv_dtype: str, *, by_kv: bool):
    """The measured head layout for (heads, kv_heads), or the nearest one and a proportional scale factor
    (decode attention scales with KV heads read, prefill attention with query heads computed)."""
    dt = "bfloat16" if kv_dtype == "bf16" else "fp8"
    key = (heads, kv_heads, head_dim, dt)
    if key in table:
        return key, 1.0
    same = [k for k in table if k[2] == head_dim and k[3] == dt]
    if not same:
        raise KeyError(f"no attention timings for head_dim {head_dim}, kv dtype {kv_dtype}")
    near = min(same, key=lambda k: (abs(np.log(k[0] / heads)) + abs(np.log(k[1] / kv_heads)), k))
    return near, (kv_heads / near[1]) if by_kv else (heads / near[0])


@dataclass(eq=False)  # identity hash: one loaded instance per root (see load_tables)
class KernelTables:
    root: Path
    _gemm: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _gemm_n: list[int] = field(default_factory=list)
    _gemm_k: list[int] = field(default_factory=list)
    _gen: dict[tuple, dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    _ctx: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _ar: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _vidur: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    # ---- loading -------------------------------------------------------------------------------
    def load(self) -> KernelTables:
        import pandas as pd

        g = pd.read_parquet(self.root / GEMM_FILE)
        for (dt, n, k), d in g.groupby(["gemm_dtype", "n", "k"]):
            d = d.groupby("m", as_index=False)["latency"].median().sort_values("m")
            self._gemm[(str(dt), int(n), int(k))] = (d["m"].to_numpy(float), d["latency"].to_numpy(float) * MS)
        self._gemm_n = sorted({key[1] for key in self._gemm})
        self._gemm_k = sorted({key[2] for key in self._gemm})

        ga = pd.read_parquet(self.root / GEN_ATTN_FILE)
        ga = ga[ga["window_size"] == 0]
        keys = ["num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype"]
        for key, d in ga.groupby(keys):
            rows = {}
            for b, db in d.groupby("batch_size"):
                db = db.groupby("step", as_index=False)["latency"].median().sort_values("step")
                if len(db) >= 2:  # large batch x long KV combinations are missing (out of memory when collected)
                    rows[int(b)] = (db["step"].to_numpy(float), db["latency"].to_numpy(float) * MS)
            self._gen[tuple(key)] = rows

        ca = pd.read_parquet(self.root / CTX_ATTN_FILE)
        ca = ca[(ca["window_size"] == 0) & (ca["batch_size"] == 1)]
        for key, d in ca.groupby(keys):
            d = d.groupby("isl", as_index=False)["latency"].median().sort_values("isl")
            isl = d["isl"].to_numpy(float)
            self._ctx[tuple(key)] = (isl * (isl + 1) / 2, d["latency"].to_numpy(float) * MS)

        ar = pd.read_parquet(self.root / CUSTOM_AR_FILE)
        for (src, n), d in ar.groupby(["kernel_source", "num_gpus"]):
            d = d.sort_values("message_size")
            self._ar[(str(src), int(n))] = (d["message_size"].to_numpy(float), d["latency"].to_numpy(float) * MS)
        nc = pd.read_parquet(self.root / NCCL_FILE)
        nc = nc[(nc["op_name"] == "all_reduce") & (nc["nccl_dtype"] == "half")]
        for n, d in nc.groupby("num_gpus"):
            d = d.groupby("message_size", as_index=False)["latency"].median().sort_values("message_size")
            self._ar[("nccl", int(n))] = (d["message_size"].to_numpy(float), d["latency"].to_numpy(float) * MS)

        v = pd.read_csv(self.root / VIDUR_70B_FILE)
        v = v[v["num_tensor_parallel_workers"] == 1]
        for op in ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add"):
            d = v.groupby("num_tokens", as_index=False)[f"time_stats.{op}.median"].median().sort_values("num_tokens")
            self._vidur[op] = {1: (d["num_tokens"].to_numpy(float), d[f"time_stats.{op}.median"].to_numpy(float) * MS)}
        return self

    # ---- lookups --------------------------------------------------------------------------------
    def gemm_s(self, *, m: int, n: int, k: int, dtype: str) -> float:
        table = "bfloat16" if dtype == "bf16" else "fp8"
        n0, n1, wn = _bracket(n, self._gemm_n)
        k0, k1, wk = _bracket(k, self._gemm_k)

        def at(nn: int, kk: int) -> float:
            ms, lat = self._gemm[(table, nn, kk)]
            return _interp(m, ms, lat)

        lo = (1 - wk) * at(n0, k0) + wk * at(n0, k1)
        hi = (1 - wk) * at(n1, k0) + wk * at(n1, k1)
        return max((1 - wn) * lo + wn * hi, 0.0)

    def decode_attention_s(self, *, batch: int, kv_len: float, heads: int, kv_heads: int, head_dim: int, kv_dtype: str) -> float:
        key, scale = _nearest_layout(self._gen, heads, kv_heads, head_dim, kv_dtype, by_kv=True)
        rows = self._gen[key]
        b0, b1, wb = _bracket(batch, sorted(rows))
        lo = _interp(kv_len, *rows[b0])
        hi = _interp(kv_len, *rows[b1])
        return scale * max((1 - wb) * lo + wb * hi, 0.0)

    def prefill_attention_s(self, *, pairs: float, heads: int, kv_heads: int, head_dim: int, kv_dtype: str) -> float:
        key, scale = _nearest_layout(self._ctx, heads, kv_heads, head_dim, kv_dtype, by_kv=False)
        return scale * _interp(pairs, *self._ctx[key])

    def all_reduce_s(self, *, elements: int, tp: int, cuda_graph: bool) -> float:
        """bf16 all-reduce of ``elements`` values across ``tp`` GPUs: vLLM custom all-reduce (graph-captured
        for small decode batches, eager otherwise) or NCCL, whichever the tables say is faster."""
        if tp == 1:
            return 0.0
        custom = self._ar[("vLLM_custom_graph" if cuda_graph else "vLLM_custom_eager", tp)]
        best = _interp(elements, *custom)
        if elements >= self._ar[("nccl", tp)][0][0]:
            best = min(best, _interp(elements, *self._ar[("nccl", tp)]))
        return best

    def elementwise_s(self, *, tokens: int, hidden: int, intermediate_per_rank: int, qk_dim_per_rank: int) -> float:
        """Per-layer RMSNorm x2, RoPE and SiLU*mul, scaled from Llama-2-70B TP1 (hidden 8192,
        FFN 28672, 64+8 heads of 128) by the width each op touches (their cost is memory traffic)."""

        def op(name: str, scale: float) -> float:
            xs, ys = self._vidur[name][1]
            return _interp(tokens, xs, ys) * scale

        h = hidden / 8192
        return (
            op("input_layernorm", h)
            + op("post_attention_layernorm", h)
            + op("attn_rope", qk_dim_per_rank / (72 * 128))
            + op("mlp_act", intermediate_per_rank / 28672)
        )  # the residual add is fused into vLLM's RMSNorm (fused_add_rms_norm), so vidur's `add` is left out


@lru_cache(maxsize=2)
def load_tables(root: str | None = None) -> KernelTables:
    return KernelTables(root=Path(root) if root else shared_dir()).load()
