"""The sweep's fourth server run, ``sweep-server-context`` (since 2026-12-06; docs/calibration-sessions.md,
"Decode context apart from batch in the server sweep"), on the two cpu-small-llama sessions recorded with it
(tests/fixtures/calibration/cpu-small-llama-context*, SOURCES.md there), and on the first cpu-tiny-llama session of
the one command with it (cpu-tiny-llama-context; the later ones are pinned in tests/test_one_command_sessions.py).

In the three rate runs a decode step's context grows with its batch (about the same context a request at any rate),
so the server fit cannot tell the two terms apart; the context run holds the batch at 8 while whole prompts of
16..1800 tokens pass through it. Measured here: what the run separates, what the fit then finds, and what the fit
without it gets wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import calibrate
from twin.calibration.fidelity import fidelity
from twin.calibration.recorded import load_recorded_run
from twin.calibration.server import reconstruct
from twin.calibration.workload_sets import CALIBRATION_SWEEP
from twin.engine_profiles import load_profile
from twin.engine_profiles.derive import write_spec

from calibkit import ONE_COMMAND, pinned_session, sweep_runs

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "calibration"
SESSIONS = [FIXTURES / "cpu-small-llama-context", FIXTURES / "cpu-small-llama-context2"]


def _decode_steps(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """(decode requests, decode context tokens) of a server run's decode-only steps."""
    s = reconstruct(load_recorded_run(run))
    pairs = [(sh.decode_requests, sh.decode_context_tokens) for sh in s.shapes
             if sh.prefill_requests == 0 and sh.decode_requests > 0]
    b, c = np.array(pairs, dtype=np.float64).T
    return b, c


def test_the_workload_holds_the_batch_while_the_context_moves() -> None:
    spec = CALIBRATION_SWEEP["sweep-server-context"]
    assert spec.mode == "server" and spec.engine.max_num_seqs == 8
    for session in SESSIONS:
        runs = sorted((session / "calibration").glob("sweep-server-*"))
        assert [r.name for r in runs] == ["sweep-server-context", "sweep-server-rate-14", "sweep-server-rate-24",
                                          "sweep-server-rate-6"]
        steps = {r.name: _decode_steps(r) for r in runs}
        b, c = steps["sweep-server-context"]
        at8 = b == 8
        assert at8.mean() > 0.85  # most of its decode steps hold the batch at 8 ...
        assert c[at8].max() / c[at8].min() > 1.4  # ... while their context moves by half as much again
        rates = [steps[n] for n in ("sweep-server-rate-6", "sweep-server-rate-14", "sweep-server-rate-24")]
        rb, rc = (np.concatenate(x) for x in zip(*rates))
        assert np.corrcoef(rb, rc)[0, 1] > 0.99  # the rate runs alone: context follows batch
        ab, ac = np.concatenate([rb, b]), np.concatenate([rc, c])
        assert np.corrcoef(ab, ac)[0, 1] < 0.85


def _fits(session: Path) -> tuple:
    runs = sweep_runs(session)
    without = [r for r in runs if r.name != "sweep-server-context"]
    return (calibrate(without, name="without", command="test", options=ONE_COMMAND).spec,
            calibrate(runs, name="with", command="test", options=ONE_COMMAND).spec)


def test_with_the_run_the_server_context_term_is_found_and_the_same_in_both_sessions(tmp_path: Path) -> None:
    fits = [_fits(s) for s in SESSIONS]
    ctx = [(w.server.step_time.decode.per_context_token_s, c.server.step_time.decode.per_context_token_s)
           for w, c in fits]
    for without, with_ in ctx:
        assert with_ > 3 * without  # the rate runs alone give the batch term what the context costs
    assert ctx[0][1] == pytest.approx(ctx[1][1], rel=0.05)  # measured: 838.5 and 836.4 ns a context token
    for w, c in fits:  # the offline fit does not see server runs
        assert w.step_time == c.step_time
    # each session's fit without the run replays the other session's context run too fast; with it, within 5 %
    # (measured, no noise: ITL p50 -27.4 and -19.7 % without, -4.3 and +2.3 % with)
    for k, (w, c) in enumerate(fits):
        other = SESSIONS[1 - k] / "calibration" / "sweep-server-context"
        errors = []
        for name, spec in (("without", w), ("with", c)):
            write_spec(spec, tmp_path / f"{name}{k}.yaml")
            run = fidelity([other], profile=str(tmp_path / f"{name}{k}.yaml"), noise=False)["runs"][0]
            errors.append(run["items"]["itl_p50_s"]["rel_error"])
        assert errors[0] < -0.15 and abs(errors[1]) < 0.05, errors


TINY = FIXTURES / "cpu-tiny-llama-context"


def test_the_tiny_models_session_with_the_run() -> None:
    """cpu-tiny-llama's session of the one command with the eleven-run sweep (SOURCES.md there): its profile and table
    are what calibrate and fidelity give on its recordings (143 of 160 items, twin* 122 of 128); on this model the
    server context term stays small with the run too (232 ns a token; 125 without it)."""
    pinned_session(TINY, "cpu-tiny-llama", 143, 61, recorded=122)
    committed = load_profile(str(TINY / "cpu-tiny-llama.yaml")).spec
    assert committed.server.step_time.decode.per_context_token_s == pytest.approx(232e-9, rel=0.01)
