"""``twin.policies`` must import in a production router without the simulator's heavy dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = ("simpy", "pandas", "streamlit", "twin.models")

PROBE = """
import sys
import twin.policies
from twin.policies import build_router
build_router({"kind": "long_context_pool", "inner": {"kind": "llm_d_scorer"}}, seed=1)
forbidden = %r
bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
print(",".join(bad))
""" % (FORBIDDEN,)


def test_policies_import_pulls_in_no_simulator_modules() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"twin.policies imported: {done.stdout.strip()}"


def test_probe_detects_a_forbidden_import() -> None:
    """The probe itself can fail: importing simpy first must be reported."""
    probe = "import simpy\n" + PROBE
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "simpy" in done.stdout.strip().split(",")
