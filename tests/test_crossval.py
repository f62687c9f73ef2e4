"""Leave-one-run-out cross-validation (`twin calibrate --cross-validate`) and the optional fit terms it judges
(`--prefill-per-request`, `--first-step`), on committed recordings of the quiet calibration sweep."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import CalibrationError, FitOptions, calibrate, first_step_excess_s
from twin.calibration.crossval import LATENCY_ITEMS, cross_validate, folds
from twin.calibration.fidelity import fidelity
from twin.calibration.recorded import load_recorded_run
from twin.cli import main
from twin.engine_profiles import list_profiles, load_profile
from twin.engine_profiles.derive import write_spec
from twin.engine_profiles.fit import fit_step_time
from twin.engine_profiles.profile import DecodeTermsStepTime, PrefillPerRequestStepTime, step_time_model_of
from twin.engine_profiles.step import StepShape
from twin.engine_profiles.step_time import LinearStepTimeModel
from twin.replay import replay

SWEEP = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-quiet" / "calibration"
DATA = Path(__file__).resolve().parents[1] / "twin" / "engine_profiles" / "data"
SMALL = [SWEEP / "sweep-prefill-chunk-512", SWEEP / "sweep-prompt-length", SWEEP / "sweep-prefix-sharing"]


def test_folds_leave_each_run_out_and_skip_a_lone_server_or_offline_run() -> None:
    plan, skipped = folds(["offline", "offline", "server"])
    assert plan == [(0, [1, 2]), (1, [0, 2])]
    assert [i for i, _ in skipped] == [2]
    plan, skipped = folds(["offline", "server", "server"])
    assert plan == [(1, [0, 2]), (2, [0, 1])]
    assert [i for i, _ in skipped] == [0]
    with pytest.raises(CalibrationError):
        cross_validate([SWEEP / "sweep-prompt-length"])


def test_each_fold_is_the_fidelity_of_a_fit_without_the_run_left_out(tmp_path: Path) -> None:
    report = cross_validate(SMALL, noise=False)
    assert [f["name"] for f in report["folds"]] == [p.name for p in SMALL]
    within, errs = 0, []
    for k, left in enumerate(SMALL):
        rest = [p for p in SMALL if p != left]
        fold = report["folds"][k]
        assert fold["fitted_on"] == [p.name for p in rest]
        spec = calibrate(rest, name="by-hand", command="test").spec
        write_spec(spec, tmp_path / f"{k}.yaml")
        want = fidelity([left], profile=str(tmp_path / f"{k}.yaml"), noise=False)["runs"][0]["items"]
        for name in LATENCY_ITEMS:
            assert fold["items"][name]["rel_error"] == pytest.approx(want[name]["rel_error"], rel=1e-12)
            assert fold["items"][name]["pass"] == want[name]["pass"]
            within += bool(want[name]["pass"])
            errs.append(abs(want[name]["rel_error"]))
        assert fold["composition"] is True
    assert report["total"]["items"] == 6 * len(SMALL) and report["total"]["within"] == within
    assert report["total"]["mean_abs_error"] == pytest.approx(float(np.mean(errs)), rel=1e-12)
    assert report["noise"] is False and report["skipped"] == []


def test_noise_is_on_by_default_and_changes_the_errors() -> None:
    on, off = cross_validate(SMALL[:2]), cross_validate(SMALL[:2], noise=False)
    assert on["noise"] is True and off["noise"] is False
    assert [f["items"]["itl_p90_s"]["twin"] for f in on["folds"]] != [f["items"]["itl_p90_s"]["twin"]
                                                                        for f in off["folds"]]


def test_the_command_prints_and_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cv.json"
    runs = [str(p) for p in SMALL[:2]] + [str(SWEEP / "sweep-server-rate-6")]
    assert main(["calibrate", "--cross-validate", *runs, "--no-noise", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert f"total   {data['total']['within']} of {data['total']['items']} within tolerance" in text
    assert "sweep-server-rate-6" in text and "the only server run" in text
    assert data["total"]["items"] == 12 and data["options"] == {
        "prefill_per_request": False, "first_step": False, "decode_single_request": False, "decode_context_sq": False,
        "decode_batch_change": False, "run_levels": False, "server_scaled_offline": False, "idle_wake": False,
        "server_offline_attention": False, "stream_ends": False, "intake": False, "intake_step": False,
        "decode_floor": False, "server_offline_context": False, "server_shared_context": False}
    assert main(["calibrate", "--cross-validate", str(SMALL[0])]) == 2
    assert main(["calibrate", str(SMALL[0]), str(SMALL[1]), "--json", str(out)]) == 2  # --json needs --cross-validate


# ---- the optional terms -----------------------------------------------------------------------------------------
def _prefill(n_decode: int, n_prefill: int, tokens: int) -> StepShape:
    return StepShape(decode_requests=n_decode, decode_context_tokens=100 * n_decode, prefill_requests=n_prefill,
                     prefill_tokens=tokens, prefill_attention_pairs=tokens * tokens // 2)


def test_the_prefill_per_request_term_is_fitted_and_applied() -> None:
    rng = np.random.default_rng(0)
    shapes = [_prefill(int(d), int(p), int(t)) for d, p, t in zip(rng.integers(0, 30, 200), rng.integers(1, 40, 200),
                                                                   rng.integers(64, 2048, 200), strict=True)]
    shapes += [StepShape(decode_requests=int(d), decode_context_tokens=int(c))
               for d, c in zip(rng.integers(1, 48, 200), rng.integers(100, 20000, 200), strict=True)]

    def truth(s: StepShape) -> float:
        if s.prefill_requests == 0:
            return 0.004 + 2e-4 * s.decode_requests + 1e-7 * s.decode_context_tokens
        return 0.008 + 3e-5 * s.total_tokens + 6e-8 * s.prefill_attention_pairs + 1.6e-4 * (
            s.decode_requests + s.prefill_requests)

    fit = fit_step_time(shapes, [truth(s) for s in shapes], prefill_per_request=True).coefficients
    assert fit.prefill.per_request_s == pytest.approx(1.6e-4, rel=1e-6)
    model = step_time_model_of(fit)
    assert isinstance(model, PrefillPerRequestStepTime)
    for s in shapes[:20]:
        assert model.step_time_s(s) == pytest.approx(truth(s), rel=1e-6)
    # without the column the same data cannot be fitted exactly, and the model is the plain linear one
    plain = fit_step_time(shapes, [truth(s) for s in shapes]).coefficients
    assert plain.prefill.per_request_s == 0.0 and isinstance(step_time_model_of(plain), LinearStepTimeModel)
    assert max(abs(step_time_model_of(plain).step_time_s(s) / truth(s) - 1) for s in shapes[:200]) > 0.05


def test_profiles_without_the_new_terms_write_and_model_as_before(tmp_path: Path) -> None:
    for name in list_profiles():
        prof = load_profile(name)
        if name in ("cpu-small-llama", "cpu-tiny-llama"):  # the shipped profiles with a decode term: a batch floor
            assert prof.spec.step_time.decode.floor_requests > 1
            assert type(prof.step_time_model()) is DecodeTermsStepTime
        else:
            assert type(prof.step_time_model()) is LinearStepTimeModel
        write_spec(prof.spec, tmp_path / "p.yaml")  # byte for byte the shipped file: no new key appears
        assert (tmp_path / "p.yaml").read_text() == (DATA / f"{name}.yaml").read_text(), name
    spec = load_profile("cpu-tiny-llama").spec
    st = spec.step_time.model_copy(update={"first_step_s": 0.01, "prefill": spec.step_time.prefill.model_copy(
        update={"per_request_s": 1e-4})})
    write_spec(spec.model_copy(update={"step_time": st}), tmp_path / "q.yaml")
    back = load_profile(str(tmp_path / "q.yaml")).spec.step_time
    assert back.first_step_s == 0.01 and back.prefill.per_request_s == 1e-4


def test_first_step_s_delays_the_first_step_of_a_replay_only(tmp_path: Path) -> None:
    spec = load_profile("cpu-tiny-llama").spec
    write_spec(spec.model_copy(update={"step_time": spec.step_time.model_copy(update={"first_step_s": 0.025})}),
               tmp_path / "first.yaml")
    rec = load_recorded_run(SWEEP / "sweep-prefill-chunk-512")
    a = replay(rec, profile="cpu-tiny-llama", noise=False).tables["iterations"].to_pydict()
    b = replay(rec, profile=str(tmp_path / "first.yaml"), noise=False).tables["iterations"].to_pydict()
    steps_a, steps_b = np.diff([*a["t_start_s"], 0.0])[:-1], np.diff([*b["t_start_s"], 0.0])[:-1]
    assert steps_b[0] == pytest.approx(steps_a[0] + 0.025, abs=1e-12)
    assert np.allclose(steps_b[1:], steps_a[1:], rtol=0, atol=1e-12)


def test_first_step_excess_is_what_the_twin_misses_before_the_first_tokens() -> None:
    elapsed = np.array([0.030, 0.010, 0.010])
    # first tokens at step 1, 50 ms after the start; steps 0-1 take 40 ms + 2 x 1 ms fixed; step 0 fitted at 25 ms
    e = first_step_excess_s(elapsed, 0.025, first_token_s=0.050, token_step=1, fixed_s=np.full(3, 0.001))
    assert e == pytest.approx(0.050 - 0.040 - 0.002 + 0.005)


def test_calibrate_first_step_fits_a_positive_term_and_leaves_the_first_steps_out() -> None:
    plain = calibrate(SMALL, name="a", command="t").spec
    first = calibrate(SMALL, name="b", command="t", options=FitOptions(first_step=True)).spec
    assert plain.step_time.first_step_s == 0.0 and first.step_time.first_step_s > 0.0
    assert first.step_time.decode == plain.step_time.decode  # first steps here are all prefill steps
    assert first.step_time.prefill != plain.step_time.prefill
    assert sum(first.step_time_noise.num_samples.values()) == sum(plain.step_time_noise.num_samples.values()) - 3
