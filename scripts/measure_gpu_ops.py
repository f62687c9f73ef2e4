r"""Measure the operator timings an engine profile is derived from, on the GPU this runs on.

    python scripts/measure_gpu_ops.py --out DIR [--budget-s 300] [--models llama3-8b,llama3-70b] [--sections ...]
    python scripts/measure_gpu_ops.py --out DIR2 --sections gemm_models,prefill_attention,gemm_grid,stack \
           --min-m 256 --graph-target-s 0.02 --heat-s 5          # compute-bound GEMMs at sustained clocks
    python -m twin.engine_profiles.derive --model llama3-70b --tp 4 --ops DIR DIR2 --out my-gpu.yaml

(docs/profiles.md, "H200 profiles"). Needs only PyTorch (CUDA build) and the standard library: no vLLM, no
network. Writes, as it goes (a row is flushed the moment it is measured, so a run stopped at its time budget
keeps everything measured so far):

* ``DIR/ops.csv``: one row per operator call shape: bf16 and fp8 (per-tensor scaled, ``torch._scaled_mm``)
  GEMMs by (m, n, k); decode attention by (batch, KV length, heads, KV heads); causal prefill attention by
  prompt length; a bandwidth-bound copy. ``latency_us`` is the median of five timed replays per call.
* ``DIR/manifest.json``: the GPU, driver, torch/CUDA versions, memory CUDA reports, the settings and how
  each section ended (complete, or stopped at its budget with how many shapes were left).

How a shape is timed: one eager call checks it runs and sizes the repeat count R; then R calls are captured
in a CUDA graph (as vLLM runs its decode steps) and the graph is replayed, timed with CUDA events; where the
capture fails the R calls run eagerly and the row says ``graphed=0``. GEMM weights rotate over enough
copies to exceed 128 MB, so a weight is read from HBM as in a real forward pass (each layer has its own), not
from L2. Attention uses ``torch.nn.functional.scaled_dot_product_attention`` with every backend that runs
(cuDNN, flash, memory-efficient), one row each; decode packs the query heads sharing a KV head into the query
length (exact for one query token), so no backend needs GQA support.

What PyTorch cannot stand in for is said where the profile is derived (``docs/engine-profiles.md``): vLLM's
own kernels (FlashAttention 3 with paged KV, CUTLASS fp8 GEMMs, fused RMSNorm/SiLU), fp8 KV attention,
and all-reduce across GPUs (one GPU here).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Llama shapes the shipped profiles use; per-rank GEMM shapes are derived from them for TP 1, 2, 4, 8.
MODELS = {
    "llama3-8b": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256),
    "llama3-70b": dict(layers=80, hidden=8192, inter=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256),
}
TPS = (1, 2, 4, 8)
GEMM_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
          8192, 16384)
GRID_N = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
GRID_K = (512, 1024, 2048, 4096, 8192, 16384, 32768)
GRID_M = (1, 8, 32, 128, 512, 2048, 8192)
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DECODE_KV = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
PREFILL_LEN = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
KV_BYTES_CAP = 24e9  # decode shapes whose K+V exceed this are left out
ROTATE_BYTES = 128 * 2**20
GRAPH_TARGET_S = 2e-3  # R calls per replay sized so one replay takes about this long
REPLAYS = 5
STACK = (  # (model, tp, weight dtype): per-rank layer stacks timed whole (section "stack")
    ("llama3-70b", 4, "fp8"),
    ("llama3-8b", 1, "bf16"),
)
STACK_DECODE = ((1, 2048), (16, 2048), (64, 2048), (128, 1024))  # (batch, KV length)
STACK_PREFILL = (512, 2048, 8192)  # one prompt of this many tokens
STACK_MIXED = ((64, 2048, 512), (64, 2048, 2048), (128, 1024, 2048))  # decodes (batch, KV length) + one prompt
FINE_M = tuple(range(256, 4097, 64))  # section gemm_fine: the stack models' GEMMs every 64 tokens (tile effects)
FIELDS = ["section", "op", "dtype", "m", "m_run", "n", "k", "batch", "kv_len", "heads", "kv_heads", "head_dim",
          "backend", "graphed", "reps", "buffers", "model", "tp", "layers", "chunk", "latency_us", "latency_us_min",
          "latency_us_max"]


class Timer:
    """Times a zero-argument callable: eager once, then R calls per CUDA graph replay (eager on CPU)."""

    def __init__(self, device: str, target_s: float = GRAPH_TARGET_S):
        self.device = device
        self.cuda = device.startswith("cuda")
        self.target_s = target_s

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def warm_up(self, seconds: float = 2.0) -> None:
        """Run large GEMMs for a while so the first shapes are not timed at idle clocks."""
        if not self.cuda:
            return
        a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once_s(self, fn) -> float:
        fn()  # first call: kernel selection, workspace
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def time(self, fns: list) -> tuple[list[float], int, bool]:
        """Per-call seconds of each replay, R, graphed. ``fns`` rotates over buffers (call i runs fns[i % len])."""
        est = self.once_s(fns[0])
        reps = max(1, min(256, int(self.target_s / max(est, 1e-7))))
        if not self.cuda:
            out = []
            for _ in range(3):
                t0 = time.perf_counter()
                for i in range(reps):
                    fns[i % len(fns)]()
                out.append((time.perf_counter() - t0) / reps)
            return out, reps, False
        graph = None
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for f in fns[: min(len(fns), 3)]:
                    f()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(reps):
                    fns[i % len(fns)]()
            run = graph.replay
            graphed = True
        except Exception:  # noqa: BLE001 - a backend that cannot be captured is timed eagerly
            graph = None
            torch.cuda.synchronize()

            def run():
                for i in range(reps):
                    fns[i % len(fns)]()

            graphed = False
        run()
        torch.cuda.synchronize()
        out = []
        for _ in range(REPLAYS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e-3 / reps)
        del graph
        return out, reps, graphed


class Writer:
    def __init__(self, path: Path):
        self.f = path.open("w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=FIELDS)
        self.w.writeheader()
        self.rows = 0

    def row(self, times: list[float], **kw) -> None:
        t = sorted(times)
        kw.update(latency_us=round(t[len(t) // 2] * 1e6, 3), latency_us_min=round(t[0] * 1e6, 3),
                  latency_us_max=round(t[-1] * 1e6, 3))
        self.w.writerow({k: kw.get(k, "") for k in FIELDS})
        self.f.flush()
        self.rows += 1


def rank_layout(model: str, tp: int) -> tuple[int, int, int, list[tuple[int, int]]]:
    """Per-rank (heads, KV heads, head dim) and the (n, k) of the QKV, O, gate+up and down GEMMs at TP ``tp``."""
    m = MODELS[model]
    heads, kvh, hd = m["heads"] // tp, max(1, m["kv_heads"] // tp), m["head_dim"]
    h, inter = m["hidden"], m["inter"] // tp
    return heads, kvh, hd, [((heads + 2 * kvh) * hd, h), (h, heads * hd), (2 * inter, h), (h, inter)]


def model_gemm_shapes(models: list[str]) -> list[tuple[int, int, str]]:
    """(n, k, kind) per-rank GEMMs of every model at every TP: QKV, O, gate+up, down, lm_head (bf16 only)."""
    out = []
    for name in models:
        for tp in TPS:
            out += [(n, k, "layer") for n, k in rank_layout(name, tp)[3]]
            out.append((-(-MODELS[name]["vocab"] // tp), MODELS[name]["hidden"], "lm_head"))
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


def attention_layouts(models: list[str]) -> list[tuple[int, int, int]]:
    seen, out = set(), []
    for name in models:
        for tp in TPS:
            lay = rank_layout(name, tp)[:3]
            if lay not in seen:
                seen.add(lay)
                out.append(lay)
    return out


def gemm_weights(n: int, k: int, dtype: str, device: str) -> list:
    """Enough (n, k) weight copies to exceed ROTATE_BYTES (at most 16)."""
    wbytes = n * k * (1 if dtype == "fp8" else 2)
    nbuf = max(1, min(16, math.ceil(ROTATE_BYTES / wbytes)))
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(nbuf)]
    return ws if dtype == "bf16" else [w.to(torch.float8_e4m3fn) for w in ws]


def gemm_fns(m: int, ws: list, dtype: str, device: str):
    """Callables computing x @ W^T, one per weight copy; returns (fns, m actually run)."""
    n, k = ws[0].shape
    if dtype == "bf16":
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        return [lambda w=w: torch.matmul(x, w.t(), out=out) for w in ws], m
    one = torch.ones((), device=device, dtype=torch.float32)
    for m_run in (m, -(-m // 16) * 16):  # cuBLASLt fp8 may need m % 16 == 0: pad as vLLM's torch path does
        x = torch.randn(m_run, k, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        try:
            torch._scaled_mm(x, ws[0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001
            if m_run != m:
                raise
            continue
        return [lambda w=w: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                for w in ws], m_run
    raise RuntimeError("unreachable")


def sdpa_backends():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return [("default", None)]
    out = []
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        if hasattr(SDPBackend, name):
            out.append((name.split("_")[0].lower(), (sdpa_kernel, getattr(SDPBackend, name))))
    return out or [("default", None)]


def with_backend(backend, fn):
    if backend is None:
        return fn
    ctx, which = backend

    def run():
        with ctx(which):
            return fn()

    return run


class Section:
    def __init__(self, name: str, budget_s: float, manifest: dict):
        self.name, self.deadline, self.manifest = name, time.monotonic() + budget_s, manifest
        self.done = self.failed = self.skipped = 0
        self.errors: list[str] = []

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def fail(self, what: str, e: Exception) -> None:
        self.failed += 1
        if len(self.errors) < 20:
            self.errors.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")

    def close(self, left: int) -> None:
        self.skipped = left
        self.manifest["sections"][self.name] = {"measured": self.done, "failed": self.failed,
                                                "left_at_budget": left, "errors": self.errors}
        print(f"[{self.name}] measured {self.done}, failed {self.failed}, left {left}", flush=True)


def run_gemms(sec: Section, w: Writer, t: Timer, shapes: list[tuple[int, int, str]], ms, device: str,
              section: str) -> None:
    """GEMMs of the (n, k, kind) shapes at every m in ``ms``: bf16 and fp8, lm_head bf16 only."""
    typed = [(n, k, dtype) for n, k, kind in shapes for dtype in (("bf16",) if kind == "lm_head" else ("bf16", "fp8"))]
    run_gemms_typed(sec, w, t, typed, ms, device, section)


def stack_gemm_shapes(configs) -> list[tuple[int, int, str]]:
    """(n, k, dtype) of the per-rank GEMMs of each stack configuration, in that configuration's weight dtype."""
    return [(n, k, wd) for model, tp, wd in configs for n, k in rank_layout(model, tp)[3]]


