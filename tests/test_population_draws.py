"""The population's draws equal the numpy calls they stand for, value for value and stream for stream."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twin.fleet_config import LengthConfig
from twin.models.population import LengthDraw


@pytest.mark.parametrize(("mean", "sigma", "lo", "hi"), [(150, 1.0, 1, 8000), (400, 0.8, 1, 4096), (3000, 0.0, 1, 10**6),
                                                         (20, 2.5, 1, 50)])
def test_length_draw_is_numpys_lognormal(mean, sigma, lo, hi) -> None:
    cfg = LengthConfig(mean=mean, sigma=sigma, min=lo, max=hi)
    draw = LengthDraw(cfg)
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    mu = math.log(cfg.mean) - cfg.sigma**2 / 2.0
    for _ in range(20_000):
        want = int(min(max(round(a.lognormal(mu, cfg.sigma)), cfg.min), cfg.max))
        assert draw(b) == want
    assert a.random() == b.random()  # the streams are at the same place


@pytest.mark.parametrize("sigma", [0.0, 0.3, 1.0, 2.5])
def test_lognormal_is_exp_of_mu_plus_sigma_times_a_standard_normal(sigma) -> None:
    """The identity LengthDraw relies on, on the raw floats (a rounded length would hide a last-bit change)."""
    mu = math.log(400) - sigma**2 / 2.0
    a, b = np.random.default_rng(11), np.random.default_rng(11)
    want = [a.lognormal(mu, sigma) for _ in range(50_000)]
    got = [math.exp(mu + sigma * b.standard_normal()) for _ in range(50_000)]
    assert got == want
