"""Skip markers for tests that read the shared data folder (``../shared`` beside the repository, or
``$TWIN_SHARED``; ``twin.paths.shared_dir``). The repository does not carry it, so a clone without it skips these
tests, each saying what it needs (README, docs/traces.md)."""

from __future__ import annotations

import pytest

from twin.models.traces import TRACE_NAMES, missing_trace_files
from twin.paths import shared_dir

needs_calibration_data = pytest.mark.skipif(not (shared_dir() / "calibration/raw").is_dir(),
                                            reason="needs ../shared calibration data")
needs_traces = pytest.mark.skipif(
    any(missing_trace_files(t) for t in TRACE_NAMES) or not (shared_dir() / "traces" / "stats.json").is_file(),
    reason="needs the public traces in ../shared/traces (or $TWIN_SHARED)")
