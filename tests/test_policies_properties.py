"""Property tests of the routing policies: safety invariants and determinism on random fleets."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.policies import LONG_CONTEXT_POOL, ReplicaSnapshot, RequestFacts, build_router, eligible_replicas

REGIONS = ("us-east", "eu-west", "ap-south")
MODELS = ("m1", "m2")

# Every router, and the interesting parameter corners (sampling, spilling, nesting).
CONFIGS: list[dict[str, Any]] = [
    {"kind": "round_robin"},
    {"kind": "least_outstanding_tokens"},
    {"kind": "power_of_two"},
    {"kind": "session_affinity"},
    {"kind": "prefix_affinity", "prefix_blocks": 2, "capacity_factor": 1.0},
    {"kind": "prefix_affinity"},
    {"kind": "llm_d_scorer", "index_capacity_blocks": 8, "index_ttl_s": 5.0},
    {"kind": "dynamo_kv_cost"},
    {"kind": "dynamo_kv_cost", "temperature": 0.7, "overlap_score_weight": 3.0},
    {"kind": "long_context_pool", "inner": {"kind": "power_of_two"}},
    {"kind": "long_context_pool", "inner": {"kind": "dynamo_kv_cost", "temperature": 1.0}},
    {"kind": "long_context_pool", "spill_short_to_long_pool": False, "inner": {"kind": "llm_d_scorer"}},
]
CONFIG_IDS = [f"{i}-{c['kind']}" for i, c in enumerate(CONFIGS)]


@st.composite
def replica_sets(draw: st.DrawFn) -> list[ReplicaSnapshot]:
    n = draw(st.integers(0, 7))
    return [
        ReplicaSnapshot(
            replica_id=f"fleet.{region}.node{i:02d}.r1",
            region=region,
            model=draw(st.sampled_from(MODELS)),
            pool=draw(st.sampled_from(("default", LONG_CONTEXT_POOL))),
            healthy=draw(st.booleans()),
            num_running=draw(st.integers(0, 64)),
            num_waiting=draw(st.integers(0, 64)),
            kv_usage=draw(st.floats(0.0, 1.0)),
            outstanding_tokens=draw(st.integers(0, 200_000)),
            max_model_len=draw(st.sampled_from((4096, 32768, 131072))),
            scraped_at_s=draw(st.floats(0.0, 100.0)),
        )
        for i in range(n)
        for region in [draw(st.sampled_from(REGIONS))]
    ]


@st.composite
def requests(draw: st.DrawFn) -> RequestFacts:
    prompt = draw(st.integers(0, 40_000))
    n_blocks = prompt // 16
    root = draw(st.integers(0, 3))  # few roots, so prefixes repeat across requests
    return RequestFacts(
        request_id=f"q{draw(st.integers(0, 10**9))}",
        tenant=draw(st.sampled_from(("acme", "globex"))),
        tier=draw(st.sampled_from(("free", "paid", "enterprise"))),
        session_id=draw(st.one_of(st.none(), st.sampled_from(("s1", "s2", "s3")))),
        prompt_tokens=prompt,
        expected_output_tokens=draw(st.integers(0, 8000)),
        block_hashes=tuple(root * 1000 + j for j in range(min(n_blocks, 12))),
        model=draw(st.sampled_from(MODELS)),
        region=draw(st.one_of(st.none(), st.sampled_from(REGIONS))),
        allowed_regions=draw(st.one_of(st.none(), st.lists(st.sampled_from(REGIONS), unique=True).map(tuple))),
        needs_long_context=draw(st.booleans()),
    )


steps = st.lists(st.tuples(requests(), replica_sets(), st.booleans()), min_size=1, max_size=12)
RUN = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _expect_none(config: dict[str, Any], request: RequestFacts, replicas: list[ReplicaSnapshot]) -> bool:
    """When the router must refuse: nothing eligible, or (strict pool rule) nothing outside the pool."""
    eligible = eligible_replicas(request, replicas)
    if config["kind"] == "long_context_pool" and not config.get("spill_short_to_long_pool", True):
        if not request.needs_long_context:
            eligible = [r for r in eligible if r.pool != LONG_CONTEXT_POOL]
    return not eligible


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@RUN
@given(seed=st.integers(0, 2**64 - 1), sequence=steps)
def test_never_unhealthy_wrong_model_or_outside_residency(
    config: dict[str, Any], seed: int, sequence: list[tuple[RequestFacts, list[ReplicaSnapshot], bool]]
) -> None:
    router = build_router(config, seed=seed)
    for t, (request, replicas, complete) in enumerate(sequence):
        d = router.route(request, replicas, float(t))
        if d.replica_id is None:
            assert _expect_none(config, request, replicas), d
            continue
        assert not _expect_none(config, request, replicas)
        chosen = next(r for r in replicas if r.replica_id == d.replica_id)
        assert chosen.healthy
        assert chosen.model == request.model
        assert request.allowed_regions is None or chosen.region in request.allowed_regions
        assert chosen.max_model_len >= request.prompt_tokens + request.expected_output_tokens
        router.on_routed(request, d.replica_id, float(t))
        if complete:
            router.on_completed(request.request_id, d.replica_id, float(t) + 0.5)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@RUN
@given(seed=st.integers(0, 2**64 - 1), sequence=steps)
def test_same_seed_and_snapshots_give_same_decisions(
    config: dict[str, Any], seed: int, sequence: list[tuple[RequestFacts, list[ReplicaSnapshot], bool]]
) -> None:
    def run() -> list[object]:
        router = build_router(config, seed=seed)
        out: list[object] = []
        for t, (request, replicas, complete) in enumerate(sequence):
            d = router.route(request, list(reversed(replicas)) if t % 2 else replicas, float(t))
            out.append(d)
            if d.replica_id is not None:
                router.on_routed(request, d.replica_id, float(t))
                if complete:
                    router.on_completed(request.request_id, d.replica_id, float(t) + 0.5)
        return out

    assert run() == run()


def test_input_order_of_snapshots_does_not_matter() -> None:
    """Ties break by replica_id, not by the order the host lists replicas in."""
    replicas = [
        ReplicaSnapshot(f"fleet.us-east.node0{i}.r1", "us-east", "m1", "default", True, 0, 0, 0.5, 0, 8192, 0.0)
        for i in range(5)
    ]
    request = RequestFacts("q", "t", "paid", "s1", 100, 10, (1, 2), "m1", None, None, False)
    for config in CONFIGS:
        a = build_router(config, seed=9).route(request, replicas, 0.0)
        b = build_router(config, seed=9).route(request, list(reversed(replicas)), 0.0)
        assert a == b, config["kind"]


@pytest.mark.parametrize("config", [{"kind": "power_of_two"}, {"kind": "dynamo_kv_cost", "temperature": 2.0}])
def test_the_seed_matters_for_randomised_routers(config: dict[str, Any]) -> None:
    replicas = [
        ReplicaSnapshot(f"r{i}", "us-east", "m1", "default", True, 0, 0, 0.1, 100 * i, 8192, 0.0) for i in range(6)
    ]
    request = RequestFacts("q", "t", "paid", None, 100, 10, (), "m1", None, None, False)

    def picks(seed: int) -> list[str | None]:
        router = build_router(config, seed=seed)
        return [router.route(request, replicas, 0.0).replica_id for _ in range(40)]

    assert picks(1) == picks(1)
    assert picks(1) != picks(2)
