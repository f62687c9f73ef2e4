"""A scoring router that omits its per-candidate scores chooses exactly as the full scan that lists them.

``LlmDScorerRouter`` with ``omit_scores()`` matches the session's last replica first, then only the
candidates whose upper bound (the total at a full prefix match) can still reach the best exact total;
``DynamoKvCostRouter`` likewise with a lower bound on the cost. These tests drive it and a default router
(every candidate scored, every score listed) through the same random sessions, fleets, failures and expiries, with
weights and signals drawn from small sets so that ties are common, and require the same decision each time.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policies import ReplicaSnapshot, RequestFacts, build_router
from twin.policies.prng import SplitMix64

from prefixkit import chained


def snapshot(i: int, *, waiting: int, kv: float, healthy: bool, region: str, tokens: int = 0) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id=f"r{i:02d}", region=region, model="m", pool="default", healthy=healthy,
                           num_running=1, num_waiting=waiting, kv_usage=kv, outstanding_tokens=tokens,
                           max_model_len=4096, scraped_at_s=0.0)


def facts(n: int, prompt: tuple[int, ...], region: str | None, session_id: str | None = None) -> RequestFacts:
    return RequestFacts(request_id=f"q{n}", tenant="t", tier="paid", session_id=session_id,
                        prompt_tokens=16 * len(prompt) + 5,
                        expected_output_tokens=50, block_hashes=prompt, model="m", region=region,
                        allowed_regions=None, needs_long_context=False)


WEIGHTS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 40), prefix_w=WEIGHTS, queue_w=WEIGHTS, kv_w=WEIGHTS,
       capacity=st.sampled_from([8, 40, 1000]), ttl=st.sampled_from([None, 0.5, 3.0]),
       wrapped=st.booleans())
def test_pruned_scorer_decides_as_the_full_scan(seed: int, size: int, prefix_w: float, queue_w: float, kv_w: float,
                                                capacity: int, ttl: float | None, wrapped: bool) -> None:
    scorer = {"kind": "llm_d_scorer", "prefix_weight": prefix_w, "queue_weight": queue_w, "kv_usage_weight": kv_w,
              "index_capacity_blocks": capacity, "index_ttl_s": ttl}
    drive(scorer, seed=seed, size=size, wrapped=wrapped, sampled=False)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 40), weight=WEIGHTS, block_size=st.sampled_from([1, 4, 16, 64]),
       temperature=st.sampled_from([0.0, 0.0, 0.5]), capacity=st.sampled_from([8, 40, 1000]),
       ttl=st.sampled_from([None, 0.5, 3.0]), wrapped=st.booleans())
def test_pruned_kv_cost_decides_as_the_full_scan(seed: int, size: int, weight: float, block_size: int,
                                                 temperature: float, capacity: int, ttl: float | None,
                                                 wrapped: bool) -> None:
    cost = {"kind": "dynamo_kv_cost", "overlap_score_weight": weight, "block_size_tokens": block_size,
            "temperature": temperature, "index_capacity_blocks": capacity, "index_ttl_s": ttl}
    drive(cost, seed=seed, size=size, wrapped=wrapped, sampled=temperature > 0)


def drive(inner: dict, *, seed: int, size: int, wrapped: bool, sampled: bool) -> None:
    """Route the same random sessions through a router with scores omitted and one with them listed
    (a sampling router scores everyone either way, as its draw needs every weight). Prompts are chained
    block hashes, as the engine's are and as the prefix index requires."""
    params = {"kind": "long_context_pool", "inner": inner} if wrapped else inner
    fast, full = build_router(params, seed=1), build_router(params, seed=1)
    fast.omit_scores()
    rng = SplitMix64(seed)
    systems = [[rng.randrange(40) for _ in range(1 + rng.randrange(6))] for _ in range(3)]
    sessions = [list(systems[s % 3]) for s in range(10)]
    for n in range(120):
        s = rng.randrange(len(sessions))
        session = sessions[s]
        if rng.random() < 0.9:
            session.extend(rng.randrange(10**6) for _ in range(1 + rng.randrange(3)))
        prompt = chained(session) if rng.random() < 0.95 else ()
        replicas = [snapshot(i, waiting=rng.randrange(3), kv=rng.randrange(3) / 4, healthy=rng.random() < 0.97,
                             region=("us", "eu")[rng.randrange(2)], tokens=16 * rng.randrange(3)) for i in range(size)]
        region = (None, "us", "eu")[rng.randrange(3)]
        # the pruned routers match the session's last replica first; some requests name no session
        request, now = facts(n, prompt, region, f"s{s}" if rng.random() < 0.8 else None), n * 0.05
        a, b = fast.route(request, replicas, now), full.route(request, replicas, now)
        assert (a.replica_id, a.reason) == (b.replica_id, b.reason)
        assert a.scores == (b.scores if sampled else ())
        if a.replica_id is not None:
            assert len(b.scores) >= 1
            fast.on_routed(request, a.replica_id, now)
            full.on_routed(request, b.replica_id, now)


def test_omit_scores_leaves_the_default_untouched() -> None:
    """A router keeps listing every candidate's score unless its host asks otherwise."""
    router = build_router({"kind": "llm_d_scorer"}, seed=0)
    replicas = [snapshot(i, waiting=i, kv=0.5, healthy=True, region="us") for i in range(3)]
    d = router.route(facts(0, chained([1, 2, 3]), None), replicas, 0.0)
    assert [rid for rid, _ in d.scores] == ["r00", "r01", "r02"]
    router.omit_scores()
    assert router.route(facts(1, chained([1, 2, 3]), None), replicas, 0.0).scores == ()
