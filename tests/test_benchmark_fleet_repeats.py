"""``python -m benchmarks.fleet --repeats N``: the cases run in N alternated rounds and each case reports its
median run, so the growth against linear is not one noisy run's (docs/performance.md, "Commands")."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest

from benchmarks import fleet
from benchmarks.common import interpreter


def test_each_case_reports_its_median_run_and_the_growth_compares_medians(capsys) -> None:
    rows = fleet.main(["--scale", "0.005", "--sim-s", "5", "--multiples", "1,2", "--repeats", "3"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["case"] for r in lines] == ["fleet_peak_x1", "fleet_peak_x2"]  # one JSON line per case
    for row, line in zip(rows, lines, strict=True):
        cpu = row["cpu_s_repeats"]
        assert len(cpu) == 3
        assert row["cpu_s"] == pytest.approx(sorted(cpu)[1], abs=1e-3)  # the median run's own figures
        assert line["cpu_s"] == row["cpu_s"] and line["cpu_s_repeats"] == cpu
    base, bigger = rows
    assert "cpu_per_turn_vs_linear" not in base
    assert bigger["cpu_per_turn_vs_linear"] == pytest.approx(
        (bigger["cpu_s"] / bigger["sim_requests"]) / (base["cpu_s"] / base["sim_requests"]))


def test_a_repeat_simulates_the_same_fleet() -> None:
    runs = [fleet.run_case("x", scale=0.005, sim_s=5, show=False) for _ in range(2)]
    keys = ("sim_requests", "completed", "ttft_p50_s", "recorded_events", "itl_gaps")
    assert [{k: r[k] for k in keys} for r in runs][0] == [{k: r[k] for k in keys} for r in runs][1]


def test_repeats_below_one_are_refused() -> None:
    with pytest.raises(SystemExit):
        fleet.main(["--repeats", "0"])


def test_the_median_run_is_picked_whole() -> None:
    rows = [{"cpu_s": c, "run": i, "peak_rss_mb": 100.0 * (i + 1)} for i, c in enumerate((3.0, 1.0, 2.0))]
    pick = fleet.median_run(rows)
    assert pick["run"] == 2 and pick["cpu_s_repeats"] == [3.0, 1.0, 2.0] and pick["cpu_s_median"] == 2.0
    assert pick["peak_rss_mb"] == 100.0  # the first round's: later ones report the largest case's peak
    even = fleet.median_run([{"cpu_s": c, "run": i, "peak_rss_mb": 1.0} for i, c in enumerate((4.0, 1.0, 3.0, 2.0))])
    assert even["run"] == 3 and even["cpu_s_median"] == 2.5  # the lower middle run; the median between
    assert "cpu_s_repeats" not in rows[2]  # the rounds' rows are left as they were


def test_a_row_names_the_interpreter_it_ran_on() -> None:
    row = fleet.run_case("x", scale=0.005, sim_s=5, show=False)
    assert row["python"] == interpreter()
    assert row["python"].startswith(f"{platform.python_implementation()} {platform.python_version()}, ")
    # this process's own maps say whether the interpreter's code came from a shared libpython
    maps = Path("/proc/self/maps").read_text(encoding="utf-8")
    assert ("shared libpython" in row["python"]) == ("libpython" in maps), sys.executable
