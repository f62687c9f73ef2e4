"""Sweeps: expansion, one folder per run, skip on rerun, retry of failed runs, common random numbers,
bad specs (exit 2 naming the field), and the same runs on a dask cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from twin.cli import main
from twin.sweep import SweepSpec, expand, flatten_summary, run_hash, run_sweep

SMALL = ["fleet.scale=0.002", "fleet.traffic.duration_s=10"]


def tiny_spec(**extra) -> SweepSpec:
    raw = {"name": "tiny", "scenarios": ["scenarios/baseline-day.yaml"],
           "policies": {"rr": {"kind": "round_robin"}, "pa": {"kind": "prefix_affinity"}},
           "seeds": [1, 2], "overrides": SMALL}
    raw.update(extra)
    return SweepSpec.model_validate(raw)


def _first_turn_arrivals(run_dir: Path) -> list[tuple[str, float]]:
    ev = pq.read_table(run_dir / "events.parquet", columns=["t_s", "kind", "request_id"])
    ev = ev.filter(pc.equal(ev["kind"], "request.arrived"))
    rows = [(r, t) for r, t in zip(ev["request_id"].to_pylist(), ev["t_s"].to_pylist()) if r.endswith("-t0")]
    return sorted(set(rows))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    spec = tiny_spec()
    report = run_sweep(spec, out=out, workers=2, progress=False)
    return spec, out, report


def test_sweep_writes_one_complete_folder_per_run(swept):
    spec, out, report = swept
    assert (report.total, report.ran, report.skipped, report.failed) == (4, 4, 0, [])
    tasks = expand(spec)
    assert len({t.run_hash for t in tasks}) == 4
    for t in tasks:
        d = out / "tiny" / "runs" / t.run_hash
        names = {p.name for p in d.iterdir()}
        assert {"events.parquet", "levels.parquet", "requests.parquet", "replicas.parquet", "manifest.json",
                "summary.json", "run.parquet"} <= names
        assert t.run_hash == run_hash(t.config, t.seed, t.replication)
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["exception"] is None and manifest["seed"] == t.seed
        row = pq.read_table(d / "run.parquet").to_pylist()
        assert len(row) == 1
        row = row[0]
        summary = json.loads((d / "summary.json").read_text())
        assert (row["policy"], row["seed"], row["run_hash"], row["scenario"]) == (t.policy, t.seed, t.run_hash,
                                                                                  "baseline-day")
        assert row["router"] == {"rr": "round_robin", "pa": "prefix_affinity"}[t.policy]
        assert row["ttft_s_p99"] == pytest.approx(summary["ttft_s"]["p99"])
        tier = sorted(summary["by_tier"])[0]
        assert row[f"tier_{tier}_ttft_s_p99"] == pytest.approx(summary["by_tier"][tier]["ttft_s"]["p99"])
        assert row["requests_arrived"] == summary["requests"]["arrived"]


def test_policies_see_the_same_arrivals(swept):
    """Common random numbers: for one scenario and seed only the router differs, so the sessions' first
    turns arrive at the same times; another seed gives other arrivals."""
    spec, out, _ = swept
    runs = out / "tiny" / "runs"
    by = {(t.policy, t.seed): _first_turn_arrivals(runs / t.run_hash) for t in expand(spec)}
    assert len(by[("rr", 1)]) > 20
    assert by[("rr", 1)] == by[("pa", 1)]
    assert by[("rr", 2)] == by[("pa", 2)]
    assert by[("rr", 1)] != by[("rr", 2)]


def test_rerun_skips_finished_runs_and_retries_failed_ones(swept, tmp_path):
    spec, out, _ = swept
    again = run_sweep(spec, out=out, workers=0, progress=False)
    assert (again.ran, again.skipped) == (0, 4)
    # a failed run leaves only its manifest (with the exception); the next sweep runs it again
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    victim = copy / "tiny" / "runs" / expand(spec)[0].run_hash
    manifest = json.loads((victim / "manifest.json").read_text())
    for p in victim.iterdir():
        p.unlink()
    (victim / "manifest.json").write_text(json.dumps(dict(manifest, exception="RuntimeError: boom")))
    third = run_sweep(spec, out=copy, workers=0, progress=False)
    assert (third.ran, third.skipped, third.failed) == (1, 3, [])
    assert json.loads((victim / "manifest.json").read_text())["exception"] is None
    # byte-identical tables from the rerun (same scenario + seed)
    orig = out / "tiny" / "runs" / victim.name
    assert (victim / "requests.parquet").read_bytes() == (orig / "requests.parquet").read_bytes()


def test_a_failing_run_writes_its_manifest_and_exits_1(tmp_path, monkeypatch, capsys):
    import twin.runner

    def boom(*a, **k):
        raise RuntimeError("the model broke")

    monkeypatch.setattr(twin.runner, "_run_fleet", boom)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "f", "scenarios": ["scenarios/baseline-day.yaml"],
                                         "policies": {"rr": {"kind": "round_robin"}}, "seeds": 1,
                                         "overrides": SMALL, "out": str(tmp_path / "out")}))
    assert main(["sweep", str(spec_path), "--workers", "0", "--quiet"]) == 1
    assert "the model broke" in capsys.readouterr().err
    (run_dir,) = (tmp_path / "out" / "f" / "runs").iterdir()
    assert {p.name for p in run_dir.iterdir()} == {"manifest.json"}
    assert "the model broke" in json.loads((run_dir / "manifest.json").read_text())["exception"]


@pytest.mark.parametrize(("patch", "field"), [
    ({"policies": {"a": {"kind": "round_robinn"}}}, "policies"),
    ({"seeds": -1}, "seeds"),
    ({"scenarios": []}, "scenarios"),
    ({"policies": {"a": {"kind": "prefix_affinity", "prefix_blocks": 0}}}, "policies"),
    ({"bogus": 1}, "bogus"),
    ({"overrides": ["fleet.scale=17"]}, "fleet.scale"),  # above the cap of 16
])
def test_a_bad_spec_exits_2_naming_the_field(tmp_path, capsys, patch, field):
    raw = {"name": "bad", "scenarios": ["scenarios/baseline-day.yaml"], "policies": {"rr": {"kind": "round_robin"}},
           "seeds": 1, "out": str(tmp_path / "out")}
    raw.update(patch)
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert main(["sweep", str(p), "--workers", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert field in err
    assert not (tmp_path / "out").exists()


def test_two_labels_for_one_run_are_rejected():
    from twin.sweep import SpecError

    spec = tiny_spec(policies={"a": {"kind": "round_robin"}, "b": {"kind": "round_robin"}})
    with pytest.raises(SpecError, match="policies.b"):
        expand(spec)


def test_policy_overrides_and_flatten():
    spec = tiny_spec(policies={"big": {"kind": "round_robin", "overrides": ["fleet.queue.deadline_s=5"]}}, seeds=1)
    (task,) = expand(spec)
    assert task.config["fleet"]["queue"]["deadline_s"] == 5
    assert task.seed == 0
    flat = flatten_summary({"ttft_s": {"p99": 1}, "by_tier": {"free": {"x": 2.5}},
                            "outcomes_by_reason": {"cancelled:user_cancelled": 3}})
    assert flat == {"ttft_s_p99": 1.0, "tier_free_x": 2.5, "outcomes_cancelled_user_cancelled": 3.0}


def test_same_sweep_on_dask_gives_identical_runs(tmp_path):
    """A LocalCluster on loopback (two worker processes) through Client.get_executor(): the same run
    folders and the same run.parquet metrics as the local process pool (wall-clock columns aside)."""
    distributed = pytest.importorskip("distributed")
    spec = tiny_spec(seeds=[3])
    local = run_sweep(spec, out=tmp_path / "local", workers=2, progress=False)
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                                  dashboard_address=":0", worker_dashboard_address=":0") as cluster:
        remote = run_sweep(spec, out=tmp_path / "dask", scheduler=cluster.scheduler_address, progress=False)
    assert (local.ran, remote.ran, local.failed, remote.failed) == (2, 2, [], [])
    a = sorted(p.name for p in (tmp_path / "local" / "tiny" / "runs").iterdir())
    b = sorted(p.name for p in (tmp_path / "dask" / "tiny" / "runs").iterdir())
    assert a == b and len(a) == 2
    for h in a:
        ra = pq.read_table(tmp_path / "local" / "tiny" / "runs" / h / "run.parquet").to_pylist()[0]
        rb = pq.read_table(tmp_path / "dask" / "tiny" / "runs" / h / "run.parquet").to_pylist()[0]
        wall = {k for k in ra if k.endswith("wall_s")}
        assert {k: v for k, v in ra.items() if k not in wall} == {k: v for k, v in rb.items() if k not in wall}
        assert ra["requests_arrived"] > 0


def test_the_documented_spec_expands():
    """docs/sweeps.md's example spec validates, and each label gets its router and overrides."""
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "sweeps.md").read_text()
    spec = SweepSpec.model_validate(yaml.safe_load(re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)))
    tasks = expand(spec)
    assert len(tasks) == 2 * 4 * 5
    got = {(t.policy, t.config["fleet"]["policy"]["router"]["kind"]) for t in tasks}
    assert ("scenario_router", "llm_d_scorer") in got and ("pa_tight", "prefix_affinity") in got
    short = [t for t in tasks if t.policy == "pa_short_queue"]
    assert short and all(t.config["fleet"]["queue"]["deadline_s"] == 10 for t in short)
