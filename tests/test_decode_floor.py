"""The decode regime's batch floor (`twin calibrate --decode-floor`, `DecodeCoefficients.floor_requests`): a decode
step of fewer requests than the floor costs what one of the floor does (docs/calibration-sessions.md, "A batch
floor")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec
from twin.engine_profiles.fit import fit_step_time
from twin.engine_profiles.profile import DecodeTermsStepTime, step_time_model_of
from twin.engine_profiles.step import StepShape
from twin.engine_profiles.step_time import LinearStepTimeModel

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "calibration"
SMALL_SWEEP = FIXTURES / "cpu-small-llama-sweep" / "calibration"
SMALL_OFFLINE = sorted(p for p in SMALL_SWEEP.iterdir() if p.is_dir() and "server" not in p.name)


def _steps(seed: int = 0) -> list[StepShape]:
    """Decode steps of batches 1-24 and prefill steps with and without decodes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(300):
        n = int(rng.integers(1, 25))
        out.append(StepShape(decode_requests=n, decode_context_tokens=n * int(rng.integers(20, 900))))
    for _ in range(60):
        n = int(rng.integers(0, 6))
        out.append(StepShape(decode_requests=n, decode_context_tokens=n * 300, prefill_requests=1,
                             prefill_tokens=int(rng.integers(64, 1024)),
                             prefill_attention_pairs=int(rng.integers(1e4, 1e6))))
    return out


def _truth(s: StepShape, floor: int) -> float:
    decode = 0.004 + 3e-4 * max(s.decode_requests, floor) + 2e-7 * s.decode_context_tokens if s.decode_requests \
        else 0.0
    if s.is_decode_only:
        return decode
    return max(0.008 + 3e-5 * s.total_tokens + 6e-8 * s.prefill_attention_pairs + 1.6e-7 * s.decode_context_tokens,
               decode)


def test_the_fit_finds_the_floor_and_the_model_applies_it() -> None:
    shapes = _steps()
    y = [_truth(s, 5) for s in shapes]
    fit = fit_step_time(shapes, y, decode_floor=True).coefficients
    d = fit.decode
    assert d.floor_requests == 5
    assert (d.base_s, d.per_request_s, d.per_context_token_s) == pytest.approx((0.004, 3e-4, 2e-7), rel=1e-6)
    model = step_time_model_of(fit)
    assert isinstance(model, DecodeTermsStepTime)
    assert [model.step_time_s(s) for s in shapes] == pytest.approx(y, rel=1e-6)
    # batches 1-5 differ only by their context; 6 costs one request more than 5
    one, five, six = (model.step_time_s(StepShape(decode_requests=n, decode_context_tokens=0)) for n in (1, 5, 6))
    assert one == pytest.approx(five) and six - five == pytest.approx(3e-4)
    # a decode run is the same as its steps one by one, below the floor and above it
    for n in (2, 9):
        run = model.decode_run_s(n, n * 300, 6)
        steps = [StepShape(decode_requests=n, decode_context_tokens=n * 300 + n * k) for k in range(6)]
        assert run == pytest.approx([model.step_time_s(s) for s in steps], rel=1e-12)
    # the floor is part of the decode-only time, so it also sets a small prefill step's floor
    tiny = StepShape(decode_requests=1, decode_context_tokens=100, prefill_requests=1, prefill_tokens=1)
    assert model.step_time_s(tiny) == pytest.approx(_truth(tiny, 5))
    # the plain fit cannot reproduce the floor
    plain = fit_step_time(shapes, y).coefficients
    assert plain.decode.floor_requests == 0 and type(step_time_model_of(plain)) is LinearStepTimeModel
    assert max(abs(step_time_model_of(plain).step_time_s(s) / t - 1) for s, t in zip(shapes, y, strict=True)) > 0.05


def test_a_linear_decode_regime_gets_no_floor() -> None:
    shapes = _steps(1)
    y = [_truth(s, 0) for s in shapes]
    fit = fit_step_time(shapes, y, decode_floor=True).coefficients
    assert fit.decode.floor_requests == 0 and type(step_time_model_of(fit)) is LinearStepTimeModel
    assert fit == fit_step_time(shapes, y).coefficients


def test_the_floor_is_written_only_when_set(tmp_path: Path) -> None:
    spec = load_profile("llama3-8b-bf16-tp1-h100").spec  # a profile without a floor
    write_spec(spec, tmp_path / "p.yaml")
    assert "floor_requests" not in (tmp_path / "p.yaml").read_text()
    dec = spec.step_time.decode.model_copy(update={"floor_requests": 4})
    write_spec(spec.model_copy(update={"step_time": spec.step_time.model_copy(update={"decode": dec})}),
               tmp_path / "q.yaml")
    loaded = load_profile(str(tmp_path / "q.yaml"))
    assert loaded.spec.step_time.decode == dec
    model = loaded.step_time_model()  # what the fleet's replicas step with
    assert model.step_time_s(StepShape(decode_requests=1)) == pytest.approx(
        model.step_time_s(StepShape(decode_requests=4)))


def test_the_small_models_offline_sweep_has_a_floor() -> None:
    """Measured: cpu-small-llama's decode steps of 1-5 requests take about the same time (docs/calibration.md)."""
    plain = calibrate(SMALL_OFFLINE, name="plain", command="test").spec
    floor = calibrate(SMALL_OFFLINE, name="floor", command="test", options=FitOptions(decode_floor=True)).spec
    assert plain.step_time.decode.floor_requests == 0
    assert 3 <= floor.step_time.decode.floor_requests <= 8
    assert floor.fit_quality.decode.mean_abs_rel_error < plain.fit_quality.decode.mean_abs_rel_error - 0.01
    assert floor.step_time.prefill == plain.step_time.prefill


def test_the_server_sections_context_term_from_the_offline_fit() -> None:
    """`--server-offline-context`: in the server sweep a decode step's context grows with its batch, so the fit
    trades the two terms (cpu-small-llama with the floor: ~17 ns a context token against the offline 409 ns); the
    option takes the offline term times the server runs' speed on their decode steps."""
    runs = sorted(p for p in SMALL_SWEEP.iterdir() if p.is_dir())
    free = calibrate(runs, name="free", command="test",
                     options=FitOptions(server_offline_attention=True, decode_floor=True)).spec
    fixed = calibrate(runs, name="fixed", command="test",
                      options=FitOptions(server_offline_attention=True, decode_floor=True,
                                         server_offline_context=True)).spec
    assert fixed.step_time == free.step_time  # the offline fit is untouched
    off, srv = fixed.step_time.decode, fixed.server.step_time.decode
    speed = srv.per_context_token_s / off.per_context_token_s
    assert f"decode per_context_token_s the offline fit's times {speed:.4f}" in fixed.server.provenance.notes
    assert 0.7 < speed < 1.3
    assert free.server.step_time.decode.per_context_token_s < 0.2 * srv.per_context_token_s
    assert fixed.server.step_time.prefill.per_attention_pair_s == free.server.step_time.prefill.per_attention_pair_s
