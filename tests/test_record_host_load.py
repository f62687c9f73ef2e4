"""The machine's other load during a server recording (``_vllm_common.load_snapshot`` / ``load_during``, run.json
``workload.host_load``): a process busy beside a server recording slows its steps ~2x (docs/calibration-sessions.md,
"The engine core's core"), so the recorder says whether one was. No vLLM here."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from twin.calibration._vllm_common import load_during, load_snapshot
from twin.calibration.recorded import load_recorded_run

FIXTURES = Path(__file__).parent / "fixtures" / "recorded"


def test_the_other_load_is_the_cpus_busy_time_less_the_recordings_own() -> None:
    before = {"t": 100.0, "busy": {0: 50.0, 1: 80.0}, "own": 20.0}
    after = {"t": 104.0, "busy": {0: 54.0, 1: 84.0}, "own": 25.0}  # both CPUs busy all along, 5 s of it the recording's
    load = load_during(before, after)
    assert load["wall_s"] == 4.0 and load["busy_share"] == {"0": 1.0, "1": 1.0}
    assert load["own_cores"] == 1.25 and load["other_cores"] == 0.75
    quiet = load_during(before, {**after, "busy": {0: 54.0, 1: 81.0}})  # the recording's own 5 s are all the CPUs did
    assert quiet["other_cores"] == 0.0
    assert "error" in load_during({**before, "busy": {}}, after)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc (Linux)")
def test_a_busy_recording_process_counts_as_its_own_load() -> None:
    before = load_snapshot(os.getpgid(0))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # this process (the client's place) busy on one core
        pass
    load = load_during(before, load_snapshot(os.getpgid(0)))
    assert set(load["busy_share"]) == {str(c) for c in range(len(load["busy_share"]))}
    assert load["own_cores"] > 0.6 and load["other_cores"] >= 0.0


def test_a_runs_other_load_shows_in_its_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "server-poisson-low", run_dir)
    assert load_recorded_run(run_dir).other_load_cores is None  # recorded before the field existed
    run = json.loads((run_dir / "run.json").read_text())
    run["workload"]["host_load"] = {"wall_s": 6.06, "busy_share": {"0": 0.998, "1": 1.0}, "own_cores": 1.191,
                                    "other_cores": 0.807}
    (run_dir / "run.json").write_text(json.dumps(run))
    rec = load_recorded_run(run_dir)
    assert rec.other_load_cores == pytest.approx(0.807)
    assert rec.summary().endswith(", other processes 0.81 cores")
