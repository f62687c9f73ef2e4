"""The optional decode-regime terms of a calibration fit (`twin calibrate --decode-single-request`,
`--decode-context-sq`, `--decode-batch-change`; the command line of `--decode-floor` too, whose fit
tests/test_decode_floor.py checks), and cross-validation over several noise draws (`--seeds`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.crossval import cross_validate
from twin.calibration.recorded import load_recorded_run
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec
from twin.engine_profiles.fit import fit_step_time
from twin.engine_profiles.profile import DecodeTermsStepTime, decode_batch_changed, step_time_model_of
from twin.engine_profiles.step import StepShape
from twin.engine_profiles.step_time import LinearStepTimeModel
from twin.replay import replay

SWEEP = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-quiet" / "calibration"
SMALL = [SWEEP / "sweep-prefill-chunk-512", SWEEP / "sweep-prompt-length", SWEEP / "sweep-prefix-sharing"]


def _decode(n: int, ctx: int) -> StepShape:
    return StepShape(decode_requests=n, decode_context_tokens=ctx)


def _steps(seed: int = 0) -> list[StepShape]:
    """Decode runs of varying batches with prefill steps between them, as an engine's step sequence."""
    rng = np.random.default_rng(seed)
    out: list[StepShape] = []
    for _ in range(60):
        n, ctx = int(rng.integers(1, 24)), int(rng.integers(50, 900))
        out.append(StepShape(decode_requests=n - 1, decode_context_tokens=(n - 1) * ctx, prefill_requests=1,
                             prefill_tokens=int(rng.integers(64, 1024)), prefill_attention_pairs=int(rng.integers(1e4, 1e6))))
        for k in range(int(rng.integers(1, 8))):
            m = max(n - int(rng.integers(0, 2)) * k // 3, 1)
            out.append(_decode(m, m * (ctx + k)))
    return out


def test_batch_changed_marks_decode_steps_with_fewer_requests_than_the_decode_step_before() -> None:
    pre = StepShape(decode_requests=2, decode_context_tokens=100, prefill_requests=1, prefill_tokens=50)
    seq = [_decode(3, 30), _decode(3, 33), pre, _decode(1, 40), _decode(3, 43), _decode(2, 30), _decode(2, 32), pre,
           _decode(4, 40), _decode(1, 10)]
    assert decode_batch_changed(seq).tolist() == [False, False, False, False, False, True, False, False, False, True]
    assert decode_batch_changed([]).tolist() == []


def test_each_decode_term_is_fitted_and_applied() -> None:
    shapes = _steps()
    changed = decode_batch_changed(shapes)

    def truth(i: int) -> float:
        s = shapes[i]
        decode = (0.004 + 2e-4 * s.decode_requests + 1e-7 * s.decode_context_tokens
                  + (0.0015 if s.decode_requests == 1 else 0.0)
                  + (3e-11 * s.decode_context_tokens ** 2 / s.decode_requests if s.decode_requests else 0.0))
        if s.is_decode_only:
            return decode + 0.0025 * changed[i]
        mixed = 0.008 + 3e-5 * s.total_tokens + 6e-8 * s.prefill_attention_pairs + 1.6e-7 * s.decode_context_tokens
        return max(mixed, decode)

    y = [truth(i) for i in range(len(shapes))]
    fit = fit_step_time(shapes, y, decode_single_request=True, decode_context_sq=True,
                        decode_batch_changed=changed).coefficients
    d = fit.decode
    assert (d.single_request_s, d.per_context_token_sq_s, d.batch_change_s) == pytest.approx((0.0015, 3e-11, 0.0025),
                                                                                            rel=1e-6)
    model = step_time_model_of(fit)
    assert isinstance(model, DecodeTermsStepTime)  # the batch change is not in it: replays add it (BatchChangeExtra)
    for i, s in enumerate(shapes):
        assert model.step_time_s(s) + (d.batch_change_s * changed[i]) == pytest.approx(y[i], rel=1e-6)
    # a decode run is the same as its steps one by one
    run = model.decode_run_s(7, 7 * 300, 5)
    assert run == pytest.approx([model.step_time_s(_decode(7, 7 * 300 + 7 * k)) for k in range(5)], rel=1e-12)
    one = model.decode_run_s(1, 40, 3)
    assert one == pytest.approx([model.step_time_s(_decode(1, 40 + k)) for k in range(3)], rel=1e-12)
    # without the columns the fit cannot be exact, and the terms are 0
    plain = fit_step_time(shapes, y).coefficients
    assert (plain.decode.single_request_s, plain.decode.per_context_token_sq_s, plain.decode.batch_change_s) == (0, 0, 0)
    assert type(step_time_model_of(plain)) is LinearStepTimeModel
    with pytest.raises(ValueError, match="one flag per shape"):
        fit_step_time(shapes, y, decode_batch_changed=changed[:-1])


def test_a_decode_term_raises_the_floor_of_a_prefill_step() -> None:
    spec = load_profile("cpu-tiny-llama").spec
    st = spec.step_time.model_copy(update={"decode": spec.step_time.decode.model_copy(update={"single_request_s": 0.5})})
    model, plain = step_time_model_of(st), step_time_model_of(spec.step_time)
    tiny = StepShape(decode_requests=1, decode_context_tokens=100, prefill_requests=1, prefill_tokens=1)
    assert model.step_time_s(tiny) == pytest.approx(plain.step_time_s(_decode(1, 100)) + 0.5)
    big = StepShape(decode_requests=3, decode_context_tokens=300, prefill_requests=1, prefill_tokens=1000)
    assert model.step_time_s(big) == plain.step_time_s(big)


def test_the_terms_are_written_only_when_set(tmp_path: Path) -> None:
    spec = load_profile("cpu-tiny-llama").spec
    write_spec(spec, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert "single_request_s" not in text and "batch_change_s" not in text and "per_context_token_sq_s" not in text
    dec = spec.step_time.decode.model_copy(update={"single_request_s": 1e-3, "per_context_token_sq_s": 2e-11,
                                                   "batch_change_s": 3e-3})
    write_spec(spec.model_copy(update={"step_time": spec.step_time.model_copy(update={"decode": dec})}),
               tmp_path / "q.yaml")
    assert load_profile(str(tmp_path / "q.yaml")).spec.step_time.decode == dec


def test_batch_change_s_is_added_by_replays_to_decode_steps_after_a_change(tmp_path: Path) -> None:
    spec = load_profile("cpu-tiny-llama").spec
    dec = spec.step_time.decode.model_copy(update={"batch_change_s": 0.02})
    write_spec(spec.model_copy(update={"step_time": spec.step_time.model_copy(update={"decode": dec})}),
               tmp_path / "bc.yaml")
    rec = load_recorded_run(SWEEP / "sweep-prefill-chunk-512")  # offline, no preemption: composition is fixed
    a = replay(rec, profile="cpu-tiny-llama", noise=False).tables["iterations"].to_pydict()
    b = replay(rec, profile=str(tmp_path / "bc.yaml"), noise=False).tables["iterations"].to_pydict()
    assert [a[c] for c in ("ctx_requests", "gen_requests")] == [b[c] for c in ("ctx_requests", "gen_requests")]
    shapes = [StepShape(decode_requests=g, prefill_requests=c, prefill_tokens=c)
              for c, g in zip(a["ctx_requests"], a["gen_requests"], strict=True)]
    extra = np.asarray(b["elapsed_ms"]) - np.asarray(a["elapsed_ms"])
    want = 20.0 * decode_batch_changed(shapes)
    assert want.sum() > 0 and np.allclose(extra, want, rtol=0, atol=1e-9)


def test_calibrate_fits_the_batch_change_where_the_recordings_show_it() -> None:
    plain = calibrate(SMALL, name="plain", command="test").spec
    bc = calibrate(SMALL, name="bc", command="test", options=FitOptions(decode_batch_change=True)).spec
    assert plain.step_time.decode.batch_change_s == 0.0
    assert bc.step_time.decode.batch_change_s > 0.0005  # these runs' decode steps after a change take ~1.5-3 ms more
    assert bc.step_time.prefill == plain.step_time.prefill


def test_cross_validation_over_several_noise_draws() -> None:
    one = cross_validate(SMALL[:2])
    three = cross_validate(SMALL[:2], seeds=3)
    assert [f.get("seed") for f in three["folds"]] == [0, 1, 2, 0, 1, 2]
    assert [f["items"] for f in three["folds"][::3]] == [f["items"] for f in one["folds"]]
    assert three["folds"][0]["items"] != three["folds"][1]["items"]  # another draw
    assert three["total"]["items"] == 3 * one["total"]["items"] and three["seeds"] == 3 and "seeds" not in one
    det = cross_validate(SMALL[:2], noise=False, seeds=3)  # deterministic replays: one row per fold
    assert len(det["folds"]) == 2 and det["total"]["items"] == 12
    with pytest.raises(ValueError):
        cross_validate(SMALL[:2], seeds=0)


# the batch floor is fitted on cpu-small-llama's offline sweep, where its decode steps show one (test_decode_floor)
SMALL_LLAMA = SWEEP.parents[1] / "cpu-small-llama-sweep" / "calibration"
SMALL_LLAMA_OFFLINE = sorted(p for p in SMALL_LLAMA.iterdir() if p.is_dir() and "server" not in p.name)


@pytest.mark.parametrize(("runs", "flag", "printed", "term"), [
    (SMALL, "--decode-batch-change", "if the batch shrank", "batch_change_s"),
    (SMALL_LLAMA_OFFLINE, "--decode-floor", "requests counted as at least", "floor_requests"),
], ids=["batch-change", "floor"])
def test_the_command_fits_the_terms_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str], runs: list[Path],
                                               flag: str, printed: str, term: str) -> None:
    from twin.cli import main

    out = tmp_path / "p.yaml"
    assert main(["calibrate", *map(str, runs), flag, "--out", str(out)]) == 0
    assert printed in capsys.readouterr().out
    spec = load_profile(str(out)).spec
    assert getattr(spec.step_time.decode, term) > 0 and spec.provenance.command.endswith(flag)
    assert main(["calibrate", *map(str, runs), "--seeds", "2"]) == 2  # --seeds goes with --cross-validate
