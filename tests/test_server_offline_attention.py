"""``FitOptions.server_offline_attention`` / ``twin calibrate --server-offline-attention``: the server section's
attention term is the offline fit's times the server runs' speed against the offline model, the other server terms
fitted on the server runs (docs/calibration-sessions.md, "The server fit's attention term from the offline fit")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.calibrate import FitOptions, calibrate
from twin.engine_profiles.fit import fit_step_time
from twin.engine_profiles.step import StepShape
from twin.paths import REPO_ROOT

from serverkit import calibrate_with_flag, server_speed

SESSION = REPO_ROOT / "tests" / "fixtures" / "calibration" / "cpu-tiny-llama-sendorder"
RUNS = sorted(p for p in (SESSION / "calibration").iterdir() if (p / "run.json").exists())


def test_a_fixed_attention_term_is_kept_and_the_others_recovered() -> None:
    """Durations made by known prefill terms: with the attention term fixed at its true value the fit gives the
    other terms back; fixed at twice it, the fit keeps that value and the others move."""
    rng = np.random.default_rng(7)
    shapes, y = [], []
    for _ in range(200):
        p_tok, prefix, d = int(rng.integers(16, 600)), int(rng.integers(0, 1024)), int(rng.integers(0, 8))
        pairs = p_tok * prefix + p_tok * (p_tok + 1) // 2
        ctx = d * int(rng.integers(50, 400))
        shapes.append(StepShape(decode_requests=d, decode_context_tokens=ctx, prefill_requests=1,
                                prefill_tokens=p_tok, prefill_attention_pairs=pairs))
        y.append(0.004 + 2e-5 * (p_tok + d) + 8e-9 * pairs + 1.5e-7 * ctx)
    for i in range(40):  # a decode regime to fit beside it
        shapes.append(StepShape(decode_requests=1 + i % 8, decode_context_tokens=300 * (1 + i % 8)))
        y.append(0.003 + 1e-4 * (1 + i % 8) + 1e-7 * 300 * (1 + i % 8))
    right = fit_step_time(shapes, y, overhead_s=0.0, fixed_attention_pair_s=8e-9).coefficients.prefill
    assert right.per_attention_pair_s == 8e-9
    assert (right.base_s, right.per_token_s, right.per_decode_context_token_s) == pytest.approx((0.004, 2e-5, 1.5e-7),
                                                                                              rel=1e-6)
    wrong = fit_step_time(shapes, y, overhead_s=0.0, fixed_attention_pair_s=16e-9).coefficients.prefill
    assert wrong.per_attention_pair_s == 16e-9 and wrong.per_token_s != pytest.approx(2e-5, rel=1e-3)
    with pytest.raises(ValueError, match=">= 0"):
        fit_step_time(shapes, y, overhead_s=0.0, fixed_attention_pair_s=-1e-9)


def test_the_server_attention_term_is_the_offline_one_times_the_server_speed() -> None:
    plain = calibrate(RUNS, name="t", command="test", generated_on="test").spec
    fixed = calibrate(RUNS, name="t", command="test", generated_on="test",
                      options=FitOptions(server_offline_attention=True)).spec
    assert fixed.step_time == plain.step_time  # the offline fit is untouched
    # the speed: median of measured / offline-predicted model time over the server runs' prefill steps
    speed = server_speed(plain.step_time, RUNS, prefill_only=True)
    srv = fixed.server.step_time
    assert srv.prefill.per_attention_pair_s == pytest.approx(plain.step_time.prefill.per_attention_pair_s * speed,
                                                             rel=1e-12)
    assert srv.prefill.per_attention_pair_s != pytest.approx(plain.server.step_time.prefill.per_attention_pair_s,
                                                             rel=0.2)
    # the decode regime and the front end are fitted as without the option
    assert srv.decode == plain.server.step_time.decode and srv.overhead_s == plain.server.step_time.overhead_s
    assert fixed.server.arrival_s == plain.server.arrival_s and fixed.server.per_chunk_s == plain.server.per_chunk_s
    assert "server_offline_attention" in fixed.server.provenance.notes


def test_the_cli_flag_writes_it_into_the_profile_and_its_command(tmp_path: Path) -> None:
    spec = calibrate_with_flag(tmp_path, RUNS, "--server-offline-attention")
    assert spec.server.step_time.prefill.per_attention_pair_s > 1.5 * 4.155e-9  # the plain fit's, this session
