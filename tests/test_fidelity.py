"""``twin fidelity``: the report's fields, tolerances widened by the spread of repeated runs, exact items that
fail when the recording disagrees, and exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from twin.calibration.fidelity import (
    EXACT_ITEMS,
    LATENCY_ITEMS,
    TOLERANCE_ITEMS,
    by_step_level,
    decode_level,
    fidelity,
    format_by_step_level,
    format_table,
    mean_deviation,
    spread,
    step_level_band,
    workload_key,
)
from twin.calibration.recorded import load_recorded_run
from twin.cli import main
from twin.engine_profiles import load_profile
from twin.paths import REPO_ROOT

FIX = REPO_ROOT / "tests" / "fixtures" / "calibration" / "cpu-tiny-llama"
RUN = FIX / "held-out" / "heldout-offline-kv-prefix"
PROFILE = "cpu-tiny-llama"


def _copy(src: Path, dst: Path, *, time_scale: float = 1.0, metrics: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if time_scale != 1.0:
        lines = []
        for line in (src / "requests.jsonl").read_text().splitlines():
            obj = json.loads(line)
            obj["token_times_s"] = [t * time_scale for t in obj["token_times_s"]]
            obj["e2e_s"] = obj["token_times_s"][-1]
            lines.append(json.dumps(obj))
        (dst / "requests.jsonl").write_text("\n".join(lines) + "\n")
    if metrics:
        run = json.loads((src / "run.json").read_text())
        run["metrics_delta"].update(metrics)
        (dst / "run.json").write_text(json.dumps(run))
    return dst


def test_json_report_has_every_item_with_real_twin_error_tolerance_and_verdict(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    assert main(["fidelity", "--profile", PROFILE, str(RUN), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["profile"] == PROFILE and rep["default_tolerance"] == 0.10
    (run,) = rep["runs"]
    assert run["name"] == RUN.name and run["mode"] == "offline" and run["repeats"] == 1
    assert set(run["items"]) == set(EXACT_ITEMS) | set(TOLERANCE_ITEMS)
    for name, item in run["items"].items():
        for key in ("kind", "real", "twin", "rel_error", "tolerance", "pass", "spread", "twin_recorded_steps"):
            assert key in item, (name, key)
        if item["kind"] == "tolerance":
            assert item["tolerance"] == 0.10 and item["spread"] is None
            assert item["pass"] == (abs(item["rel_error"]) <= 0.10)
            assert item["real"] > 0 and item["twin"] > 0
    # an offline run: the schedule does not depend on timing, so both replays reproduce it exactly
    for name in ("steps", "composition", "preemptions", "prefix_cache_hits"):
        assert run["items"][name]["pass"] is True and run["items"][name]["pass_recorded_steps"] is True, name
    rec = load_recorded_run(RUN)
    assert run["items"]["steps"]["real"] == len(rec.iterations)
    # the replay with recorded step times reproduces the recorded step-time sum
    s = run["items"]["step_time_sum_s"]
    assert s["twin_recorded_steps"] == pytest.approx(s["real"], rel=1e-9)
    assert rep["summary"]["items"] == rep["summary"]["passed"] + rep["summary"]["failed"] == len(run["items"])


def test_repeats_widen_the_tolerance_to_the_real_spread(tmp_path: Path) -> None:
    a = _copy(RUN, tmp_path / "a")
    b = _copy(RUN, tmp_path / "b", time_scale=1.5)  # the same workload, every token 1.5x later
    assert workload_key(load_recorded_run(a)) == workload_key(load_recorded_run(b))
    rep = fidelity([a, b], profile=PROFILE)
    for run in rep["runs"]:
        assert run["repeats"] == 2
        ttft = run["items"]["ttft_p50_s"]
        assert ttft["spread"] == pytest.approx(0.5)  # values x and 1.5x: the one predicts the other 50 % off
        assert ttft["tolerance"] == pytest.approx(0.5)
        # the stricter rule: mean 1.25x, largest deviation 0.25x = 20 %
        assert ttft["mean_deviation"] == pytest.approx(0.2) and ttft["tolerance_strict"] == pytest.approx(0.2)
        steps = run["items"]["step_time_sum_s"]  # iterations are the same in both copies
        assert steps["spread"] == 0.0 and steps["tolerance"] == 0.10
    assert spread([1.0]) is None and spread([2.0, 2.0]) == 0.0 and spread([0.0, 1.0]) is None
    strict = rep["summary"]["strict"]
    assert strict["tolerance_items"] == 2 * len(TOLERANCE_ITEMS) == strict["repeated_items"]


def test_the_repeats_mean_passes_the_run_to_run_spread_but_not_always_the_stricter_rule() -> None:
    """Why the tolerance is the run-to-run spread: an exact prediction of the repeats' mean is always within it
    (the mean lies between the smallest and the largest repeat), while the deviation-from-mean rule can fail it,
    since the error is relative to the run and the deviation relative to the mean."""
    rng = np.random.default_rng(3)
    failed_strict = 0
    for _ in range(200):
        v = rng.uniform(1.0, 2.0, size=4)
        m = v.mean()
        assert all(abs(m / x - 1) <= spread(v) + 1e-12 for x in v)
        failed_strict += any(abs(m / x - 1) > mean_deviation(v) + 1e-12 for x in v)
    assert failed_strict > 0
    v = [1.0, 2.0, 2.0, 2.0]  # mean 1.75: 43 % from the low repeat's value in the mean's terms, 75 % in its own
    assert mean_deviation(v) == pytest.approx(0.75 / 1.75) and spread(v) == pytest.approx(1.0)


def test_what_the_recorder_measured_does_not_split_repeats(tmp_path: Path) -> None:
    """Repeats differ in the machine's speed probe, their warm-up's step times and the machine's other load, and may
    differ in the pinning's thread counts; they are still repeats of one workload (before this, the probe split every
    repeat into its own group: tolerances of 10 %)."""
    copies = []
    for i, probe_ms in enumerate((4.3, 6.3)):
        d = _copy(RUN, tmp_path / f"r{i}")
        run = json.loads((d / "run.json").read_text())
        run["workload"]["speed_probe"] = {"before": {"median_s": probe_ms / 1e3}, "after": {"median_s": probe_ms / 1e3}}
        run["workload"]["front_end_pinning"] = {"pinned": True, "threads": 60 + i}
        run["workload"]["warmup_steps"] = {"ctx_requests": [1, 0], "ctx_tokens": [127, 0], "gen_requests": [0, 126],
                                           "gen_tokens": [0, 126], "elapsed_ms": [9.0, 5.0 + i]}
        run["workload"]["host_load"] = {"wall_s": 5.9, "busy_share": {"0": 1.0, "1": 0.8 + 0.2 * i},
                                        "own_cores": 1.78, "other_cores": 0.01 + 0.8 * i}
        (d / "run.json").write_text(json.dumps(run))
        copies.append(load_recorded_run(d))
    assert workload_key(copies[0]) == workload_key(copies[1]) == workload_key(load_recorded_run(RUN))
    run = json.loads((copies[1].path / "run.json").read_text())
    run["workload"]["num_requests"] = run["workload"].get("num_requests", 0) + 1  # the workload itself differs
    (copies[1].path / "run.json").write_text(json.dumps(run))
    assert workload_key(load_recorded_run(copies[1].path)) != workload_key(copies[0])


def test_different_workloads_are_not_repeats(tmp_path: Path) -> None:
    other = FIX / "calibration" / "sweep-kv-pressure"
    assert workload_key(load_recorded_run(RUN)) != workload_key(load_recorded_run(other))


def test_exact_items_fail_when_the_recording_disagrees_and_the_exit_code_stays_0(tmp_path: Path) -> None:
    rec = load_recorded_run(RUN)
    bad = _copy(RUN, tmp_path / "bad", metrics={"num_preemptions": int(rec.metric("num_preemptions")) + 1})
    out = tmp_path / "f.json"
    assert main(["fidelity", "--profile", PROFILE, str(bad), "--json", str(out)]) == 0
    item = json.loads(out.read_text())["runs"][0]["items"]["preemptions"]
    assert item["pass"] is False and item["real"] == item["twin"] + 1


def test_bad_input_exits_2(tmp_path: Path) -> None:
    assert main(["fidelity", "--profile", PROFILE, str(tmp_path / "missing")]) == 2
    assert main(["fidelity", "--profile", "no-such-profile", str(RUN)]) == 2
    assert main(["fidelity", str(RUN)]) == 2  # --profile is required
    skeleton = load_profile(PROFILE).spec.model_dump(mode="json")
    skeleton["step_time"] = None
    (tmp_path / "skeleton.yaml").write_text(yaml.safe_dump(skeleton))
    assert main(["fidelity", "--profile", str(tmp_path / "skeleton.yaml"), str(RUN)]) == 2
    broken = _copy(RUN, tmp_path / "broken")
    (broken / "run.json").write_text("{}")
    out = tmp_path / "f.json"
    assert main(["fidelity", "--profile", PROFILE, str(broken), "--json", str(out)]) == 2
    assert not out.exists()


def test_a_server_runs_step_count_is_judged_with_the_repeats_spread_and_its_composition_only_reported() -> None:
    """On a server the engine batches what has arrived when a step starts, so the step count and composition
    follow timing (the two recordings of server-poisson-low differ in both): the step count is a tolerance item
    widened by the repeats' spread, the composition is reported and not counted; an offline run's stay exact."""
    rec_dir = REPO_ROOT / "tests" / "fixtures" / "recorded"
    runs = [rec_dir / "server-poisson-low", rec_dir / "server-poisson-low-rep2", RUN]
    rep = fidelity(runs, profile=PROFILE)
    steps_real = [len(load_recorded_run(p).iterations) for p in runs[:2]]
    assert steps_real[0] != steps_real[1]  # the repeats themselves differ
    for run in rep["runs"][:2]:
        assert run["mode"] == "server" and run["repeats"] == 2
        steps, comp = run["items"]["steps"], run["items"]["composition"]
        assert steps["kind"] == "tolerance" and isinstance(steps["real"], int) and isinstance(steps["twin"], int)
        assert steps["spread"] == pytest.approx(max(steps_real) / min(steps_real) - 1)
        assert steps["tolerance"] == max(0.10, steps["spread"])
        assert steps["rel_error"] == pytest.approx(steps["twin"] / steps["real"] - 1)
        assert steps["pass"] == (abs(steps["rel_error"]) <= steps["tolerance"])
        assert comp["kind"] == "reported" and comp["pass"] is None and isinstance(comp["identical"], bool)
        for name in ("preemptions", "prefix_cache_hits"):
            assert run["items"][name]["kind"] == "exact"
    offline = rep["runs"][2]["items"]
    assert offline["steps"]["kind"] == offline["composition"]["kind"] == "exact"
    assert offline["composition"]["pass"] is True
    judged = [it for r in rep["runs"] for it in r["items"].values() if it["pass"] is not None]
    assert rep["summary"]["items"] == len(judged) == 3 * len(EXACT_ITEMS) + 3 * len(TOLERANCE_ITEMS) - 2
    text = format_table(rep)
    assert "timing" in text and f"{rep['summary']['items']} items" in text


def test_each_run_says_where_its_steps_sat_against_the_model_as_steps_by_run_does(tmp_path: Path) -> None:
    """``step_level``: the run's decode and prefill steps, median recorded / modelled, the same numbers as
    ``--steps``' by-run view; a copy whose logged step times are 1.5x sits 1.5x higher, and the table prints it."""
    from twin.calibration.residuals import step_residuals

    slow = tmp_path / "slow"
    shutil.copytree(RUN, slow)
    lines = (RUN / "iterations.csv").read_text().splitlines()
    col = lines[0].split(",").index("elapsed_ms")
    scaled = [lines[0]] + [",".join(repr(float(v) * 1.5) if i == col else v for i, v in enumerate(row.split(",")))
                           for row in lines[1:]]
    (slow / "iterations.csv").write_text("\n".join(scaled) + "\n")
    rep = fidelity([RUN, slow], profile=PROFILE)
    by_run = {Path(r["run"]).name: r for r in step_residuals([RUN, slow], profile=PROFILE)["runs"]}
    levels = {}
    for run in rep["runs"]:
        level = run["step_level"]
        for regime in ("decode", "prefill"):
            assert level[regime] == by_run[Path(run["run"]).name][regime]
        levels[run["name"]] = level["decode"]["median_ratio"]
    assert 0.7 < levels[RUN.name] < 1.3
    assert levels["slow"] == pytest.approx(1.5 * levels[RUN.name], rel=1e-6)
    assert f"recorded steps / the profile's model, median: decode {levels['slow']:.2f}" in format_table(rep)
    # the latency items counted by how far their run's decode steps sat from the model: the 1.5x copy well off it
    bands = {b["band"]: b for b in rep["latency_by_step_level"]}
    by_name = {r["name"]: r for r in rep["runs"]}
    assert [decode_level(by_name[n]) for n in (RUN.name, "slow")] == [levels[RUN.name], levels["slow"]]
    assert step_level_band(levels["slow"]) == "10 % or more"
    if step_level_band(levels[RUN.name]) != "10 % or more":  # then the band holds the copy's six items alone
        slow_failed = [by_name["slow"]["items"][k]["pass"] for k in LATENCY_ITEMS].count(False)
        assert (bands["10 % or more"]["items"], bands["10 % or more"]["failed"]) == (6, slow_failed)
    assert sum(b["items"] for b in bands.values()) == rep["latency_items"]["items"] == 12
    assert sum(b["failed"] for b in bands.values()) == 12 - rep["latency_items"]["passed"]
    far = bands["10 % or more"]
    assert f"10 % or more off: {far['failed']} of {far['items']}" in format_table(rep)


def test_latency_verdicts_by_the_runs_step_level() -> None:
    """``by_step_level``: a band holds the levels ``lo <= |level - 1| < hi``; runs without a level are counted apart;
    an empty band is left out, and the line is only printed where some run has a level."""
    judged = [(1.0, True), (0.96, False), (0.95, True), (1.09, False), (1.10, False), (0.5, True), (None, False)]
    assert by_step_level(judged) == [
        {"band": "under 5 %", "items": 2, "failed": 1}, {"band": "5-10 %", "items": 2, "failed": 1},
        {"band": "10 % or more", "items": 2, "failed": 1}, {"band": "not known", "items": 1, "failed": 1}]
    assert by_step_level([(1.2, True)]) == [{"band": "10 % or more", "items": 1, "failed": 0}]
    assert by_step_level([]) == []
    assert format_by_step_level(by_step_level([(None, True)])) is None
    line = format_by_step_level(by_step_level(judged))
    assert line is not None and "under 5 % off: 1 of 2; 5-10 % off: 1 of 2" in line and "not known: 1 of 1" in line
