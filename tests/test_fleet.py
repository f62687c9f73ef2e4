"""The whole request path: invariants under hypothesis-chosen seeds and sizes, determinism, and behaviours."""

from __future__ import annotations

import collections
import copy
import io

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.models.population import sessions
from twin.runner import run_scenario
from twin.scenario import ScenarioError, parse_scenario

BASE = {
    "name": "fleet-test", "seed": 1,
    "fleet": {
        "topology": {"regions": [
            {"name": "us-east", "share": 0.6, "pools": [{"model": "large", "nodes": 1}]},
            {"name": "eu-west", "share": 0.4, "pools": [{"model": "large", "nodes": 1},
                                                          {"model": "small", "nodes": 1}]}]},
        "models": {"large": {"profile": "llama3-70b-fp8-tp4-h100",
                             "engine": {"max_model_len": 32768, "num_gpu_blocks": 3000, "max_num_seqs": 64}},
                   "small": {"profile": "llama3-8b-bf16-tp1-h100",
                             "engine": {"max_model_len": 16384, "num_gpu_blocks": 2000, "max_num_seqs": 32}}},
        "traffic": {"daily_users": 10_000_000, "turns_per_user": 15, "scale": 0.0004, "duration_s": 20,
                    "think_time_s": 2.0, "classes": {"chat": 0.6, "retrieval": 0.1, "tool": 0.2, "background": 0.05,
                                                     "long_context": 0.05}},
        "client": {"patience_s": 5.0, "cancel_share": 0.2, "disconnect_share": 0.2, "max_retries": 2,
                   "retry_backoff_s": 0.5},
        "gateway": {"admission": {"kind": "composite", "policies": [
            {"kind": "retry_budget", "ratio": 0.5, "min_retries_per_window": 2, "window_s": 5},
            {"kind": "token_bucket", "tokens_per_s": 300, "burst_tokens": 20000}]}},
        "queue": {"policy": {"kind": "token_aware", "capacity_tokens": 200000, "min_drain_tokens_per_s": 500},
                  "max_waiting_per_replica": 2, "deadline_s": 4.0},
        "free_tier_model": "small",
    },
}


def scenario(**fleet_over) -> object:
    raw = copy.deepcopy(BASE)
    for k, v in fleet_over.items():
        node = raw["fleet"]
        *path, last = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return parse_scenario(raw)


def check_invariants(res) -> None:
    assert res.ok, res.manifest.get("traceback")
    ev = res.tables["events"].to_pydict()
    arrived = [r for k, r in zip(ev["kind"], ev["request_id"]) if k == "request.arrived"]
    terminal_kinds = {"request.finished", "request.rejected", "request.cancelled", "request.abandoned",
                      "request.failed"}
    terminal = collections.Counter(r for k, r in zip(ev["kind"], ev["request_id"]) if k in terminal_kinds)
    assert len(set(arrived)) == len(arrived)
    assert set(terminal) == set(arrived), "every arrived turn ends"
    assert max(terminal.values(), default=1) == 1, "exactly one outcome per turn"
    s = res.summary["requests"]
    assert sum(v for k, v in s.items() if k != "arrived") == s["arrived"] == len(arrived)
    assert s["unfinished"] == 0
    # no idempotency key completes twice
    assert res.world.conversation.duplicate_completions == 0
    finished = collections.Counter(r for k, r in zip(ev["kind"], ev["request_id"]) if k == "request.finished")
    assert max(finished.values(), default=1) == 1
    # a tool call executes once per key
    tools = collections.Counter(r for k, r in zip(ev["kind"], ev["request_id"]) if k == "tool.executed")
    assert max(tools.values(), default=1) == 1
    # cancelled and finished generations freed their KV: every pool drains completely
    for eng in res.world.engines():
        eng.kv.check_invariants()
        assert eng.kv.num_free == eng.kv.num_usable
        assert not eng.running and len(eng.waiting) == 0
    # the router's ledger returns to zero
    assert all(h.outstanding_tokens == 0 for h in res.world.handles)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([0.0002, 0.0005, 0.001]),
       cancel=st.floats(0.0, 0.5), surge=st.sampled_from([1.0, 5.0]),
       router=st.sampled_from(["round_robin", "least_outstanding_tokens", "power_of_two", "session_affinity",
                               "prefix_affinity", "llm_d_scorer", "dynamo_kv_cost"]))
