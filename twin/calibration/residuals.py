"""Where a profile's step-time model is off, regime by regime: recorded step time over the model's, binned.

    from twin.calibration.residuals import step_residuals, format_residuals
    print(format_residuals(step_residuals(RUN_DIRS, profile="cpu-tiny-llama")))

``twin fidelity`` says how far the twin's latencies are from a run's; this says whether the step-time model
behind them is biased anywhere, or only noisy. Every recorded step is paired with the shape the twin gives it
(offline runs: the recorded-step replay, whose composition must match the log exactly; server runs: the FCFS
reconstruction of ``twin.calibration.server``) and with the profile's model time for that shape (offline
regimes for offline runs, the ``server`` section's for server runs where the profile has one). The ratio
``recorded / model`` is then binned along the axes a fleet moves on: the decode batch; for prefill-carrying
steps the prompt tokens computed, the prefill requests, the attention context per prompt token (a cached prefix
makes it long) and whether decodes ride along; every step by its place in the run (a run's first step is a cold
engine's, ``twin calibrate --first-step``); for server runs whether the step is an idle wake (the first step after
the engine sat idle, ``server.idle_wakes``).

A bin is **biased** when the approximate 95 % confidence interval of its median ratio (order statistics,
``median_ci``) lies wholly outside ``1 +- bias`` (default 5 %). On a shared CPU single steps move by 10-30 %, so a
bin's spread (its interquartile range) is mostly noise; a median that is off with a narrow interval is a term
the model lacks or misfits (docs/calibration.md, "Step-time residuals by regime").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from twin.calibration.calibrate import CalibrationError, run_samples
from twin.calibration.recorded import RecordedRun, load_recorded_run
from twin.calibration.regimes import predict_model_s
from twin.calibration.server import ReconstructionError, idle_wakes, reconstruct
from twin.calibration.witness import run_witness_ms
from twin.engine_profiles.step import StepShape

DEFAULT_BIAS = 0.05
MIN_CI_SAMPLES = 6  # fewer steps give no interval (and a bin is never called biased)


def _edges(value: int, edges: Sequence[int]) -> str:
    """The label of the bin ``[edges[i], edges[i+1])`` holding ``value`` (the last bin is open)."""
    for lo, hi in zip(edges, [*edges[1:], None], strict=True):
        if hi is None or value < hi:
            if hi is None:
                return f"{lo}+"
            return f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"
    raise ValueError(f"{value} is below the first edge {edges[0]}")


# (view, regime it applies to, bin label of a step); edges span CPU (a few hundred tokens) and H100 (8k chunks) runs
VIEWS: tuple[tuple[str, str, Callable[[StepShape], str]], ...] = (
    ("decode batch", "decode", lambda s: _edges(s.decode_requests, (1, 2, 5, 17, 65, 257))),
    ("prompt tokens in the step", "prefill", lambda s: _edges(s.prefill_tokens, (1, 128, 512, 2048, 8192))),
    ("prefill requests", "prefill", lambda s: _edges(s.prefill_requests, (1, 2, 3, 5))),
    ("attention context per prompt token", "prefill",
     lambda s: _edges(s.prefill_attention_pairs // max(s.prefill_tokens, 1), (0, 128, 512, 2048))),
    ("decodes alongside", "prefill", lambda s: "with decodes" if s.decode_requests else "prefill only"),
)
FIRST_VIEW = "place in the run"  # every step: a run's first step (a cold engine: --first-step) or a later one
WAKE_VIEW = "after an idle engine (server)"


def median_ci(values: np.ndarray) -> tuple[float, float] | None:
    """Approximate 95 % interval of the median of ``values``: the order statistics ``n/2 -+ 0.98 sqrt(n)``
    (the normal approximation to the binomial); None below ``MIN_CI_SAMPLES`` values."""
    n = len(values)
    if n < MIN_CI_SAMPLES:
        return None
    v = np.sort(values)
    lo = max(int(math.floor(n / 2 - 0.98 * math.sqrt(n))), 0)
    hi = min(int(math.ceil(n / 2 + 0.98 * math.sqrt(n))), n - 1)
    return float(v[lo]), float(v[hi])


def _bin(label: str, ratio: np.ndarray, excess_s: np.ndarray, bias: float) -> dict[str, Any]:
    ci = median_ci(ratio)
    q1, med, q3 = (float(x) for x in np.percentile(ratio, [25, 50, 75]))
    biased = ci is not None and (ci[0] > 1 + bias or ci[1] < 1 - bias)
    return {"bin": label, "steps": int(ratio.size), "median_ratio": med, "q1": q1, "q3": q3,
            "ci": None if ci is None else list(ci), "median_excess_ms": float(np.median(excess_s)) * 1e3,
            "biased": bool(biased)}


class _Step(NamedTuple):
    shape: StepShape
    recorded_s: float
    model_s: float
    idle_wake: bool  # (server runs) the first step after the engine sat idle
    first: bool  # the run's first step


class Unpaired(ValueError):
    """A run whose steps cannot be paired with the twin's shapes (it is skipped, with this reason)."""


