"""The recorded-step-time replay of a server run (twin*) times each step from the recorded steps that did its work
(``twin.replay.MatchedStepTimes``), not from the recorded step with its index: a server's steps do not line up with
the recording's one for one, and by index a burst's prefill took a decode step's time (bursty TTFT p50 a median
-54 % over the committed sessions)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from twin.calibration.fidelity import fidelity
from twin.calibration.recorded import load_recorded_run
from twin.calibration.server import ServerSteps, ServerStepTimeModel, reconstruct
from twin.engine_profiles import load_profile
from twin.engine_profiles.step import StepShape
from twin.replay import MatchedStepTimes

CAL = Path(__file__).parent / "fixtures" / "calibration" / "cpu-tiny-llama-serverattn"
PROFILE = CAL / "cpu-tiny-llama.yaml"
SERVER_RUNS = [CAL / "held-out" / "heldout-server-bursty", CAL / "held-out" / "heldout-server-prefix-mix",
               CAL / "calibration" / "sweep-server-rate-14"]


def _member(rid: str, *, prompt: int, computed: int, output: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_tokens=prompt, num_computed=computed, num_output=output)


def _step(members: list[tuple[SimpleNamespace, int]], shape: StepShape, g_n: int = 0) -> SimpleNamespace:
    """A twin step as the replica hands it over: members with their tokens, ``num_computed`` already counting them."""
    return SimpleNamespace(reqs=[m for m, _ in members], ns=[n for _, n in members], g_n=g_n, shape=shape)


def _timer(steps: ServerSteps, *, overhead_s: float = 0.0, per_chunk_s: float = 0.0) -> MatchedStepTimes:
    server = load_profile(str(PROFILE)).spec.server
    model = ServerStepTimeModel(server.step_time, per_chunk_s=per_chunk_s)
    return MatchedStepTimes(steps, model, overhead_s=overhead_s, per_chunk_s=per_chunk_s)


@pytest.mark.parametrize("path", SERVER_RUNS, ids=lambda p: p.name)
def test_each_recorded_step_rebuilt_maps_to_itself_and_takes_its_own_time(path: Path) -> None:
    """Every recorded step, rebuilt as the twin would schedule it (decodes first, then prefill chunks), maps to
    itself alone and takes its recorded time plus the overhead and chunks: an off-by-one token or chunk fails."""
    rec = load_recorded_run(path)
    steps = reconstruct(rec)
    prompts = {r.request_id: r.prompt_tokens for r in rec.requests}
    members: dict[int, list[tuple[SimpleNamespace, int]]] = {i: [] for i in range(len(steps.shapes))}
    for rid, ts in steps.token_steps.items():
        for j, k in enumerate(ts.tolist()):
            if j:  # output token j (0-based) comes from a decode that computes position prompt + j - 1
                members[k].append((_member(rid, prompt=prompts[rid], computed=prompts[rid] + j, output=j), 1))
    for rid, chunks in steps.chunk_steps.items():
        for a, b, k in chunks:
            members[k].append((_member(rid, prompt=prompts[rid], computed=b, output=0), b - a))
    timer = _timer(steps, overhead_s=0.5e-3, per_chunk_s=0.1e-3)
    for i, shape in enumerate(steps.shapes):
        step = _step(members[i], shape)
        assert timer.recorded_steps(step) == {i}, i
        want = steps.elapsed_s[i] + 0.5e-3 + 0.1e-3 * (shape.decode_requests + shape.prefill_requests)
        assert timer.step_time_for(step) == pytest.approx(want, rel=1e-12), i
    assert timer.exact == len(steps.shapes) and timer.scaled == timer.modelled == 0


def test_chunks_tokens_and_group_members_map_to_the_steps_that_did_them() -> None:
    """A 100-token prompt recorded in two chunks (steps 0 and 1; its first token from step 1) and two decodes."""
    shapes = [StepShape(prefill_requests=1, prefill_tokens=64, prefill_attention_pairs=2080),
              StepShape(prefill_requests=1, prefill_tokens=36, prefill_attention_pairs=2970),
              StepShape(decode_requests=1, decode_context_tokens=101),
              StepShape(decode_requests=1, decode_context_tokens=102)]
    steps = ServerSteps(path=Path("synthetic"), shapes=shapes, elapsed_s=np.array([0.010, 0.008, 0.004, 0.005]),
                        chunks=np.array([0, 1, 1, 1]), first_step={"a": 0},
                        token_steps={"a": np.array([1, 2, 3])}, chunk_steps={"a": [(0, 64, 0), (64, 100, 1)]})
    timer = _timer(steps)

    def a(computed: int, output: int) -> SimpleNamespace:
        return _member("a", prompt=100, computed=computed, output=output)

    assert timer.recorded_steps(_step([(a(64, 0), 64)], shapes[0])) == {0}
    assert timer.recorded_steps(_step([(a(100, 0), 36)], shapes[1])) == {1}
    assert timer.recorded_steps(_step([(a(100, 0), 100)], shapes[0])) == {0, 1}  # the whole prompt in one step
    assert timer.recorded_steps(_step([(a(101, 1), 1)], shapes[2])) == {2}
    assert timer.recorded_steps(_step([(a(-1, 2), 1)], shapes[3], g_n=1)) == {3}  # a group member: its output count
    assert timer.recorded_steps(_step([(a(101, 1), 101)], shapes[0])) == {0, 1}  # a re-prefill past the prompt
    assert timer.recorded_steps(_step([(a(102, 3), 1)], shapes[3])) == set()  # past the recording
    # one recorded step of the same shape: its time; another shape or several steps: the model at their speed
    assert timer.step_time_for(_step([(a(101, 1), 1)], shapes[2])) == pytest.approx(0.004, rel=1e-12)
    whole = StepShape(prefill_requests=1, prefill_tokens=100, prefill_attention_pairs=5050)
    speed = (0.010 + 0.008) / (timer._model_time(shapes[0]) + timer._model_time(shapes[1]))
    assert timer.step_time_for(_step([(a(100, 0), 100)], whole)) == pytest.approx(timer._model_time(whole) * speed,
                                                                                 rel=1e-12)
    assert timer.step_time_for(_step([(a(102, 3), 1)], shapes[3])) == pytest.approx(timer._model_time(shapes[3]),
                                                                                    rel=1e-12)
    assert (timer.exact, timer.scaled, timer.modelled) == (1, 1, 1)


def test_a_server_sessions_twin_star_ttft_is_near_the_recording() -> None:
    """The one-command session's four repeats: twin*'s server TTFT p50 is within 20 % of every repeat (measured
    -15.2 to +7.6 %); by index it was -31 to -52 % on the bursty runs. Offline runs keep the index (their steps
    are the recording's) and their step-time sum exactly."""
    runs = sorted(p for rep in ("held-out", "held-out-repeat2", "held-out-repeat3", "held-out-repeat4")
                  for p in (CAL / rep).iterdir())
    report = fidelity(runs, profile=str(PROFILE), noise=False)
    for run in report["runs"]:
        items = run["items"]
        if run["mode"] == "server":
            assert run["recorded_step_times"]["matched"] == "work"
            assert run["recorded_step_times"]["exact"] > 0
            assert abs(items["ttft_p50_s"]["rel_error_recorded_steps"]) <= 0.20, run["run"]
        else:
            assert run["recorded_step_times"] == {"matched": "index"}
            assert items["step_time_sum_s"]["rel_error_recorded_steps"] == pytest.approx(0.0, abs=1e-9)
    rs = report["summary"]["recorded_steps"]
    assert rs["tolerance_items"] == 128 and rs["passed"] > 100


def test_twin_replay_with_recorded_step_times_says_how_a_server_runs_steps_were_timed(tmp_path: Path, capsys) -> None:
    from twin.cli import main

    run = CAL / "held-out" / "heldout-server-bursty"
    assert main(["replay", str(run), "--profile", str(PROFILE), "--step-times", "recorded",
                 "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    comparison = json.loads((tmp_path / "r" / "comparison.json").read_text())
    timing = comparison["recorded_step_times"]
    assert timing["matched"] == "work" and timing["exact"] + timing["scaled"] + timing["modelled"] == \
        comparison["steps"]["twin"]
    assert f"twin* steps: {timing['exact']} timed by the one recorded step" in printed
    # the step-time sum leaves the front end's per-chunk time out, as the fidelity table does (it was +9.6 % high
    # in this command when the twin's logged step times kept it), and is the table's twin* value
    s = comparison["step_time_sum_s"]
    assert abs(s["rel_error"]) < 0.02
    report = fidelity([run], profile=str(PROFILE), noise=False)
    assert report["runs"][0]["items"]["step_time_sum_s"]["twin_recorded_steps"] == pytest.approx(s["twin"], rel=1e-12)
    assert main(["replay", str(CAL / "held-out" / "heldout-offline-kv-prefix"), "--step-times", "recorded",
                 "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "comparison.json").read_text())["recorded_step_times"] == {"matched": "index"}
    assert "twin* steps" not in capsys.readouterr().out
