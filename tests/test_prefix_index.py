"""The router's approximate prefix index answers exactly as the plain per-replica LRU it stands for.

These tests drive ``ApproxPrefixIndex`` and a plain reference LRU with the same random records, matches,
expiries and forgets and compare every answer, size and LRU order.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policies import ApproxPrefixIndex

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
            assert list(fast._lru.get(r, {}).items()) == list(ref.lru.get(r, {}).items())  # same LRU order
    return fast


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), capacity=st.integers(1, 30), ttl=st.sampled_from((None, 1.0, 4.0)))
def test_matches_equal_the_scan_on_chained_hashes(ops, capacity, ttl) -> None:
    drive(ops, capacity=capacity, ttl=ttl, hashes=chained)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), capacity=st.integers(1, 30), ttl=st.sampled_from((None, 1.0, 4.0)))
def test_matches_equal_the_scan_on_hand_made_hashes(ops, capacity, ttl) -> None:
    drive(ops, capacity=capacity, ttl=ttl, hashes=tuple)


def test_holds_is_false_only_for_blocks_not_held() -> None:
    idx = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None)
    a, b = chained([1, 2, 3, 4]), chained([1, 2, 9])
    idx.record("r0", a, 0.0)
    idx.record("r1", b, 0.0)
    assert idx.match_many(("r0", "r1", "r2"), chained([1, 2, 3, 7]), 1.0) == [3, 2, 0]
    assert idx.holds("r0", a[3]) and not idx.holds("r1", a[3]) and not idx.holds("r2", a[0])