def _run_steps(rec: RecordedRun, prof: Any) -> tuple[str, list[StepShape], np.ndarray, np.ndarray, set[int]]:
    """``(section, shapes, recorded_s, model_s, idle-wake steps)`` of one run; raises ``Unpaired`` (with the
    reason) when its steps cannot be paired with shapes."""
    spec = prof.spec
    if rec.run.mode == "server":
        try:
            steps = reconstruct(rec)
        except ReconstructionError as exc:
            raise Unpaired(str(exc)) from None
        server = spec.server
        coefficients = server.step_time if server is not None else spec.step_time
        wakes = {k for k, _r, _t in idle_wakes(rec, steps, arrival_s=server.arrival_s)} if server is not None \
            else set()
        return ("server" if server is not None else "offline", steps.shapes, np.asarray(steps.elapsed_s),
                predict_model_s(coefficients, steps.shapes), wakes)
    try:
        samples = run_samples(rec)
    except CalibrationError as exc:
        raise Unpaired(str(exc)) from None
    return "offline", samples.shapes, np.asarray(samples.elapsed_s), predict_model_s(spec.step_time, samples.shapes), \
        set()


def _paired_rows(rec: RecordedRun, prof: Any) -> tuple[str, list[StepShape], list[_Step]]:
    """``(section, shapes, rows)``: the run's steps paired with the model's times, without the steps a shared CPU
    logged as 0 ms (their time went to a neighbour); raises ``Unpaired`` as ``_run_steps``."""
    section, shapes, recorded, model, wakes = _run_steps(rec, prof)
    rows = [_Step(shape, r, m, i in wakes, i == 0)
            for i, (shape, r, m) in enumerate(zip(shapes, recorded.tolist(), model.tolist(), strict=True))
            if r > 0 and m > 0]
    return section, shapes, rows


def run_step_level(rec: RecordedRun, prof: Any, *, bias: float = DEFAULT_BIAS) -> dict[str, Any] | None:
    """One run's steps against ``prof``'s model, as ``--steps``' by-run view gives them (``_run_level``): its decode
    and its prefill-carrying steps binned whole, and the speed probe; None when its steps cannot be paired with
    shapes. ``twin fidelity`` prints it under each run, so a failure on a run that ran off the model stands out."""
    try:
        _section, _shapes, rows = _paired_rows(rec, prof)
    except Unpaired:
        return None
    return _run_level(rec, rows, bias)


def step_residuals(run_dirs: Sequence[str | Path], *, profile: str, bias: float = DEFAULT_BIAS) -> dict[str, Any]:
    """The residual report (a JSON-ready dict) of ``profile``'s step-time model on the recorded runs ``run_dirs``:
    per section (``offline``, ``server``) and view, the bins' step counts, median ratio recorded / model with its
    quartiles and 95 % interval, median excess (recorded - model) and whether the bin is biased (module doc).
    Runs whose steps cannot be paired with shapes are listed under ``skipped`` with the reason; a folder that is
    not a recorded run raises ``RecordedRunError`` (before any work)."""
    from twin.engine_profiles import load_profile

    if not 0 < bias < 1:
        raise ValueError("bias must be a fraction between 0 and 1")
    prof = load_profile(profile)
    if prof.spec.step_time is None:
        raise ValueError(f"profile {profile!r} has no step-time coefficients to check")
    collected: dict[str, list[_Step]] = {}
    used, skipped = [], []
    for rec in [load_recorded_run(p) for p in run_dirs]:
        try:
            section, shapes, mine = _paired_rows(rec, prof)
        except Unpaired as exc:
            skipped.append({"run": str(rec.path), "reason": str(exc)})
            continue
        collected.setdefault(section, []).extend(mine)
        used.append({"run": str(rec.path), "section": section, "steps": len(shapes), **_run_level(rec, mine, bias)})
    sections = []
    for section in ("offline", "server"):
        rows = collected.get(section)
        if not rows:
            continue
        views = []
        for view, regime, key in VIEWS:
            members = [x for x in rows if (x.shape.prefill_requests > 0) == (regime == "prefill")]
            views.append({"view": view, "regime": regime,
                          "bins": _binned(members, lambda x, key=key: key(x.shape), bias)})
        views.append({"view": FIRST_VIEW, "regime": "all",
                      "bins": _binned(rows, lambda x: "first step" if x.first else "later steps", bias)})
        if section == "server":
            prefill = [x for x in rows if x.shape.prefill_requests > 0]
            views.append({"view": WAKE_VIEW, "regime": "prefill",
                          "bins": _binned(prefill, lambda x: "idle wake" if x.idle_wake else "busy or short idle",
                                          bias)})
        sections.append({"section": section, "steps": len(rows), "views": views})
    return {"profile": profile, "profile_name": prof.name, "bias": bias, "runs": used, "skipped": skipped,
            "sections": sections,
            "biased_bins": sum(b["biased"] for s in sections for v in s["views"] for b in v["bins"])}


