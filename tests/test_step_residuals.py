"""``twin fidelity --steps``: the step-time model's residuals by regime (``twin.calibration.residuals``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from twin.calibration.recorded import RecordedRunError
from twin.calibration.residuals import MIN_CI_SAMPLES, format_residuals, median_ci, step_residuals
from twin.cli import main

SESSION = Path(__file__).parent / "fixtures" / "calibration" / "cpu-tiny-llama-sendorder"
PROFILE = SESSION / "cpu-tiny-llama.yaml"
RUNS = [SESSION / "calibration" / "sweep-decode-batch", SESSION / "calibration" / "sweep-prefill-chunk-128",
        SESSION / "calibration" / "sweep-server-rate-6", SESSION / "held-out" / "heldout-server-bursty"]


@pytest.fixture(scope="module")
def report() -> dict:
    return step_residuals(RUNS, profile=str(PROFILE))


def _bins(rep: dict) -> dict[tuple[str, str, str], dict]:
    return {(s["section"], v["view"], b["bin"]): b for s in rep["sections"] for v in s["views"] for b in v["bins"]}


def test_every_view_partitions_its_regime(report: dict) -> None:
    assert [r["section"] for r in report["runs"]] == ["offline", "offline", "server", "server"]
    assert report["skipped"] == []
    for s in report["sections"]:
        totals: dict[str, set[int]] = {}
        for v in s["views"]:
            totals.setdefault(v["regime"], set()).add(sum(b["steps"] for b in v["bins"]))
        # each view of a regime counts the same steps, and decode + prefill steps are all of them
        assert all(len(t) == 1 for t in totals.values()), totals
        assert totals["decode"].pop() + totals["prefill"].pop() == totals["all"].pop() == s["steps"] > 300
        first = next(v for v in s["views"] if v["view"] == "place in the run")
        assert {b["bin"]: b["steps"] for b in first["bins"]}["first step"] == 2  # two runs per section


def test_each_runs_level_splits_its_sections_steps_and_carries_its_speed_probe(report: dict) -> None:
    for s in report["sections"]:
        mine = [r for r in report["runs"] if r["section"] == s["section"]]
        assert sum(r["decode"]["steps"] + r["prefill"]["steps"] for r in mine) == s["steps"]
    for r in report["runs"]:
        probe = json.loads((Path(r["run"]) / "run.json").read_text())["workload"]["speed_probe"]
        assert r["speed_probe_ms"] == [probe["before"]["median_s"] * 1e3, probe["after"]["median_s"] * 1e3]
    text = format_residuals(report)
    assert "by run (median recorded / model" in text and "sendorder" not in text.split("by run")[1].split("\n")[1]
    assert "held-out/heldout-server-bursty" in text.split("by run")[1]


def test_a_slower_model_is_flagged_everywhere_it_is_clearly_off(report: dict, tmp_path: Path) -> None:
    """Every step-time term x 1.25: each bin's ratio falls by exactly that factor, and every bin whose interval
    was below 1.18 is now biased (its interval below 0.95)."""
    data = yaml.safe_load(PROFILE.read_text())

    def scale(node):  # every number of a step-time section (the overhead too: the model time scales exactly)
        if isinstance(node, dict):
            return {k: scale(v) for k, v in node.items()}
        return node * 1.25 if isinstance(node, float) else node

    data["step_time"] = scale(data["step_time"])
    data["server"]["step_time"] = scale(data["server"]["step_time"])
    slow = tmp_path / "slow.yaml"
    slow.write_text(yaml.safe_dump(data))
    before, after = _bins(report), _bins(step_residuals(RUNS, profile=str(slow)))
    assert before.keys() == after.keys()
    clear = 0
    for key, b in before.items():
        assert after[key]["steps"] == b["steps"]
        assert after[key]["median_ratio"] == pytest.approx(b["median_ratio"] / 1.25, rel=1e-9)
        if b["ci"] is not None and b["ci"][1] < 1.18:
            assert after[key]["biased"], key
            clear += 1
    assert clear >= 15


def test_the_idle_wake_is_the_bias_this_session_shows(report: dict) -> None:
    """In these runs the server's first step after an idle engine runs ~1.2x its fitted time (1.5x over the whole
    session; docs/calibration-sessions.md, "A quiet server's first step") while its decode steps sit on the model."""
    bins = _bins(report)
    wake = bins[("server", "after an idle engine (server)", "idle wake")]
    assert wake["biased"] and wake["ci"][0] > 1.1
    assert not bins[("server", "decode batch", "2-4")]["biased"]
    assert not bins[("offline", "decode batch", "5-16")]["biased"]


def test_median_ci() -> None:
    assert median_ci(np.arange(MIN_CI_SAMPLES - 1, dtype=float)) is None
    rng = np.random.default_rng(3)
    for n in (MIN_CI_SAMPLES, 7, 20, 101, 1000):
        x = rng.normal(1.0, 0.1, n)
        lo, hi = median_ci(x)
        assert lo <= np.median(x) <= hi and lo < hi
    # about 95 % coverage of the true median (1.0) over repeated samples of 50
    covered = sum(lo <= 1.0 <= hi for lo, hi in (median_ci(rng.normal(1.0, 0.1, 50)) for _ in range(400)))
    assert 0.90 * 400 <= covered <= 0.99 * 400


def test_bad_input() -> None:
    with pytest.raises(RecordedRunError):
        step_residuals([SESSION / "held-out"], profile=str(PROFILE))
    with pytest.raises(ValueError, match="bias"):
        step_residuals(RUNS[:1], profile=str(PROFILE), bias=1.5)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "residuals.json"
    assert main(["fidelity", "--profile", str(PROFILE), str(RUNS[0]), str(RUNS[2]), "--steps",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step-time residuals of cpu-tiny-llama" in text and "biased bin(s) over" in text
    saved = json.loads(out.read_text())
    assert [s["section"] for s in saved["sections"]] == ["offline", "server"]
    assert main(["fidelity", "--profile", str(PROFILE), str(tmp_path / "missing"), "--steps"]) == 2
    assert "no run.json" in capsys.readouterr().err
