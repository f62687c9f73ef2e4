"""The production-router example in docs/ runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "examples" / "production_router.py"


def test_production_router_example_runs() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    turn1 = next(line for line in lines if line.startswith("turn 1 -> "))
    turn2 = next(line for line in lines if line.startswith("turn 2 -> "))
    assert turn1.split()[3] == turn2.split()[3], "the follow-up turn must reach the replica holding its prefix"
    assert "long prompt -> fleet.us-east.node03.r1" in done.stdout
