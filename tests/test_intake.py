"""The server front end's optional time per request sent while a step runs (``twin calibrate --intake``): the fit
recovers a known term, the reconstruction counts each send in the one step it fell in, a committed sweep gives the
term, a replay adds it to each step by the sends inside that step, and a profile keeps it out of its file unless
fitted (docs/calibration-sessions.md, "The front end's time per request taken in")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.fidelity import fidelity, format_table
from twin.calibration.recorded import load_recorded_run
from twin.calibration.server import fit_front_end, front_end_samples, front_end_sent, reconstruct, sends_during
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec
from twin.replay import IntakeExtra, StreamEndsExtra, recorded_step_timing, replay

from calibkit import assert_same_fit

ROOT = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-offlinewarm2"
SWEEP = sorted(p for p in (ROOT / "calibration").iterdir() if (p / "run.json").exists())
BURSTY = ROOT / "held-out-repeat2" / "heldout-server-bursty"


def test_the_fit_recovers_a_known_intake_term_and_without_it_is_the_two_term_fit() -> None:
    rng = np.random.default_rng(13)
    chunks = rng.integers(1, 16, size=4000)
    sent = rng.poisson(0.4, size=chunks.size)  # a few requests arrive during some steps
    gaps = 0.0009 + 0.00007 * chunks + 0.0008 * sent + rng.normal(0, 0.0001, size=chunks.size)
    base, per_chunk, per_first, per_last, per_in = fit_front_end(gaps, chunks, sent=sent)
    assert base == pytest.approx(0.0009, abs=2e-5) and per_chunk == pytest.approx(0.00007, abs=3e-6)
    assert per_in == pytest.approx(0.0008, abs=2e-5) and per_first == per_last == 0.0
    two = fit_front_end(gaps, chunks)
    assert two[4] == 0.0 and two[0] > base  # without the column the intake time lands on the per-step base
    firsts, lasts = rng.binomial(chunks, 0.05), rng.binomial(chunks, 0.05)
    all_terms = fit_front_end(gaps + 0.0005 * lasts, chunks, (firsts, lasts), sent=sent)
    assert all_terms[3] == pytest.approx(0.0005, abs=3e-5) and all_terms[4] == pytest.approx(0.0008, abs=3e-5)


def test_each_send_is_counted_in_the_step_that_ran_while_it_came() -> None:
    rec = load_recorded_run(BURSTY)
    steps = reconstruct(rec)
    sends = np.array([r.arrival_s for r in rec.requests])
    send_of = {r.request_id: r.arrival_s for r in rec.requests}
    assert (steps.sent == sends_during(steps, send_of)).all()
    assert 0 < steps.sent.sum() <= len(rec.requests)
    last = {rid: int(ts[-1]) for rid, ts in steps.token_steps.items()}
    idle_starts = 0
    for k, t_b in steps.end_s.items():
        busy = any(f <= k - 1 < last[rid] for rid, f in steps.first_step.items())
        if busy:
            t_a = steps.end_s.get(k - 1)
        else:  # an idle engine: step k started on the earliest request it admitted, whose send is not counted
            admitted = [send_of[rid] for rid, f in steps.first_step.items() if f == k]
            t_a = min(admitted) if admitted else None
            idle_starts += bool(admitted)
        expected = 0 if t_a is None else int(np.sum((sends > t_a) & (sends <= t_b)))
        assert steps.sent[k] == expected, k
    assert idle_starts > 0
    gaps, chunks, _, _ = front_end_samples(steps)
    sent = front_end_sent(steps)
    assert sent.size == gaps.size and 0 < sent.sum() <= steps.sent.sum()


@pytest.fixture(scope="module")
def fitted() -> tuple:  # (with the option, without it)
    on = calibrate(SWEEP, name="cpu-tiny-llama", command="t", options=FitOptions(intake=True)).spec
    off = load_profile(str(ROOT / "cpu-tiny-llama.yaml")).spec
    return on, off


def test_the_sweep_gives_the_term_and_the_rest_of_the_fit_as_before(fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, off = fitted
    srv, old = on.server, off.server
    assert old.per_request_in_s == 0.0
    # on this session's two Poisson server runs: about 0.9 ms per request sent while a step ran
    assert 0.0005 < srv.per_request_in_s < 0.0013
    assert srv.step_time.overhead_s < old.step_time.overhead_s  # part of the old per-step base was intake time
    assert_same_fit(on.step_time, off.step_time)  # the offline fit is not touched
    assert "per request sent while the step ran" in srv.provenance.notes
    write_spec(on, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert "per_request_in_s" in text
    assert load_profile(str(tmp_path / "p.yaml")).spec.server == srv
    assert "per_request_in_s" not in (ROOT / "cpu-tiny-llama.yaml").read_text()


def test_a_replay_adds_the_term_for_the_sends_inside_each_step(
        fitted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    on, _ = fitted
    write_spec(on, tmp_path / "p.yaml")
    rec = load_recorded_run(BURSTY)
    sends = np.array(sorted(r.arrival_s for r in rec.requests))
    x = on.server.per_request_in_s
    seen: list[tuple[float, float, float]] = []  # (start, duration asked, duration given)
    stretch = IntakeExtra.stretch_step

    def spy(self, t0_s: float, duration_s: float) -> float:  # noqa: ANN001
        seen.append((t0_s, duration_s, stretch(self, t0_s, duration_s)))
        return seen[-1][2]

    monkeypatch.setattr(IntakeExtra, "stretch_step", spy)
    for step_times in ("profile", "recorded"):
        seen.clear()
        res = replay(rec, profile=str(tmp_path / "p.yaml"), step_times=step_times, noise=False)
        model = res.world.replica.step_model
        assert res.ok and isinstance(model, IntakeExtra) and not isinstance(model.base, StreamEndsExtra)
        it = res.tables["iterations"]
        assert it.num_rows == len(seen)
        assert it.column("t_start_s").to_numpy() == pytest.approx([t for t, _, _ in seen])
        over = res.world.replica.overhead_s  # (the log leaves out the per-step base)
        assert it.column("elapsed_ms").to_numpy() / 1e3 + over == pytest.approx([g for _, _, g in seen])
        counted = np.array([np.sum((sends > t) & (sends <= t + g)) for t, _, g in seen])
        # each step is longer by x for every send inside its own (lengthened) span, and by nothing else
        assert np.array([g - a for _, a, g in seen]) == pytest.approx(x * counted, abs=1e-12)
        assert counted.sum() == model.taken_in > 0 and model.added_s == pytest.approx(x * model.taken_in)
        assert 0 < int(np.sum(counted > 0)) < it.num_rows  # most steps take in nothing
    assert recorded_step_timing(res)["matched"] == "work"  # twin* still matches steps by work under the wrapper


def test_fidelity_names_the_term_and_keeps_it_out_of_the_step_time_sum(fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, _ = fitted
    write_spec(on, tmp_path / "p.yaml")
    report = fidelity([BURSTY], profile=str(tmp_path / "p.yaml"), noise=False)
    assert "per request sent while a step runs" in format_table(report)
    assert report["server_front_end"]["per_request_in_s"] == on.server.per_request_in_s
    item = report["runs"][0]["items"]["step_time_sum_s"]
    assert abs(item["rel_error_recorded_steps"]) < 0.03
