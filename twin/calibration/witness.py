"""The host witness in the fit and in replays.

The recorder samples the host's speed beside every run (``_vllm_common.HostWitness``: a 32 MB sum every 0.5 s on
a core the model does not use; ``workload.host_witness`` in run.json). On a shared VM a run's steps move with the
host's speed for work that leaves the core's caches, which that sum follows and the speed probe does not
(docs/calibration-sessions.md, "What moves a run's level").

- ``fit_host_witness``: how the calibration runs' decode levels (median recorded / modelled step, against the
  profile just fitted from them) follow their witness: ``level = (witness / reference_ms) ** exponent``, least
  squares in logs (``HostWitnessTerm``, kept in the profile by ``twin calibrate``).
- ``host_factor``: a recorded run's level as the term predicts it from the run's own witness; ``twin fidelity
  --host-witness`` scales the profile replay's model-execution time by it (``replay``'s ``host_speed``). It uses
  the run's witness only, never its steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from twin.calibration.recorded import RecordedRun
from twin.engine_profiles.profile import HostWitnessTerm

MIN_RUNS = 3


def run_witness_ms(rec: RecordedRun) -> float | None:
    """The run's host witness median (ms), or None where it has none (recorded before 2026-12-08, or a witness that
    failed: ``{"error": ...}``)."""
    w = (rec.run.workload or {}).get("host_witness") or {}
    try:
        v = float(w["median_ms"])
    except (KeyError, TypeError, ValueError):
        return None
    return v if v > 0 and math.isfinite(v) else None


def fit_host_witness(recs: Sequence[RecordedRun], prof: Any) -> HostWitnessTerm | None:
    """The term over ``recs`` (the calibration runs) against ``prof`` (an ``EngineProfile`` fitted from them), or
    None with fewer than ``MIN_RUNS`` runs that carry both a witness and decode steps, or witnesses that do not
    differ."""
    from twin.calibration.residuals import run_step_level

    pairs = []
    for rec in recs:
        w = run_witness_ms(rec)
        level = run_step_level(rec, prof) if w is not None else None
        decode = (level or {}).get("decode")
        if decode is not None and decode["median_ratio"] > 0:
            pairs.append((w, float(decode["median_ratio"]), rec.run.mode))
    if len(pairs) < MIN_RUNS:
        return None
    lw = np.log([p[0] for p in pairs])
    ll = np.log([p[1] for p in pairs])
    if np.ptp(lw) <= 0:
        return None
    slope, intercept = np.polyfit(lw, ll, 1)
    if slope == 0:
        return None
    corr = float(np.corrcoef(lw, ll)[0, 1]) if np.ptp(ll) > 0 else 0.0
    reference = math.exp(-intercept / slope)
    if not math.isfinite(reference) or reference <= 0:
        return None
    modes = sorted({p[2] for p in pairs})
    return HostWitnessTerm(
        reference_ms=round(reference, 6), exponent=round(float(slope), 6), runs=len(pairs),
        correlation=round(corr, 4),
        notes=(f"{len(pairs)} calibration runs ({', '.join(modes)}): their decode steps' median recorded / modelled "
               f"{math.exp(ll.min()):.3f}..{math.exp(ll.max()):.3f} against witness medians "
               f"{math.exp(lw.min()):.3f}..{math.exp(lw.max()):.3f} ms; log level = {slope:.3f} log witness "
               f"{intercept:+.3f}"))


def host_factor(rec: RecordedRun, term: HostWitnessTerm | None) -> float | None:
    """``(witness / reference_ms) ** exponent`` for ``rec``, or None without a term or without the run's witness."""
    w = run_witness_ms(rec)
    if term is None or w is None:
        return None
    return (w / term.reference_ms) ** term.exponent
