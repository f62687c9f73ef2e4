"""``FitOptions.server_scaled_offline`` / ``twin calibrate --server-scaled-offline``: the server section's step time
is the offline fit's regimes times one factor, the median of measured over offline-predicted model time of the
server runs' steps (docs/calibration-sessions.md, "The server section from the offline terms")."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.paths import REPO_ROOT

from serverkit import calibrate_with_flag, server_speed

SESSION = REPO_ROOT / "tests" / "fixtures" / "calibration" / "cpu-tiny-llama-freshhost2"
RUNS = sorted(p for p in (SESSION / "calibration").iterdir() if (p / "run.json").exists())


def test_the_server_regimes_are_the_offline_ones_times_the_median_ratio() -> None:
    plain = calibrate(RUNS, name="t", command="test", generated_on="test").spec
    scaled = calibrate(RUNS, name="t", command="test", generated_on="test",
                       options=FitOptions(server_scaled_offline=True)).spec
    assert scaled.step_time == plain.step_time  # the offline fit is untouched
    off, srv = scaled.step_time, scaled.server.step_time
    ratios = [getattr(getattr(srv, regime), k) / v for regime in ("decode", "prefill")
              for k, v in getattr(off, regime).model_dump().items() if v]
    assert len(ratios) >= 6 and max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    # the factor is the median of measured / predicted over the server runs' reconstructed steps
    assert ratios[0] == pytest.approx(server_speed(off, RUNS), rel=1e-12)
    # the front end (arrival, per step, per chunk) is fitted as without the option
    assert srv.overhead_s == plain.server.step_time.overhead_s
    assert scaled.server.per_chunk_s == plain.server.per_chunk_s and scaled.server.arrival_s == plain.server.arrival_s
    assert "server_scaled_offline" in scaled.server.provenance.notes


def test_the_cli_flag_writes_it_into_the_profile_and_its_command(tmp_path: Path) -> None:
    spec = calibrate_with_flag(tmp_path, RUNS, "--server-scaled-offline")
    d, s = spec.step_time.decode, spec.server.step_time.decode
    assert s.per_request_s / d.per_request_s == pytest.approx(s.base_s / d.base_s, rel=1e-12)
