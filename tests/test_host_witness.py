"""The recorder's host witness (``_vllm_common.HostWitness``): a sampling process on a core the engine's model does
not use, its samples cut to a run's window, nothing left running after it; shown under each run by fidelity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twin.calibration import _vllm_common as common
from twin.calibration.fidelity import MEASURED_WORKLOAD_FIELDS

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="the witness needs a CPU free of the model's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@needs_two
def test_samples_within_the_window_on_the_other_cpus(tmp_path):
    w = common.HostWitness(sys.executable, CPUS[:1], tmp_path)
    assert w.cpus == CPUS[1:]
    time.sleep(0.8)  # numpy's import and the first sum are over before the window opens
    t0 = time.monotonic()
    time.sleep(1.6)
    t1 = time.monotonic()
    pid = w.proc.pid
    r = w.result(t0, t1)
    assert "error" not in r, r
    assert r["cpus"] == CPUS[1:] and r["period_s"] == common.WITNESS_PERIOD_S
    assert r["buffer_mb"] == common.WITNESS_BUFFER_MB
    assert 2 <= r["samples"] <= 4  # one every 0.5 s in 1.6 s (3 or 4; 2 if the machine is busy)
    assert r["samples"] == len(r["t_s"]) == len(r["ms"]) == len(r["cpu_ms"])
    assert all(0 <= t <= t1 - t0 for t in r["t_s"]) and r["t_s"] == sorted(r["t_s"])
    assert all(m > 0 for m in r["ms"]) and sorted(r["ms"])[len(r["ms"]) // 2] == r["median_ms"]
    assert not _alive(pid)  # stopped
    assert not list(tmp_path.iterdir())  # its sample file removed


@needs_two
def test_a_window_without_samples_is_an_error_not_a_failure(tmp_path):
    w = common.HostWitness(sys.executable, CPUS[:1], tmp_path)
    r = w.result(0.0, 1.0)  # long before this process started
    assert set(r) == {"error"} and r["error"].startswith("no samples during the run")


def test_no_free_cpu_no_process(tmp_path):
    for engine_cpus in (CPUS, []):  # every CPU the model's; no bound thread found
        w = common.HostWitness(sys.executable, engine_cpus, tmp_path)
        assert w.proc is None
        assert w.result(0.0, 1e9) == {"error": "no CPU free of the engine's model workers"}


@needs_two
def test_the_witness_stops_when_its_recorder_dies(tmp_path):
    """A recording killed mid-run (the worker's group is killed by record.py, but a crash may not be) leaves no
    sampling process behind: it watches its parent."""
    code = (f"import sys, time; sys.path.insert(0, {str(Path(common.__file__).parent)!r}); import _vllm_common as c; "
            f"from pathlib import Path; w = c.HostWitness(sys.executable, [{CPUS[0]}], Path({str(tmp_path)!r})); "
            "print(w.proc.pid, flush=True); time.sleep(0.6)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_passes_with_different_witnesses_are_repeats():
    assert "host_witness" in MEASURED_WORKLOAD_FIELDS


def test_fidelity_prints_the_witness_under_a_run(tmp_path):
    from twin.calibration.fidelity import fidelity, format_table

    src = Path(__file__).parent / "fixtures" / "calibration" / "cpu-tiny-llama-avx2-3"
    run = src / "held-out" / "heldout-offline-kv-prefix"
    dst = tmp_path / "run"
    dst.mkdir()
    for f in run.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    meta = json.loads((dst / "run.json").read_text())
    meta["workload"]["host_witness"] = {"cpus": [1], "period_s": 0.5, "buffer_mb": 32, "median_ms": 2.345,
                                        "median_cpu_ms": 2.3, "samples": 1, "t_s": [0.1], "ms": [2.345],
                                        "cpu_ms": [2.3]}
    (dst / "run.json").write_text(json.dumps(meta))
    rep = fidelity([dst], profile=str(src / "cpu-tiny-llama.yaml"), noise=False)
    assert rep["runs"][0]["step_level"]["host_witness_ms"] == 2.345
    assert "; host witness 2.35 ms" in format_table(rep)
    plain = fidelity([run], profile=str(src / "cpu-tiny-llama.yaml"), noise=False)
    assert plain["runs"][0]["step_level"]["host_witness_ms"] is None
    assert "host witness" not in format_table(plain)