def test_request_path_invariants(seed, scale, cancel, surge, router):
    sc = scenario(**{"traffic.scale": scale, "client.cancel_share": cancel,
                     "traffic.surges": [{"start_s": 5, "ramp_s": 2, "hold_s": 8, "multiplier": surge}],
                     "policy.router": {"kind": router}})
    check_invariants(run_scenario(sc, seed=seed))


def _bytes(t) -> bytes:
    buf = io.BytesIO()
    pq.write_table(t, buf)
    return buf.getvalue()


def test_fleet_runs_are_deterministic():
    sc = scenario()
    a, b = run_scenario(sc), run_scenario(sc)
    for name in ("events", "levels", "requests"):
        assert _bytes(a.tables[name]) == _bytes(b.tables[name]), name


def test_cancellation_reaches_the_replica_and_frees_kv():
    res = run_scenario(scenario(**{"client.cancel_share": 1.0, "client.disconnect_share": 0.0,
                                   "traffic.classes": {"chat": 1.0, "retrieval": 0, "tool": 0, "background": 0,
                                                       "long_context": 0}}))
    check_invariants(res)
    ev = res.tables["events"].to_pydict()
    gen_cancel = [r for k, r in zip(ev["kind"], ev["request_id"]) if k == "generation.cancelled"]
    turn_cancel = [r for k, r in zip(ev["kind"], ev["request_id"]) if k == "request.cancelled"]
    assert gen_cancel and len(turn_cancel) >= len(gen_cancel) * 0.9
    # a cancelled turn's output is shorter than what it asked for
    req = res.tables["requests"].to_pydict()
    assert all(o == "cancelled" for o in req["outcome"] if o not in ("rejected", "abandoned", "completed"))


def test_residency_bound_turns_stay_in_their_region():
    res = run_scenario(scenario(**{"traffic.tenants": [
        {"name": "eu-only", "share": 1.0, "tier": "enterprise", "residency": ["eu-west"]}]}))
    check_invariants(res)
    req = res.tables["requests"].to_pydict()
    placed = [s for s in req["scope"] if s]
    assert placed and all(".eu-west." in s for s in placed)


def test_free_tier_goes_to_the_small_model_when_capable():
    res = run_scenario(scenario(**{"traffic.tenants": [{"name": "free", "share": 1.0, "tier": "free"}],
                                   "traffic.classes": {"chat": 1.0, "retrieval": 0, "tool": 0, "background": 0,
                                                       "long_context": 0}}))
    req = res.tables["requests"].to_pydict()
    placed = [s for s in req["scope"] if s]
    assert placed and all(".small-" in s for s in placed)


def test_multi_turn_history_hits_the_prefix_cache_under_session_affinity():
    sc = scenario(**{"policy.router": {"kind": "session_affinity"}, "traffic.turns_per_session": 4.0,
                     "client.cancel_share": 0.0})
    res = run_scenario(sc)
    check_invariants(res)
    req = res.tables["requests"].to_pydict()
    follow = [c for k, c in zip(req["klass"], req["num_cached_tokens"]) if k == "followup" and c is not None]
    assert follow and sum(follow) / len(follow) > 500  # history (and system prompt) come back from cache


def test_fleet_scale_above_one_grows_nodes_and_turns_together():
    """``fleet.scale`` 2 (the speed benchmark's bigger fleets): twice the nodes of every pool and about twice the
    sessions of scale 1; above the documented cap the scenario is refused, naming the field."""
    small = run_scenario(scenario(**{"traffic.duration_s": 5}))
    big_raw = copy.deepcopy(BASE)
    big_raw["fleet"]["scale"] = 2.0
    big_raw["fleet"]["traffic"]["duration_s"] = 5
    big = run_scenario(parse_scenario(big_raw))
    assert small.ok and big.ok
    assert big.summary["fleet"]["replicas"] == 2 * small.summary["fleet"]["replicas"] > 0
    sc = parse_scenario(big_raw)
    traffic = sc.fleet.traffic.model_copy(update={"duration_s": 3600.0})
    n1 = len(sessions(traffic, sc.fleet.topology, seed=1, replication=0, scale=1.0))
    n2 = len(sessions(traffic, sc.fleet.topology, seed=1, replication=0, scale=2.0))
    assert n1 > 1000 and 1.9 < n2 / n1 < 2.1, (n1, n2)
    bad = copy.deepcopy(BASE)
    bad["fleet"]["scale"] = 17.0
    with pytest.raises(ScenarioError, match="scale"):
        parse_scenario(bad)
