"""`twin calibrate --run-levels` (FitOptions.run_levels): each run gets its own speed level while the coefficients
are fitted, so a host that ran one run slower than another does not turn into a step-shape term."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.regimes import robust_fit
from twin.engine_profiles.step import StepShape

SWEEP = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-quiet" / "calibration"
SMALL = [SWEEP / "sweep-prefill-chunk-512", SWEEP / "sweep-prompt-length", SWEEP / "sweep-prefix-sharing"]

BASE, PER_REQ, PER_CTX = 0.004, 2e-4, 1e-7  # the decode regime the synthetic runs follow


def _runs(levels: list[float], seed: int = 0) -> tuple[list[StepShape], np.ndarray, np.ndarray]:
    """Runs whose decode steps differ in how batch and context go together (run 0: small batches with long
    contexts, run 1: large batches with short ones), each at its own speed ``levels[j]``, with 3 % noise;
    a prefill step opens each run and a few more follow (the prefill regime needs them)."""
    rng = np.random.default_rng(seed)
    shapes: list[StepShape] = []
    elapsed: list[float] = []
    runs: list[int] = []
    for j, level in enumerate(levels):
        for k in range(300):
            if k % 30 == 0:
                s = StepShape(decode_requests=2, decode_context_tokens=400, prefill_requests=1,
                              prefill_tokens=int(rng.integers(64, 1024)), prefill_attention_pairs=int(rng.integers(1e4, 1e6)))
                t = 0.003 + 2e-5 * s.prefill_tokens + 1e-9 * s.prefill_attention_pairs
            else:
                n = int(rng.integers(1, 8)) if j % 2 == 0 else int(rng.integers(16, 48))
                per = int(rng.integers(1500, 3000)) if j % 2 == 0 else int(rng.integers(50, 300))
                s = StepShape(decode_requests=n, decode_context_tokens=n * per)
                t = BASE + PER_REQ * n + PER_CTX * n * per
            shapes.append(s)
            elapsed.append(level * t * float(np.exp(rng.normal(0, 0.03))))
            runs.append(j)
    return shapes, np.array(elapsed), np.array(runs)


def test_run_levels_recover_the_terms_that_a_slow_run_bends() -> None:
    # run 0 (long contexts) ran 1.3x slow: a pooled fit reads that as a larger context term
    shapes, elapsed, runs = _runs([1.3, 1.0])
    plain, _ = robust_fit(shapes, elapsed, overhead_s=0.0)
    levelled, _ = robust_fit(shapes, elapsed, overhead_s=0.0, options=FitOptions(run_levels=True), runs=runs)
    scale = np.sqrt(1.3)  # the levels' geometric mean: the coefficients describe a run at the average speed
    d = levelled.coefficients.decode
    assert d.per_context_token_s == pytest.approx(PER_CTX * scale, rel=0.1)
    assert d.per_request_s == pytest.approx(PER_REQ * scale, rel=0.1)
    assert d.base_s == pytest.approx(BASE * scale, rel=0.1)
    assert abs(plain.coefficients.decode.per_context_token_s / scale / PER_CTX - 1) > 0.2  # what the option fixes


def test_equal_speeds_give_the_plain_fit() -> None:
    shapes, elapsed, runs = _runs([1.0, 1.0, 1.0], seed=1)
    plain, _ = robust_fit(shapes, elapsed, overhead_s=0.0)
    levelled, _ = robust_fit(shapes, elapsed, overhead_s=0.0, options=FitOptions(run_levels=True), runs=runs)
    a, b = plain.coefficients.decode, levelled.coefficients.decode
    for k in ("base_s", "per_request_s", "per_context_token_s"):
        assert getattr(b, k) == pytest.approx(getattr(a, k), rel=0.05), k


def test_run_levels_need_the_runs() -> None:
    shapes, elapsed, _ = _runs([1.0, 1.0])
    with pytest.raises(ValueError, match="run of every step"):
        robust_fit(shapes, elapsed, overhead_s=0.0, options=FitOptions(run_levels=True))


def test_calibrate_with_run_levels_on_recorded_runs() -> None:
    plain = calibrate(SMALL, name="a", command="t").spec.step_time
    levelled = calibrate(SMALL, name="b", command="t", options=FitOptions(run_levels=True)).spec.step_time
    assert levelled.overhead_s == plain.overhead_s  # only the regimes are fitted differently
    assert levelled.decode != plain.decode


def test_the_command_takes_the_flag_and_records_it(tmp_path: Path) -> None:
    from twin.cli import main
    from twin.engine_profiles import load_profile

    out = tmp_path / "p.yaml"
    assert main(["calibrate", *map(str, SMALL), "--run-levels", "--out", str(out)]) == 0
    spec = load_profile(str(out)).spec
    assert spec.provenance.command.endswith(" --run-levels")
    refit = calibrate(SMALL, name="p", command="t", options=FitOptions(run_levels=True)).spec.step_time
    assert spec.step_time.decode.per_context_token_s == pytest.approx(refit.decode.per_context_token_s, rel=1e-12)
