"""The one command's cpu-tiny-llama sessions with the eleven-run sweep (``scripts/calibrate-cpu.sh
--heldout-repeats 4``, since 2026-12-06), each committed under tests/fixtures/calibration/ with its SOURCES.md: its
profile is the refit of its sweep, its table is what fidelity gives today, and what each session's failures were is
pinned (docs/calibration-sessions.md has a section per session)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np

from twin.calibration.calibrate import calibrate
from twin.calibration.fidelity import decode_level
from twin.calibration.recorded import load_recorded_run
from twin.calibration.residuals import step_residuals
from twin.engine_profiles import load_profile
from twin.engine_profiles.profile import step_time_model_of
from twin.engine_profiles.step import StepShape

from calibkit import (LATENCY, ONE_COMMAND, REPEATS, decode_levels, failing_latency, held_out_key, held_out_runs,
                      held_out_table, latency_passed, pinned_session, spec_latency_passed, sweep_runs)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "calibration"


def _pinned_session(root: Path, passed: int, latency: int, *, recorded: int = 128, idle_wake: bool = False,
                    front_end: bool = False) -> tuple[list[Path], dict]:
    """A one-command cpu-tiny-llama session with the eleven-run sweep (``calibkit.pinned_session``). Returns the
    sweep's runs and today's table."""
    assert (root / "calibration" / "sweep-server-context").is_dir()
    _, runs, report, _ = pinned_session(root, "cpu-tiny-llama", passed, latency, recorded=recorded, idle_wake=idle_wake,
                                        front_end=front_end)
    return runs, report


FRESH_TINY = FIXTURES / "cpu-tiny-llama-freshclone-context"  # the default one command from a fresh clone of 13e95d2


def test_the_default_one_command_from_a_fresh_clone() -> None:
    """`scripts/calibrate-cpu.sh --heldout-repeats 4` (cpu-tiny-llama, the default) from a fresh clone (SOURCES.md
    there): its profile is the fit of its sweep and its table is what fidelity gives today: 155 of 160 items, 71 of 72
    latency items, twin* 128 of 128."""
    _pinned_session(FRESH_TINY, 155, 71)


def test_its_held_out_server_runs_ran_slower_than_its_sweeps_server_runs() -> None:
    """Where that session's twin is fast: recorded interleaved, its four sweep server runs' decode steps sit on the fit
    (medians 1.00-1.04 of it, ``twin fidelity --steps``' by-run view), and all eight held-out server runs' ran slower
    (1.06-1.46), at the same batch and context. The session of stop 49 (cpu-tiny-llama-context) had its held-out
    server runs at 0.86-1.07 of its fit."""
    runs = [r for r in sweep_runs(FRESH_TINY) if r.name.startswith("sweep-server-")]
    runs += [FRESH_TINY / rep / w for rep in REPEATS for w in ("heldout-server-bursty", "heldout-server-prefix-mix")]
    level = [r["decode"] for r in step_residuals(runs, profile=str(FRESH_TINY / "cpu-tiny-llama.yaml"))["runs"]]
    sweep, held = [b["median_ratio"] for b in level[:4]], [b["median_ratio"] for b in level[4:]]
    assert all(0.99 <= x <= 1.05 for x in sweep) and not any(b["biased"] for b in level[:4]), sweep
    assert min(held) >= 1.05 and np.median(held) >= 1.18 and all(b["biased"] for b in level[4:]), held


AFTER_REFIT = FIXTURES / "cpu-tiny-llama-after-refit"  # the one command again, after the shipped file was chosen


def test_the_session_after_the_shipped_refit() -> None:
    """A session recorded after the shipped cpu-tiny-llama became the pooled fit of the two sessions above (SOURCES.md
    there): its own fit passes 159 of 160 items (71 of 72 latency items), the shipped file 151 of 160 (70 of 72), the
    twin fast by a median ~26 % on a slower host, inside repeats that spread a median 44 %."""
    _pinned_session(AFTER_REFIT, 159, 71)
    shipped = held_out_table(AFTER_REFIT, "cpu-tiny-llama")
    assert (shipped["summary"]["passed"], latency_passed(shipped)) == (151, 70)
    errors = [r["items"][k]["rel_error"] for r in shipped["runs"] for k in LATENCY]
    assert -0.30 < np.median(errors) < -0.20


WARMUP_STEPS = FIXTURES / "cpu-tiny-llama-warmupsteps"  # the first session whose server runs keep the warm-up's steps


def test_the_first_session_with_the_warm_ups_steps() -> None:
    """Its profile and table (156 of 160, 70 of 72 latency items), and what its warm-ups say (SOURCES.md there): each
    server run's warm-up decoded its one-token prompts down to a batch of 1, and across the twelve server runs the
    warm-up's level does not follow the run's."""
    runs, _ = _pinned_session(WARMUP_STEPS, 156, 70)
    server = [r for r in runs if r.name.startswith("sweep-server-")]
    server += [WARMUP_STEPS / rep / w for rep in REPEATS
               for w in ("heldout-server-bursty", "heldout-server-prefix-mix")]
    model = step_time_model_of(load_profile(str(WARMUP_STEPS / "cpu-tiny-llama.yaml")).spec.server.step_time)
    warm = []
    for run in server:
        steps = load_recorded_run(run).run.workload["warmup_steps"]
        assert 1 in steps["gen_requests"] and len(steps["elapsed_ms"]) >= 8
        ratios, j = [], 0
        for c, ct, g, e in zip(steps["ctx_requests"], steps["ctx_tokens"], steps["gen_requests"], steps["elapsed_ms"]):
            if c > 0 and ct > c:  # the long prompts' wave: the decode wave is over
                break
            if c == 0 and g > 0:  # a decode step of the one-token prompts, each with j + 2 tokens of context
                shape = StepShape(decode_requests=g, decode_context_tokens=g * (2 + j))
                ratios.append(e / 1e3 / (model.step_time_s(shape) - model.overhead_s))
                j += 1
        warm.append(float(np.median(ratios)))
    report = step_residuals(server, profile=str(WARMUP_STEPS / "cpu-tiny-llama.yaml"))
    level = [r["decode"]["median_ratio"] for r in report["runs"]]
    assert abs(np.corrcoef(warm, level)[0, 1]) < 0.2
    assert np.std(np.log(np.array(level) / warm)) > np.std(np.log(level))


FRESH_SESSIONS = FIXTURES / "cpu-tiny-llama-freshclone-sessions"  # the one command from a fresh clone, 2026-12-06 pm


def test_the_one_command_from_a_fresh_clone_in_the_afternoon() -> None:
    """Its profile is the refit of its sweep and its table (160 of 160 items, 72 of 72 latency items) is what fidelity
    gives today; it passes on wide repeats' spreads (SOURCES.md there), so the test also pins that only about half the
    latency items are within 10 % outright."""
    _pinned_session(FRESH_SESSIONS, 160, 72)
    table = json.loads((FRESH_SESSIONS / "fidelity-held-out.json").read_text())
    errors = [abs(r["items"][k]["rel_error"]) for r in table["runs"] for k in LATENCY]
    assert sum(e <= 0.10 for e in errors) == 38 and 0.08 < np.median(errors) < 0.10


BURN_IN = FIXTURES / "cpu-tiny-llama-burnin"  # the one command after two burn-in recordings, on a steady host


def test_the_session_after_a_burn_in() -> None:
    """Its profile is the refit of its sweep and its table (143 of 160 items, 60 of 72 latency items) is what fidelity
    gives today (SOURCES.md there). On that steady hour the prefix mix's lean fails: the twin is slow on every repeat's
    ITL p50 and E2E p90, by more than 10 % on three of the four, where the recorded-step replay is within 6 %."""
    _pinned_session(BURN_IN, 143, 60, recorded=124)
    table = json.loads((BURN_IN / "fidelity-held-out.json").read_text())
    mix = [r for r in table["runs"] if r["name"] == "heldout-server-prefix-mix"]
    assert len(mix) == 4
    for k in ("itl_p50_s", "e2e_p90_s"):
        errors = [r["items"][k]["rel_error"] for r in mix]
        assert min(errors) > 0.04 and sum(e > 0.10 for e in errors) == 3
        assert all(0 <= r["items"][k]["rel_error_recorded_steps"] < 0.06 for r in mix)


FRESH_EVENING = FIXTURES / "cpu-tiny-llama-freshclone-evening"  # the one command from a fresh clone, 2026-12-06 eve


def test_the_one_command_from_a_fresh_clone_in_the_evening() -> None:
    """Its profile is the refit of its sweep and its table (144 of 160 items, 58 of 72 latency items, twin* 127 of 128)
    is what fidelity gives today (SOURCES.md there). Its latency failures are the offline run's first two repeats, the
    twin slow where twin* is within 3 %, and the bursty run's TTFT p50, where twin* is early as well."""
    _pinned_session(FRESH_EVENING, 144, 58, recorded=127)
    table = json.loads((FRESH_EVENING / "fidelity-held-out.json").read_text())
    # (repeat folder, workload, item) of each failing latency item -> twin*'s error on it
    failing = {(r["run"].split("/")[-2], r["name"], k): r["items"][k]["rel_error_recorded_steps"]
               for r in table["runs"] for k in LATENCY if r["items"][k]["pass"] is False}
    offline = {f: e for f, e in failing.items() if f[1] == "heldout-offline-kv-prefix"}
    assert len(offline) == 11 and {f[0] for f in offline} == {"held-out", "held-out-repeat2"}
    assert all(0 < e < 0.03 for e in offline.values())
    bursty = {f: e for f, e in failing.items() if f not in offline}
    assert set(bursty) == {
        (d, "heldout-server-bursty", "ttft_p50_s") for d in ("held-out", "held-out-repeat2", "held-out-repeat4")}
    assert all(-0.11 < e < -0.07 for e in bursty.values())


FRESH_SLOWHOST = FIXTURES / "cpu-tiny-llama-freshclone-slowhost"  # the one command from a fresh clone, 2026-12-06 night


def test_the_one_command_from_a_fresh_clone_on_a_host_slow_during_the_prefix_mix() -> None:
    """Its profile is the refit of its sweep and its table (145 of 160 items, 65 of 72 latency items, twin* 127 of 128)
    is what fidelity gives today (SOURCES.md there). Its latency failures are all the server prefix mix's, on three
    repeats whose decode steps ran at 1.31-1.59 of the fit: the twin fast by more than a quarter, twin* much closer."""
    _pinned_session(FRESH_SLOWHOST, 145, 65, recorded=127)
    failing = failing_latency(FRESH_SLOWHOST)
    assert len(failing) == 7 and {f[1] for f in failing} == {"heldout-server-prefix-mix"}
    assert {f[0] for f in failing} == {"held-out", "held-out-repeat2", "held-out-repeat4"}
    assert all(e < -0.25 and e < e_rec < 0 and e_rec > -0.22 for e, e_rec in failing.values())


FRESH_INTEL = FIXTURES / "cpu-tiny-llama-freshclone-tightbursty"  # the one command from a fresh clone on an Intel VM


def test_the_one_command_from_a_fresh_clone_where_the_bursty_repeats_agree() -> None:
    """Its profile is the refit of its sweep and its table (140 of 160 items, 57 of 72 latency items, twin* 122 of 128)
    is what fidelity gives today (SOURCES.md there). Its latency failures are all the bursty server run's, whose repeats
    spread 7-9 %: the twin slow on ITL p90 by more than a tenth where twin* is within 4 %."""
    _pinned_session(FRESH_INTEL, 140, 57, recorded=122)
    failing = failing_latency(FRESH_INTEL)
    assert len(failing) == 15 and {f[1] for f in failing} == {"heldout-server-bursty"}
    itl90 = [v for (_, _, k), v in failing.items() if k == "itl_p90_s"]
    assert len(itl90) == 4 and all(e > 0.13 and abs(e_rec) < 0.04 for e, e_rec in itl90)


FRESH_TTFT = FIXTURES / "cpu-tiny-llama-freshclone-ttft"  # the one command from a fresh clone of 39a53e2, an Intel VM


def test_the_one_command_from_a_fresh_clone_where_the_server_ttft_came_early() -> None:
    """Its profile is the refit of its sweep and its table (148 of 160 items, 60 of 72 latency items, twin* 123 of 128)
    is what fidelity gives today (SOURCES.md there). 8 of its 12 latency failures are server TTFT items with the twin
    early and twin* early too (the front end, not the step time); the offline ones are on the two repeats whose steps
    ran slowest, and the table's count by step level puts them in its outer bands."""
    _, report = _pinned_session(FRESH_TTFT, 148, 60, recorded=123)
    failing = failing_latency(FRESH_TTFT)
    assert len(failing) == 12
    ttft = {key: v for key, v in failing.items() if key[1] != "heldout-offline-kv-prefix" and key[2].startswith("ttft")}
    assert len(ttft) == 8 and all(e < -0.15 and e_rec < -0.10 for e, e_rec in ttft.values())
    offline = {key: v for key, v in failing.items() if key[1] == "heldout-offline-kv-prefix"}
    assert set(offline) == {(f"held-out-repeat{i}", "heldout-offline-kv-prefix", "ttft_p50_s") for i in (2, 4)}
    assert all(abs(e_rec) < 0.01 for _, e_rec in offline.values())
    assert [(b["band"], b["items"], b["failed"]) for b in report["latency_by_step_level"]] == [
        ("under 5 %", 54, 8), ("5-10 %", 12, 3), ("10 % or more", 6, 1)]


FRESH_IDLE_WAKE = FIXTURES / "cpu-tiny-llama-freshclone-idlewake"  # the one command with --idle-wake, a fresh clone


def test_the_one_command_with_the_idle_wake_from_a_fresh_clone() -> None:
    """The first session of the one command with --idle-wake (SOURCES.md there): its profile is the refit of its sweep
    with that option, and its table is what fidelity gives today: 159 of 160 items, 71 of 72 latency items, twin* 127 of
    128; the one failing latency item is the prefix mix's E2E p50, with twin* on the real run."""
    _, report = _pinned_session(FRESH_IDLE_WAKE, 159, 71, recorded=127, idle_wake=True)
    assert 0.005 < load_profile(str(FRESH_IDLE_WAKE / "cpu-tiny-llama.yaml")).spec.server.idle_wake_s < 0.01
    ((key, (err, err_recorded)),) = failing_latency(FRESH_IDLE_WAKE).items()
    assert key == ("held-out-repeat3", "heldout-server-prefix-mix", "e2e_p50_s")
    assert 0.10 < err < 0.12 and abs(err_recorded) < 0.01
    assert report["latency_items"]["median_abs_error"] < 0.05


FRESH_IDLE_WAKE2 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake2"  # the same, once more, a clone of 011892f


def test_the_one_command_with_the_idle_wake_once_more() -> None:
    """The second session of the one command with --idle-wake (SOURCES.md there): 158 of 160 items, 71 of 72 latency
    items, twin* 127 of 128; the one failing latency item is the prefix mix's TTFT p90 on the repeat whose decode steps
    ran slowest against the fit, and the table's count by step level puts it there."""
    _, report = _pinned_session(FRESH_IDLE_WAKE2, 158, 71, recorded=127, idle_wake=True)
    ((key, (err, _)),) = failing_latency(FRESH_IDLE_WAKE2).items()
    assert key == ("held-out-repeat2", "heldout-server-prefix-mix", "ttft_p90_s") and -0.13 < err < -0.12
    slowest = max(report["runs"], key=decode_level)
    assert held_out_key(slowest["run"]) == "held-out-repeat2/heldout-server-prefix-mix"
    assert [b for b in report["latency_by_step_level"] if b["failed"]] == [
        {"band": "10 % or more", "items": 24, "failed": 1}]


FRESH_IDLE_WAKE3 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake3"  # the same, a third time, a clone of 55b2df4


def test_the_one_command_with_the_idle_wake_a_third_time() -> None:
    """The third session of the one command with --idle-wake (SOURCES.md there): 154 of 160 items, 66 of 72 latency
    items, twin* 127 of 128. All six latency failures are server TTFT items with the twin early and twin* early too,
    none on a run within 5 % of the fit."""
    _, report = _pinned_session(FRESH_IDLE_WAKE3, 154, 66, recorded=127, idle_wake=True)
    failing = failing_latency(FRESH_IDLE_WAKE3)
    assert len(failing) == 6 and all(k.startswith("ttft") and w != "heldout-offline-kv-prefix" for _, w, k in failing)
    assert all(e < -0.18 and e_rec < -0.05 for e, e_rec in failing.values())
    assert [b["failed"] for b in report["latency_by_step_level"]] == [0, 5, 1]


FRESH_IDLE_WAKE4 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake4"  # the same, a fourth time, a clone of 1d8d0af


def test_the_one_command_with_the_idle_wake_a_fourth_time() -> None:
    """The fourth session of the one command with --idle-wake (SOURCES.md there): 157 of 160 items, 69 of 72 latency
    items, twin* 128 of 128. The three latency failures are the bursty run's TTFT p50, the twin early, one in each
    band of the step-level count."""
    _, report = _pinned_session(FRESH_IDLE_WAKE4, 157, 69, recorded=128, idle_wake=True)
    failing = failing_latency(FRESH_IDLE_WAKE4)
    assert {(w, k) for _, w, k in failing} == {("heldout-server-bursty", "ttft_p50_s")}
    assert sorted(r for r, _, _ in failing) == ["held-out", "held-out-repeat2", "held-out-repeat4"]
    assert all(e < -0.16 and abs(e_rec) < 0.10 for e, e_rec in failing.values())
    assert [b["failed"] for b in report["latency_by_step_level"]] == [1, 1, 1]


FRESH_IDLE_WAKE5 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake5"  # the same, a fifth time, a clone of 4c3ffb6


def test_the_one_command_with_the_idle_wake_a_fifth_time() -> None:
    """The fifth session of the one command with --idle-wake (SOURCES.md there): 157 of 160 items, 69 of 72 latency
    items, twin* 127 of 128. The three latency failures are server TTFT p50 items: the prefix mix's late on the two
    repeats whose steps ran fast, the bursty run's early on the one whose steps ran slowest."""
    _, report = _pinned_session(FRESH_IDLE_WAKE5, 157, 69, recorded=127, idle_wake=True)
    failing = failing_latency(FRESH_IDLE_WAKE5)
    assert set(failing) == {("held-out", "heldout-server-prefix-mix", "ttft_p50_s"),
                            ("held-out-repeat2", "heldout-server-prefix-mix", "ttft_p50_s"),
                            ("held-out-repeat3", "heldout-server-bursty", "ttft_p50_s")}
    levels = decode_levels(report)
    for (rep, workload, _), (err, err_recorded) in failing.items():
        late = workload == "heldout-server-prefix-mix"
        assert (err > 0.14 and 0 < err_recorded < 0.10) if late else (err < -0.19 and -0.12 < err_recorded < 0)
        assert (levels[f"{rep}/{workload}"] < 1.0) if late else levels[f"{rep}/{workload}"] == max(
            v for k, v in levels.items() if k.endswith(workload))


FRESH_IDLE_WAKE6 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake6"  # the same, a sixth time, a clone of 5b20266


def test_the_one_command_with_the_idle_wake_a_sixth_time() -> None:
    """The sixth session of the one command with --idle-wake (SOURCES.md there): 154 of 160 items, 67 of 72 latency
    items, twin* 122 of 128. The five latency failures are the bursty run's TTFT, the twin early and twin* early too,
    on runs whose steps sat near the fit: the scheduling and latency accounting's miss, not the step-time model's."""
    _, report = _pinned_session(FRESH_IDLE_WAKE6, 154, 67, recorded=122, idle_wake=True)
    failing = failing_latency(FRESH_IDLE_WAKE6)
    assert {(rep, k) for rep, w, k in failing if w == "heldout-server-bursty"} == {
        *((rep, "ttft_p90_s") for rep in REPEATS), ("held-out-repeat4", "ttft_p50_s")}
    assert len(failing) == 5 and all(e < -0.11 and e_rec < -0.12 for e, e_rec in failing.values())
    bursty = [r for r in report["runs"] if r["name"] == "heldout-server-bursty"]
    assert all(0.93 < decode_level(r) < 1.10 for r in bursty)


FRESH_IDLE_WAKE7 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake7"  # the same, a seventh time, a clone of 12d8d88
FRESH_IDLE_WAKE8 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake8"  # and an eighth, right after
FRESH_IDLE_WAKE9 = FIXTURES / "cpu-tiny-llama-freshclone-idlewake9"  # and a ninth


def test_the_one_command_with_the_idle_wake_a_seventh_time() -> None:
    """The seventh session of the one command with --idle-wake (SOURCES.md there): 157 of 160 items, 69 of 72 latency
    items, twin* 127 of 128. Two of the three failures are the bursty run's TTFT, the twin early by more than a quarter
    on runs whose steps sat on the fit, twin* early too; the third the prefix mix's TTFT p90, just past its spread."""
    _, report = _pinned_session(FRESH_IDLE_WAKE7, 157, 69, recorded=127, idle_wake=True)
    failing = failing_latency(FRESH_IDLE_WAKE7)
    assert set(failing) == {("held-out", "heldout-server-bursty", "ttft_p90_s"),
                            ("held-out-repeat4", "heldout-server-bursty", "ttft_p50_s"),
                            ("held-out-repeat2", "heldout-server-prefix-mix", "ttft_p90_s")}
    assert all(e < -0.27 and e_rec < -0.15 for (_, w, _), (e, e_rec) in failing.items() if w == "heldout-server-bursty")
    levels = decode_levels(report)
    assert all(0.99 < levels[f"{rep}/{w}"] < 1.06 for rep, w, _ in failing)


def test_the_one_command_with_the_idle_wake_an_eighth_time() -> None:
    """The eighth session (SOURCES.md there): 153 of 160 items, 65 of 72 latency items, twin* 127 of 128. The bursty
    run's TTFT p90 fails on all four repeats, the twin early by 10-15 %; the prefix mix's TTFT p50 late on two."""
    _pinned_session(FRESH_IDLE_WAKE8, 153, 65, recorded=127, idle_wake=True)
    failing = failing_latency(FRESH_IDLE_WAKE8)
    assert {rep for rep, w, k in failing if (w, k) == ("heldout-server-bursty", "ttft_p90_s")} == set(REPEATS)
    assert all(-0.15 < e < -0.10 for (_, w, _), (e, _) in failing.items() if w == "heldout-server-bursty")
    late = {rep for rep, w, k in failing if (w, k) == ("heldout-server-prefix-mix", "ttft_p50_s")}
    assert late == {"held-out-repeat2", "held-out-repeat4"} and len(failing) == 7


def test_the_one_command_with_the_idle_wake_a_ninth_time() -> None:
    """The ninth session (SOURCES.md there): every item passes, 160 of 160 and 72 of 72 latency items, twin* 128 of
    128, on repeats whose steps sat 0.85-1.13 of the fit."""
    _, report = _pinned_session(FRESH_IDLE_WAKE9, 160, 72, recorded=128, idle_wake=True)
    assert report["latency_items"]["median_abs_error"] < 0.09


def test_the_three_sessions_with_the_front_ends_terms(tmp_path: Path) -> None:
    """The three sessions above were recorded after the stream-end and intake terms were chosen for the one command
    over the 52 sessions committed before (docs/calibration-sessions.md, "The front end's optional terms, judged again
    over 52 sessions"), and before the command took them. Their sweeps fitted with the terms as well give 70, 69 and 72
    of their 72 latency items (69, 65, 72 as recorded): 211 of 216 against 206."""
    options = dataclasses.replace(ONE_COMMAND, idle_wake=True, stream_ends=True, intake=True)
    counts = []
    for root in (FRESH_IDLE_WAKE7, FRESH_IDLE_WAKE8, FRESH_IDLE_WAKE9):
        spec = calibrate(sweep_runs(root), name="cpu-tiny-llama", command="test", options=options).spec
        assert spec.server is not None and spec.server.per_request_in_s > 0 and spec.server.has_stream_ends
        counts.append(spec_latency_passed(spec, held_out_runs(root), tmp_path / f"{root.name}.yaml"))
    assert counts == [70, 69, 72]


FRESH_FRONT_END = FIXTURES / "cpu-tiny-llama-freshclone-frontend"  # the one command with the terms, a clone of c49f675


def test_the_one_command_with_the_front_ends_terms_from_a_fresh_clone() -> None:
    """The first session of the one command with --stream-ends --intake (SOURCES.md there): its profile is the refit
    of its sweep with those terms, and its table is what fidelity gives today: 160 of 160 items, 72 of 72 latency items,
    twin* 128 of 128, on repeats whose steps sat at 0.90-1.14 of the fit."""
    _, report = _pinned_session(FRESH_FRONT_END, 160, 72, recorded=128, idle_wake=True, front_end=True)
    server = load_profile(str(FRESH_FRONT_END / "cpu-tiny-llama.yaml")).spec.server
    assert server.has_stream_ends and 0.0003 < server.per_request_in_s < 0.001
    assert report["latency_items"]["within_tolerance_outright"] == 57


FRESH_FRONT_END2 = FIXTURES / "cpu-tiny-llama-freshclone-frontend2"  # the command with the terms, a clone of ada8e6d


def test_the_one_command_with_the_front_ends_terms_a_second_time() -> None:
    """The second session of the one command with --stream-ends --intake (SOURCES.md there): 160 of 160 items, 72 of
    72 latency items, twin* 127 of 128 (the first repeat's bursty TTFT p50 leaning early, as the twin's does over the
    committed sessions), on repeats whose steps sat at 0.88-1.16 of the fit."""
    _, report = _pinned_session(FRESH_FRONT_END2, 160, 72, recorded=127, idle_wake=True, front_end=True)
    assert report["latency_items"]["within_tolerance_outright"] == 55
    assert report["latency_items"]["median_abs_error"] < 0.05


FRESH_FRONT_END3 = FIXTURES / "cpu-tiny-llama-freshclone-frontend3"  # the command with the terms, a clone of 811ee02


def test_the_one_command_with_the_front_ends_terms_a_third_time() -> None:
    """The third session of the one command with --stream-ends --intake (SOURCES.md there): 148 of 160 items, 63 of 72
    latency items, twin* 128 of 128. Seven of the nine failures are the bursty run's step tail (ITL p90 on every
    repeat), the twin slow where twin* is within 5 %: the twin's drawn step-time noise ran a longer tail than these
    runs' steps. The other two are the prefix mix's TTFT p50, late with twin* late as well."""
    _pinned_session(FRESH_FRONT_END3, 148, 63, recorded=128, idle_wake=True, front_end=True)
    failing = failing_latency(FRESH_FRONT_END3)
    bursty = {key: errors for key, errors in failing.items() if key[1] == "heldout-server-bursty"}
    assert len(bursty) == 7 and {k for _, _, k in bursty} >= {"itl_p90_s"}
    assert all(e > 0.10 and abs(e_recorded) < 0.05 for e, e_recorded in bursty.values())
    assert sorted((w, k) for _, w, k in failing if w != "heldout-server-bursty") == [("heldout-server-prefix-mix",
                                                                                     "ttft_p50_s")] * 2
    assert sum(1 for _, _, k in bursty if k == "itl_p90_s") == 4


FRESH_FRONT_END4 = FIXTURES / "cpu-tiny-llama-freshclone-frontend4"  # the command with the terms, a clone of 811ee02


def test_the_one_command_with_the_front_ends_terms_a_fourth_time() -> None:
    """The fourth session of the one command with --stream-ends --intake (SOURCES.md there): 149 of 160 items, 64 of
    72 latency items, twin* 128 of 128, median |error| under 5 %. All eight failures are the bursty run's first two
    repeats, whose steps ran at 0.92 of the fit: the twin slow, twin* within 10 %."""
    _, report = _pinned_session(FRESH_FRONT_END4, 149, 64, recorded=128, idle_wake=True, front_end=True)
    assert report["latency_items"]["median_abs_error"] < 0.05
    failing = failing_latency(FRESH_FRONT_END4)
    assert {(rep, w) for rep, w, _ in failing} == {(rep, "heldout-server-bursty") for rep in REPEATS[:2]}
    assert len(failing) == 8
    assert all(e > 0.15 and abs(e_recorded) < 0.10 for e, e_recorded in failing.values())
    levels = decode_levels(report)
    assert all(0.9 < levels[f"{rep}/{w}"] < 0.93 for rep, w, _ in failing)


FRESH_FRONT_END5 = FIXTURES / "cpu-tiny-llama-freshclone-frontend5"  # the command with the terms, a clone of 342fbd8


def test_the_one_command_with_the_front_ends_terms_a_fifth_time() -> None:
    """The fifth session of the one command with --stream-ends --intake (SOURCES.md there): 157 of 160 items, 69 of
    72 latency items, twin* 125 of 128, median |error| under 5 %. The three failures are the prefix mix's TTFT p90,
    early, on runs that sat on the fit: the lean the committed sessions show there."""
    _, report = _pinned_session(FRESH_FRONT_END5, 157, 69, recorded=125, idle_wake=True, front_end=True)
    assert report["latency_items"]["median_abs_error"] < 0.05
    failing = failing_latency(FRESH_FRONT_END5)
    assert sorted(failing) == [(rep, "heldout-server-prefix-mix", "ttft_p90_s")
                               for rep in ("held-out", "held-out-repeat2", "held-out-repeat4")]
    levels = decode_levels(report)
    assert all(-0.15 < e < -0.10 and abs(levels[f"{rep}/{w}"] - 1) < 0.03 for (rep, w, _), (e, _) in failing.items())


FRESH_FRONT_END6 = FIXTURES / "cpu-tiny-llama-freshclone-frontend6"  # the command with the terms, a clone of da6ee34


def test_the_one_command_with_the_front_ends_terms_a_sixth_time() -> None:
    """The sixth session of the one command with --stream-ends --intake (SOURCES.md there): 157 of 160 items, 69 of
    72 latency items, twin* 126 of 128, median |error| under 5 % on a steady host. Two failures are the bursty run's
    ITL p90, the twin slow by ~11 % where twin* is within 1 % and the run's decode steps sat on the fit (the drawn
    noise's tail); the third the prefix mix's TTFT p90, early."""
    _, report = _pinned_session(FRESH_FRONT_END6, 157, 69, recorded=126, idle_wake=True, front_end=True)
    assert report["latency_items"]["median_abs_error"] < 0.05
    failing = failing_latency(FRESH_FRONT_END6)
    tail = [("held-out", "heldout-server-bursty", "itl_p90_s"), ("held-out-repeat4", "heldout-server-bursty",
                                                                   "itl_p90_s")]
    assert sorted(failing) == sorted([*tail, ("held-out-repeat2", "heldout-server-prefix-mix", "ttft_p90_s")])
    levels = decode_levels(report)
    for rep, w, item in tail:
        twin, star = failing[(rep, w, item)]
        assert 0.10 < twin < 0.13 and abs(star) < 0.01 and abs(levels[f"{rep}/{w}"] - 1) < 0.02
    assert -0.13 < failing[("held-out-repeat2", "heldout-server-prefix-mix", "ttft_p90_s")][0] < -0.10


FRESH_FRONT_END7 = FIXTURES / "cpu-tiny-llama-freshclone-frontend7"  # the command with the terms, a clone of da4a9e9


def test_the_one_command_with_the_front_ends_terms_a_seventh_time() -> None:
    """The seventh session of the one command with --stream-ends --intake (SOURCES.md there): 156 of 160 items, 69 of
    72 latency items, twin* 126 of 128, median |error| under 5 %. The three latency failures are server TTFT p50 late
    (the bursty run's with twin* late too) and the offline ITL p90 on a run faster than the fit."""
    _, report = _pinned_session(FRESH_FRONT_END7, 156, 69, recorded=126, idle_wake=True, front_end=True)
    assert report["latency_items"]["median_abs_error"] < 0.05
    failing = failing_latency(FRESH_FRONT_END7)
    assert sorted(failing) == [("held-out", "heldout-server-prefix-mix", "ttft_p50_s"),
                               ("held-out-repeat2", "heldout-offline-kv-prefix", "itl_p90_s"),
                               ("held-out-repeat3", "heldout-server-bursty", "ttft_p50_s")]
    assert all(0.10 < e < 0.20 for e, _ in failing.values())
    assert failing[("held-out-repeat3", "heldout-server-bursty", "ttft_p50_s")][1] > 0.15  # twin* late as well
    levels = decode_levels(report)
    assert 0.90 < levels["held-out-repeat2/heldout-offline-kv-prefix"] < 0.95


FRESH_FRONT_END8 = FIXTURES / "cpu-tiny-llama-freshclone-frontend8"  # the command with the terms, a clone of e108ae8


def test_the_one_command_with_the_front_ends_terms_an_eighth_time() -> None:
    """The eighth session of the one command with --stream-ends --intake (SOURCES.md there): 159 of 160 items, 71 of
    72 latency items (the issue's bar), twin* 128 of 128, median |error| under 5 %. The one failure is the bursty run's
    E2E p50 on a repeat a little faster than the fit, the twin slow where twin* is within 1 %."""
    _, report = _pinned_session(FRESH_FRONT_END8, 159, 71, recorded=128, idle_wake=True, front_end=True)
    assert report["latency_items"]["median_abs_error"] < 0.05
    failing = failing_latency(FRESH_FRONT_END8)
    assert list(failing) == [("held-out-repeat2", "heldout-server-bursty", "e2e_p50_s")]
    twin, star = failing[("held-out-repeat2", "heldout-server-bursty", "e2e_p50_s")]
    assert 0.11 < twin < 0.13 and abs(star) < 0.01
    assert 0.93 < decode_levels(report)["held-out-repeat2/heldout-server-bursty"] < 0.97


FRESH_FRONT_END9 = FIXTURES / "cpu-tiny-llama-freshclone-frontend9"  # the command as it stands, a clone of 04101b4
ENGINE_CORE = FIXTURES / "cpu-tiny-llama-enginecore"  # the command with --engine-core model, a clone of 04101b4
ENGINE_CORE2 = FIXTURES / "cpu-tiny-llama-enginecore2"  # the same, right after FRESH_FRONT_END9


def test_the_one_command_a_ninth_time_the_engine_core_sessions_control() -> None:
    """The ninth session of the one command with the front end's terms, recorded between the two with the engine core
    on the model's core (SOURCES.md there): 155 of 160 items, 69 of 72 latency items, twin* 128 of 128. Its latency
    failures are the prefix mix's TTFT p90 on three repeats whose steps ran 12-19 % slower than the fit."""
    _, report = _pinned_session(FRESH_FRONT_END9, 155, 69, recorded=128, idle_wake=True, front_end=True)
    failing = failing_latency(FRESH_FRONT_END9)
    assert sorted(failing) == [(rep, "heldout-server-prefix-mix", "ttft_p90_s")
                               for rep in ("held-out-repeat2", "held-out-repeat3", "held-out-repeat4")]
    levels = decode_levels(report)
    assert all(-0.29 < e < -0.20 and 1.10 < levels[f"{rep}/{w}"] < 1.21 for (rep, w, _), (e, _) in failing.items())


def test_the_engine_core_on_the_models_core_lost_to_the_same_hours_control() -> None:
    """`--engine-core model` (the engine core bound to the worker's core, away from the API server and the client),
    judged by the rule written before its two sessions: 64 and 52 of 72 latency items, where the session between them
    with the command as it stands gives 69. The first's failures are server items, the twin early (ITL p90 by
    27-28 % with twin* early too: a token-gap tail the front end's terms lack); the second's all have the twin slow, on
    held-out server runs faster than the sweep's, with an idle wake four times the other sessions'."""
    _pinned_session(ENGINE_CORE, 152, 64, recorded=125, idle_wake=True, front_end=True)
    for root in (ENGINE_CORE, ENGINE_CORE2):
        workload = load_recorded_run(root / "held-out" / "heldout-server-bursty").run.workload
        assert workload["front_end_pinning"]["engine_core"] == "model"
    failing = failing_latency(ENGINE_CORE)
    assert len(failing) == 8 and all(e < -0.10 for e, _ in failing.values())
    tail = [(k, v) for k, v in failing.items() if k[2] == "itl_p90_s"]
    assert len(tail) == 3 and all(e < -0.26 and star < -0.12 for _, (e, star) in tail)
    _, report2 = _pinned_session(ENGINE_CORE2, 132, 52, recorded=123, idle_wake=True, front_end=True)
    failing2 = failing_latency(ENGINE_CORE2)
    assert len(failing2) == 20 and all(e > 0.10 for e, _ in failing2.values())
    assert load_profile(str(ENGINE_CORE2 / "cpu-tiny-llama.yaml")).spec.server.idle_wake_s > 0.015
    levels2 = decode_levels(report2)
    assert all(0.88 < levels2[f"{rep}/heldout-server-bursty"] < 0.98 for rep in REPEATS)


FRESH_FRONT_END10 = FIXTURES / "cpu-tiny-llama-freshclone-frontend10"  # the command as it stands, a clone of d5cfc42


def test_the_one_command_a_tenth_time_with_the_machines_other_load_kept() -> None:
    """The tenth session of the one command with the front end's terms (SOURCES.md there), the first whose runs keep
    the machine's other load: none (at most 0.04 cores in any run). 149 of 160 items, 65 of 72 latency items, twin* 128
    of 128; six of the seven latency failures are the bursty run's, the twin slow where twin* is within 4 %."""
    runs, report = _pinned_session(FRESH_FRONT_END10, 149, 65, recorded=128, idle_wake=True, front_end=True)
    held = [FRESH_FRONT_END10 / rep / w
            for rep in REPEATS for w in ("heldout-server-bursty", "heldout-offline-kv-prefix")]
    assert all(0.0 <= load_recorded_run(r).other_load_cores < 0.05 for r in [*runs, *held])
    failing = failing_latency(FRESH_FRONT_END10)
    bursty = {k: v for k, v in failing.items() if k[1] == "heldout-server-bursty"}
    assert len(failing) == 7 and len(bursty) == 6
    assert all(0.09 < e < 0.16 and abs(star) < 0.04 for e, star in bursty.values())
    assert decode_levels(report)["held-out/heldout-server-bursty"] < 0.92


AVX2 = FIXTURES / "cpu-tiny-llama-avx2"  # the command as it stands on a VM without AVX-512, a clone of 01c4e49


def test_the_one_command_on_a_cpu_without_avx512() -> None:
    """The one command on a 2-core AMD EPYC (Zen 3) VM with AVX2 and no AVX-512 (SOURCES.md there), where torch runs
    the model's bf16 without vector support: the steps are compute-bound, the decode per-request term ~20x the
    AVX-512 VMs' (3.0 against 0.14 ms), and the loop holds all the same: 156 of 160 items, 72 of 72 latency items,
    twin* 128 of 128, on repeats whose latency items spread a median 26 % (39 of 72 within 10 % outright)."""
    runs, report = _pinned_session(AVX2, 156, 72, recorded=128, idle_wake=True, front_end=True)
    assert all(load_recorded_run(r).run.hardware == "cpu 2-core x86_64 (AMD EPYC)" for r in runs)  # before `avx2`
    probes = [load_recorded_run(r).run.workload["speed_probe"]["before"]["median_s"] for r in runs]
    assert min(probes) > 0.2  # the bf16 probe: 2.2-9.4 ms on every AVX-512 VM of the committed sessions
    spec = load_profile(str(AVX2 / "cpu-tiny-llama.yaml")).spec
    assert spec.step_time is not None and spec.step_time.decode.per_request_s > 2e-3
    assert not failing_latency(AVX2)


FLOAT32_AVX2 = FIXTURES / "cpu-tiny-llama-float32-avx2"  # `--dtype float32` on the same VM, a clone of cd9297f


def _float32_avx2_session(root: Path, passed: int, latency: int, *, recorded: int) -> tuple[dict, dict]:
    """A session of the one command with ``--dtype float32`` on an AVX2 VM (``calibkit.pinned_session`` with the
    command's options): an fp32 profile, every run in float32 with half the bf16 blocks and the speed probe in float32.
    Returns today's table and the committed table's failing latency items."""
    spec, runs, report, _ = pinned_session(root, "cpu-tiny-llama-float32", passed, latency, recorded=recorded,
                                           idle_wake=True, front_end=True)
    assert (spec.weight_dtype, spec.kv_dtype) == ("fp32", "fp32")
    recs = [load_recorded_run(r) for r in runs]
    assert all(r.run.dtype == "float32" and r.run.hardware == "cpu 2-core x86_64 avx2 (AMD EPYC)" for r in recs)
    assert {r.run.num_gpu_blocks for r in recs if "--num-gpu-blocks-override" not in r.run.engine_args} == {512}
    assert all(r.run.workload["speed_probe"]["before"]["dtype"] == "float32" for r in recs)
    return report, failing_latency(root)


def test_the_one_command_in_float32_on_a_cpu_without_avx512() -> None:
    """`scripts/calibrate-cpu.sh --heldout-repeats 4 --dtype float32` on the same AMD EPYC VM right after (SOURCES.md
    there): every run in float32 with half the bf16 blocks, steps ~1.5-2x the AVX-512 VMs' bf16 ones, and a host whose
    speed moved more than the fit's error: 142 of 160 items, 60 of 72 latency items, twin* 126 of 128. Ten of the
    twelve latency failures are on runs 12-44 % off the fit (the bursty run's second repeat at 0.88, the offline
    run's second at 1.44), where twin* is within 16 %."""
    report, failing = _float32_avx2_session(FLOAT32_AVX2, 142, 60, recorded=126)
    assert len(failing) == 12
    levels = decode_levels(report)
    off = [k for k in failing if not 0.9 < levels[f"{k[0]}/{k[1]}"] < 1.1]  # 10 % or more off the fit
    assert len(off) == 10 and all(abs(failing[k][1]) < 0.16 for k in off)


FLOAT32_AVX2_2 = FIXTURES / "cpu-tiny-llama-float32-avx2-2"  # `--dtype float32` on a new AVX2 VM, a clone of 7460bba


def test_the_one_command_in_float32_on_a_cpu_without_avx512_again() -> None:
    """The float32 command again on a new start of the AMD EPYC VM, this time first of the pair (SOURCES.md there): 150
    of 160 items, 65 of 72 latency items, twin* 127 of 128 (45 within 10 % outright). Six of the seven latency
    failures are the offline run's fourth repeat, whose decode steps ran at 0.92 of the fit: the twin slow by 12-19 %,
    twin* within 4 %."""
    report, failing = _float32_avx2_session(FLOAT32_AVX2_2, 150, 65, recorded=127)
    offline = {k: v for k, v in failing.items() if k[:2] == ("held-out-repeat4", "heldout-offline-kv-prefix")}
    assert len(failing) == 7 and len(offline) == 6
    assert all(0.1 < e < 0.2 and abs(star) < 0.04 for e, star in offline.values())
    assert 0.9 < decode_levels(report)["held-out-repeat4/heldout-offline-kv-prefix"] < 0.93


def _bf16_avx2_session(root: Path, passed: int, latency: int) -> tuple[dict, list]:
    """A session of the one command as it stands (bf16) on the AVX2 VM since its runs name the instruction set
    (``_pinned_session`` with the command's options): every run in bf16, the bf16 speed probe slow as it is there.
    Returns today's table and the sweep's recordings."""
    runs, report = _pinned_session(root, passed, latency, recorded=128, idle_wake=True, front_end=True)
    recs = [load_recorded_run(r) for r in runs]
    assert all(r.run.dtype == "bfloat16" and r.run.hardware == "cpu 2-core x86_64 avx2 (AMD EPYC)" for r in recs)
    assert min(r.run.workload["speed_probe"]["before"]["median_s"] for r in recs) > 0.2
    return report, recs


AVX2_2 = FIXTURES / "cpu-tiny-llama-avx2-2"  # the command as it stands on a new AVX2 VM, a clone of 7460bba


def test_the_one_command_on_a_cpu_without_avx512_again() -> None:
    """The command as it stands (bf16) on the new AVX2 VM right after the float32 one (SOURCES.md there): 159 of 160
    items, 71 of 72 latency items, twin* 128 of 128 (44 within 10 % outright). The one failure is the offline run's
    ITL p50 on a repeat whose decode steps ran at 1.17 of the fit, the twin fast by 10.2 %, twin* within 2 %. Over the
    two pairs the bf16 command passed 143 of 144 latency items, the float32 one 125 ("Hosts without AVX-512" in
    docs/calibration.md)."""
    report, _ = _bf16_avx2_session(AVX2_2, 159, 71)
    (key, (error, star)), = failing_latency(AVX2_2).items()
    assert key == ("held-out", "heldout-offline-kv-prefix", "itl_p50_s") and -0.11 < error < -0.1 and abs(star) < 0.02
    assert 1.15 < decode_levels(report)["held-out/heldout-offline-kv-prefix"] < 1.2


AVX2_3 = FIXTURES / "cpu-tiny-llama-avx2-3"  # the command as it stands on the same AVX2 VM later, a clone of a07ddab


def test_the_one_command_on_a_cpu_without_avx512_a_third_time() -> None:
    """The command as it stands (bf16) on the same boot of the AVX2 VM three and a half hours after the evening's
    (SOURCES.md there): 157 of 160 items, 69 of 72 latency items, twin* 128 of 128, 61 within 10 % outright and a
    median |error| of 4.9 %. The three failures are ITL items the twin puts late on runs near the fit, twin* within
    3 %: the prefix mix's p90 on two repeats (its drawn step tail longer than these runs'), the bursty run's p50 on one."""
    report, recs = _bf16_avx2_session(AVX2_3, 157, 69)
    assert all(r.other_load_cores is not None and r.other_load_cores < 0.05 for r in recs)
    failing = failing_latency(AVX2_3)
    assert set(failing) == {("held-out-repeat2", "heldout-server-prefix-mix", "itl_p90_s"),
                            ("held-out-repeat3", "heldout-server-prefix-mix", "itl_p90_s"),
                            ("held-out-repeat4", "heldout-server-bursty", "itl_p50_s")}
    assert all(0.12 < error < 0.23 and abs(star) < 0.03 for error, star in failing.values())
    levels = decode_levels(report)
    assert all(0.95 < levels[f"held-out-repeat{k}/heldout-server-prefix-mix"] < 1.05 for k in (2, 3))
    assert 0.87 < min(levels.values()) and max(levels.values()) < 1.18


AVX2_WITNESS = FIXTURES / "cpu-tiny-llama-avx2-witness"  # the first one command with the host witness, a clone of fc40272


def test_the_one_command_with_the_host_witness() -> None:
    """The command as it stands (bf16) on the same boot of the AVX2 VM, the first session whose runs carry the host
    witness (SOURCES.md there): 159 of 160 items, 71 of 72 latency items, twin* 128 of 128. Every run's witness
    follows its decode level (log-log correlation 0.83 offline, 0.78 server), and the sweep refitted today keeps the
    term; with --host-witness the same 71 of 72 pass and 49 rather than 40 are within 10 % outright
    (docs/calibration-sessions.md, "What moves a run's level")."""
    from twin.calibration.calibrate import FitOptions
    from twin.calibration.fidelity import fidelity
    from twin.calibration.witness import run_witness_ms
    from twin.engine_profiles.derive import write_spec

    report, recs = _bf16_avx2_session(AVX2_WITNESS, 159, 71)
    (key, (error, star)), = failing_latency(AVX2_WITNESS).items()
    assert key == ("held-out", "heldout-server-bursty", "itl_p90_s")  # steps at 0.88 of the fit: the twin slow
    assert 0.34 < error < 0.36 and abs(star) < 0.01
    levels = decode_levels(report)
    held = {held_out_key(str(p)): load_recorded_run(p) for p in held_out_runs(AVX2_WITNESS)}
    pairs = [(run_witness_ms(held[k]), levels[k]) for k in levels]
    assert all(w is not None for w, _ in pairs)
    assert np.corrcoef(np.log([w for w, _ in pairs]), np.log([lv for _, lv in pairs]))[0, 1] > 0.7
    opts = FitOptions(server_offline_attention=True, decode_floor=True, idle_wake=True, stream_ends=True, intake=True)
    spec = calibrate(sweep_runs(AVX2_WITNESS), name="cpu-tiny-llama", command="test", options=opts).spec
    term = spec.host_witness
    assert term is not None and term.runs == 11 and 0.8 < term.correlation < 0.83 and 1.6 < term.exponent < 1.75
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu-tiny-llama.yaml"
        write_spec(spec, path)
        scaled = fidelity(held_out_runs(AVX2_WITNESS), profile=str(path), draws=9, host_witness=True)
    lat = scaled["latency_items"]
    assert (lat["passed"], lat["items"], lat["within_tolerance_outright"]) == (71, 72, 49)