def _run_level(rec: RecordedRun, rows: list[_Step], bias: float) -> dict[str, Any]:
    """One run's level: its decode and its prefill-carrying steps binned whole (``decode``, ``prefill``; None
    without such steps), the recorder's speed probe before and after it (``speed_probe_ms``, the median trial;
    None where the run has none) and its host witness during it (``host_witness_ms``, the median sample; None where
    the run has none: ``_vllm_common.HostWitness``). A run whose decode steps sit off the model while the others' do
    not ran at its own speed (another host, a slower start, a neighbour), which no term of the model can follow. The probe is a hint,
    not a measure: before server runs it has read slow where the run then sat on the model (docs/calibration.md,
    "Step-time residuals by regime")."""
    bins = {b["bin"]: b for b in _binned(rows, lambda x: "prefill" if x.shape.prefill_requests > 0 else "decode", bias)}
    level: dict[str, Any] = {regime: bins.get(regime) for regime in ("decode", "prefill")}
    probe = (rec.run.workload or {}).get("speed_probe") or {}
    try:
        level["speed_probe_ms"] = [float(probe[k]["median_s"]) * 1e3 for k in ("before", "after")]
    except (KeyError, TypeError, ValueError):  # no probe, or one that failed ({"error": ...})
        level["speed_probe_ms"] = None
    level["host_witness_ms"] = run_witness_ms(rec)
    return level


def _binned(rows: list[_Step], key: Callable[[_Step], str], bias: float) -> list[dict[str, Any]]:
    groups: dict[str, list[tuple[float, float]]] = {}
    for x in rows:
        groups.setdefault(key(x), []).append((x.recorded_s, x.model_s))
    out = []
    for label, pairs in groups.items():
        a = np.asarray(pairs)
        out.append(_bin(label, a[:, 0] / a[:, 1], a[:, 0] - a[:, 1], bias))
    return sorted(out, key=lambda b: _order(b["bin"]))


def _order(label: str) -> tuple[int, str]:
    head = label.split("-")[0].rstrip("+")
    return (int(head), label) if head.isdigit() else (10**9, label)


def format_residuals(report: dict[str, Any]) -> str:
    """The report as text: one block per section and view, one line per bin."""
    lines = [f"step-time residuals of {report['profile_name']} (recorded / model; biased: the median's 95 % "
             f"interval outside 1 +- {report['bias']:.0%})"]
    for s in report["sections"]:
        lines.append(f"\n{s['section']} steps ({s['steps']}):")
        for v in s["views"]:
            lines.append(f"  {v['view']} ({v['regime']} steps)")
            for b in v["bins"]:
                ci = "      n/a    " if b["ci"] is None else f"{b['ci'][0]:5.2f}-{b['ci'][1]:5.2f}"
                lines.append(f"    {b['bin']:>20s}  {b['steps']:6d} steps  median {b['median_ratio']:5.2f}  "
                             f"IQR {b['q1']:4.2f}-{b['q3']:4.2f}  95% {ci}  excess {b['median_excess_ms']:+7.2f} ms"
                             f"{'  BIASED' if b['biased'] else ''}")
    if report["runs"]:
        lines.append("\nby run (median recorded / model of its decode and its prefill steps; the speed probe's median "
                     "trial before and after it; the host witness's median sample during it, where recorded)")
        for r in report["runs"]:
            name = "/".join(Path(r["run"]).parts[-2:])
            cells = []
            for regime in ("decode", "prefill"):
                b = r.get(regime)
                cells.append(f"{regime} {'  n/a' if b is None else format(b['median_ratio'], '5.2f')} "
                             f"({0 if b is None else b['steps']:4d}){'*' if b is not None and b['biased'] else ' '}")
            probe = r.get("speed_probe_ms")
            cells.append("probe n/a" if probe is None else f"probe {probe[0]:.2f} / {probe[1]:.2f} ms")
            if r.get("host_witness_ms") is not None:
                cells.append(f"witness {r['host_witness_ms']:.2f} ms")
            lines.append(f"  {name:<48s} {r['section']:<7s} " + "  ".join(cells))
        lines.append("  (* the run's median is biased: its 95 % interval outside 1 +- "
                     f"{report['bias']:.0%})")
    for sk in report["skipped"]:
        lines.append(f"skipped {sk['run']}: {sk['reason']}")
    lines.append(f"\n{report['biased_bins']} biased bin(s) over {sum(s['steps'] for s in report['sections'])} steps "
                 f"of {len(report['runs'])} run(s)")
    return "\n".join(lines)
