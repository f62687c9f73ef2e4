"""The router's approximate prefix index answers exactly as the block-by-block scan it replaced.

``ApproxPrefixIndex`` binary searches a prompt's leading run of cached blocks when that is provably the
same answer (chained hashes, no conflicting predecessor); these tests drive it and a plain reference
LRU with the same random records, matches, expiries and forgets and compare every answer and size.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policies import ApproxPrefixIndex, ReplicaSnapshot, RequestFacts, build_router
from twin.policies.cache_aware import SEARCH_MIN_CANDIDATES
from twin.policies.prng import SplitMix64

from prefixkit import chained


class ReferenceIndex:
    """The index as it was: per replica an LRU of hashes, the match a scan of the leading blocks."""

    def __init__(self, *, capacity_blocks: int, ttl_s: float | None) -> None:
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.lru: dict[str, OrderedDict[int, float]] = {}

    def record(self, replica_id: str, block_hashes, now_s: float) -> None:
        lru = self.lru.setdefault(replica_id, OrderedDict())
        for h in reversed(block_hashes):
            lru[h] = now_s
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
        self._expire(lru, now_s)

    def match_blocks(self, replica_id: str, block_hashes, now_s: float) -> int:
        lru = self.lru.get(replica_id)
        if not lru:
            return 0
        self._expire(lru, now_s)
        n = 0
        for h in block_hashes:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        self.lru.pop(replica_id, None)

    def _expire(self, lru, now_s: float) -> None:
        if self.ttl_s is None:
            return
        while lru:
            h, t = next(iter(lru.items()))
            if now_s - t <= self.ttl_s:
                break
            del lru[h]


REPLICAS = ("r0", "r1", "r2")
# prompts from a tiny alphabet share prefixes often; raw (unchained) prompts reuse hashes at any depth
prompt = st.lists(st.integers(0, 3), min_size=0, max_size=12)
op = st.tuples(st.sampled_from(("record", "match", "forget")), st.sampled_from(REPLICAS), prompt,
               st.floats(0.0, 3.0))


def drive(ops, *, capacity: int, ttl: float | None, hashes) -> ApproxPrefixIndex:
    fast = ApproxPrefixIndex(capacity_blocks=capacity, ttl_s=ttl)
    ref = ReferenceIndex(capacity_blocks=capacity, ttl_s=ttl)
    now = 0.0
    for kind, rid, tokens, dt in ops:
        now += dt
        bh = hashes(tokens)
        if kind == "record":
            fast.record(rid, bh, now)
            ref.record(rid, bh, now)
        elif kind == "forget":
            fast.forget(rid)
            ref.forget(rid)
        else:
            assert fast.match_many(REPLICAS, bh, now) == [ref.match_blocks(r, bh, now) for r in REPLICAS]
        for r in REPLICAS:
            assert fast.size(r) == len(ref.lru.get(r, ()))
    return fast


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), capacity=st.integers(1, 30), ttl=st.sampled_from((None, 1.0, 4.0)))
def test_matches_equal_the_scan_on_chained_hashes(ops, capacity, ttl) -> None:
    assert drive(ops, capacity=capacity, ttl=ttl, hashes=chained)._search  # the search stayed on


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), capacity=st.integers(1, 30), ttl=st.sampled_from((None, 1.0, 4.0)))
def test_matches_equal_the_scan_on_hand_made_hashes(ops, capacity, ttl) -> None:
    drive(ops, capacity=capacity, ttl=ttl, hashes=tuple)


def test_chained_prompts_take_the_binary_search_and_conflicts_fall_back() -> None:
    idx = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None)
    a, b = chained([1, 2, 3, 4]), chained([1, 2, 9])
    idx.record("r0", a, 0.0)
    idx.record("r1", b, 0.0)
    assert idx._prefix_closed(a) and idx._prefix_closed(chained([1, 2, 3, 7]))
    assert idx.match_many(("r0", "r1", "r2"), chained([1, 2, 3, 7]), 1.0) == [3, 2, 0]
    # a query whose second block was recorded after a different first block is scanned: a binary
    # search would find the held second block and answer 2
    assert not idx._prefix_closed((12345, a[1]))
    assert idx.match_blocks("r0", (12345, a[1]), 1.0) == 0
    # one block recorded after two different predecessors turns the search off for good
    idx.record("r2", (a[0], a[2]), 2.0)
    assert not idx._search
    assert idx.match_many(("r0", "r1", "r2"), a, 3.0) == [4, 2, 1]
    # so does a prompt that repeats a block
    again = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None)
    again.record("r0", (7, 8, 7), 0.0)
    assert not again._search


# ------------------------------------------------------------------------------- in the scoring routers
def snapshot(i: int, waiting: int, kv: float, tokens: int) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id=f"r{i:02d}", region="us", model="m", pool="default", healthy=True,
                           num_running=1, num_waiting=waiting, kv_usage=kv, outstanding_tokens=tokens,
                           max_model_len=4096, scraped_at_s=0.0)


def facts(n: int, prompt: tuple[int, ...]) -> RequestFacts:
    return RequestFacts(request_id=f"q{n}", tenant="t", tier="paid", session_id=None, prompt_tokens=16 * len(prompt),
                        expected_output_tokens=50, block_hashes=prompt, model="m", region=None,
                        allowed_regions=None, needs_long_context=False)


@pytest.mark.parametrize("kind", ["llm_d_scorer", "dynamo_kv_cost"])
@pytest.mark.parametrize("size", [3, SEARCH_MIN_CANDIDATES + 6])
def test_routers_decide_the_same_with_and_without_the_search(kind: str, size: int) -> None:
    """Sessions sharing system prompts, small LRUs and a TTL: every decision and every score is the one
    a router whose index always scans gives; the search is on exactly for the larger fleet."""
    params = {"kind": kind, "index_capacity_blocks": 60, "index_ttl_s": 5.0}
    fast, scan = build_router(params, seed=3), build_router(params, seed=3)
    scan.index.stop_searching()  # type: ignore[attr-defined]
    rng = SplitMix64(size)
    systems = [[rng.randrange(50) for _ in range(6)] for _ in range(3)]
    sessions = [list(systems[s % 3]) for s in range(12)]
    for n in range(400):
        session = sessions[rng.randrange(len(sessions))]
        session.extend(rng.randrange(10**6) for _ in range(1 + rng.randrange(3)))
        replicas = [snapshot(i, rng.randrange(4), rng.random(), rng.randrange(5000)) for i in range(size)]
        request, now = facts(n, chained(session)), n * 0.05
        a, b = fast.route(request, replicas, now), scan.route(request, replicas, now)
        assert a == b
        fast.on_routed(request, a.replica_id, now)  # type: ignore[arg-type]
        scan.on_routed(request, b.replica_id, now)  # type: ignore[arg-type]
    assert fast.index._search == (size >= SEARCH_MIN_CANDIDATES)  # type: ignore[attr-defined]
