"""The query layer: DuckDB views over a sweep folder, load spread from requests.scope, CIs across seeds,
and the ``twin results`` command."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from twin import results_db
from twin.cli import main
from twin.sweep import SweepSpec, run_sweep

pytest.importorskip("duckdb")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    spec = SweepSpec.model_validate({
        "name": "q", "scenarios": ["scenarios/baseline-day.yaml"],
        "policies": {"rr": {"kind": "round_robin"}, "sa": {"kind": "session_affinity"}},
        "seeds": [1, 2], "overrides": ["fleet.scale=0.002", "fleet.traffic.duration_s=10"]})
    report = run_sweep(spec, out=tmp_path_factory.mktemp("q"), workers=0, progress=False)
    assert report.failed == []
    return report.folder


def test_views_carry_run_hash_and_every_row(folder):
    con = results_db.connect(folder)
    runs = con.execute("SELECT run_hash, policy, seed FROM runs ORDER BY run_hash").fetchall()
    assert len(runs) == 4
    for name in ("requests", "events", "levels"):
        got = dict(con.execute(f"SELECT run_hash, count(*) FROM {name} GROUP BY run_hash").fetchall())
        want = {h: pq.read_metadata(folder / "runs" / h / f"{name}.parquet").num_rows for h, _, _ in runs}
        assert got == want
    # a failed run (manifest with an exception) is left out of every view
    bad = folder.parent / "q2"
    import shutil

    shutil.copytree(folder, bad)
    victim = bad / "runs" / runs[0][0]
    m = json.loads((victim / "manifest.json").read_text())
    (victim / "manifest.json").write_text(json.dumps(dict(m, exception="x")))
    con2 = results_db.connect(bad)
    assert con2.execute("SELECT count(*) FROM runs").fetchone()[0] == 3
    assert con2.execute(f"SELECT count(*) FROM requests WHERE run_hash = '{runs[0][0]}'").fetchone()[0] == 0
    # only the runs the last sweep's index lists are read (a folder from an older spec is ignored)
    index = json.loads((bad / "index.json").read_text())
    assert sorted(r["run_hash"] for r in index["runs"]) == [h for h, _, _ in runs]
    index["runs"] = [r for r in index["runs"] if r["run_hash"] != runs[1][0]]
    (bad / "index.json").write_text(json.dumps(index))
    assert results_db.connect(bad).execute("SELECT count(*) FROM runs").fetchone()[0] == 2


def test_load_spread_matches_a_direct_computation(folder):
    con = results_db.connect(folder)
    rows = {r["run_hash"]: r for r in results_db.per_run(con)}
    for h, r in rows.items():
        scopes = [s for s in pq.read_table(folder / "runs" / h / "requests.parquet")["scope"].to_pylist() if s]
        reps = pq.read_table(folder / "runs" / h / "replicas.parquet").to_pylist()
        assert len(reps) == json.loads((folder / "runs" / h / "summary.json").read_text())["fleet"]["replicas"]
        assert set(scopes) <= {p["scope"] for p in reps}
        pool = lambda p: (p["region"], p["model"], p["pool"])  # noqa: E731
        busy = {pool(p) for p in reps if p["scope"] in scopes}
        counts = np.array([scopes.count(p["scope"]) for p in reps if pool(p) in busy], float)
        assert r["replicas"] == len(counts)
        assert r["load_spread_cv"] == pytest.approx(counts.std() / counts.mean(), rel=1e-9)
    spreads = {r["policy"]: r["load_spread_cv"] for r in rows.values()}
    assert len(set(spreads.values())) > 1


def test_an_idle_replica_counts_as_zero_and_an_idle_pool_is_left_out(tmp_path):
    """Hand-made run folder: pool A has replicas a0 (3 requests) and a1 (idle); pool B (b0) is idle."""
    import pyarrow as pa

    run = tmp_path / "runs" / "0123456789abcdef"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"exception": None}))
    pq.write_table(pa.Table.from_pylist([{"run_hash": run.name, "scenario": "s", "policy": "p", "seed": 0,
                                          "ttft_s_p50": 0.1, "ttft_s_p99": 0.2, "itl_s_p99": 0.01,
                                          "prefix_cache_hit_rate": 0.5, "goodput_rps": 1.0}]), run / "run.parquet")
    pq.write_table(pa.Table.from_pylist([{"scope": s, "outcome": "completed"} for s in ["a0", "a0", "a0", ""]]),
                   run / "requests.parquet")
    pq.write_table(pa.Table.from_pylist([{"scope": "a0", "region": "r", "model": "m", "pool": "A"},
                                         {"scope": "a1", "region": "r", "model": "m", "pool": "A"},
                                         {"scope": "b0", "region": "r", "model": "m", "pool": "B"}]),
                   run / "replicas.parquet")
    (row,) = results_db.per_run(results_db.connect(tmp_path))
    assert row["replicas"] == 2
    assert row["load_spread_cv"] == pytest.approx(1.0)  # counts (3, 0): std 1.5 / mean 1.5


def test_summary_mean_and_ci_across_seeds(folder):
    st = pytest.importorskip("scipy.stats")
    rows = results_db.per_run(results_db.connect(folder))
    summary = results_db.summarize_runs(rows)
    assert [(e["scenario"], e["policy"], e["n"]) for e in summary] == [("baseline-day", "rr", 2),
                                                                       ("baseline-day", "sa", 2)]
    vals = [r["ttft_p99_s"] for r in rows if r["policy"] == "rr"]
    e = summary[0]["ttft_p99_s"]
    assert e["mean"] == pytest.approx(np.mean(vals))
    assert e["ci95"] == pytest.approx(st.t.ppf(0.975, 1) * np.std(vals, ddof=1) / math.sqrt(2), rel=1e-3)
    for df in (1, 2, 4, 10, 29, 30, 31, 45, 80, 200):
        assert results_db.t975(df) == pytest.approx(st.t.ppf(0.975, df), abs=3e-3)


def test_results_commands(folder, capsys):
    assert main(["results", "query", "SELECT policy, count(*) AS n FROM runs GROUP BY policy ORDER BY policy",
                 "--dir", str(folder), "--csv"]) == 0
    out = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert out == [["policy", "n"], ["rr", "2"], ["sa", "2"]]
    assert main(["results", "summary", "--dir", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "load_spread_cv" in text and "±" in text and "sa" in text
    assert main(["results", "query", "SELECT nope FROM runs", "--dir", str(folder)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["results", "summary", "--dir", str(folder / "missing")]) == 2
