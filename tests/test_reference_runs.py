"""The reference-run tool that speed-ups are checked with: its runs load, and its comparison catches a change."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.reference_runs import RUNS, compare_all
from twin.scenario import load_scenario


@pytest.mark.parametrize("name", list(RUNS))
def test_each_reference_run_loads(name):
    scenario, overrides = RUNS[name]
    load_scenario(scenario, overrides=overrides)  # a renamed field or scenario fails here


def _run(folder, values, p50=1.0):
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"x": values}), folder / "requests.parquet")
    (folder / "summary.json").write_text(json.dumps({"ttft_s": {"p50": p50}, "wall_s": 3.0}))


def test_compare_all_finds_a_changed_value_a_changed_summary_and_a_missing_run(tmp_path, capsys):
    _run(tmp_path / "a" / "one", [1.0, float("nan")])
    _run(tmp_path / "a" / "two", [2.0])
    _run(tmp_path / "b" / "one", [1.0, float("nan")])
    _run(tmp_path / "b" / "two", [2.0])
    assert compare_all(tmp_path / "a", tmp_path / "b") == 0
    assert "4 of 4 tables and summaries identical" in capsys.readouterr().out

    _run(tmp_path / "c" / "one", [1.0, 5.0])
    _run(tmp_path / "c" / "two", [2.0], p50=1.5)
    assert compare_all(tmp_path / "a", tmp_path / "c") == 1
    out = capsys.readouterr().out
    assert "2 of 4 tables and summaries identical; 2 run(s) differ" in out

    _run(tmp_path / "d" / "one", [1.0, float("nan")])
    assert compare_all(tmp_path / "a", tmp_path / "d") == 1
    assert "two: DIFFERENT (no run in" in capsys.readouterr().out
