"""Derive an H100 or H200 engine profile from kernel tables: ``python -m twin.engine_profiles.derive``.

1. Operator-level model (``operator_model``) from the aiconfigurator vLLM 0.19 H100 tables + vidur
   (``--hardware h100``), or from the operators measured on an H200 with ``scripts/measure_gpu_ops.py``
   (``--hardware h200``, ``data/h200-sxm/``; what one PyTorch GPU cannot measure comes from the H100 tables,
   see ``measured_kernels``).
2. Host time outside the forward pass, ``o + r * requests in the step``: non-negative least squares of
   (measured TPOT - modelled forward time) over the vLLM 0.12 Qwen3-32B H100 serving points in
   aiconfigurator's ``silicon_sample.csv`` (TP 2/4/8), the only modern-vLLM H100 serving measurements of a
   dense Llama-like model in ``../shared``. ``o`` is the profile's ``overhead_s``; ``r`` is folded into the
   regime coefficients by step 3.
3. The compact two-regime coefficients, fitted (non-negative, relative least squares) to the operator
   model over a grid of step shapes.
   The same host time serves both GPUs: it is CPU-side work, and H200 serving points are kept for the checks.
4. Checks against vLLM serving TPOTs of Llama-3.1 (aiconfigurator's silicon points, H100 and H200), and on H100
   splitwise-sim iteration times, argonne static batches and the design-note anchor.

``--all`` regenerates every shipped profile into ``twin/engine_profiles/data/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from twin.engine_profiles import checks as ck
from twin.engine_profiles.fit import fit_step_time, nnls
from twin.engine_profiles.grid import fit_grid
from twin.engine_profiles.kernels import KERNEL_SOURCES, KernelTables, load_tables
from twin.engine_profiles.memory import derive_num_gpu_blocks
from twin.engine_profiles.measured_kernels import H100_FALLBACKS, H200_TABLE_RUNS, load_measured, run_manifest
from twin.engine_profiles.operator_model import OperatorStepModel
from twin.engine_profiles.profile import (
    Check,
    EngineProfile,
    EngineProfileSpec,
    FitQuality,
    Hardware,
    MemoryAssumptions,
    ModelShape,
    Provenance,
)
from twin.engine_profiles.step import StepShape, prefill_attention_work
from twin.engine_profiles.step_time import LinearStepTimeModel
from twin.paths import shared_dir

GIB = 2**30
H100_SXM = Hardware(name="H100-SXM-80GB", gpu_memory_bytes=85_029_158_912, gpus_per_node=8, price_per_gpu_hour_usd=2.5)
# memory: torch.cuda.mem_get_info total on the H200 measured (data/h200-sxm/manifest.json); no price in ../shared
H200_SXM = Hardware(name="H200-SXM-141GB", gpu_memory_bytes=150_109_880_320, gpus_per_node=8)
HARDWARE = {"h100": H100_SXM, "h200": H200_SXM}
H200_OPS = Path(__file__).parent / "data" / "h200-sxm"
H200_OPS_SOURCES = [  # relative to the repository, not ../shared
    "twin/engine_profiles/data/h200-sxm/isolated/ops.csv",
    "twin/engine_profiles/data/h200-sxm/sustained/ops.csv",
    "twin/engine_profiles/data/h200-sxm/fine/ops.csv",
]
SILICON_SYSTEM = {"h100": "h100_sxm", "h200": "h200_sxm"}
MODELS = {
    "llama3-8b": ModelShape(name="llama3-8b", num_layers=32, hidden_size=4096, intermediate_size=14336,
                            num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256),
    "llama3-70b": ModelShape(name="llama3-70b", num_layers=80, hidden_size=8192, intermediate_size=28672,
                             num_attention_heads=64, num_kv_heads=8, head_dim=128, vocab_size=128256),
}
QWEN3_32B = ModelShape(name="qwen3-32b", num_layers=64, hidden_size=5120, intermediate_size=25600,
                       num_attention_heads=64, num_kv_heads=8, head_dim=128, vocab_size=151936)
SHIPPED = [  # (model, weight dtype, kv dtype, tp, hardware)
    *((m, wd, wd, tp, "h100") for m, wd, tp in [("llama3-70b", "fp8", 4), ("llama3-70b", "bf16", 4),
                                                ("llama3-70b", "bf16", 2), ("llama3-8b", "bf16", 1),
                                                ("llama3-8b", "fp8", 1)]),
    *(("llama3-70b", "fp8", "fp8", tp, "h200") for tp in (1, 2, 4, 8)),
    *((m, wd, wd, tp, "h200") for m, wd, tp in [("llama3-70b", "bf16", 4), ("llama3-8b", "bf16", 1),
                                                ("llama3-8b", "fp8", 1)]),
]
# vLLM serving points in aiconfigurator's silicon_sample.csv per (model, weight dtype, kv dtype): model_path, precision
SILICON_MODELS = {
    ("llama3-70b", "fp8", "fp8"): ("meta-llama/Llama-3.1-70B", "fp8"),
    ("llama3-8b", "fp8", "fp8"): ("nvidia/Llama-3.1-8B-Instruct-FP8", "fp8"),
}
ARGONNE_MODELS = {"llama3-8b": "meta-llama/Meta-Llama-3-8B", "llama3-70b": "meta-llama/Meta-Llama-3-70B"}


def memory_assumptions(model: ModelShape, *, tp: int) -> MemoryAssumptions:
    """Non-KV memory vLLM subtracts at startup, per GPU (assumed, see §8.2 of the engine-semantics reference)."""
    return MemoryAssumptions(
        non_torch_bytes_per_gpu=GIB // 4 if tp == 1 else GIB,
        activation_bytes_per_batched_token=2 * (4 * model.hidden_size + 4 * model.intermediate_size // tp),
        cudagraph_bytes_per_gpu=GIB // 2,
        notes="assumed: non-torch 0.25 GiB (TP1) / 1 GiB (TP>1, NCCL); activation peak = bf16 x (4 hidden + "
        "4 intermediate/TP) per batched token; CUDA graphs 0.5 GiB; chosen so Llama-3-8B TP1 at util 0.90 lands "
        "in the published-log range of the engine-semantics reference (8.2). Prefer num_gpu_blocks from a real "
        "startup log.",
    )


@dataclass(frozen=True)
class HostOverhead:
    """Time per step outside the forward pass: ``overhead_s + per_request_s * requests in the step``
    (scheduler, input preparation, sampler, output processing), fitted on measured serving TPOTs."""

    overhead_s: float
    per_request_s: float
    rel_errors: tuple[float, ...]  # per silicon point, after the fit
    tps: tuple[int, ...]

    def step_s(self, shape: StepShape) -> float:
        return self.overhead_s + self.per_request_s * (shape.decode_requests + shape.prefill_requests)

    def summary(self) -> str:
        parts = []
        for tp in sorted(set(self.tps)):
            r = [abs(e) for e, t in zip(self.rel_errors, self.tps, strict=True) if t == tp]
            parts.append(f"TP{tp} mean {sum(r) / len(r):.3f} max {max(r):.3f}")
        return "; ".join(parts)


@lru_cache(maxsize=4)
def fit_host_overhead(tables) -> HostOverhead:
    """Non-negative relative least squares of (measured TPOT - modelled forward time) = o + r * concurrency over
    the vLLM 0.12 Qwen3-32B H100 serving points (every step of that closed loop carries ``concurrency``
    requests)."""
    points = ck.silicon_qwen3_32b_h100(shared_dir())
    modelled = []
    for p in points:
        om = OperatorStepModel(model=QWEN3_32B, tp=p.tp, weight_dtype="bf16", kv_dtype="bf16", tables=tables)
        modelled.append(ck.steady_state_tpot_s(om.model_s, isl=p.isl, osl=p.osl, concurrency=p.concurrency))
    y = np.array([p.tpot_s for p in points])
    a = np.array([[1.0, p.concurrency] for p in points])
    x = nnls(a / y[:, None], (y - np.array(modelled)) / y)
    pred = np.array(modelled) + a @ x
    return HostOverhead(overhead_s=float(x[0]), per_request_s=float(x[1]),
                        rel_errors=tuple(float(e) for e in (pred - y) / y), tps=tuple(p.tp for p in points))


def profile_checks(spec: EngineProfileSpec, step_s, operator_step_s, hardware: str = "h100") -> list[Check]:
    """Every public figure that matches the profile's configuration, evaluated with the compact model
    (``step_s``, what the simulator uses) and with the operator-level model it was fitted to."""
    root, out = shared_dir(), []

    def _check(name: str, source: str, quantity: str, measured: float, twin_of, notes: str = "") -> Check:
        twin, op = twin_of(step_s), twin_of(operator_step_s)
        return Check(name=name, source=source, quantity=quantity, measured=round(measured, 9), twin=round(twin, 9),
                     rel_error=round((twin - measured) / measured, 6), twin_operator_level=round(op, 9),
                     notes=notes)

    mname, tp, wd = spec.model.name, spec.tp, spec.weight_dtype
    out.extend(silicon_checks(spec, _check, hardware))
    if hardware != "h100":  # the rest are H100 measurements
        return out
    if mname == "llama3-70b" and wd == "bf16" and spec.kv_dtype == "bf16":
        sw = ck.splitwise_medians(root, tp=tp)
        note = "Llama-2-70B FP16, late-2023 serving stack (older than vLLM 0.19); twin uses the Llama-3 shape"
        for b in (1, 16, 32, 64):
            if ("decode", 512, b, 128) in sw:
                shape = StepShape(decode_requests=b, decode_context_tokens=b * (512 + 64))
                out.append(_check(f"splitwise decode step b={b} prompt=512", ck.SPLITWISE_FILE,
                                  "token_time_s", sw[("decode", 512, b, 128)], lambda f, s=shape: f(s), note))
        for p in (512, 2048, 8192):
            if ("prefill", p, 1, 128) in sw:
                shape = StepShape(prefill_requests=1, prefill_tokens=p,
                                  prefill_attention_pairs=prefill_attention_work(0, p))
                out.append(_check(f"splitwise prefill {p} tokens", ck.SPLITWISE_FILE, "prompt_time_s",
                                  sw[("prefill", p, 1, 128)], lambda f, s=shape: f(s), note))
    quant = {("bf16", "bf16"): None, ("fp8", "fp8"): "Weight = fp8, KV Cache = fp8"}.get((wd, spec.kv_dtype))
    if mname in ARGONNE_MODELS and (wd, spec.kv_dtype) in (("bf16", "bf16"), ("fp8", "fp8")):
        ar = ck.argonne_latency_s(root, model=ARGONNE_MODELS[mname], tp=tp, quant=quant)
        src = ck.ARGONNE_FILE if quant is None else ck.ARGONNE_QUANT_FILE
        for length, b in ((128, 1), (128, 64), (1024, 16), (2048, 1), (2048, 64)):
            if (length, b) in ar:
                out.append(_check(f"argonne static batch len={length} b={b}", src, "latency_s", ar[(length, b)],
                                  lambda f, n=length, b=b: ck.static_batch_latency_s(f, length=n, batch=b),
                                  "vLLM ~0.4-0.5 (mid-2024) benchmark_latency, FP16 or FP8 as labelled"))
    if mname == "llama3-70b" and wd == "fp8" and spec.kv_dtype == "fp8" and tp == 4:
        shape = StepShape(decode_requests=170, decode_context_tokens=170 * 1900)
        out.append(_check("design-note anchor: decode step at 170 streams x 1,900 tokens", ck.DESIGN_NOTE_FILE,
                          "step_s", 1 / 30, lambda f: f(shape),
                          "an assumption of the design note (~30 tok/s per stream), not a measurement"))
    return out


def kv_capacity_tokens(spec: EngineProfileSpec) -> int:
    """Tokens of KV the profile's memory model leaves at vLLM's defaults (block 16, 8,192 batched tokens)."""
    return (derive_num_gpu_blocks(EngineProfile(spec), block_size=16, max_num_batched_tokens=8192) - 1) * 16


def silicon_selection(spec: EngineProfileSpec, hardware: str) -> tuple[list[ck.SiliconPoint], int]:
    """The vLLM serving points of this model, dtype, TP and GPU, and how many were left out because their
    closed loop (concurrency x (ISL + OSL) tokens) does not fit the KV cache: those queue (TTFTs of seconds
    to a minute in the file), so their TPOT is not the steady state ``steady_state_tpot_s`` models."""
    which = SILICON_MODELS.get((spec.model.name, spec.weight_dtype, spec.kv_dtype))
    if which is None or hardware not in SILICON_SYSTEM:  # a GPU measured by the user has no public points here
        return [], 0
    points = [p for p in ck.silicon_points(shared_dir(), model_path=which[0], system=SILICON_SYSTEM[hardware],
                                           precision=which[1]) if p.tp == spec.tp]
    cap = kv_capacity_tokens(spec)
    kept = [p for p in points if p.concurrency * (p.isl + p.osl) <= cap]
    return kept, len(points) - len(kept)


def silicon_checks(spec: EngineProfileSpec, check, hardware: str) -> list[Check]:
    kept, _ = silicon_selection(spec, hardware)
    which = SILICON_MODELS.get((spec.model.name, spec.weight_dtype, spec.kv_dtype), ("", ""))[0]
    return [check(f"vLLM serving TPOT isl={p.isl} osl={p.osl} concurrency={p.concurrency}", ck.SILICON_FILE,
                  "tpot_s", p.tpot_s,
                  lambda f, p=p: ck.steady_state_tpot_s(f, isl=p.isl, osl=p.osl, concurrency=p.concurrency),
                  f"{which} on {SILICON_SYSTEM[hardware]}, vLLM (aiconfigurator silicon point), closed loop of "
                  "fixed concurrency; twin = mean step of that loop (checks.steady_state_tpot_s)")
            for p in kept]


@lru_cache(maxsize=2)
def kernel_tables(hardware: str) -> KernelTables:
    h100 = load_tables(str(shared_dir()))
    return h100 if hardware == "h100" else load_measured([H200_OPS / r for r in H200_TABLE_RUNS], h100)


def hardware_from_ops(runs: list[Path], *, gpus_per_node: int = 8, price_per_gpu_hour_usd: float | None = None
                      ) -> Hardware:
    """The GPU a ``measure_gpu_ops.py`` run was measured on, from its manifest (name, memory CUDA reports)."""
    env = run_manifest(runs[0]).get("environment", {})
    if not env.get("gpu") or not env.get("mem_get_info_total_bytes"):
        raise ValueError(f"{runs[0]}: manifest.json names no GPU and its memory (not a CUDA run?)")
    return Hardware(name=env["gpu"], gpu_memory_bytes=int(env["mem_get_info_total_bytes"]),
                    gpus_per_node=gpus_per_node, price_per_gpu_hour_usd=price_per_gpu_hour_usd)


def derive_spec(*, model: ModelShape, tp: int, weight_dtype: str, kv_dtype: str, name: str, command: str,
                generated_on: str, hardware: str = "h100", ops: list[Path] | None = None,
                ops_hardware: Hardware | None = None) -> EngineProfileSpec:
    """``ops`` (run folders of ``scripts/measure_gpu_ops.py``, measured on ``ops_hardware``) replaces the tables of
    a named ``hardware``; the profile is then for that GPU ("measured")."""
    if ops:
        hardware = "measured"
        tables = load_measured(ops, kernel_tables("h100"))
        hw = ops_hardware or hardware_from_ops(ops)
    elif hardware in HARDWARE:
        tables, hw = kernel_tables(hardware), HARDWARE[hardware]
    else:
        raise ValueError(f"unknown hardware {hardware!r} (known: {', '.join(HARDWARE)})")
    host = fit_host_overhead(kernel_tables("h100"))
    skeleton = EngineProfileSpec(name=name, model=model, hardware=hw, tp=tp,
                                 weight_dtype=weight_dtype, kv_dtype=kv_dtype, memory=memory_assumptions(model, tp=tp),
                                 provenance=Provenance(sources=[], command=command, generated_on=generated_on))
    om = OperatorStepModel(model=model, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, tables=tables)

    def operator_step_s(shape: StepShape) -> float:
        return host.step_s(shape) + om.model_s(shape)

    shapes = fit_grid(EngineProfile(skeleton))
    fit = fit_step_time(shapes, [operator_step_s(s) for s in shapes], overhead_s=host.overhead_s)
    compact = LinearStepTimeModel.from_coefficients(fit.coefficients)
    spec = skeleton.model_copy(update={
        "step_time": fit.coefficients,
        "fit_quality": FitQuality(target="operator-level model (kernel tables) + host overhead over the fit_grid shapes",
                                  decode=fit.decode_quality, prefill=fit.prefill_quality),
    })
    notes = (
        f"Host time outside the forward pass = {host.overhead_s * 1e3:.3f} ms per step (overhead_s) + "
        f"{host.per_request_s * 1e6:.1f} us per request in the step (folded into the regime coefficients by the fit), "
        f"fitted on {len(host.tps)} vLLM 0.12 Qwen3-32B H100 serving TPOTs (aiconfigurator silicon_sample.csv); "
        f"|rel error| after the fit: {host.summary()}. "
    )
    if hardware == "h100":
        notes += ("Kernel tables are vLLM 0.19 (aiconfigurator) except elementwise ops (vidur, FP16 eager). Attention "
                  "kernels are FlashAttention (vllm_flash_attn).")
        sources = [*KERNEL_SOURCES, ck.SILICON_FILE]
    elif hardware == "h200":
        notes += ("GEMMs and bf16 attention measured on one H200 with PyTorch 2.11 / CUDA 13.0 "
                  "(scripts/measure_gpu_ops.py; cuBLAS GEMMs, compute-bound ones at sustained clocks; the fastest of "
                  "PyTorch's attention backends per shape; not vLLM's kernels); from the H100 tables: "
                  f"{'; '.join(H100_FALLBACKS)}. The host time is the H100 fit (CPU-side work).")
        sources = [*H200_OPS_SOURCES, *KERNEL_SOURCES, ck.SILICON_FILE]
    else:
        notes += (f"GEMMs and bf16 attention measured on {hw.name} with scripts/measure_gpu_ops.py (run folders in "
                  f"sources); from the H100 tables: {'; '.join(H100_FALLBACKS)}. The host time is the H100 fit.")
        sources = [*(str(Path(r) / "ops.csv") for r in ops), *KERNEL_SOURCES]
    kept, left_out = silicon_selection(spec, hardware)
    if kept or left_out:
        notes += (f" Serving TPOT checks: {len(kept)} silicon points of this TP; {left_out} left out because "
                  "concurrency x (ISL + OSL) exceeds the profile's KV capacity (they queue).")
    return spec.model_copy(update={
        "checks": profile_checks(spec, compact.step_time_s, operator_step_s, hardware),
        "provenance": Provenance(sources=sources, command=command, generated_on=generated_on, notes=notes),
    })


def write_spec(spec: EngineProfileSpec, path: Path) -> None:
    data = spec.model_dump(mode="json")
    if data.get("server") is None:  # profiles without a server section keep their files as they were
        data.pop("server", None)
    if data.get("step_time_noise") is None:  # nor do profiles without a fitted noise term
        data.pop("step_time_noise", None)
    if data.get("host_witness") is None:  # nor those fitted from runs without the host witness
        data.pop("host_witness", None)
    if data.get("server") is not None and data["server"].get("step_time_noise") is None:
        data["server"].pop("step_time_noise", None)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=120))


def shipped_name(model: str, weight_dtype: str, tp: int, hardware: str = "h100") -> str:
    return f"{model}-{weight_dtype}-tp{tp}-{hardware}"


def shipped_command(model: str, weight_dtype: str, kv_dtype: str, tp: int, hardware: str = "h100") -> str:
    cmd = (f"python -m twin.engine_profiles.derive --model {model} --weight-dtype {weight_dtype} "
           f"--kv-dtype {kv_dtype} --tp {tp}")
    return cmd if hardware == "h100" else f"{cmd} --hardware {hardware}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m twin.engine_profiles.derive", description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="regenerate every shipped profile into the package data")
    ap.add_argument("--model", default="llama3-70b", help=f"{', '.join(MODELS)} or 'custom' (give the shape)")
    for flag in ("layers", "hidden", "intermediate", "heads", "kv-heads", "head-dim", "vocab"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--tied", action="store_true", help="tied input/output embeddings (custom shapes)")
    ap.add_argument("--tp", type=int, default=4, choices=(1, 2, 4, 8))
    ap.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--hardware", default="h100", choices=tuple(HARDWARE),
                    help="h100: public aiconfigurator tables; h200: operators measured on an H200 (data/h200-sxm)")
    ap.add_argument("--ops", type=Path, nargs="+", metavar="RUN_DIR",
                    help="instead of --hardware: your own GPU, from run folders of scripts/measure_gpu_ops.py "
                         "(runs with --graph-target-s >= 0.01 count as sustained-clock GEMMs)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="with --ops (default 8)")
    ap.add_argument("--price-per-gpu-hour", type=float, help="with --ops: USD per GPU-hour (default none)")
    ap.add_argument("--name", help="profile name (default <model>-<weight dtype>-tp<N>-<hardware>)")
    ap.add_argument("--date", default=dt.date.today().isoformat(), help="generated_on field (YYYY-MM-DD)")
    ap.add_argument("--out", type=Path, help="output YAML (default: stdout)")
    a = ap.parse_args(argv)
    data = Path(__file__).parent / "data"
    if a.all:
        for m, wd, kd, tp, hw in SHIPPED:
            spec = derive_spec(model=MODELS[m], tp=tp, weight_dtype=wd, kv_dtype=kd, name=shipped_name(m, wd, tp, hw),
                               command=shipped_command(m, wd, kd, tp, hw), generated_on=a.date, hardware=hw)
            write_spec(spec, data / f"{spec.name}.yaml")
            print(f"wrote {spec.name}", file=sys.stderr)
        return 0
    if a.model in MODELS:
        model = MODELS[a.model]
    else:
        missing = [f for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")
                   if getattr(a, f) is None]
        if missing:
            ap.error(f"--model {a.model}: give the shape ({', '.join('--' + m.replace('_', '-') for m in missing)})")
        model = ModelShape(name=a.model, num_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.intermediate,
                           num_attention_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                           vocab_size=a.vocab, tie_word_embeddings=a.tied)
    ops_hardware = None
    if a.ops:
        for run in a.ops:
            if not (run / "ops.csv").is_file():
                ap.error(f"--ops: {run} has no ops.csv (give folders written by scripts/measure_gpu_ops.py --out)")
        try:
            ops_hardware = hardware_from_ops(a.ops, gpus_per_node=a.gpus_per_node,
                                             price_per_gpu_hour_usd=a.price_per_gpu_hour)
        except ValueError as exc:
            ap.error(f"--ops: {exc}")
    slug = re.sub(r"[^a-z0-9]+", "-", ops_hardware.name.lower()).strip("-") if ops_hardware else a.hardware
    name = a.name or shipped_name(model.name, a.weight_dtype, a.tp, slug)
    args = list(argv if argv is not None else sys.argv[1:])
    for flag in ("--out", "--date"):  # where it was written and when are not part of how it was derived
        if flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    args = [x for x in args if not x.startswith(("--out=", "--date="))]
    command = " ".join(["python -m twin.engine_profiles.derive", *args])
    if a.model in MODELS and a.name is None and not a.ops:
        command = shipped_command(a.model, a.weight_dtype, a.kv_dtype, a.tp, a.hardware)
    spec = derive_spec(model=model, tp=a.tp, weight_dtype=a.weight_dtype, kv_dtype=a.kv_dtype, name=name,
                       command=command, generated_on=a.date, hardware=a.hardware, ops=a.ops,
                       ops_hardware=ops_hardware)
    if a.out:
        write_spec(spec, a.out)
    else:
        sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False, width=120))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