def run_gemms_typed(sec: Section, w: Writer, t: Timer, shapes: list[tuple[int, int, str]], ms, device: str,
                    section: str) -> None:
    """GEMMs of given (n, k, dtype) at every m in ``ms``."""
    for i, (n, k, dtype) in enumerate(shapes):
        if sec.over():
            sec.close((len(shapes) - i) * len(ms))
            return
        try:
            ws = gemm_weights(n, k, dtype, device)
        except Exception as e:  # noqa: BLE001
            sec.fail(f"gemm {dtype} weights n={n} k={k}", e)
            continue
        for m in ms:
            try:
                fns, m_run = gemm_fns(m, ws, dtype, device)
                times, reps, graphed = t.time(fns)
                w.row(times, section=section, op="gemm", dtype=dtype, m=m, m_run=m_run, n=n, k=k,
                      graphed=int(graphed), reps=reps, buffers=len(ws))
                sec.done += 1
            except Exception as e:  # noqa: BLE001
                sec.fail(f"gemm {dtype} m={m} n={n} k={k}", e)
            fns = None
        ws = None
        t.free()
    sec.close(0)


def run_decode(sec: Section, w: Writer, t: Timer, layouts, device: str, batches, kvs) -> None:
    backends = sdpa_backends()
    todo = [(lay, b, L) for lay in layouts for L in kvs for b in batches
            if b * L * lay[1] * lay[2] * 4 <= KV_BYTES_CAP]
    for i, ((heads, kvh, hd), b, L) in enumerate(todo):
        if sec.over():
            sec.close(len(todo) - i)
            return
        g = heads // kvh
        try:
            q = torch.randn(b, kvh, g, hd, device=device, dtype=torch.bfloat16)
            kk = torch.randn(b, kvh, L, hd, device=device, dtype=torch.bfloat16)
            vv = torch.randn_like(kk)
        except Exception as e:  # noqa: BLE001
            sec.fail(f"decode alloc b={b} L={L}", e)
            continue
        for bname, backend in backends:
            try:
                fn = with_backend(backend, lambda: F.scaled_dot_product_attention(q, kk, vv))
                times, reps, graphed = t.time([fn])
                w.row(times, section="decode_attention", op="decode_attention", dtype="bf16", batch=b, kv_len=L,
                      heads=heads, kv_heads=kvh, head_dim=hd, backend=bname, graphed=int(graphed), reps=reps,
                      buffers=1)
                sec.done += 1
            except Exception as e:  # noqa: BLE001
                sec.fail(f"decode {bname} {heads}/{kvh} b={b} L={L}", e)
        q = kk = vv = None
    sec.close(0)


