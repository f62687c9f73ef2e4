"""The router's approximate prefix index answers exactly as the plain per-replica LRU it stands for.

These tests drive ``ApproxPrefixIndex`` and a plain reference LRU with the same random records, matches,
expiries and forgets and compare every answer, size and LRU order, and after every step the index's
block -> holders map against a scan of the reference LRUs for every block seen so far.
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
    seen: set[int] = set()
    for kind, rid, tokens, dt in ops:
        now += dt
        bh = hashes(tokens)
        seen.update(bh)
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
        for h in seen:  # the holders of each block are the replicas whose LRU holds it, by brute force
            held_by = sorted(r for r in REPLICAS if h in ref.lru.get(r, {}))
            assert sorted(fast.holders(h)) == held_by
            assert len(fast.holders(h)) == len(held_by)  # no replica twice
            assert all(fast.holds(r, h) == (r in held_by) for r in REPLICAS)
        assert set(fast._holders) <= seen and all(fast.holders(h) for h in fast._holders)  # nothing stale kept
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


def test_holders_follow_records_evictions_expiries_and_forgets() -> None:
    idx = ApproxPrefixIndex(capacity_blocks=3, ttl_s=10.0)
    a, b = chained([1, 2, 3]), chained([1, 2, 9])
    idx.record("r0", a, 0.0)
    idx.record("r1", b, 5.0)
    assert [sorted(idx.holders(h)) for h in a] == [["r0", "r1"], ["r0", "r1"], ["r0"]]
    assert list(idx.holders(b[2])) == ["r1"] and list(idx.holders(12345)) == []
    idx.record("r0", chained([7]), 6.0)  # capacity 3: r0's leaf a[2] (its least recently used) goes
    assert list(idx.holders(a[2])) == []
    assert idx.match_blocks("r0", a, 12.0) == 0  # past the TTL: r0's a[0], a[1] expire; r1's stay
    assert [sorted(idx.holders(h)) for h in a[:2]] == [["r1"], ["r1"]]
    idx.forget("r1")
    assert [list(idx.holders(h)) for h in (*a, *b)] == [[]] * 6
    assert list(idx.holders(chained([7])[0])) == ["r0"]
