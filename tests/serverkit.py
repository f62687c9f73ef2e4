"""The server sweep runs' speed against an offline step-time model, computed here from the reconstruction, apart from
the library's own helper (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from twin.calibration.recorded import load_recorded_run
from twin.calibration.regimes import predict_model_s
from twin.calibration.server import reconstruct


def server_speed(coefficients, runs: Sequence[Path], *, prefill_only: bool = False) -> float:  # noqa: ANN001
    """Median of recorded over ``coefficients``-predicted model time on the server runs' reconstructed steps with
    both positive (prefill-carrying ones only with ``prefill_only``); the sessions it reads (recorded before
    2026-12-04) have two server runs."""
    steps = [reconstruct(rec) for rec in map(load_recorded_run, runs) if rec.run.mode == "server"]
    assert len(steps) == 2
    shapes = [sh for s in steps for sh in s.shapes]
    elapsed = np.concatenate([s.elapsed_s for s in steps])
    pred = predict_model_s(coefficients, shapes)
    ok = (elapsed > 0) & (pred > 0)
    if prefill_only:
        ok &= np.array([sh.prefill_requests > 0 for sh in shapes])
    return float(np.median(elapsed[ok] / pred[ok]))


def calibrate_with_flag(tmp_path: Path, runs: Sequence[Path], flag: str):  # noqa: ANN201 (ProfileSpec)
    """``twin calibrate RUNS FLAG --out``: the profile it wrote, whose command names the flag."""
    from twin.cli import main
    from twin.engine_profiles import load_profile

    out = tmp_path / "p.yaml"
    assert main(["calibrate", *map(str, runs), flag, "--out", str(out)]) == 0
    spec = load_profile(str(out)).spec
    assert flag in spec.provenance.command
    return spec
