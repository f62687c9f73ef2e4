"""The diagnostic workload `diag-decode-context` (twin.calibration.workload_sets.DIAGNOSTIC) and its four
committed recordings (tests/fixtures/calibration/cpu-tiny-llama-diag-decode-context): recordable by name, in no
calibration session, and replayed step for step by the twin."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from twin.calibration.calibrate import composition_mismatch, replay_recorded, run_samples
from twin.calibration.recorded import load_recorded_run
from twin.calibration.workload_sets import DIAGNOSTIC, get_workload, session_plan

DIAG = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-diag-decode-context"
REPEATS = [DIAG / f"repeat{i}" for i in range(1, 5)]


def test_the_workload_is_recordable_by_name_and_in_no_session() -> None:
    assert get_workload("diag-decode-context") is DIAGNOSTIC["diag-decode-context"]
    assert all(name not in DIAGNOSTIC for _, name in session_plan(4))


def test_the_recordings_hold_the_batch_while_the_context_varies_and_replay_exactly() -> None:
    for path in REPEATS:
        rec = load_recorded_run(path)
        result, _ = replay_recorded(rec, overhead_s=0.0)
        assert composition_mismatch(rec, result) is None, path.name
        s = run_samples(rec)
        at8 = np.array([q.decode_context_tokens for q in s.shapes if q.is_decode_only and q.decode_requests == 8])
        # what the workload is for: most decode steps at the held batch, over a ~2x range of context
        assert at8.size > 600 and np.quantile(at8, 0.95) > 1.6 * np.quantile(at8, 0.05), path.name
