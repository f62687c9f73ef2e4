"""The server front end: step shapes reconstructed from a server run's iteration log, the front-end and arrival
fits, the profile's ``server`` section (fitted from server runs that are not held out), and replays that apply
it to server-mode runs only."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from twin.calibration.calibrate import FitOptions, calibrate, fit_server, replay_recorded
from twin.calibration.fidelity import fidelity
from twin.calibration.recorded import load_recorded_run
from twin.calibration.server import (
    ReconstructionError,
    ServerStepTimeModel,
    fit_arrival_s,
    fit_front_end,
    front_end_samples,
    reconstruct,
)
from twin.engine_profiles import StepShape, load_profile
from twin.engine_profiles.derive import write_spec
from twin.paths import REPO_ROOT
from twin.replay import replay

FIX = REPO_ROOT / "tests" / "fixtures"
CAL = FIX / "calibration" / "cpu-tiny-llama"
QUIET = FIX / "calibration" / "cpu-tiny-llama-quiet"
SERVER_RUNS = sorted([*FIX.glob("recorded/server-*"), *CAL.glob("calibration/sweep-server-*"),
                      *CAL.glob("held-out*/heldout-server-*"), *FIX.glob("recorded/held-out/heldout-server-*"),
                      *QUIET.glob("calibration/sweep-server-*"), *QUIET.glob("held-out*/heldout-server-*")])
OFFLINE_NO_PREEMPTION = [FIX / "recorded" / n for n in ("offline-mixed", "offline-prefix", "offline-chunked-256")]


def test_there_are_server_recordings() -> None:
    assert len(SERVER_RUNS) >= 22


@pytest.mark.parametrize("path", SERVER_RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_reconstruction_explains_every_server_log(path: Path) -> None:
    rec = load_recorded_run(path)
    steps = reconstruct(rec)  # raises unless every step's gen_requests comes out of the FCFS walk
    assert len(steps.shapes) == len(rec.iterations)
    assert sum(s.prefill_tokens for s in steps.shapes) == sum(
        r.prompt_tokens - (r.num_cached_tokens or 0) for r in rec.requests)
    assert int(steps.chunks.sum()) == sum(r.output_tokens for r in rec.requests)
    for r in rec.requests:
        own = steps.token_steps[r.request_id]
        assert own.size == r.output_tokens and np.all(np.diff(own) == 1)  # one token per step once decoding
        assert own[0] >= steps.first_step[r.request_id]


@pytest.mark.parametrize("path", OFFLINE_NO_PREEMPTION, ids=lambda p: p.name)
def test_reconstructed_shapes_are_the_engines_shapes(path: Path) -> None:
    """On offline runs (where the twin's steps line up with the log) the walk gives the twin engine's shapes."""
    rec = load_recorded_run(path)
    _, recorder = replay_recorded(rec, overhead_s=0.0)
    assert reconstruct(rec).shapes == recorder.shapes


def test_a_log_the_walk_cannot_explain_is_refused(tmp_path: Path) -> None:
    src = FIX / "recorded" / "server-prefix"
    dst = shutil.copytree(src, tmp_path / "bad")
    with open(src / "iterations.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    col = rows[0].index("gen_requests")
    rows[6][col] = str(int(rows[6][col]) + 1)
    with open(dst / "iterations.csv", "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(rows)
    with pytest.raises(ReconstructionError, match="step 5"):
        reconstruct(load_recorded_run(dst))
    with pytest.raises(ReconstructionError, match="preemptions"):
        reconstruct(load_recorded_run(FIX / "recorded" / "offline-kv-pressure"))


def test_front_end_fit_recovers_base_and_per_chunk() -> None:
    rng = np.random.default_rng(5)
    chunks = rng.integers(1, 30, size=2000)
    gaps = 0.0012 + 0.00015 * chunks + rng.normal(0, 0.0002, size=chunks.size)
    base, per_chunk, per_first, per_last, per_in = fit_front_end(gaps, chunks)
    assert per_first == per_last == per_in == 0.0  # (no stream ends or intake asked for)
    assert base == pytest.approx(0.0012, abs=5e-5) and per_chunk == pytest.approx(0.00015, abs=5e-6)


def test_front_end_samples_leave_out_the_wait_of_an_idle_engine() -> None:
    """At 4 req/s the engine idles between requests; an interval spanning an idle spell is not front-end time."""
    steps = reconstruct(load_recorded_run(FIX / "recorded" / "server-poisson-low"))
    gaps, chunks, firsts, lasts = front_end_samples(steps)
    pairs = sum(1 for a in steps.end_s if a + 1 in steps.end_s)
    assert 0 < gaps.size < pairs and gaps.max() < 0.05 and chunks.min() >= 1
    assert (firsts <= chunks).all() and (lasts <= chunks).all() and lasts.sum() > 0


def test_arrival_fit_is_the_value_most_bounds_allow() -> None:
    lower = np.array([-np.inf, 0.002, 0.004, 0.001, -np.inf])
    upper = np.array([0.010, 0.012, 0.009, 0.0065, 0.0008])
    d, n = fit_arrival_s(lower, upper)
    assert (d, n) == (pytest.approx(0.0045), 4)  # (0.004, 0.0065]: all but the last; 0.0045 is the first grid point


def test_server_step_time_model_adds_the_per_chunk_time_consistently() -> None:
    sv = load_profile("cpu-tiny-llama").spec.server
    assert sv is not None
    model = ServerStepTimeModel(sv.step_time, per_chunk_s=0.001)
    run = model.decode_run_s(7, 900, 4)
    for i in range(4):
        one = StepShape(decode_requests=7, decode_context_tokens=900 + 7 * i)
        assert run[i] == pytest.approx(model.step_time_s(one))
    mixed = StepShape(decode_requests=3, decode_context_tokens=300, prefill_requests=2, prefill_tokens=200,
                      prefill_attention_pairs=20_000)
    assert model.step_time_s(mixed) == pytest.approx(model.base.step_time_s(mixed) + 0.005)


def test_shipped_server_section_is_fitted_from_server_runs_that_are_not_held_out(tmp_path: Path) -> None:
    prof = load_profile("cpu-tiny-llama")
    sv = prof.spec.server
    assert sv is not None and sv.arrival_s > 0 and sv.step_time.overhead_s > 0
    sources = [REPO_ROOT / s for s in sv.provenance.sources]
    assert len(sources) >= 4
    for src in sources:
        assert load_recorded_run(src).run.mode == "server"
        assert "held-out" not in str(src) and "heldout" not in src.name
    # fitted as the one command fits: the server attention term from the shipped offline fit, a decode batch floor
    refit = fit_server([load_recorded_run(s) for s in sources], command="test", generated_on="2026-11-29",
                       source_label=str, options=FitOptions(server_offline_attention=True, decode_floor=True),
                       offline=prof.spec.step_time).front_end
    assert refit.arrival_s == pytest.approx(sv.arrival_s, abs=1e-12)
    assert refit.per_chunk_s == pytest.approx(sv.per_chunk_s, rel=1e-9, abs=1e-15)
    for regime in ("decode", "prefill"):
        for k, v in getattr(refit.step_time, regime).model_dump().items():
            assert getattr(getattr(sv.step_time, regime), k) == pytest.approx(v, rel=1e-9, abs=1e-15), (regime, k)
    assert sv.step_time.overhead_s == pytest.approx(refit.step_time.overhead_s, rel=1e-9)


def test_calibrate_fits_offline_runs_as_before_and_server_runs_into_the_server_section() -> None:
    offline = [CAL / "calibration" / n for n in ("sweep-decode-batch", "sweep-prefill-chunk-512")]
    server = [FIX / "recorded" / "server-prefix", FIX / "recorded" / "server-poisson-low"]
    alone = calibrate(offline, name="x", command="t", generated_on="2026-11-29")
    both = calibrate([*offline, *server], name="x", command="t", generated_on="2026-11-29")
    assert alone.spec.server is None and both.spec.server is not None
    assert both.spec.model_copy(update={"server": None}) == alone.spec
    assert both.spec.server.provenance.sources == [str(p) for p in server]
    assert both.used == [*offline, *server] and not both.refused


def test_a_profile_without_a_server_section_is_written_as_before(tmp_path: Path) -> None:
    for name in ("llama3-8b-bf16-tp1-h100", "llama3-70b-fp8-tp4-h100"):
        spec = load_profile(name).spec
        assert spec.server is None
        write_spec(spec, tmp_path / f"{name}.yaml")
        assert "server" not in yaml.safe_load((tmp_path / f"{name}.yaml").read_text())


def _profile_without_server(tmp_path: Path) -> str:
    spec = load_profile("cpu-tiny-llama").spec.model_copy(update={"server": None})
    write_spec(spec, tmp_path / "no-server.yaml")
    return str(tmp_path / "no-server.yaml")


def test_offline_replays_do_not_see_the_server_section(tmp_path: Path) -> None:
    plain = _profile_without_server(tmp_path)
    rec = load_recorded_run(CAL / "held-out" / "heldout-offline-kv-prefix")
    for mode in ("profile", "recorded"):
        a = replay(rec, profile="cpu-tiny-llama", step_times=mode).tables
        b = replay(rec, profile=plain, step_times=mode).tables
        for t in ("requests", "iterations"):
            assert a[t].equals(b[t]), (mode, t)


def test_server_replay_applies_the_front_end_and_measures_from_the_send(tmp_path: Path) -> None:
    sv = load_profile("cpu-tiny-llama").spec.server
    rec = load_recorded_run(FIX / "recorded" / "server-prefix")
    with_fe = replay(rec, profile="cpu-tiny-llama").tables["requests"].to_pydict()
    without = replay(rec, profile=_profile_without_server(tmp_path)).tables["requests"].to_pydict()
    sent = {r.request_id: r.arrival_s for r in rec.requests}
    assert with_fe["arrival_s"] == pytest.approx([sent[i] for i in with_fe["request_id"]], abs=1e-9)
    for ttft, times in zip(with_fe["ttft_s"], with_fe["token_times_s"], strict=True):
        assert ttft >= sv.arrival_s and times[0] == pytest.approx(ttft)
    # the arrival alone adds sv.arrival_s to an idle engine's first request
    assert with_fe["ttft_s"][0] != pytest.approx(without["ttft_s"][0])


def test_fidelity_reports_the_front_end_and_keeps_offline_rows(tmp_path: Path) -> None:
    runs = [FIX / "recorded" / "server-prefix", CAL / "held-out" / "heldout-offline-kv-prefix"]
    with_fe = fidelity(runs, profile="cpu-tiny-llama")
    without = fidelity(runs, profile=_profile_without_server(tmp_path))
    assert with_fe["server_front_end"]["arrival_s"] > 0 and without["server_front_end"] is None
    assert with_fe["runs"][1]["items"] == without["runs"][1]["items"]  # the offline run: same rows
    server = with_fe["runs"][0]["items"]
    assert server["step_time_sum_s"]["twin"] > 0 and server["step_time_sum_s"]["twin_recorded_steps"] > 0
    assert json.dumps(with_fe)  # JSON-ready


def test_server_runs_alone_cannot_fit_a_profile() -> None:
    from twin.calibration.calibrate import CalibrationError

    with pytest.raises(CalibrationError, match="no offline run given"):
        calibrate([FIX / "recorded" / "server-prefix"], name="x", command="t")
