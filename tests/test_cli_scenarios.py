"""The run/validate commands: outputs, failures that keep their manifest, bad input -> exit 2."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.cli import main
from twin.models.traces import missing_trace_files

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))

SMALL = {
    "name": "small", "seed": 1,
    "workload": {"kind": "synthetic", "num_requests": 30, "arrival": {"kind": "poisson", "rate_per_s": 5.0},
                 "prompt_tokens": {"kind": "uniform", "low": 10, "high": 300},
                 "output_tokens": {"kind": "constant", "value": 20}},
    "replica": {"step_time": {"kind": "fixed", "step_s": 0.01, "prefill_token_s": 1e-5},
                "engine": {"num_gpu_blocks": 200, "max_model_len": 1024, "max_num_batched_tokens": 256}},
}


def _write(tmp_path: Path, raw, name="s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw), encoding="utf-8")
    return p


def test_run_writes_every_table_and_summary(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(_write(tmp_path, SMALL)), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["events.parquet", "levels.parquet", "manifest.json", "requests.parquet", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("requests", "ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s", "output_tokens_per_s", "goodput_rps",
                "slo_attainment", "prefix_cache_hit_rate", "preemptions", "kv_usage_mean", "sim_time_s", "wall_s"):
        assert key in summary, key
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s"):
        assert set(summary[key]) >= {"p50", "p90", "p95", "p99", "mean"}
    assert summary["requests"]["arrived"] == 30 == summary["requests"]["completed"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["exception"] is None and manifest["seed"] == 1 and manifest["config"]["name"] == "small"
    assert pq.read_table(out / "requests.parquet").num_rows == 30
    assert "ttft_s" in capsys.readouterr().out


def test_set_overrides_are_validated_and_applied(tmp_path, capsys):
    p = _write(tmp_path, SMALL)
    out = tmp_path / "o"
    assert main(["run", str(p), "--out", str(out), "--set", "workload.num_requests=7", "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["requests"]["arrived"] == 7
    assert main(["run", str(p), "--out", str(tmp_path / "x"), "--set", "workload.num_requestz=7"]) == 2
    assert "workload.num_requestz" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_block_count_no_machine_has_is_a_scenario_error(tmp_path, capsys):
    """The fuzz test below once drew num_gpu_blocks 1,838,534,478: the twin's per-block state (~16 bytes each, up
    front) exhausted memory and the run was killed. It is refused as bad input now, naming the field."""
    p = _write(tmp_path, SMALL)
    for n, rc in ((1_838_534_478, 2), (50_000_001, 2), (4096, 0)):
        out = tmp_path / f"o{n}"
        assert main(["run", str(p), "--out", str(out), "--set", f"replica.engine.num_gpu_blocks={n}", "--quiet"]) == rc
        if rc == 2:
            assert "replica.engine.num_gpu_blocks" in capsys.readouterr().err


def test_failed_run_leaves_its_manifest(tmp_path, capsys):
    raw = copy.deepcopy(SMALL)
    # a KV pool too small for the longest prompt: the engine cannot schedule it and the run fails
    raw["replica"]["engine"].update(num_gpu_blocks=3, max_model_len=1024)
    raw["workload"]["prompt_tokens"] = {"kind": "constant", "value": 900}
    out = tmp_path / "failed"
    assert main(["run", str(_write(tmp_path, raw)), "--out", str(out)]) == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["exception"] and "nothing can be scheduled" in manifest["exception"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r["workload"].update(num_requets=3), "workload.num_requets"),
    (lambda r: r["workload"]["arrival"].update(rate_per_s=-1), "workload.arrival.rate_per_s"),
    (lambda r: r["replica"]["engine"].update(max_num_seqs="many"), "replica.engine.max_num_seqs"),
    # block 0 is the null block: one block used to pass validation and fail the run (found by the fuzz test below)
    (lambda r: r["replica"]["engine"].update(num_gpu_blocks=1), "replica.engine.num_gpu_blocks"),
    (lambda r: r["replica"].update(step_time={"kind": "profile", "profile": "llama3-70b-fp9-tp4-h100"}),
     "replica.step_time.profile"),
    (lambda r: r["workload"]["arrival"].update(kind="poison"), "workload.arrival"),
    (lambda r: r.pop("name"), "name"),
])
def test_bad_file_names_the_field_and_exits_2(tmp_path, capsys, mutate, field):
    raw = copy.deepcopy(SMALL)
    mutate(raw)
    out = tmp_path / "out"
    assert main(["run", str(_write(tmp_path, raw)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
    assert not out.exists()
    assert main(["validate", str(tmp_path / "s.yaml")]) == 2


def test_yaml_syntax_error_is_exit_2(tmp_path, capsys):
    assert main(["validate", str(_write(tmp_path, "name: [unclosed\n"))]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_shipped_scenario_validates_and_runs_a_short_horizon(path, tmp_path):
    assert main(["validate", str(path)]) == 0
    out = tmp_path / "out"
    raw = yaml.safe_load(path.read_text())
    trace_name = (raw.get("workload") or {}).get("trace") or (
        ((raw.get("fleet") or {}).get("traffic") or {}).get("trace") or {}).get("trace")
    if trace_name and missing_trace_files(trace_name):  # the public traces live in ../shared (docs/traces.md)
        pytest.skip(f"needs the trace {trace_name} from ../shared/traces (or $TWIN_SHARED)")
    if "fleet" in raw:
        trace = raw["fleet"].get("traffic", {}).get("kind") == "trace_replay"
        short = ["--set", "fleet.traffic.trace.max_requests=40" if trace else "fleet.traffic.duration_s=5",
                 "--set", "fleet.scale=0.002"]
    else:
        short = (["--set", "workload.num_requests=60"] if raw["workload"]["kind"] == "synthetic"
                 else ["--set", "workload.max_requests=60"])
    assert main(["run", str(path), "--out", str(out), "--quiet", "--set", "horizon_s=20", *short]) == 0
    assert (out / "summary.json").exists()


# ---- fuzz: mutated scenarios either run cleanly or exit 2 with a message ------------------------------
def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


def _get_parent(raw, path):
    node = raw
    for k in path[:-1]:
        node = node[k]
    return node


@st.composite
def mutated(draw):
    raw = copy.deepcopy(SMALL)
    raw["workload"]["num_requests"] = 8
    paths = list(_paths(raw))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(raw))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _get_parent(raw, path)
        key = path[-1]
        op = draw(st.sampled_from(["drop", "retype", "negate", "rename", "garble"]))
        if op == "drop":
            parent.pop(key)
        elif op == "retype":
            parent[key] = draw(st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2), st.none(),
                                         st.booleans(), st.floats(allow_nan=True)))
        elif op == "negate" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
            parent[key] = -parent[key]
        elif op == "rename":
            parent[key + draw(st.sampled_from(["s", "_", "x"]))] = parent.pop(key)
        elif op == "garble":
            parent[key] = draw(st.text(min_size=1, max_size=8))
    text = yaml.safe_dump(raw)
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]  # truncate
    return text


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutated())
def test_fuzzed_scenarios_run_cleanly_or_exit_2(tmp_path, text):
    p = tmp_path / "fuzz.yaml"
    p.write_text(text, encoding="utf-8")
    out = tmp_path / "fuzz-out"
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "twin", "run", str(p), "--out", str(out), "--quiet",
                           "--set", "horizon_s=30"], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode == 0:
        assert (out / "summary.json").exists() and (out / "manifest.json").exists()
    else:
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        assert proc.stderr.strip()
        assert not out.exists()
