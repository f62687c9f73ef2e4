"""Unit tests of the routing policies on hand-made snapshots (what a serving engineer would check)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from twin.policies import (
    ROUTERS,
    BaseRouter,
    ReplicaSnapshot,
    RequestFacts,
    RouterPolicy,
    RoutingDecision,
    build_router,
    candidate_replicas,
    eligible_replicas,
    parse_router_config,
)
from twin.policies.prng import SplitMix64, combine_hashes, stable_hash_str
from twin.policies.routing import LeastOutstandingTokensParams

from prefixkit import chained


REPO = Path(__file__).resolve().parent.parent


def rep(replica_id: str, **kw: object) -> ReplicaSnapshot:
    base: dict[str, object] = dict(
        replica_id=replica_id, region="us-east", model="m", pool="default", healthy=True, num_running=0,
        num_waiting=0, kv_usage=0.0, outstanding_tokens=0, max_model_len=8192, scraped_at_s=0.0,
    )
    base.update(kw)
    return ReplicaSnapshot(**base)  # type: ignore[arg-type]


_N = iter(range(10**9))


def req(**kw: object) -> RequestFacts:
    base: dict[str, object] = dict(
        request_id=f"q{next(_N)}", tenant="t", tier="paid", session_id=None, prompt_tokens=100,
        expected_output_tokens=100, block_hashes=(), model="m", region=None, allowed_regions=None,
        needs_long_context=False,
    )
    base.update(kw)
    return RequestFacts(**base)  # type: ignore[arg-type]


def fleet(n: int, **kw: object) -> list[ReplicaSnapshot]:
    return [rep(f"fleet.us-east.node0{i}.r1", **kw) for i in range(n)]


def with_(replicas: list[ReplicaSnapshot], replica_id: str, **kw: object) -> list[ReplicaSnapshot]:
    return [dataclasses.replace(r, **kw) if r.replica_id == replica_id else r for r in replicas]  # type: ignore[arg-type]


def send(router: BaseRouter, request: RequestFacts, replicas: list[ReplicaSnapshot], now_s: float = 0.0) -> str:
    d = router.route(request, replicas, now_s)
    assert d.replica_id is not None, d
    router.on_routed(request, d.replica_id, now_s)
    return d.replica_id


# ----------------------------------------------------------------------------------------- value types
def test_value_types_are_frozen_and_validated() -> None:
    r = rep("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.healthy = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="kv_usage"):
        rep("a", kv_usage=1.5)
    with pytest.raises(ValueError, match="tier"):
        req(tier="gold")
    assert req(prompt_tokens=10, expected_output_tokens=5).total_tokens == 15
    assert rep("a", num_running=3, num_waiting=4).queue_depth == 7


def test_every_router_satisfies_the_protocol() -> None:
    for key in ROUTERS:
        assert isinstance(build_router({"kind": key}, seed=0), RouterPolicy), key


# ------------------------------------------------------------------------------------------ eligibility
def test_eligibility_hard_constraints() -> None:
    replicas = [
        rep("ok"), rep("sick", healthy=False), rep("other-model", model="x"),
        rep("eu", region="eu-west"), rep("short", max_model_len=150),
    ]
    r = req(allowed_regions=("us-east",), prompt_tokens=100, expected_output_tokens=100)
    assert [x.replica_id for x in eligible_replicas(r, replicas)] == ["ok"]
    # without the residency constraint the EU replica is fine
    assert [x.replica_id for x in eligible_replicas(req(), replicas)] == ["eu", "ok"]


def test_steering_prefers_long_pool_and_region_but_never_refuses_because_of_it() -> None:
    replicas = [rep("d1"), rep("L1", pool="long_context", max_model_len=131072), rep("eu", region="eu-west")]
    assert [x.replica_id for x in candidate_replicas(req(needs_long_context=True), replicas)] == ["L1"]
    assert [x.replica_id for x in candidate_replicas(req(region="eu-west"), replicas)] == ["eu"]
    # steered region has nothing eligible -> other allowed regions
    assert [x.replica_id for x in candidate_replicas(req(region="ap-south"), replicas)] == ["L1", "d1", "eu"]
    sick_pool = with_(replicas, "L1", healthy=False)
    assert [x.replica_id for x in candidate_replicas(req(needs_long_context=True), sick_pool)] == ["d1", "eu"]


@pytest.mark.parametrize("key", ROUTERS.keys())
def test_no_eligible_replica_gives_none(key: str) -> None:
    router = build_router({"kind": key}, seed=1)
    d = router.route(req(), [rep("a", healthy=False), rep("b", model="other")], 0.0)
    assert d == RoutingDecision(None, "no_eligible_replica")
    assert router.route(req(), [], 0.0).replica_id is None


def test_base_router_refuses_to_return_an_ineligible_replica() -> None:
    class Broken(BaseRouter):
        Params = LeastOutstandingTokensParams

        def _choose(self, request, candidates, now_s):  # type: ignore[no-untyped-def]
            return RoutingDecision("sick", "bug")

    with pytest.raises(RuntimeError, match="ineligible"):
        Broken(LeastOutstandingTokensParams(), seed=0).route(req(), [rep("ok"), rep("sick", healthy=False)], 0.0)


# ------------------------------------------------------------------------------------------ round robin
def test_round_robin_cycles_and_survives_membership_changes() -> None:
    rr = build_router({"kind": "round_robin"}, seed=0)
    replicas = fleet(3)
    ids = [r.replica_id for r in replicas]
    picks = [send(rr, req(), replicas) for _ in range(6)]
    assert picks == ids + ids
    # the middle replica goes unhealthy: the cycle skips it without restarting
    sick = with_(replicas, ids[1], healthy=False)
    assert [send(rr, req(), sick) for _ in range(3)] == [ids[0], ids[2], ids[0]]


# ------------------------------------------------------------------------------ least outstanding tokens
def test_least_outstanding_tokens_picks_least_loaded_and_breaks_ties_by_id() -> None:
    lot = build_router({"kind": "least_outstanding_tokens"}, seed=0)
    replicas = [rep("c", outstanding_tokens=50), rep("a", outstanding_tokens=900), rep("b", outstanding_tokens=50)]
    d = lot.route(req(), replicas, 0.0)
    assert d.replica_id == "b"
    assert dict(d.scores) == {"a": 900.0, "b": 50.0, "c": 50.0}
    # stale scraped queue signals do not matter; only the router's own token count does
    replicas = [rep("a", outstanding_tokens=10, num_waiting=50), rep("b", outstanding_tokens=20)]
    assert lot.route(req(), replicas, 0.0).replica_id == "a"


# ----------------------------------------------------------------------------------------- power of two
def test_power_of_two_never_picks_the_most_loaded_and_favours_the_least() -> None:
    p2 = build_router({"kind": "power_of_two"}, seed=7)
    replicas = [rep(n, outstanding_tokens=t) for n, t in [("a", 0), ("b", 100), ("c", 200), ("d", 300)]]
    counts = Counter(p2.route(req(), replicas, 0.0).replica_id for _ in range(3000))
    assert counts["d"] == 0
    # P(pick) for loads ranked 1..4 of 4 with two distinct samples: 1/2, 1/3, 1/6, 0
    assert abs(counts["a"] / 3000 - 1 / 2) < 0.04
    assert abs(counts["b"] / 3000 - 1 / 3) < 0.04
    assert abs(counts["c"] / 3000 - 1 / 6) < 0.04


def test_power_of_two_breaks_token_ties_on_scraped_queue() -> None:
    p2 = build_router({"kind": "power_of_two"}, seed=3)
    replicas = [rep("a", num_waiting=5), rep("b", num_waiting=0)]
    assert {p2.route(req(), replicas, 0.0).replica_id for _ in range(20)} == {"b"}


# ------------------------------------------------------------------------------------- session affinity
def test_session_affinity_is_sticky_and_spreads_sessions() -> None:
    sa = build_router({"kind": "session_affinity"}, seed=0)
    replicas = fleet(4)
    first = send(sa, req(session_id="s-1"), replicas)
    loaded = with_(replicas, first, outstanding_tokens=10**6, num_waiting=99)
    assert all(send(sa, req(session_id="s-1"), loaded) == first for _ in range(10))
    homes = {send(sa, req(session_id=f"s-{i}"), replicas) for i in range(60)}
    assert len(homes) == 4


def test_session_affinity_moves_only_sessions_of_an_unhealthy_replica_and_moves_back() -> None:
    sa = build_router({"kind": "session_affinity"}, seed=0)
    replicas = fleet(4)
    home = {f"s-{i}": sa.route(req(session_id=f"s-{i}"), replicas, 0.0).replica_id for i in range(80)}
    victim = home["s-0"]
    sick = with_(replicas, victim, healthy=False)
    moved = {s: sa.route(req(session_id=s), sick, 1.0).replica_id for s in home}
    for s, r in home.items():
        if r == victim:
            assert moved[s] != victim
        else:
            assert moved[s] == r, "a session whose replica stayed healthy must not move"
    assert sa.route(req(session_id="s-0"), replicas, 2.0).replica_id == victim


def test_session_affinity_without_session_uses_least_tokens() -> None:
    sa = build_router({"kind": "session_affinity"}, seed=0)
    replicas = [rep("a", outstanding_tokens=5), rep("b", outstanding_tokens=1)]
    assert sa.route(req(session_id=None), replicas, 0.0).replica_id == "b"


# ------------------------------------------------------------------------------------- prefix affinity
def test_prefix_affinity_keys_on_the_first_k_blocks() -> None:
    pa = build_router({"kind": "prefix_affinity", "prefix_blocks": 2, "capacity_factor": 100.0}, seed=0)
    replicas = fleet(8)
    homes = {send(pa, req(block_hashes=(11, 22, 1000 + i)), replicas) for i in range(20)}
    assert len(homes) == 1, "same first K blocks -> same replica"
    spread = {send(pa, req(block_hashes=(i, 22, 33)), replicas) for i in range(40)}
    assert len(spread) > 3, "different prefixes spread"


def test_prefix_affinity_bounded_load_spills_at_c_times_average() -> None:
    c = 1.25
    pa = build_router({"kind": "prefix_affinity", "prefix_blocks": 1, "capacity_factor": c}, seed=0)
    replicas = fleet(4)
    hot = (424242,)
    picks = []
    for m in range(12):  # nothing completes: load builds up
        d = pa.route(req(block_hashes=hot), replicas, 0.0)
        assert d.replica_id is not None
        cap = math.ceil(c * (m + 1) / 4)
        assert pa.in_flight(d.replica_id) + 1 <= cap  # type: ignore[attr-defined]
        pa.on_routed(req(request_id=f"hot{m}", block_hashes=hot), d.replica_id, 0.0)
        picks.append((d.replica_id, d.reason))
    preferred = picks[0][0]
    assert "spilled" not in picks[0][1]
    assert picks[1][0] != preferred and "spilled" in picks[1][1]  # cap = ceil(1.25*2/4) = 1
    loads = Counter(p for p, _ in picks)
    assert max(loads.values()) <= math.ceil(c * 12 / 4)
    assert loads[preferred] == max(loads.values())
    # once the hot replica's requests complete, the prefix goes home again
    for m in range(12):
        pa.on_completed(f"hot{m}", "ignored-by-policy", 1.0)
    assert pa.route(req(block_hashes=hot), replicas, 1.0).replica_id == preferred


def test_prefix_affinity_ignores_duplicate_and_unknown_completions() -> None:
    pa = build_router({"kind": "prefix_affinity"}, seed=0)
    r = req(request_id="x")
    pa.on_routed(r, "a", 0.0)
    pa.on_routed(r, "a", 0.0)
    assert pa.in_flight("a") == 1  # type: ignore[attr-defined]
    pa.on_completed("x", "a", 1.0)
    pa.on_completed("x", "a", 1.0)
    pa.on_completed("never-sent", "a", 1.0)
    assert pa.in_flight("a") == 0  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------- llm-d scorer
PREFIX = tuple(range(100, 132))  # 32 full blocks


def test_llm_d_scorer_prefers_the_replica_it_sent_the_prefix_to_until_its_queue_is_much_longer() -> None:
    sc = build_router({"kind": "llm_d_scorer"}, seed=0)
    replicas = fleet(3, kv_usage=0.3)
    home = send(sc, req(block_hashes=PREFIX), replicas, 0.0)
    # a follow-up with the same prefix (plus new blocks) goes home, even with a slightly longer queue
    follow = req(block_hashes=PREFIX + (7, 8))
    busy = with_(replicas, home, num_waiting=2)
    d = sc.route(follow, busy, 1.0)
    assert d.replica_id == home
    assert dict(d.scores)[home] > max(s for r, s in d.scores if r != home)
    # a much longer queue (which on vLLM comes with a full KV cache) sends it elsewhere
    swamped = with_(replicas, home, num_waiting=40, kv_usage=0.97)
    assert sc.route(follow, swamped, 2.0).replica_id != home


def test_llm_d_scorer_prefix_score_is_the_matched_fraction() -> None:
    sc = build_router({"kind": "llm_d_scorer", "queue_weight": 0, "kv_usage_weight": 0}, seed=0)
    replicas = fleet(2)
    home = send(sc, req(block_hashes=chained([1, 2])), replicas)
    d = sc.route(req(block_hashes=chained([1, 2, 3, 4])), replicas, 1.0)
    assert dict(d.scores)[home] == pytest.approx(3.0 * 2 / 4)
    # matching is of the leading blocks only: block 2 after block 9 is another block (its hash chains from 9's)
    assert dict(sc.route(req(block_hashes=chained([9, 2])), replicas, 1.0).scores)[home] == 0.0


def test_llm_d_scorer_index_ages_out_evicts_lru_and_forgets_unhealthy_replicas() -> None:
    params = {"kind": "llm_d_scorer", "index_ttl_s": 60.0, "index_capacity_blocks": 40}
    sc = build_router(params, seed=0)
    replicas = fleet(2)
    home = send(sc, req(block_hashes=PREFIX), replicas, 0.0)
    assert sc.index.match_blocks(home, PREFIX, 59.0) == 32  # type: ignore[attr-defined]
    assert sc.index.match_blocks(home, PREFIX, 61.0) == 0  # type: ignore[attr-defined]

    sc = build_router(params, seed=0)
    sc.on_routed(req(block_hashes=PREFIX), home, 0.0)
    sc.on_routed(req(block_hashes=tuple(range(500, 520))), home, 1.0)  # 52 blocks > 40: oldest go
    assert sc.index.size(home) == 40  # type: ignore[attr-defined]
    # the prompt's root blocks were recorded last, so the prefix keeps its head, loses its tail
    assert 0 < sc.index.match_blocks(home, PREFIX, 2.0) < 32  # type: ignore[attr-defined]

    sc.route(req(), with_(replicas, home, healthy=False), 3.0)
    assert sc.index.match_blocks(home, PREFIX, 3.0) == 0  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- Dynamo KV cost
def test_dynamo_cost_formula_and_overlap_versus_load_trade() -> None:
    cached8 = tuple(range(1, 9))
    prompt = req(prompt_tokens=160, block_hashes=cached8 + (9, 10))  # 10 blocks of 16
    replicas = [rep("a", outstanding_tokens=320), rep("b", outstanding_tokens=0)]

    def costs(weight: float) -> tuple[dict[str, float], str | None]:
        r = build_router({"kind": "dynamo_kv_cost", "overlap_score_weight": weight}, seed=0)
        r.on_routed(req(block_hashes=cached8), "a", 0.0)
        d = r.route(prompt, replicas, 1.0)
        return dict(d.scores), d.replica_id

    # a: w*(10-8) + (320/16 + 10) ; b: w*10 + (0 + 10)
    scores, pick = costs(1.0)
    assert scores == {"a": 32.0, "b": 20.0} and pick == "b"  # load wins at weight 1
    scores, pick = costs(4.0)
    assert scores == {"a": 38.0, "b": 50.0} and pick == "a"  # overlap wins at weight 4
    scores, pick = costs(0.0)
    assert pick == "b"  # weight 0: pure load balancing


def test_dynamo_temperature_samples_in_favour_of_low_cost() -> None:
    replicas = [rep("a", outstanding_tokens=0), rep("b", outstanding_tokens=1600)]
    hot = build_router({"kind": "dynamo_kv_cost", "temperature": 0.5}, seed=11)
    counts = Counter(hot.route(req(), replicas, 0.0).replica_id for _ in range(2000))
    assert counts["a"] > counts["b"] > 0
    cold = build_router({"kind": "dynamo_kv_cost", "temperature": 0.0}, seed=11)
    assert {cold.route(req(), replicas, 0.0).replica_id for _ in range(50)} == {"a"}


# ------------------------------------------------------------------------------------ long-context rule
LC = "long_context"


def lc_fleet() -> list[ReplicaSnapshot]:
    return [rep("d1"), rep("d2"), rep("L1", pool=LC, max_model_len=131072), rep("L2", pool=LC, max_model_len=131072)]


def test_long_context_rule_separates_the_pools() -> None:
    r = build_router({"kind": "long_context_pool", "inner": {"kind": "round_robin"}}, seed=0)
    long_req = dict(needs_long_context=True, prompt_tokens=60000)
    assert {send(r, req(**long_req), lc_fleet()) for _ in range(4)} == {"L1", "L2"}
    assert {send(r, req(), lc_fleet()) for _ in range(4)} == {"d1", "d2"}


def test_long_context_rule_fallbacks() -> None:
    spill = build_router({"kind": "long_context_pool"}, seed=0)
    strict = build_router({"kind": "long_context_pool", "spill_short_to_long_pool": False}, seed=0)
    defaults_down = [dataclasses.replace(r, healthy=r.pool == LC) for r in lc_fleet()]
    d = spill.route(req(), defaults_down, 0.0)
    assert d.replica_id in {"L1", "L2"} and "spilled" in d.reason
    assert strict.route(req(), defaults_down, 0.0).replica_id is None
    # long request, long pool down: any replica that fits; nothing fits -> None
    pool_down = [dataclasses.replace(r, healthy=r.pool != LC) for r in lc_fleet()]
    assert spill.route(req(needs_long_context=True, prompt_tokens=4000), pool_down, 0.0).replica_id in {"d1", "d2"}
    assert spill.route(req(needs_long_context=True, prompt_tokens=60000), pool_down, 0.0).replica_id is None


def test_long_context_rule_forwards_history_to_its_inner_router() -> None:
    r = build_router({"kind": "long_context_pool", "inner": {"kind": "prefix_affinity"}}, seed=0)
    r.on_routed(req(request_id="x"), "d1", 0.0)
    assert r.inner.in_flight("d1") == 1  # type: ignore[attr-defined]
    r.on_completed("x", "d1", 1.0)
    assert r.inner.in_flight("d1") == 0  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------- config + registry
def test_each_registered_router_declares_its_key_as_kind() -> None:
    for key in ROUTERS:
        assert ROUTERS.get(key).Params().kind == key


def test_unknown_kind_names_known_kinds_with_a_hint() -> None:
    with pytest.raises(ValidationError, match=r"did you mean 'round_robin'.*known: .*power_of_two"):
        parse_router_config({"kind": "round_robbin"})
    with pytest.raises(ValidationError, match=r"inner"):
        parse_router_config({"kind": "long_context_pool", "inner": {"kind": "nope"}})
    with pytest.raises(ValidationError, match="kind"):
        parse_router_config({})


def test_params_are_frozen_and_reject_typos_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="capacity_factr"):
        parse_router_config({"kind": "prefix_affinity", "capacity_factr": 2})
    with pytest.raises(ValidationError, match="capacity_factor"):
        parse_router_config({"kind": "prefix_affinity", "capacity_factor": 0.5})
    p = parse_router_config({"kind": "dynamo_kv_cost", "temperature": 0.2})
    with pytest.raises(ValidationError):
        p.temperature = 1.0  # type: ignore[misc]
    assert build_router(p, seed=0).params is p


def test_router_config_embeds_in_a_scenario_model() -> None:
    from pydantic import BaseModel, ConfigDict

    from twin.policies import RouterConfig

    class Section(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        router: RouterConfig

    s = Section.model_validate({"router": {"kind": "long_context_pool", "inner": {"kind": "llm_d_scorer"}}})
    assert s.router.inner.kind == "llm_d_scorer"  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match=r"router\n.*unknown router 'llm_d'"):
        Section.model_validate({"router": {"kind": "llm_d"}})


# ---------------------------------------------------------------------------------- PRNG and hashing
def test_splitmix_is_reproducible_and_in_range() -> None:
    a, b = SplitMix64(5), SplitMix64(5)
    assert [a.next_u64() for _ in range(5)] == [b.next_u64() for _ in range(5)]
    assert SplitMix64(5).next_u64() != SplitMix64(6).next_u64()
    rng = SplitMix64(1)
    counts = Counter(rng.randrange(6) for _ in range(6000))
    assert set(counts) == set(range(6)) and all(abs(v - 1000) < 150 for v in counts.values())
    assert all(0.0 <= rng.random() < 1.0 for _ in range(1000))
    assert all(i != j for i, j in (rng.sample2(3) for _ in range(300)))


def test_stable_hash_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from twin.policies.prng import stable_hash_str, combine_hashes\n"
        "print(stable_hash_str('s-1'), combine_hashes((1, -2, 3)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.split()
    assert out == [str(stable_hash_str("s-1")), str(combine_hashes((1, -2, 3)))]
