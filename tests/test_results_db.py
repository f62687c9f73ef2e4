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


def test_load_spread_matches_a_direct_computation(folder):
    con = results_db.connect(folder)
    rows = {r["run_hash"]: r for r in results_db.per_run(con)}
    for h, r in rows.items():
        scopes = [s for s in pq.read_table(folder / "runs" / h / "requests.parquet")["scope"].to_pylist() if s]
        n_rep = json.loads((folder / "runs" / h / "summary.json").read_text())["fleet"]["replicas"]
        counts = np.array([scopes.count(s) for s in sorted(set(scopes))] + [0] * (n_rep - len(set(scopes))), float)
        assert r["replicas"] == n_rep
        assert r["load_spread_cv"] == pytest.approx(counts.std() / counts.mean(), rel=1e-9)
    spreads = {r["policy"]: r["load_spread_cv"] for r in rows.values()}
    assert len(set(spreads.values())) > 1


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
