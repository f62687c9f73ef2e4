"""A host may hand a router only the steered region's replicas when that changes nothing.

``BaseRouter.chooses_from_candidates`` says a router decides from ``candidate_replicas`` alone, so for a
request that needs no long context and is steered to a region with an eligible replica, the steered
region's healthy replicas give the same decision as the whole healthy fleet (the twin's router host,
``Router.candidates_for``, relies on this). Two routers of each kind, with the same seed, are driven
side by side through the same random fleets and requests, one given the whole fleet and one the region,
whenever the region has an eligible replica; every decision must match. The long-context rule filters
replicas itself, and says so.
"""

from __future__ import annotations

import pytest

from twin.policies import ROUTERS, ReplicaSnapshot, RequestFacts, build_router
from twin.policies.eligibility import eligible_replicas
from twin.policies.prng import SplitMix64

from prefixkit import chained

REGIONS = ("us", "eu", "ap")


def fleet(rng: SplitMix64, size: int) -> list[ReplicaSnapshot]:
    return [ReplicaSnapshot(replica_id=f"r{i:02d}", region=REGIONS[rng.randrange(3)], model="m",
                            pool=("default", "long_context")[rng.randrange(4) == 0], healthy=True,
                            num_running=rng.randrange(4), num_waiting=rng.randrange(3), kv_usage=rng.randrange(4) / 4,
                            outstanding_tokens=16 * rng.randrange(6), max_model_len=(1000, 4096)[rng.randrange(3) > 0],
                            scraped_at_s=0.0) for i in range(size)]


@pytest.mark.parametrize("kind", sorted(k for k in ROUTERS.keys() if k != "long_context_pool"))
def test_the_steered_region_alone_gives_the_same_decisions(kind: str) -> None:
    whole, regional = build_router({"kind": kind}, seed=5), build_router({"kind": kind}, seed=5)
    assert whole.chooses_from_candidates
    whole.omit_scores()
    regional.omit_scores()
    rng = SplitMix64(11)
    sessions = [[rng.randrange(30) for _ in range(3)] for _ in range(6)]
    compared = 0
    for n in range(400):
        replicas = fleet(rng, 1 + rng.randrange(20))
        s = rng.randrange(len(sessions))
        sessions[s].append(rng.randrange(10**6))
        region = REGIONS[rng.randrange(3)]
        request = RequestFacts(request_id=f"q{n}", tenant="t", tier="paid", session_id=f"s{s}",
                               prompt_tokens=16 * len(sessions[s]) + rng.randrange(2000),
                               expected_output_tokens=100, block_hashes=chained(sessions[s]), model="m",
                               region=region, allowed_regions=None, needs_long_context=False)
        local = [r for r in replicas if r.region == region]
        given = local if eligible_replicas(request, local) else replicas
        compared += given is local
        a, b = whole.route(request, replicas, n * 0.1), regional.route(request, given, n * 0.1)
        assert a == b
        if a.replica_id is not None:
            whole.on_routed(request, a.replica_id, n * 0.1)
            regional.on_routed(request, b.replica_id, n * 0.1)
            if rng.random() < 0.5:
                whole.on_completed(request.request_id, a.replica_id, n * 0.1)
                regional.on_completed(request.request_id, b.replica_id, n * 0.1)
    assert compared > 100  # the region alone was given often


def test_the_long_context_rule_says_it_filters_replicas_itself() -> None:
    assert not build_router({"kind": "long_context_pool"}, seed=0).chooses_from_candidates
