"""Determinism, Little's law and an M/G/1 degenerate case against queueing theory."""

from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq

from twin.runner import run_scenario
from twin.scenario import parse_scenario


def _scenario(**over):
    raw = {
        "name": "theory", "seed": 3,
        "workload": {"kind": "synthetic", "num_requests": 400, "arrival": {"kind": "poisson", "rate_per_s": 8.0},
                     "prompt_tokens": {"kind": "lognormal", "mean": 400, "sigma": 0.7, "max": 3000},
                     "output_tokens": {"kind": "exponential", "mean": 60},
                     "shared_prefix": {"groups": 3, "tokens": 128, "fraction": 0.6}},
        "replica": {"step_time": {"kind": "fixed", "overhead_s": 0.002, "step_s": 0.01, "prefill_token_s": 3e-5,
                                  "decode_token_s": 2e-4, "context_token_s": 1e-7},
                    "engine": {"num_gpu_blocks": 600, "max_num_batched_tokens": 512, "max_num_seqs": 32,
                               "max_model_len": 4096}},
    }
    raw.update(over)
    return parse_scenario(raw)


def test_same_seed_identical_tables_other_seed_differs():
    sc = _scenario()
    a, b = run_scenario(sc), run_scenario(sc)
    for name in ("events", "levels", "requests"):
        assert _parquet_bytes(a.tables[name]) == _parquet_bytes(b.tables[name]), name
    c = run_scenario(sc, seed=4)
    assert not a.tables["requests"].equals(c.tables["requests"])


def _parquet_bytes(table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_replications_are_independent_streams():
    sc = _scenario()
    a, b = run_scenario(sc, replication=0), run_scenario(sc, replication=1)
    assert not a.tables["requests"].equals(b.tables["requests"])


def test_littles_law_holds_on_a_run_that_starts_and_ends_empty():
    res = run_scenario(_scenario())
    assert res.ok
    s = res.summary
    levels = res.world.rec.level_means(s["sim_time_s"])
    in_system = levels[("replica", "running")] + levels[("replica", "waiting")]
    req = res.tables["requests"].to_pydict()
    e2e = np.array(req["e2e_s"])
    lam = len(e2e) / s["sim_time_s"]
    # requests enter at arrival (level updated at submit) and leave at finish: L = lambda * W exactly
    assert s["preemptions"] >= 0
    assert abs(in_system - lam * e2e.mean()) / in_system < 1e-6


def test_mg1_queue_wait_matches_pollaczek_khinchine():
    """max_num_seqs=1 and a fixed step time make a replica an M/G/1 queue with geometric service.

    Service of a request with x output tokens = x steps of 10 ms (first step = prefill + first token).
    x ~ Geometric(p=1/100) on {1, 2, ...}: E[S] = 1 s, E[S^2] = 1e-4 (2-p)/p^2 = 1.99 s^2.
    Pollaczek-Khinchine: Wq = lambda E[S^2] / (2 (1 - rho)). Sync scheduling admits an arrival only at the
    next step boundary, adding half a step on average. Tolerance: 3 standard errors over replications.
    """
    lam, step = 0.6, 0.01
    sc = _scenario(workload={"kind": "synthetic", "num_requests": 6000,
                             "arrival": {"kind": "poisson", "rate_per_s": lam},
                             "prompt_tokens": {"kind": "constant", "value": 16},
                             "output_tokens": {"kind": "exponential", "mean": 100, "min": 1, "max": 100000}},
                   replica={"step_time": {"kind": "fixed", "step_s": step},
                            "engine": {"num_gpu_blocks": 20000, "max_num_seqs": 1, "max_num_batched_tokens": 2048,
                                       "max_model_len": 200000, "enable_prefix_caching": False}})
    p = 1 / 100
    es, es2 = 100 * step, step**2 * (2 - p) / p**2
    rho = lam * es
    theory = lam * es2 / (2 * (1 - rho)) + step / 2
    means = []
    for rep in range(6):
        res = run_scenario(sc, replication=rep)
        q = np.array(res.tables["requests"].column("queue_s").to_pylist())
        means.append(q[500:].mean())  # drop the warm-up from an empty system
    m, se = np.mean(means), np.std(means, ddof=1) / np.sqrt(len(means))
    assert abs(m - theory) < 3 * se + 0.02 * theory, (m, se, theory)
