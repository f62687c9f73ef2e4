"""The fitted step-time noise (profile ``step_time_noise``; docs/calibration.md): what calibrate stores, and
how replays use it (opt-in, seeded; without it a replay is as before)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.calibration.recorded import load_recorded_run
from twin.engine_profiles import load_profile
from twin.engine_profiles.step import StepShape
from twin.engine_profiles.step_time import LinearStepTimeModel
from twin.replay import NoisyStepTimes, replay

QUIET = Path(__file__).resolve().parent / "fixtures" / "calibration" / "cpu-tiny-llama-quiet"
PROFILE = str(QUIET / "cpu-tiny-llama.yaml")
OFFLINE = QUIET / "held-out" / "heldout-offline-kv-prefix"
SERVER = QUIET / "held-out" / "heldout-server-bursty"


def _step_times(result) -> list[float]:  # noqa: ANN001
    return list(result.tables["iterations"].to_pydict()["elapsed_ms"])


def test_the_fitted_noise_is_the_calibration_residual_distribution() -> None:
    spec = load_profile(PROFILE).spec
    noise = spec.step_time_noise
    assert noise is not None and spec.server is not None and spec.server.step_time_noise is not None
    assert noise.num_samples["decode"] + noise.num_samples["prefill"] == (
        spec.fit_quality.decode.num_samples + spec.fit_quality.prefill.num_samples)
    for q in (noise.decode, noise.prefill):
        assert len(q) == 101 and q == sorted(q)
        assert 0.8 < q[50] < 1.2 and q[90] > 1.1 and q[10] < 0.95  # spread around the fit, not a point


def test_noisy_replay_is_deterministic_and_differs_from_the_deterministic_one() -> None:
    for run in (OFFLINE, SERVER):
        rec = load_recorded_run(run)
        a = replay(rec, profile=PROFILE, noise=True)
        b = replay(rec, profile=PROFILE, noise=True)
        off = replay(rec, profile=PROFILE, noise=False)
        assert _step_times(replay(rec, profile=PROFILE)) == _step_times(a)  # on by default, the profile has the table
        assert a.ok and b.ok and off.ok
        assert _step_times(a) == _step_times(b)
        assert _step_times(a) != _step_times(off)
        assert a.tables["requests"].equals(b.tables["requests"])


def test_a_profile_without_noise_replays_as_before(tmp_path: Path) -> None:
    import yaml

    data = yaml.safe_load(Path(PROFILE).read_text())
    data.pop("step_time_noise")
    data["server"].pop("step_time_noise")
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(data, sort_keys=False))
    rec = load_recorded_run(OFFLINE)
    # the default (noise where the profile has a table) is deterministic without one
    assert _step_times(replay(rec, profile=str(bare))) == _step_times(replay(rec, profile=PROFILE, noise=False))
    assert _step_times(replay(rec, profile=str(bare))) != _step_times(replay(rec, profile=PROFILE))
    with pytest.raises(ValueError, match="step_time_noise"):
        replay(rec, profile=str(bare), noise=True)


def test_noisy_step_times_scale_model_execution_only() -> None:
    prof = load_profile(PROFILE)
    base = prof.step_time_model()
    assert isinstance(base, LinearStepTimeModel)
    const = prof.spec.step_time_noise.model_copy(update={"decode": [2.0] * 101, "prefill": [3.0] * 101})
    m = NoisyStepTimes(base, const, seed=1, fixed_s=lambda n: base.overhead_s)
    dec = StepShape(decode_requests=4, decode_context_tokens=400, prefill_requests=0, prefill_tokens=0,
                    prefill_attention_pairs=0)
    o = base.overhead_s
    assert m.step_time_s(dec) == pytest.approx(o + 2.0 * (base.step_time_s(dec) - o))
    run = m.decode_run_s(4, 400, 5)
    np.testing.assert_allclose(run, o + 2.0 * (base.decode_run_s(4, 400, 5) - o))
