"""``candidate_replicas`` equals its plain definition on random fleets and requests (its usual case filters
the steered region and checks eligibility in one pass)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policies import ReplicaSnapshot, RequestFacts, candidate_replicas, eligible_replicas
from twin.policies.eligibility import LONG_CONTEXT_POOL

REGIONS = ("us-east", "eu-west", "ap-south")


def plain_candidates(request: RequestFacts, replicas) -> list[ReplicaSnapshot]:
    """The rule as written in the module docstring, without the one-pass shortcut."""
    region = request.region
    if region is not None and not request.needs_long_context:
        local = eligible_replicas(request, [r for r in replicas if r.region == region])
        if local:
            return local
    out = eligible_replicas(request, replicas)
    if request.needs_long_context:
        in_pool = [r for r in out if r.pool == LONG_CONTEXT_POOL]
        if in_pool:
            out = in_pool
    if region is not None:
        local = [r for r in out if r.region == region]
        if local:
            out = local
    return out


replica = st.builds(
    lambda i, region, model, pool, healthy, mml: ReplicaSnapshot(
        replica_id=f"r{i:02d}", region=region, model=model, pool=pool, healthy=healthy, num_running=0,
        num_waiting=0, kv_usage=0.0, outstanding_tokens=0, max_model_len=mml, scraped_at_s=0.0),
    st.integers(0, 40), st.sampled_from(REGIONS), st.sampled_from(("a", "b")),
    st.sampled_from(("default", LONG_CONTEXT_POOL)), st.booleans(), st.sampled_from((1000, 4000, 32000)))
request = st.builds(
    lambda region, allowed, model, prompt, lc: RequestFacts(
        request_id="q", tenant="t", tier="paid", session_id=None, prompt_tokens=prompt, expected_output_tokens=100,
        block_hashes=(), model=model, region=region, allowed_regions=allowed, needs_long_context=lc),
    st.one_of(st.none(), st.sampled_from(REGIONS)),
    st.one_of(st.none(), st.lists(st.sampled_from(REGIONS), min_size=1, max_size=2, unique=True).map(tuple)),
    st.sampled_from(("a", "b")), st.sampled_from((500, 3000, 20000)), st.booleans())


@settings(max_examples=500, deadline=None)
@given(replicas=st.lists(replica, max_size=25), request=request)
def test_candidates_equal_the_plain_rule(replicas, request) -> None:
    got = candidate_replicas(request, replicas)
    want = plain_candidates(request, replicas)
    assert [id(r) for r in got] == [id(r) for r in want]  # the same snapshots in the same order
