"""The per-run report: chart functions on real and hand-made tables, the report files, ``twin report``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("plotly")

from twin import charts  # noqa: E402
from twin.cli import main  # noqa: E402
from twin.report import RunData, load_run, render_markdown, reasons_table, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# The brief's tiny two-region fleet. The router is spelled out: left to its default, the schema's
# unvalidated default dict makes pydantic warn while dumping the manifest, which this suite turns into an
# error (twin/fleet_config.py, PolicyConfig.router).
FLEET_YAML = """\
name: report-fleet
seed: 1
fleet:
  topology:
    regions:
      - {name: us-east, share: 0.6, pools: [{model: large, nodes: 1}]}
      - {name: eu-west, share: 0.4, pools: [{model: large, nodes: 1}]}
  models:
    large: {profile: llama3-70b-fp8-tp4-h100}
  policy: {router: {kind: least_outstanding_tokens}}
  traffic: {daily_users: 10000000, turns_per_user: 15, scale: 0.0005, duration_s: 60,
            classes: {long_context: 0.0}}
"""


def _run(tmp: Path, name: str, args: list[str]) -> Path:
    out = tmp / name
    assert main(["run", *args, "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fleet")
    (tmp / "fleet.yaml").write_text(FLEET_YAML, encoding="utf-8")
    return _run(tmp, "run", [str(tmp / "fleet.yaml")])


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("single")
    return _run(tmp, "run", [str(ROOT / "scenarios" / "single-replica-demo.yaml"),
                             "--set", "workload.num_requests=200"])


@pytest.fixture(scope="module")
def fleet(fleet_dir) -> RunData:
    return load_run(fleet_dir)


@pytest.fixture(scope="module")
def single(single_dir) -> RunData:
    return load_run(single_dir)


def _names(fig) -> list[str]:
    return [t.name for t in fig.data]


# --- charts on a real fleet run ------------------------------------------------------------------------

def test_traffic_bars_count_every_arrival_and_completion(fleet):
    req = fleet.requests.to_pandas()
    fig = charts.fig_traffic(fleet.requests, window_s=5.0)
    classes = sorted(req["klass"].unique())
    assert _names(fig) == [f"arrived: {k}" for k in classes] + ["completed (by finish)"]
    for k, bar in zip(classes, fig.data):
        assert sum(bar.y) * 5.0 == pytest.approx((req["klass"] == k).sum())
    assert sum(fig.data[-1].y) * 5.0 == pytest.approx((req["outcome"] == "completed").sum())


def test_queue_and_kv_charts_cover_every_replica(fleet):
    lv = fleet.levels.to_pandas()
    replicas = sorted(lv.loc[lv["metric"] == "kv_usage", "scope"].unique())
    assert len(replicas) == fleet.summary["fleet"]["replicas"]
    q = charts.fig_queue_depth(fleet.levels)
    assert _names(q) == ["fleet queue (queued_requests)", f"engine waiting (sum over {len(replicas)} replicas)"]
    # At the last instant the summed waiting equals the sum of each replica's last sample.
    last = sum(lv[(lv["scope"] == s) & (lv["metric"] == "waiting")].sort_values("t_s", kind="stable")["value"].iloc[-1]
               for s in replicas)
    assert q.data[1].y[-1] == pytest.approx(last)
    kv = charts.fig_kv_usage(fleet.levels)
    assert _names(kv) == [f"mean of {len(replicas)} replicas", "max over replicas"]
    mean, mx = np.asarray(kv.data[0].y), np.asarray(kv.data[1].y)
    assert np.all(mx >= mean) and mx.max() > 0
    assert mx.max() == pytest.approx(lv.loc[lv["metric"] == "kv_usage", "value"].max())


def test_latency_and_itl_charts_have_p50_and_p99(fleet):
    slo = fleet.summary["slo"]
    ttft = charts.fig_latency_over_time(fleet.requests, "ttft_s", slo_s=slo["ttft_s"])
    assert _names(ttft) == ["p50", "p99"]
    assert np.all(np.asarray(ttft.data[1].y) >= np.asarray(ttft.data[0].y))
    assert sum(ttft.data[0].customdata) == fleet.summary["ttft_s"]["count"]  # every completed request, once
    itl = charts.fig_itl_over_time(fleet.requests, slo_s=slo["itl_s"])
    assert "proxy" in itl.layout.title.text and "TPOT" in itl.layout.title.text
    assert _names(itl) == ["p50", "p99"]
    assert sum(itl.data[0].customdata) == fleet.summary["tpot_s"]["count"]


def test_outcomes_by_tier_and_class_match_the_requests_table(fleet):
    req = fleet.requests.to_pandas()
    for by in ("tier", "klass"):
        fig = charts.fig_outcomes(fleet.requests, by=by)
        assert set(_names(fig)) == set(req["outcome"].unique())
        for bar in fig.data:
            for group, n in zip(bar.x, bar.y):
                assert n == ((req[by] == group) & (req["outcome"] == bar.name)).sum()
    tiers = charts.fig_outcomes(fleet.requests, by="tier")
    completed = dict(zip(tiers.data[0].x, tiers.data[0].y))
    assert completed == {t: s["requests"]["completed"] for t, s in fleet.summary["by_tier"].items()}


def test_cost_figure_quotes_the_fleet_summary(fleet, single):
    fig = charts.fig_cost(fleet.summary)
    labels, values = fig.data[0].cells.values
    got = dict(zip(labels, values))
    assert float(got["GPU-hours"]) == pytest.approx(fleet.summary["fleet"]["gpu_hours"], rel=1e-3)
    assert float(got["$ per M output tokens"]) == pytest.approx(fleet.summary["fleet"]["usd_per_m_output_tokens"],
                                                                rel=1e-3)
    assert len(charts.fig_cost(single.summary).data) == 0


# --- charts on hand-made tables ------------------------------------------------------------------------

def test_window_percentiles_use_completed_requests_only():
    req = pa.table({
        "arrival_s": [1.0, 2.0, 3.0, 12.0, 5.0, 6.0],
        "finish_s": [2.0, 3.0, 4.0, 13.0, 5.0, 9.0],
        "ttft_s": [0.1, 0.2, 0.3, 1.0, math.nan, 9.0],
        "tpot_s": [0.01, 0.02, 0.03, 0.04, math.nan, 0.5],
        "outcome": ["completed"] * 4 + ["rejected", "cancelled"],
    })
    fig = charts.fig_latency_over_time(req, "ttft_s", window_s=10.0)
    assert list(fig.data[0].x) == [5.0, 15.0]
    assert list(fig.data[0].y) == [0.2, 1.0] and list(fig.data[1].y) == [0.3, 1.0]
    itl = charts.fig_itl_over_time(req, window_s=10.0)
    assert list(itl.data[1].y) == [0.03, 0.04]


def test_level_steps_are_summed_and_maxed_across_replicas():
    lv = pa.table({
        "t_s": [1.0, 3.0, 2.0, 1.0, 3.0, 2.0],
        "scope": ["r0", "r0", "r1", "r0", "r0", "r1"],
        "metric": ["waiting", "waiting", "waiting", "kv_usage", "kv_usage", "kv_usage"],
        "value": [2.0, 0.0, 1.0, 0.5, 0.1, 0.3],
    })
    q = charts.fig_queue_depth(lv)
    assert _names(q) == ["engine waiting (sum over 2 replicas)"]  # no queue scope: a single-replica-like run
    assert list(q.data[0].x) == [1.0, 2.0, 3.0] and list(q.data[0].y) == [2.0, 3.0, 1.0]
    kv = charts.fig_kv_usage(lv)
    assert list(kv.data[0].y) == pytest.approx([0.25, 0.4, 0.2])
    assert list(kv.data[1].y) == pytest.approx([0.5, 0.5, 0.3])


def test_empty_tables_give_empty_figures_with_a_note(fleet):
    empty_req = fleet.requests.slice(0, 0)
    empty_lv = fleet.levels.slice(0, 0)
    figs = [charts.fig_traffic(empty_req), charts.fig_queue_depth(empty_lv), charts.fig_kv_usage(empty_lv),
            charts.fig_latency_over_time(empty_req), charts.fig_itl_over_time(empty_req),
            charts.fig_outcomes(empty_req), charts.fig_queue_depth(None), charts.fig_cost({})]
    for fig in figs:
        assert len(fig.data) == 0
        assert fig.layout.annotations and fig.layout.annotations[0].text


def test_single_replica_run_without_tier_columns(single):
    assert "tier" not in single.requests.column_names
    fig = charts.fig_outcomes(single.requests, by="tier")
    assert list(fig.data[0].x) == ["all"] and "no tier column" in fig.layout.title.text
    assert _names(charts.fig_traffic(single.requests))[0] == "arrived: all"
    assert _names(charts.fig_queue_depth(single.levels)) == ["engine waiting (sum over 1 replica)"]
    md = render_markdown(single)
    header, *rows = _md_table(md, "Per tier")
    assert [r[0] for r in rows] == ["all"]
    cell = dict(zip(header, rows[0]))
    assert int(cell["arrived"]) == 200 and int(cell["completed"]) == single.summary["requests"]["completed"]
    assert _close(cell["ITL p99 (s)"], single.summary["itl_s"]["p99"])
    assert "no fleet section" in md.split("## Cost\n", 1)[1]


# --- the report files ----------------------------------------------------------------------------------

def _md_table(md: str, title: str) -> list[list[str]]:
    block = md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[:1] + rows[2:]]


def _close(cell: str, value) -> bool:
    if value is None:
        return cell == "—"
    return float(cell) == pytest.approx(value, rel=5e-4)


def test_report_files_quote_the_summary(fleet_dir, tmp_path):
    html_path, md_path = write_report(fleet_dir, tmp_path / "report.html", title="tiny fleet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.md"]  # no temp files left
    summary = json.loads((fleet_dir / "summary.json").read_text())
    md = md_path.read_text()
    assert md.startswith("# tiny fleet\n")
    header, *rows = _md_table(md, "Per tier")
    assert [r[0] for r in rows] == [*sorted(summary["by_tier"]), "all"]
    for row in rows:
        s = summary if row[0] == "all" else summary["by_tier"][row[0]]
        cell = dict(zip(header, row))
        assert int(cell["arrived"]) == s["requests"]["arrived"]
        assert _close(cell["TTFT p50 (s)"], s["ttft_s"]["p50"])
        assert _close(cell["TTFT p99 (s)"], s["ttft_s"]["p99"])
        assert _close(cell["ITL p99 (s)"], s["itl_s"]["p99"])
        assert _close(cell["goodput (req/s)"], s["goodput_rps"])
    cost = dict(r for r in _md_table(md, "Cost")[1:])
    assert _close(cost["GPU-hours"], summary["fleet"]["gpu_hours"])
    assert _close(cost["$ per M output tokens"], summary["fleet"]["usd_per_m_output_tokens"])
    reasons = _md_table(md, "Not completed, by reason")[1:]
    assert {(t, r): int(n) for t, r, n in reasons if t == "all"} == \
        {("all", k): v for k, v in summary["outcomes_by_reason"].items()}
    page = html_path.read_text()
    assert page.count("plotly.js v") == 1 and "<script src=" not in page  # plotly.js inline, once
    assert page.count("Plotly.newPlot") == 7
    assert "<td>" + cost["$ per M output tokens"] + "</td>" in page


def test_baseline_side_by_side(fleet_dir, single_dir, tmp_path):
    _, md_path = write_report(fleet_dir, tmp_path / "r.html", baseline=single_dir)
    md = md_path.read_text()
    assert md.startswith("# report-fleet vs single-replica-demo\n")
    header, *rows = _md_table(md, "Per tier")
    assert header == ["tier", "metric", "report-fleet", "single-replica-demo", "change"]
    single_summary = json.loads((single_dir / "summary.json").read_text())
    fleet_summary = json.loads((fleet_dir / "summary.json").read_text())
    row = next(r for r in rows if r[:2] == ["all", "TTFT p99 (s)"])
    assert _close(row[2], fleet_summary["ttft_s"]["p99"]) and _close(row[3], single_summary["ttft_s"]["p99"])
    assert next(r for r in rows if r[:2] == ["enterprise", "arrived"])[3] == "—"  # no tiers in the baseline
    # The same run as its own baseline: labelled "baseline", every defined change is zero.
    _, md2 = write_report(fleet_dir, tmp_path / "same.html", baseline=fleet_dir)
    header, *rows = _md_table(md2.read_text(), "Overview")
    assert header == ["metric", "report-fleet", "baseline", "change"]
    assert {r[3] for r in rows} <= {"+0.0%", ""} and "+0.0%" in {r[3] for r in rows}


def test_reasons_table_with_a_baseline_lists_both_runs():
    def summary(reasons: dict) -> dict:
        return {"requests": {"arrived": 1, "completed": 0}, "outcomes_by_reason": reasons,
                "by_tier": {"free": {"requests": {"arrived": 1, "completed": 0}, "outcomes_by_reason": reasons}}}

    run = RunData("launch-day-10x", summary({"rejected:queue_full": 7}))
    base = RunData("baseline", summary({"abandoned:patience": 2}))
    t = reasons_table(run, base)
    assert t.columns == ("tier", "outcome:reason", "launch-day-10x", "baseline")
    assert set(t.rows) == {("free", "rejected:queue_full", 7, 0), ("all", "rejected:queue_full", 7, 0),
                           ("free", "abandoned:patience", 0, 2), ("all", "abandoned:patience", 0, 2)}


def test_a_failed_render_leaves_the_old_report(fleet_dir, tmp_path, monkeypatch):
    out = tmp_path / "report.html"
    out.write_text("old")
    import twin.report

    def boom(*a, **k):
        raise RuntimeError("render failed")

    monkeypatch.setattr(twin.report, "render_html", boom)
    with pytest.raises(RuntimeError):
        write_report(fleet_dir, out)
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_load_run_from_a_run_result_matches_the_folder(fleet_dir):
    from twin.runner import run_scenario
    from twin.scenario import load_scenario

    path = fleet_dir.parent / "fleet.yaml"
    result = run_scenario(load_scenario(path), seed=1)
    from_result, from_dir = load_run(result), load_run(fleet_dir)
    assert from_result.label == from_dir.label == "report-fleet"
    assert from_result.requests.to_pandas().equals(pq.read_table(fleet_dir / "requests.parquet").to_pandas())
    assert render_markdown(from_result).split("\n## ", 1)[1] == render_markdown(from_dir).split("\n## ", 1)[1]


# --- the command ---------------------------------------------------------------------------------------

def test_cli_writes_the_report(fleet_dir, tmp_path, capsys):
    out = tmp_path / "x" / "fleet.html"
    assert main(["report", str(fleet_dir), "--out", str(out)]) == 0
    assert out.is_file() and (tmp_path / "x" / "fleet.md").is_file()
    assert str(out) in capsys.readouterr().out


def test_cli_missing_or_failed_run_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "r.html")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "manifest.json").write_text('{"exception": "boom"}')
    assert main(["report", str(failed)]) == 2
    assert "no summary.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed"]
    assert sorted(p.name for p in failed.iterdir()) == ["manifest.json"]


def test_cli_without_plotly_names_the_extra(fleet_dir, tmp_path, monkeypatch, capsys):
    import importlib.util

    import twin.commands.report as cmd

    real = importlib.util.find_spec
    monkeypatch.setattr(cmd.importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a))
    assert main(["report", str(fleet_dir), "--out", str(tmp_path / "r.html")]) == 2
    assert "twin[report]" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
