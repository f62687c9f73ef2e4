"""Public measured figures the H100 profiles are fitted to (per-step overhead) or checked against.

Each reader returns plain records; ``derive`` turns them into ``Check`` entries of a profile.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from twin.engine_profiles.step import StepShape, prefill_attention_work

SILICON_FILE = "calibration/raw/aiconfigurator/systems/silicon_sample.csv"
SPLITWISE_FILE = "calibration/raw/splitwise-sim/data/perf_model.csv"
ARGONNE_FILE = "calibration/raw/argonne-llm-inference-bench/Plots/All_results.csv"
ARGONNE_QUANT_FILE = "calibration/raw/argonne-llm-inference-bench/Plots/Fig_3/qaunt_results/quant_all_results.csv"
DESIGN_NOTE_FILE = "seeds/001_f6a4481be0b62607.txt"

StepFn = Callable[[StepShape], float]


@dataclass(frozen=True)
class SiliconPoint:
    """A measured vLLM serving point (fixed concurrency, fixed ISL/OSL): mean TPOT and TTFT in seconds."""

    tp: int
    isl: int
    osl: int
    concurrency: int
    tpot_s: float
    ttft_s: float | None = None  # (the file's mean TTFT; None where it has none)


def silicon_points(root: Path, *, model_path: str, system: str, precision: str) -> list[SiliconPoint]:
    """vLLM aggregated-serving points of one model on one system (``h100_sxm``, ``h200_sxm``), all TPs."""
    out = []
    with (root / SILICON_FILE).open() as f:
        for r in csv.DictReader(f):
            if (
                r["model_path"] == model_path
                and r["system"] == system
                and r["backend"] == "vllm"
                and r["mode"] == "agg"
                and r["precision"] == precision
                and r["tp_size"]
            ):
                out.append(
                    SiliconPoint(
                        tp=int(r["tp_size"]),
                        isl=int(r["isl"]),
                        osl=int(r["osl"]),
                        concurrency=int(r["batch_size"]),
                        tpot_s=float(r["silicon_tpot_ms"]) * 1e-3,
                        ttft_s=float(r["silicon_ttft_ms"]) * 1e-3 if r["silicon_ttft_ms"] else None,
                    )
                )
    return sorted(out, key=lambda p: (p.tp, p.isl, p.osl, p.concurrency))


def silicon_qwen3_32b_h100(root: Path) -> list[SiliconPoint]:
    """The host-overhead fit's inputs: Qwen3-32B on H100 with vLLM 0.12 (precision unlabelled, taken as BF16)."""
    return silicon_points(root, model_path="Qwen/Qwen3-32B", system="h100_sxm", precision="")


def steady_state_tpot_s(step_s: StepFn, *, isl: int, osl: int, concurrency: int) -> float:
    """Mean step time of a closed loop of ``concurrency`` requests of fixed ISL/OSL (the TPOT a client sees):
    decode steps at mean context ISL + OSL/2, with ``concurrency/OSL`` prompt prefills per step on average
    (each done whole, mixed with the other requests' decodes)."""
    c, ctx = concurrency, isl + osl / 2
    decode = step_s(StepShape(decode_requests=c, decode_context_tokens=round(c * ctx)))
    mixed = step_s(
        StepShape(
            decode_requests=c - 1,
            decode_context_tokens=round((c - 1) * ctx),
            prefill_requests=1,
            prefill_tokens=isl,
            prefill_attention_pairs=prefill_attention_work(0, isl),
        )
    )
    return decode + (c / osl) * (mixed - decode)


def splitwise_medians(root: Path, *, tp: int) -> dict[tuple[str, int, int, int], float]:
    """Llama-2-70B FP16 on DGX-H100: median (prompt_time|token_time) in seconds keyed by
    (kind, prompt_size, batch_size, token_size)."""
    groups: dict[tuple[str, int, int, int], list[float]] = {}
    with (root / SPLITWISE_FILE).open() as f:
        for r in csv.DictReader(f):
            if r["model"] != "llama2-70b" or r["hardware"] != "h100-80gb" or int(r["tensor_parallel"]) != tp:
                continue
            key = (int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"]))
            groups.setdefault(("prefill", *key), []).append(float(r["prompt_time"]) * 1e-3)
            groups.setdefault(("decode", *key), []).append(float(r["token_time"]) * 1e-3)
    return {k: median(v) for k, v in groups.items()}


def argonne_latency_s(root: Path, *, model: str, tp: int, quant: str | None) -> dict[tuple[int, int], float]:
    """Static-batch end-to-end latency (s) keyed by (length, batch); ``quant`` selects the Fig. 3 rows,
    e.g. "Weight = fp8, KV Cache = fp8" (the unquoted comma is rejoined)."""
    out: dict[tuple[int, int], float] = {}
    path = root / (ARGONNE_FILE if quant is None else ARGONNE_QUANT_FILE)
    with path.open() as f:
        rows = csv.reader(f)
        next(rows)
        for r in rows:
            if len(r) < 8:  # blank separator lines
                continue
            if quant is not None:
                if len(r) == 10:
                    r = [*r[:6], f"{r[6]},{r[7]}", *r[8:]]
                if r[6].strip() != quant:
                    continue
            if r[0] != "Nvidia H100 GPU" or r[2] != "vLLM" or r[3] != model or int(r[1]) != tp:
                continue
            out[(int(r[4]), int(r[5]))] = float(r[6] if quant is None else r[7])
    return out


def static_batch_latency_s(step_s: StepFn, *, length: int, batch: int, max_batched_tokens: int = 8192) -> float:
    """``benchmark_latency``: prefill of ``batch`` prompts of ``length`` (whole prompts per step, up to
    ``max_batched_tokens``), then ``length - 1`` decode steps with contexts growing from ``length``."""
    total, left = 0.0, batch
    per_step = max(1, max_batched_tokens // length)
    while left:
        k = min(per_step, left)
        total += step_s(
            StepShape(
                prefill_requests=k,
                prefill_tokens=k * length,
                prefill_attention_pairs=k * prefill_attention_work(0, length),
            )
        )
        left -= k
    for i in range(length - 1):
        total += step_s(StepShape(decode_requests=batch, decode_context_tokens=batch * (length + i)))
    return total
