"""The server section's optional idle-wake term (``twin calibrate --idle-wake``): what it fits on a committed
session's sweep, that a replay adds it to the first step after an idle spell only, and that it stays out of a
profile unless fitted (docs/calibration-sessions.md, "A quiet server's first step"); and, on a later session, where
the option's items went ("Three more sessions of the one command with `--idle-wake`")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.recorded import load_recorded_run
from twin.calibration.regimes import predict_model_s
from twin.calibration.server import IDLE_AFTER_S, idle_wake_excess_s, idle_wakes, reconstruct, step_front_end_s
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec
from twin.replay import IdleWakeExtra, replay

from calibkit import ONE_COMMAND, assert_same_fit, spec_latency_passed, sweep_runs

ROOT = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-offlinewarm2"
SWEEP = sorted(p for p in (ROOT / "calibration").iterdir() if (p / "run.json").exists())
BURSTY = ROOT / "held-out-repeat2" / "heldout-server-bursty"


def test_the_fit_adds_the_term_and_leaves_the_wakes_out_of_the_server_prefill_regime(tmp_path: Path) -> None:
    committed = load_profile(str(ROOT / "cpu-tiny-llama.yaml")).spec
    spec = calibrate(SWEEP, name="cpu-tiny-llama", command="t", options=FitOptions(idle_wake=True)).spec
    assert committed.server is not None and spec.server is not None and committed.server.idle_wake_s == 0.0
    # on this quiet session a request sent to an idle server got its first token ~4 ms later than the fit put it
    assert 0.003 < spec.server.idle_wake_s < 0.005
    assert_same_fit(spec.step_time, committed.step_time)  # the offline fit is not touched
    srv, old = spec.server, committed.server
    assert (srv.arrival_s, srv.per_chunk_s, srv.step_time.overhead_s) == pytest.approx(
        (old.arrival_s, old.per_chunk_s, old.step_time.overhead_s), rel=1e-9)
    assert_same_fit(srv.step_time.decode, old.step_time.decode)
    # the 15 wakes' steps are prefill steps, left out of that regime and of its noise table
    assert srv.step_time.prefill != old.step_time.prefill
    assert srv.step_time_noise.num_samples["prefill"] == old.step_time_noise.num_samples["prefill"] - 15
    assert "median excess of the first token of 15 requests" in srv.provenance.notes
    write_spec(spec, tmp_path / "p.yaml")
    assert "idle_wake_s" in (tmp_path / "p.yaml").read_text()
    assert load_profile(str(tmp_path / "p.yaml")).spec.server.idle_wake_s == spec.server.idle_wake_s
    assert "idle_wake_s" not in (ROOT / "cpu-tiny-llama.yaml").read_text()


def test_the_excess_counts_each_idle_wake_once_from_its_earliest_request() -> None:
    rec = load_recorded_run(SWEEP[-1])  # sweep-server-rate-6: Poisson sends, many to an idle engine
    steps = reconstruct(rec)
    srv = load_profile(str(ROOT / "cpu-tiny-llama.yaml")).spec.server
    model_s = predict_model_s(srv.step_time, steps.shapes)
    wakes = idle_wake_excess_s(idle_wakes(rec, steps, arrival_s=srv.arrival_s), model_s,
                               step_front_end_s(steps, base_s=srv.step_time.overhead_s, per_chunk_s=srv.per_chunk_s))
    first_steps = sorted(set(steps.first_step.values()))
    idle = [k for k in first_steps
            if k == 0 or (k - 1 in steps.end_s and min(r.arrival_s for r in rec.requests
                                                       if steps.first_step[r.request_id] == k)
                          + srv.arrival_s - steps.end_s[k - 1] >= IDLE_AFTER_S)]
    assert 0 < len(wakes) <= len(idle) < len(first_steps)
    assert float(np.median(wakes)) > 0.0


def test_a_replay_adds_the_term_to_the_first_step_after_an_idle_spell(tmp_path: Path) -> None:
    spec = load_profile(str(ROOT / "cpu-tiny-llama.yaml")).spec
    write_spec(spec.model_copy(update={"server": spec.server.model_copy(update={"idle_wake_s": 0.010})}),
               tmp_path / "wake.yaml")
    rec = load_recorded_run(BURSTY)
    a = replay(rec, profile=str(ROOT / "cpu-tiny-llama.yaml"), noise=False).tables["requests"].to_pydict()
    b = replay(rec, profile=str(tmp_path / "wake.yaml"), noise=False).tables["requests"].to_pydict()
    ttft_a = dict(zip(a["request_id"], a["ttft_s"], strict=True))
    ttft_b = dict(zip(b["request_id"], b["ttft_s"], strict=True))
    first = min(rec.requests, key=lambda r: r.arrival_s).request_id  # the run's first request: an idle engine
    assert ttft_b[first] == pytest.approx(ttft_a[first] + 0.010, abs=1e-12)
    assert sum(ttft_b[k] > ttft_a[k] + 0.009 for k in ttft_a) >= 10  # every later idle wake too


def test_the_wrapper_charges_one_step_per_wake_and_only_after_the_threshold() -> None:
    class Flat:
        overhead_s = 0.0

        def step_time_s(self, shape) -> float:  # noqa: ANN001
            return 0.001

        def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> np.ndarray:
            return np.full(num_steps, 0.001)

    m = IdleWakeExtra(Flat(), 0.004, IDLE_AFTER_S)
    m.woke_after_idle(IDLE_AFTER_S / 2)
    assert m.step_time_s(None) == 0.001
    m.woke_after_idle(IDLE_AFTER_S)
    assert m.step_time_s(None) == pytest.approx(0.005) and m.step_time_s(None) == 0.001
    m.woke_after_idle(float("inf"))
    assert m.decode_run_s(1, 10, 3).tolist() == pytest.approx([0.005, 0.001, 0.001])
    assert m.decode_run_s(1, 10, 2).tolist() == [0.001, 0.001]


def test_where_the_option_lost_items_on_the_fourth_one_command_session(tmp_path: Path) -> None:
    """cpu-tiny-llama-freshclone-idlewake4 (docs/calibration-sessions.md, "Three more sessions of the one command with
    `--idle-wake`"): fitted without the option its eight held-out server runs pass 47 of 48 latency items, with it 45.
    The loss is the option's prefill noise table (the wakes left out of it): that table alone, put into the fit
    without the option, gives 45 as well."""
    session = ROOT.parent / "cpu-tiny-llama-freshclone-idlewake4"
    runs = sorted(p for rep in session.glob("held-out*") for p in rep.iterdir() if "server" in p.name)
    assert len(runs) == 8
    fits = {wake: calibrate(sweep_runs(session), name="cpu-tiny-llama", command="t",
                            options=dataclasses.replace(ONE_COMMAND, idle_wake=wake)).spec for wake in (True, False)}
    with_wake, without = fits[True].server, fits[False].server
    assert with_wake.step_time_noise.num_samples["prefill"] == without.step_time_noise.num_samples["prefill"] - 16
    noise = without.step_time_noise.model_copy(update={"prefill": with_wake.step_time_noise.prefill})
    swapped = fits[False].model_copy(update={"server": without.model_copy(update={"step_time_noise": noise})})
    assert [spec_latency_passed(spec, runs, tmp_path / f"{name}.yaml") for name, spec in
            (("with", fits[True]), ("without", fits[False]), ("swapped", swapped))] == [45, 47, 45]