def run_prefill(sec: Section, w: Writer, t: Timer, layouts, device: str, lens) -> None:
    backends = sdpa_backends()
    todo = [(lay, L) for lay in layouts for L in lens]
    for i, ((heads, kvh, hd), L) in enumerate(todo):
        if sec.over():
            sec.close(len(todo) - i)
            return
        q = torch.randn(1, heads, L, hd, device=device, dtype=torch.bfloat16)
        kk = torch.randn(1, kvh, L, hd, device=device, dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        # GQA: repeat K/V outside the timed call (not every backend takes enable_gqa); the backends are
        # compute-bound here, so reading the repeated heads costs little
        kr, vr = kk.repeat_interleave(heads // kvh, dim=1), vv.repeat_interleave(heads // kvh, dim=1)
        for bname, backend in backends:
            try:
                fn = with_backend(backend, lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
                times, reps, graphed = t.time([fn])
                w.row(times, section="prefill_attention", op="prefill_attention", dtype="bf16", batch=1, kv_len=L,
                      heads=heads, kv_heads=kvh, head_dim=hd, backend=bname, graphed=int(graphed), reps=reps,
                      buffers=1)
                sec.done += 1
            except Exception as e:  # noqa: BLE001
                sec.fail(f"prefill {bname} {heads}/{kvh} L={L}", e)
        q = kk = vv = kr = vr = None
    sec.close(0)


def one_weight(n: int, k: int, dtype: str, device: str):
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    return w if dtype == "bf16" else w.to(torch.float8_e4m3fn)


def run_stack(sec: Section, w: Writer, t: Timer, device: str, configs, decode, prefill, mixed=(),
              layers_override: int | None = None) -> None:
    """Whole per-rank forward passes without all-reduce, norms or activations: per layer the QKV GEMM, attention
    (bf16 KV; each of cuDNN and flash, one row each), O, gate+up and down GEMMs, each layer with its own weights
    and KV, captured as one CUDA graph. Three kinds: ``decode`` (batch, KV length), ``prefill`` (one prompt) and
    ``mixed`` (decodes and one whole prompt in the same pass, as a chunked-prefill step runs them). The derive
    side checks that the operator tables summed layer by layer predict these."""
    backends = dict(sdpa_backends())
    todo = [(cfg, kind, shape) for cfg in configs
            for kind, shapes in (("decode", decode), ("prefill", prefill), ("mixed", mixed)) for shape in shapes]
    state: dict = {}
    for i, ((model, tp, wd), kind, shape) in enumerate(todo):
        if sec.over():
            sec.close(len(todo) - i)
            return
        try:
            m = MODELS[model]
            if state.get("key") != (model, tp, wd):
                state.clear()
                t.free()
                heads, kvh, hd, shapes = rank_layout(model, tp)
                nl = layers_override or m["layers"]
                layers = [[one_weight(n, k, wd, device) for n, k in shapes] for _ in range(nl)]
                state.update(key=(model, tp, wd), layers=layers, lay=(heads, kvh, hd))
            heads, kvh, hd = state["lay"]
            bf = {"device": device, "dtype": torch.bfloat16}
            b, L, chunk = {"decode": lambda: (*shape, 0), "prefill": lambda: (0, 0, shape),
                           "mixed": lambda: shape}[kind]()
            tokens = b + chunk
            # per layer: a list of attention calls (q, k, v, causal), each layer with its own K/V
            attn = [[] for _ in state["layers"]]
            if b:
                qd = torch.randn(b, kvh, heads // kvh, hd, **bf)
                for calls in attn:
                    calls.append((qd, torch.randn(b, kvh, L, hd, **bf), torch.randn(b, kvh, L, hd, **bf), False))
            if chunk:
                qp = torch.randn(1, heads, chunk, hd, **bf)
                for calls in attn:
                    calls.append((qp, torch.randn(1, heads, chunk, hd, **bf), torch.randn(1, heads, chunk, hd, **bf),
                                  True))
            per_layer = []  # each layer's GEMMs read that layer's own weights, its attention its own KV
            for li, ws in enumerate(state["layers"]):
                per_layer.append(([gemm_fns(tokens, [ww], wd, device)[0][0] for ww in ws], attn[li]))
            for bname in ("cudnn", "flash"):
                backend = backends.get(bname)
                if backend is None:
                    continue

                def forward(per_layer=per_layer, backend=backend):
                    for calls, attention in per_layer:
                        calls[0]()
                        for q, kk, vv, causal in attention:
                            with_backend(backend, lambda q=q, kk=kk, vv=vv, causal=causal:
                                         F.scaled_dot_product_attention(q, kk, vv, is_causal=causal))()
                        for c in calls[1:]:
                            c()

                try:
                    times, reps, graphed = t.time([forward])
                    w.row(times, section="stack", op=f"stack_{kind}", dtype=wd, m=tokens, batch=b or 1,
                          kv_len=L or chunk, chunk=chunk,
                          heads=heads, kv_heads=kvh, head_dim=hd, backend=bname, graphed=int(graphed), reps=reps,
                          buffers=1, model=model, tp=tp, layers=len(state["layers"]))
                    sec.done += 1
                except Exception as e:  # noqa: BLE001
                    sec.fail(f"stack {model} tp{tp} {kind} {shape} {bname}", e)
            per_layer = attn = None
        except Exception as e:  # noqa: BLE001
            sec.fail(f"stack {model} tp{tp} {kind} {shape}", e)
    state.clear()
    sec.close(0)


def run_bandwidth(sec: Section, w: Writer, t: Timer, device: str) -> None:
    """A device-to-device copy (read + write) and RMSNorm/SiLU*mul as PyTorch runs them, by token count of
    a 8192-wide hidden state (and a 28672-wide FFN half), so elementwise costs can be compared with vidur's H100."""
    sizes = (1, 16, 64, 256, 1024, 4096, 16384)
    for i, tok in enumerate(sizes):
        if sec.over():
            sec.close(len(sizes) - i)
            return
        try:
            x = torch.randn(tok, 8192, device=device, dtype=torch.bfloat16)
            y = torch.empty_like(x)
            wgt = torch.ones(8192, device=device, dtype=torch.bfloat16)
            u = torch.randn(tok, 2 * 28672 // 4, device=device, dtype=torch.bfloat16)
            half = u.shape[1] // 2
            for op, fn in (("copy", lambda: y.copy_(x)),
                           ("rms_norm", lambda: F.rms_norm(x, (8192,), wgt, 1e-5)),
                           ("silu_mul", lambda: F.silu(u[:, :half]) * u[:, half:])):
                times, reps, graphed = t.time([fn])
                w.row(times, section="elementwise", op=op, dtype="bf16", m=tok, n=8192 if op != "silu_mul" else half,
                      graphed=int(graphed), reps=reps, buffers=1)
                sec.done += 1
        except Exception as e:  # noqa: BLE001
            sec.fail(f"elementwise tokens={tok}", e)
    sec.close(0)


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "host": platform.node(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        env.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   mem_get_info_total_bytes=total, mem_get_info_free_bytes=free,
                   cudnn=torch.backends.cudnn.version())
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                "clocks.max.mem,power.limit,pstate,temperature.gpu", "--format=csv"],
                               capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = q.stdout.strip()
        except Exception as e:  # noqa: BLE001
            env["nvidia_smi"] = f"unavailable: {e}"
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=300.0, help="total time budget, split over the sections")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graph-target-s", type=float, default=GRAPH_TARGET_S,
                    help="one timed replay lasts about this long (longer = timed at sustained clocks)")
    ap.add_argument("--min-m", type=int, default=1, help="GEMMs: only m (tokens) at least this")
    ap.add_argument("--heat-s", type=float, default=2.0, help="large GEMMs run this long before the first section")
    ap.add_argument("--sections", help="comma-separated subset of the sections, in the order they run (default all)")
    ap.add_argument("--quick", action="store_true", help="a few shapes per section (to check the script on a CPU)")
    a = ap.parse_args(argv)
    models = a.models.split(",")
    for name in models:
        if name not in MODELS:
            ap.error(f"--models: unknown model {name!r} (known: {', '.join(MODELS)})")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --quick to check the script", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    args = list(argv if argv is not None else sys.argv[1:])
    for i, x in enumerate(args):  # the output folder by its name only: no machine's path in the manifest
        if x == "--out" and i + 1 < len(args):
            args[i + 1] = a.out.name
        elif x.startswith("--out="):
            args[i] = f"--out={a.out.name}"
    manifest = {"command": " ".join([os.path.basename(sys.argv[0]), *args]),
                "environment": environment(a.device), "budget_s": a.budget_s, "models": models,
                "settings": {"rotate_bytes": ROTATE_BYTES, "graph_target_s": a.graph_target_s, "replays": REPLAYS,
                             "min_m": a.min_m, "heat_s": a.heat_s,
                             "kv_bytes_cap": KV_BYTES_CAP}, "sections": {}}
    man_path = a.out / "manifest.json"

    def save_manifest() -> None:
        tmp = man_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(man_path)

    save_manifest()
    w, t = Writer(a.out / "ops.csv"), Timer(a.device, a.graph_target_s)
    gemm_m = tuple(m for m in GEMM_M if m >= a.min_m)
    grid_m = tuple(m for m in GRID_M if m >= a.min_m)
    q = a.quick
    shapes = model_gemm_shapes(models)
    layouts = attention_layouts(models)
    grid = [(n, k, "grid") for n in GRID_N for k in GRID_K]
    plan = [  # (name, share of the budget, runner)
        ("gemm_models", 0.32, lambda s: run_gemms(s, w, t, shapes[:2] if q else shapes, (1, 16) if q else gemm_m,
                                                  a.device, "gemm_models")),
        ("decode_attention", 0.24, lambda s: run_decode(s, w, t, layouts[:1] if q else layouts, a.device,
                                                        (1, 4) if q else DECODE_BATCH, (128,) if q else DECODE_KV)),
        ("prefill_attention", 0.14, lambda s: run_prefill(s, w, t, layouts[:1] if q else layouts, a.device,
                                                          (128,) if q else PREFILL_LEN)),
        ("gemm_grid", 0.26, lambda s: run_gemms(s, w, t, [(1024, 512, "grid")] if q else grid,
                                                (1,) if q else grid_m, a.device, "gemm_grid")),
        ("elementwise", 0.04, lambda s: run_bandwidth(s, w, t, a.device)),
        ("gemm_fine", 0.12, lambda s: run_gemms_typed(s, w, t, stack_gemm_shapes(STACK[1:] if q else STACK),
                                                       (256, 320) if q else FINE_M, a.device, "gemm_fine")),
        ("stack", 0.12, lambda s: run_stack(s, w, t, a.device, STACK[1:] if q else STACK,
                                            STACK_DECODE[:1] if q else STACK_DECODE,
                                            STACK_PREFILL[:1] if q else STACK_PREFILL,
                                            STACK_MIXED[:1] if q else STACK_MIXED, 2 if q else None)),
    ]
    if a.sections:
        wanted = a.sections.split(",")
        unknown = [x for x in wanted if x not in [p[0] for p in plan]]
        if unknown:
            ap.error(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(p[0] for p in plan)})")
        plan = [p for p in plan if p[0] in wanted]
    t.warm_up(a.heat_s)
    t_start = time.monotonic()
    for name, share, runner in plan:
        # a section's leftover budget goes to the next one
        spent_share = sum(sh for nm, sh, _ in plan[: [p[0] for p in plan].index(name)])
        total_share = sum(sh for _, sh, _ in plan)
        budget = max(5.0, a.budget_s * (spent_share + share) / total_share - (time.monotonic() - t_start))
        sec = Section(name, budget, manifest)
        try:
            runner(sec)
        except Exception as e:  # noqa: BLE001 - keep what the other sections measure
            sec.fail("section", e)
            sec.close(-1)
        t.free()
        if t.cuda:
            try:  # NVML's current SM clock: did the section run at boost or at a power-limited clock?
                manifest["sections"][name]["sm_clock_mhz_at_end"] = torch.cuda.clock_rate()
            except Exception:  # noqa: BLE001
                pass
        manifest["sections"][name]["seconds"] = round(time.monotonic() - (sec.deadline - budget), 1)
        save_manifest()
    manifest["rows"] = w.rows
    manifest["seconds"] = round(time.monotonic() - t_start, 1)
    save_manifest()
    print(f"{w.rows} rows in {manifest['seconds']} s -> {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
