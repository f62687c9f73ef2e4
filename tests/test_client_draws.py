"""The client's batched length draws give the lengths, in order, that one numpy call per draw gave."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import simpy

from twin.fleet_config import LengthConfig
from twin.models.client import NORMALS_BATCH, Clients
from twin.models.population import LengthDraw
from twin.rng import stream


def test_batched_standard_normals_are_the_single_draws() -> None:
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    single = [a.standard_normal() for _ in range(3 * NORMALS_BATCH + 7)]
    batched: list[float] = []
    while len(batched) < len(single):
        batched.extend(b.standard_normal(NORMALS_BATCH).tolist())
    assert batched[:len(single)] == single


def test_draw_length_matches_one_lognormal_draw_per_call() -> None:
    fields = {"message_tokens": LengthConfig(mean=150, sigma=1.0, min=1, max=8000),
              "output_tokens": LengthConfig(mean=400, sigma=0.8, min=1, max=4096),
              "long_context_tokens": LengthConfig(mean=30000, sigma=0.5, min=1000, max=120000)}
    world = SimpleNamespace(env=simpy.Environment(), cfg=SimpleNamespace(traffic=SimpleNamespace(**fields)))
    clients = Clients(world, seed=11, replication=2)
    ref_rng = stream(11, 2, "workload.lengths")
    ref = {k: LengthDraw(v) for k, v in fields.items()}
    order = ["message_tokens", "output_tokens", "output_tokens", "long_context_tokens", "message_tokens"]
    for i in range(4 * NORMALS_BATCH + 3):  # across several refills
        field = order[i % len(order)]
        assert clients._draw_length(field) == ref[field](ref_rng)
