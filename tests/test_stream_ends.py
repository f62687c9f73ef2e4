"""The server front end's optional time per stream opened and closed (``twin calibrate --stream-ends``): the fit
recovers known terms, the reconstruction counts each request's first and last chunk once, a committed sweep
gives both terms, a replay adds them to exactly the steps that send a first or a last token, and a profile keeps
them out of its file unless fitted (docs/calibration-sessions.md, "Streams opened and closed")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import twin.replay as replay_mod
from twin.calibration.calibrate import FitOptions, calibrate
from twin.calibration.fidelity import fidelity, format_table
from twin.calibration.recorded import load_recorded_run
from twin.calibration.server import fit_front_end, front_end_samples, reconstruct, step_front_end_s, stream_ends
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec
from twin.replay import StreamEndsExtra, replay

from calibkit import assert_same_fit

ROOT = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-offlinewarm2"
SWEEP = sorted(p for p in (ROOT / "calibration").iterdir() if (p / "run.json").exists())
BURSTY = ROOT / "held-out-repeat2" / "heldout-server-bursty"


def test_the_fit_recovers_known_terms_and_without_ends_is_the_two_term_fit() -> None:
    rng = np.random.default_rng(11)
    chunks = rng.integers(1, 16, size=4000)
    firsts = rng.binomial(chunks, 0.05)  # each streamed chunk a stream's first or last now and then, as on a server
    lasts = rng.binomial(chunks, 0.05)
    gaps = 0.0006 + 0.00008 * chunks + 0.0004 * firsts + 0.0006 * lasts + rng.normal(0, 0.0001, size=chunks.size)
    base, per_chunk, per_first, per_last, per_in = fit_front_end(gaps, chunks, (firsts, lasts))
    assert base == pytest.approx(0.0006, abs=2e-5) and per_chunk == pytest.approx(0.00008, abs=3e-6)
    assert per_first == pytest.approx(0.0004, abs=2e-5) and per_last == pytest.approx(0.0006, abs=2e-5)
    two = fit_front_end(gaps, chunks)
    assert per_in == 0.0 and two[2:] == (0.0, 0.0, 0.0)
    assert two[1] > per_chunk  # the ends' time lands on the per-chunk term without them


def test_each_request_opens_and_closes_one_stream_in_the_steps_of_its_first_and_last_token() -> None:
    steps = reconstruct(load_recorded_run(BURSTY))
    firsts, lasts = stream_ends(steps)
    n = len(steps.token_steps)
    assert firsts.sum() == lasts.sum() == n
    for ts in steps.token_steps.values():
        assert firsts[int(ts[0])] >= 1 and lasts[int(ts[-1])] >= 1
    assert (firsts <= steps.chunks).all() and (lasts <= steps.chunks).all()
    fixed = step_front_end_s(steps, base_s=0.001, per_chunk_s=0.0001, per_first_s=0.0003, per_last_s=0.0005)
    assert fixed == pytest.approx(0.001 + 0.0001 * steps.chunks + 0.0003 * firsts + 0.0005 * lasts)
    gaps, chunks, f, last = front_end_samples(steps)
    assert gaps.size == chunks.size == f.size == last.size and 0 < f.sum() <= n and 0 < last.sum() <= n


@pytest.fixture(scope="module")
def fitted() -> tuple:  # (with the option, without it)
    on = calibrate(SWEEP, name="cpu-tiny-llama", command="t", options=FitOptions(stream_ends=True)).spec
    off = load_profile(str(ROOT / "cpu-tiny-llama.yaml")).spec
    return on, off


def test_the_sweep_gives_both_terms_and_the_rest_of_the_fit_as_before(fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, off = fitted
    srv, old = on.server, off.server
    assert old.per_first_chunk_s == old.per_last_chunk_s == 0.0
    # on this session's two Poisson server runs: a stream opened ~0.2 ms, one closed ~0.6 ms beyond its chunk
    assert 0.0001 < srv.per_first_chunk_s < 0.0004 and 0.0004 < srv.per_last_chunk_s < 0.0008
    assert srv.per_chunk_s < old.per_chunk_s
    assert_same_fit(on.step_time, off.step_time)  # the offline fit is not touched
    assert "per stream opened" in srv.provenance.notes
    write_spec(on, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert "per_first_chunk_s" in text and "per_last_chunk_s" in text
    assert load_profile(str(tmp_path / "p.yaml")).spec.server == srv
    assert "per_first_chunk_s" not in (ROOT / "cpu-tiny-llama.yaml").read_text()


def test_a_replay_adds_the_terms_to_the_steps_that_send_a_first_or_last_token(
        fitted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    on, _ = fitted
    write_spec(on, tmp_path / "p.yaml")
    seen: list[tuple[int, int]] = []
    count = replay_mod.stream_ends_of

    def spy(step, max_model_len: int) -> tuple[int, int]:  # noqa: ANN001
        seen.append(count(step, max_model_len))
        return seen[-1]

    monkeypatch.setattr(replay_mod, "stream_ends_of", spy)
    rec = load_recorded_run(BURSTY)
    res = replay(rec, profile=str(tmp_path / "p.yaml"), noise=False)
    assert res.ok and isinstance(res.world.replica.step_model, StreamEndsExtra)
    it = res.tables["iterations"]
    assert it.num_rows == len(seen)
    # each step's end from the iteration log, and the requests whose first and last token came at it
    over = res.world.replica.overhead_s
    ends = it.column("t_start_s").to_numpy() + it.column("elapsed_ms").to_numpy() / 1e3 + over
    times = list(res.world.token_times.values())
    for i, end in enumerate(ends):
        opened = sum(1 for ts in times if abs(ts[0] - end) < 1e-9)
        closed = sum(1 for ts in times if abs(ts[-1] - end) < 1e-9)
        assert seen[i] == (opened, closed), i
    assert sum(o for o, _ in seen) == sum(c for _, c in seen) == len(rec.requests)
    # the recorded-step replay (twin*) adds them as well, through the same wrapper
    seen.clear()
    res_r = replay(rec, profile=str(tmp_path / "p.yaml"), step_times="recorded")
    assert isinstance(res_r.world.replica.step_model, StreamEndsExtra)
    assert sum(o for o, _ in seen) == len(rec.requests)


def test_fidelity_names_the_terms_and_keeps_them_out_of_the_step_time_sum(fitted, tmp_path: Path) -> None:  # noqa: ANN001
    on, _ = fitted
    write_spec(on, tmp_path / "p.yaml")
    report = fidelity([BURSTY], profile=str(tmp_path / "p.yaml"), noise=False)
    assert "per stream opened" in format_table(report)
    item = report["runs"][0]["items"]["step_time_sum_s"]
    # twin*'s steps take the recorded times (plus the front end, which the sum leaves out): near the recording
    assert abs(item["rel_error_recorded_steps"]) < 0.03
