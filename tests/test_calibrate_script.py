"""scripts/calibrate-cpu.sh lists each built-in set with an inline Python snippet; a rename in
twin.calibration once broke it silently (every recording skipped, the fit then failed). This runs the
snippet as the script does, for every set it records, without vLLM."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "calibrate-cpu.sh"


def test_the_scripts_set_listing_runs_for_the_sets_it_records() -> None:
    text = SCRIPT.read_text()
    snippet = re.search(r'-c "([^"]*SETS[^"]*)"', text).group(1)
    recorded = re.findall(r"^\s*record_set (\S+) ", text, flags=re.M)
    assert recorded, "the script records no set"
    for name in sorted(set(recorded)):
        out = subprocess.run([sys.executable, "-c", snippet.replace("$set", name)], capture_output=True,
                             text=True, check=True).stdout.split()
        assert out, f"set {name!r} lists no workload"
