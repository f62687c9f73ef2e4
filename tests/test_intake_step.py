"""The server section's optional engine time per request sent while a step runs (``twin calibrate
--intake-step``): what it fits on a committed session's sweep (the steps during which the client sent requests left
out of the server regimes and noise, their excess per request sent), that a profile replay adds it to the step the
sends fell in while a replay with the recorded step times does not (those steps hold it already), and that a profile
keeps it out of its file unless fitted (docs/calibration-sessions.md, "The engine's own time per request taken
in")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.fidelity import fidelity, format_table
from twin.calibration.recorded import load_recorded_run
from twin.calibration.regimes import predict_model_s
from twin.calibration.server import reconstruct
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec
from twin.replay import IntakeExtra, replay

from calibkit import ONE_COMMAND, assert_same_fit, sweep_runs

ROOT = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-freshclone-frontend6"
BURSTY = ROOT / "held-out" / "heldout-server-bursty"


@pytest.fixture(scope="module")
def fitted() -> tuple:  # (the one command's options with the term, the committed profile: without it)
    on = calibrate(sweep_runs(ROOT), name="cpu-tiny-llama", command="t",
                   options=dataclasses.replace(ONE_COMMAND, idle_wake=True, stream_ends=True, intake=True,
                                               intake_step=True)).spec
    return on, load_profile(str(ROOT / "cpu-tiny-llama.yaml")).spec


def test_the_sweep_gives_the_term_from_the_steps_with_sends_left_out_of_the_regimes(
        fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, off = fitted
    srv, old = on.server, off.server
    assert old.per_request_in_step_s == 0.0
    # on this session's server runs a decode or prefill step during which a request came in ran ~0.6 ms longer
    assert 0.0004 < srv.per_request_in_step_s < 0.0009
    assert_same_fit(on.step_time, off.step_time)  # the offline fit is not touched
    assert (srv.arrival_s, srv.per_chunk_s, srv.per_request_in_s) == pytest.approx(
        (old.arrival_s, old.per_chunk_s, old.per_request_in_s), rel=1e-9)  # the front end's fit as committed
    servers = [load_recorded_run(p) for p in sweep_runs(ROOT) if "server" in p.name]
    with_sends = sum(int((reconstruct(r).sent > 0).sum()) for r in servers)
    assert f"of the {with_sends} steps during which the client sent requests" in srv.provenance.notes
    left_out = sum(old.step_time_noise.num_samples.values()) - sum(srv.step_time_noise.num_samples.values())
    assert 0 < left_out <= with_sends  # (less those already out as idle wakes)
    # the term is the median excess, per request sent, of those steps over the regimes fitted without them
    per = []
    for r in servers:
        s = reconstruct(r)
        m = s.sent > 0
        per.extend(((s.elapsed_s[m] - predict_model_s(srv.step_time, s.shapes)[m]) / s.sent[m]).tolist())
    assert len(per) == with_sends and srv.per_request_in_step_s == pytest.approx(float(np.median(per)), rel=1e-12)
    write_spec(on, tmp_path / "p.yaml")
    assert "per_request_in_step_s" in (tmp_path / "p.yaml").read_text()
    assert load_profile(str(tmp_path / "p.yaml")).spec.server == srv
    assert "per_request_in_step_s" not in (ROOT / "cpu-tiny-llama.yaml").read_text()


def test_a_profile_replay_adds_it_to_the_steps_the_sends_fell_in_and_a_recorded_replay_does_not(
        fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, _ = fitted
    rec = load_recorded_run(BURSTY)
    sends = np.array(sorted(r.arrival_s for r in rec.requests))
    for name, term in (("with", 0.002), ("without", 0.0)):
        write_spec(on.model_copy(update={"server": on.server.model_copy(update={"per_request_in_step_s": term})}),
                   tmp_path / f"{name}.yaml")
    x = on.server.per_request_in_s
    for step_times in ("profile", "recorded"):
        res = {name: replay(rec, profile=str(tmp_path / f"{name}.yaml"), step_times=step_times, noise=False)
               for name in ("with", "without")}
        model = res["with"].world.replica.step_model
        assert isinstance(model, IntakeExtra)
        it = res["with"].tables["iterations"]
        starts, ms = it.column("t_start_s").to_numpy(), it.column("elapsed_ms").to_numpy()
        span = ms / 1e3 + res["with"].world.replica.overhead_s
        counted = np.array([np.sum((sends > t) & (sends <= t + d)) for t, d in zip(starts, span, strict=True)])
        assert counted.sum() == model.taken_in > 0
        assert model.added_s == pytest.approx(x * model.taken_in)  # the front end's part only (step-time sum)
        ttft = {k: np.array(v.tables["requests"].column("ttft_s").to_pylist()) for k, v in res.items()}
        if step_times == "profile":
            assert model.engine_per_request_s == 0.002
            assert np.median(ttft["with"] - ttft["without"]) > 0.001  # a request's own send slows the step it waits on
        else:
            assert model.engine_per_request_s == 0.0 and (ttft["with"] == ttft["without"]).all()


def test_fidelity_names_the_term(fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, _ = fitted
    write_spec(on, tmp_path / "p.yaml")
    report = fidelity([BURSTY], profile=str(tmp_path / "p.yaml"), noise=False)
    assert report["server_front_end"]["per_request_in_step_s"] == on.server.per_request_in_step_s
    text = format_table(report)
    assert "the engine's step" in text and "longer per request sent while it runs" in text


def test_the_option_stays_off_by_default_and_the_command_line_carries_it(tmp_path: Path) -> None:
    from twin.cli import main

    assert FitOptions().intake_step is False
    out = tmp_path / "p.yaml"
    assert main(["calibrate", *map(str, sweep_runs(ROOT)), "--idle-wake", "--intake", "--intake-step",
                 "--out", str(out)]) == 0
    spec = load_profile(str(out)).spec
    assert "--intake-step" in spec.provenance.command and spec.server.per_request_in_step_s > 0
