"""Kernel tables measured on one GPU by ``scripts/measure_gpu_ops.py`` (PyTorch), as ``KernelTables`` lookups.

Only ``derive`` imports this module: for the shipped H200 runs (``--hardware h200``) or a user's own run folders
(``--ops``). The H200 folder (``data/h200-sxm/``, see its ``SOURCES.md``) holds five runs of
the script, each ``ops.csv`` + ``manifest.json``: ``isolated`` (every section, 2 ms timed replays), ``sustained``
(GEMMs at m >= 256 and prefill attention, 20 ms replays after 5 s of large GEMMs: a GPU kept busy by serving
runs compute-bound GEMMs ~10 % slower, at power-limited clocks), ``fine`` (the stacked models' GEMMs every 64
tokens, sustained), ``repeat`` (the isolated run again, for the run-to-run spread) and ``mixed``; ``repeat``,
``sustained`` and ``mixed`` also time whole layer stacks (``stack_checks``). The tables use:

* GEMMs (bf16, fp8 per-tensor) by m: ``sustained``/``fine`` where measured, else ``isolated``, linear in m
  between measured values; the exact per-rank (n, k) of the shipped models where measured, else linear
  interpolation over the measured (n, k) grid, as for the H100 tables;
* decode attention by (batch, KV length) and causal prefill attention by prompt length, per head layout,
  bf16 KV: the fastest PyTorch backend per shape (cuDNN, flash or memory-efficient), from ``isolated``;

and takes from the H100 tables what one PyTorch GPU cannot measure (``H100_FALLBACKS``):

* fp8 KV attention: the measured bf16 time x the H100 tables' fp8 / bf16 ratio at the same shape (PyTorch has
  no fp8-KV attention kernel);
* all-reduce across GPUs (one GPU was lent): H100's vLLM custom all-reduce / NCCL, which assumes the same
  NVLink 4 / NVSwitch fabric (H200 SXM and H100 SXM both have 900 GB/s);
* elementwise ops (RMSNorm, RoPE, SiLU*mul): vidur's H100 medians (vLLM fuses them; PyTorch eager does not,
  so its timings would overstate them).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.engine_profiles.kernels import KernelTables, _interp
from twin.engine_profiles.operator_model import rank_layout
from twin.engine_profiles.profile import ModelShape
from twin.engine_profiles.step import prefill_attention_work

H200_TABLE_RUNS = ("isolated", "sustained", "fine")  # the runs the shipped H200 tables are read from
STACK_RUNS = ("repeat", "sustained", "mixed")  # the runs holding whole-stack timings
H100_FALLBACKS = ("fp8 KV attention: bf16 measured x H100 fp8/bf16 ratio", "all-reduce: H100 tables",
                  "elementwise: vidur H100")


@dataclass(eq=False)
class MeasuredTables(KernelTables):
    """``KernelTables`` read from measured run folders (``runs``); ``h100`` supplies what they cannot.

    A run whose manifest says ``graph_target_s`` >= 0.01 was timed at sustained clocks: its GEMMs replace the
    other runs' at the same shape and m. Of the other runs, GEMMs and attention cells are the median across
    runs (attention: each run's fastest backend)."""

    h100: KernelTables | None = None
    runs: tuple[Path, ...] = ()
    _exact: set[tuple[str, int, int]] | None = None

    def load(self) -> MeasuredTables:  # noqa: C901 - one pass over each run's CSV, grouped by op
        if self.h100 is None:
            raise ValueError("MeasuredTables needs the H100 tables for all-reduce, elementwise and fp8 KV ratios")
        if not self.runs:
            raise ValueError("MeasuredTables needs at least one run folder")
        gemm: dict[tuple[str, int, int], dict[int, list[float]]] = {}
        sustained: dict[tuple[str, int, int], dict[int, list[float]]] = {}
        grid: set[tuple[int, int]] = set()
        dec: dict[tuple, dict[tuple[int, int], list[float]]] = {}
        pre: dict[tuple, dict[int, list[float]]] = {}
        for run in self.runs:
            rows = read_ops(run)
            if not rows:
                raise ValueError(f"{run}: no ops.csv rows (a folder written by scripts/measure_gpu_ops.py --out)")
            target = run_settings(run).get("graph_target_s", 0.002)
            by_m = sustained if target >= 0.01 else gemm
            run_dec: dict[tuple, float] = {}
            run_pre: dict[tuple, float] = {}
            for r in rows:
                lat = float(r["latency_us"]) * 1e-6
                if r["op"] == "gemm":
                    key = ("bfloat16" if r["dtype"] == "bf16" else "fp8", int(r["n"]), int(r["k"]))
                    by_m.setdefault(key, {}).setdefault(int(r["m"]), []).append(lat)
                    if r["section"] == "gemm_grid":
                        grid.add((int(r["n"]), int(r["k"])))
                elif r["op"] in ("decode_attention", "prefill_attention") and by_m is gemm:
                    lay = (int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]), "bfloat16")
                    if r["op"] == "decode_attention":
                        cell = (lay, int(r["batch"]), int(r["kv_len"]))
                        run_dec[cell] = min(run_dec.get(cell, np.inf), lat)  # fastest backend
                    else:
                        cell = (lay, int(r["kv_len"]))
                        run_pre[cell] = min(run_pre.get(cell, np.inf), lat)
            for (lay, b, L), lat in run_dec.items():
                dec.setdefault(lay, {}).setdefault((b, L), []).append(lat)
            for (lay, L), lat in run_pre.items():
                pre.setdefault(lay, {}).setdefault(L, []).append(lat)
        for key, ms in sustained.items():  # sustained timings replace the others at the same shape and m
            gemm.setdefault(key, {}).update(ms)
        for key, by_m in gemm.items():
            ms = sorted(by_m)
            self._gemm[key] = (np.array(ms, float), np.array([float(np.median(by_m[m])) for m in ms]))
        self._exact = set(self._gemm)
        self._gemm_n = sorted({n for n, _ in grid})
        self._gemm_k = sorted({k for _, k in grid})
        for lay, cells in dec.items():
            rows_by_b = {}
            for b in sorted({b for b, _ in cells}):
                kv = sorted(L for bb, L in cells if bb == b)
                if len(kv) >= 2:
                    rows_by_b[b] = (np.array(kv, float), np.array([float(np.median(cells[(b, L)])) for L in kv]))
            self._gen[lay] = rows_by_b
        for lay, cells in pre.items():
            isl = np.array(sorted(cells), float)
            self._ctx[lay] = (isl * (isl + 1) / 2, np.array([float(np.median(cells[int(L)])) for L in isl]))
        self._ar = self.h100._ar
        self._vidur = self.h100._vidur
        return self

    def gemm_s(self, *, m: int, n: int, k: int, dtype: str) -> float:
        key = ("bfloat16" if dtype == "bf16" else "fp8", n, k)
        if key in self._exact:
            return max(_interp(m, *self._gemm[key]), 0.0)
        return super().gemm_s(m=m, n=n, k=k, dtype=dtype)

    def decode_attention_s(self, *, batch: int, kv_len: float, heads: int, kv_heads: int, head_dim: int,
                           kv_dtype: str) -> float:
        args = {"batch": batch, "kv_len": kv_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        bf16 = super().decode_attention_s(**args, kv_dtype="bf16")
        return bf16 if kv_dtype == "bf16" else bf16 * self._fp8_ratio(self.h100.decode_attention_s, args)

    def prefill_attention_s(self, *, pairs: float, heads: int, kv_heads: int, head_dim: int, kv_dtype: str) -> float:
        args = {"pairs": pairs, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        bf16 = super().prefill_attention_s(**args, kv_dtype="bf16")
        return bf16 if kv_dtype == "bf16" else bf16 * self._fp8_ratio(self.h100.prefill_attention_s, args)

    @staticmethod
    def _fp8_ratio(fn, args: dict) -> float:
        return fn(**args, kv_dtype="fp8") / fn(**args, kv_dtype="bf16")


def read_ops(run: Path) -> list[dict[str, str]]:
    """The rows of one run's ``ops.csv`` (empty if the run folder is absent)."""
    path = run / "ops.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def run_manifest(run: Path) -> dict:
    """A run's ``manifest.json`` (empty if absent)."""
    path = run / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def run_settings(run: Path) -> dict:
    return run_manifest(run).get("settings", {})


def load_measured(runs: list[Path] | tuple[Path, ...], h100: KernelTables) -> MeasuredTables:
    """Tables from ``scripts/measure_gpu_ops.py`` run folders (the first one's parent is the tables' ``root``,
    where ``stack_checks`` looks for the stack runs)."""
    runs = tuple(Path(r) for r in runs)
    return MeasuredTables(root=runs[0].parent if runs else Path("."), h100=h100, runs=runs).load()


@dataclass(frozen=True)
class StackCheck:
    """A whole per-rank layer stack as timed (``stack`` section) beside the operator tables' sum for it."""

    run: str
    kind: str  # "decode", "prefill" or "mixed" (decodes and one prompt in the same pass)
    model: str
    tp: int
    dtype: str
    tokens: int
    batch: int
    kv_len: int
    chunk: int  # prompt tokens in a mixed pass (0 otherwise)
    layers: int
    measured_s: float
    predicted_s: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def stack_checks(tables: MeasuredTables, models: dict[str, ModelShape]) -> list[StackCheck]:
    """Every measured layer stack (the ``repeat``, ``sustained`` and ``mixed`` runs; fastest attention backend per
    stack) against ``layers x (QKV + O + gate/up + down GEMMs + attention)`` from the tables: the stack has no
    all-reduce, norms, activations, lm_head or host time, so neither does the prediction. Attention is bf16
    KV (the stack's); decodes use one KV length for the whole batch, a prompt has no cached prefix."""
    best: dict[tuple, float] = {}
    for run in STACK_RUNS:
        for r in read_ops(tables.root / run):
            if r["op"].startswith("stack_"):
                key = (run, r["op"][6:], r["model"], int(float(r["tp"])), r["dtype"], int(r["m"]), int(r["batch"]),
                       int(r["kv_len"]), int(r.get("chunk") or 0), int(float(r["layers"])))
                best[key] = min(best.get(key, np.inf), float(r["latency_us"]) * 1e-6)
    out = []
    for (run, kind, model, tp, dtype, tokens, batch, kv_len, chunk, layers), measured in sorted(best.items()):
        heads, kvh, shapes = rank_layout(models[model], tp)
        gemms = sum(tables.gemm_s(m=tokens, n=n, k=k, dtype=dtype) for n, k in shapes)
        lay = {"heads": heads, "kv_heads": kvh, "head_dim": models[model].head_dim, "kv_dtype": "bf16"}
        if kind == "prefill":
            attention = tables.prefill_attention_s(pairs=prefill_attention_work(0, tokens), **lay)
        else:
            attention = tables.decode_attention_s(batch=batch, kv_len=kv_len, **lay)
            if kind == "mixed":
                attention += tables.prefill_attention_s(pairs=prefill_attention_work(0, chunk), **lay)
        out.append(StackCheck(run=run, kind=kind, model=model, tp=tp, dtype=dtype, tokens=tokens, batch=batch,
                              kv_len=kv_len, chunk=chunk, layers=layers, measured_s=measured,
                              predicted_s=layers * (gemms + attention)))
    return out
