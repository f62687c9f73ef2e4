"""The router's approximate prefix index answers exactly as the plain per-replica LRU it stands for.

These tests drive ``ApproxPrefixIndex`` and a plain reference LRU with the same random records, matches,
expiries and forgets and compare every answer, size and LRU order, and after every step the index's
marked block -> holders map against a scan of the reference's marked blocks for every block seen so far
(and its stamps: no replica joined a list whose stamp stayed), and ``holders_at`` against the replicas whose
LRU holds each block of each prompt seen. The hashes chain, as the index requires (its docstring): prompts
from a tiny alphabet, so that they share prefixes often.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policies import ApproxPrefixIndex
from twin.policies.prng import SplitMix64

from prefixkit import chained


class ReferenceIndex:
    """The index as it was: per replica an LRU of hashes, the match a scan of the leading blocks."""

    def __init__(self, *, capacity_blocks: int, ttl_s: float | None, stride: int = 1, dense: int = 0) -> None:
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.lru: dict[str, OrderedDict[int, float]] = {}
        # per replica, the blocks in its LRU that some record put at a marked position (below dense, or a
        # multiple of stride) since they last entered it
        self.stride, self.dense = stride, dense
        self.marked: dict[str, set[int]] = {}

    def record(self, replica_id: str, block_hashes, now_s: float) -> None:
        lru = self.lru.setdefault(replica_id, OrderedDict())
        for h in reversed(block_hashes):
            lru[h] = now_s
            lru.move_to_end(h)
        self.marked.setdefault(replica_id, set()).update(
            h for p, h in enumerate(block_hashes) if p < self.dense or p % self.stride == 0)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
        self._expire(lru, now_s)
        self._unmark(replica_id)

    def _unmark(self, replica_id: str) -> None:
        """A block that leaves the LRU is no longer marked (it may come back unmarked)."""
        self.marked[replica_id] &= set(self.lru[replica_id])

    def match_blocks(self, replica_id: str, block_hashes, now_s: float) -> int:
        lru = self.lru.get(replica_id)
        if not lru:
            return 0
        self._expire(lru, now_s)
        self._unmark(replica_id)
        n = 0
        for h in block_hashes:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        self.lru.pop(replica_id, None)
        self.marked.pop(replica_id, None)

    def _expire(self, lru, now_s: float) -> None:
        if self.ttl_s is None:
            return
        while lru:
            h, t = next(iter(lru.items()))
            if now_s - t <= self.ttl_s:
                break
            del lru[h]


REPLICAS = ("r0", "r1", "r2")
prompt = st.lists(st.integers(0, 3), min_size=0, max_size=12)
op = st.tuples(st.sampled_from(("record", "match", "forget")), st.sampled_from(REPLICAS), prompt,
               st.floats(0.0, 3.0))


def drive(ops, *, capacity: int, ttl: float | None, stride: int, dense: int) -> ApproxPrefixIndex:
    fast = ApproxPrefixIndex(capacity_blocks=capacity, ttl_s=ttl, holder_stride=stride, holder_dense=dense)
    ref = ReferenceIndex(capacity_blocks=capacity, ttl_s=ttl, stride=stride, dense=dense)
    now = 0.0
    seen: set[int] = set()
    prompts: set[tuple[int, ...]] = set()
    stamped: dict[int, tuple[int, set[str]]] = {}  # stamp -> its block and the holders it last listed
    for kind, rid, tokens, dt in ops:
        now += dt
        bh = chained(tokens)
        seen.update(bh)
        prompts.add(bh)
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
            assert fast.lru_items(r) == list(ref.lru.get(r, {}).items())  # same LRU order
        marked = {r: ref.marked.get(r, set()) for r in REPLICAS}
        for bh in prompts:  # holds: block k of each prompt seen, against the reference's LRU
            for k, h in enumerate(bh):
                assert [fast.holds(r, bh, k) for r in REPLICAS] == [h in ref.lru.get(r, {}) for r in REPLICAS]
        for h in seen:  # the holders of each marked block are the replicas that hold it marked, by brute force
            held_by = sorted(r for r in REPLICAS if h in marked[r])
            assert sorted(fast.holders_at((h,), 0)) == held_by
            assert len(fast.holders_at((h,), 0)) == len(held_by)  # no replica twice
        assert set(fast._holders) <= seen and all(fast.holders_at((h,), 0) for h in fast._holders)  # none stale
        for h in seen:  # a stamp: 0 under two holders; one block's; the same only while no replica joins
            now_held, stamp = set(fast.holders_at((h,), 0)), fast.holders_stamp((h,), 0)
            assert (stamp == 0) == (len(now_held) < 2)
            if stamp:
                block, was = stamped.get(stamp, (h, now_held))
                assert block == h and now_held <= was
                stamped[stamp] = (h, now_held)
        # block k's holders are among holders_at(k): the holders of the marked block at or before it
        for bh in prompts:
            for k, h in enumerate(bh):
                got = set(fast.holders_at(bh, k))
                assert {r for r in REPLICAS if h in ref.lru.get(r, {})} <= got
                mark = k if k < dense else k - k % stride
                assert got == {r for r in REPLICAS if bh[mark] in ref.lru.get(r, {})}
    return fast


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), capacity=st.integers(1, 30), ttl=st.sampled_from((None, 1.0, 4.0)),
       stride=st.sampled_from((1, 2, 3, 8)), dense=st.sampled_from((0, 1, 3, 5)))
def test_matches_equal_the_scan(ops, capacity, ttl, stride, dense) -> None:
    drive(ops, capacity=capacity, ttl=ttl, stride=stride, dense=dense)


# longer prompts from two tokens: runs share long prefixes, so a record shortens runs by long ranges and the
# bisections for where a run's prompt and the new one part run several steps
long_op = st.tuples(st.sampled_from(("record", "record", "match", "forget")), st.sampled_from(REPLICAS),
                    st.lists(st.integers(0, 1), min_size=0, max_size=40), st.floats(0.0, 1.0))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(long_op, max_size=40), capacity=st.integers(1, 80), ttl=st.sampled_from((None, 2.0)),
       stride=st.sampled_from((1, 3, 8)), dense=st.sampled_from((0, 4)))
def test_matches_equal_the_scan_on_long_shared_prompts(ops, capacity, ttl, stride, dense) -> None:
    drive(ops, capacity=capacity, ttl=ttl, stride=stride, dense=dense)


def test_holds_is_false_only_for_blocks_not_held() -> None:
    idx = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None)
    a, b = chained([1, 2, 3, 4]), chained([1, 2, 9])
    idx.record("r0", a, 0.0)
    idx.record("r1", b, 0.0)
    assert idx.match_many(("r0", "r1", "r2"), chained([1, 2, 3, 7]), 1.0) == [3, 2, 0]
    assert idx.holds("r0", a, 3) and not idx.holds("r1", a, 3) and not idx.holds("r2", a, 0)
    assert idx.holds("r1", a, 1) and not idx.holds("r1", a, 2)


def test_holders_follow_records_evictions_expiries_and_forgets() -> None:
    idx = ApproxPrefixIndex(capacity_blocks=3, ttl_s=10.0, holder_stride=1, holder_dense=0)
    a, b = chained([1, 2, 3]), chained([1, 2, 9])
    idx.record("r0", a, 0.0)
    idx.record("r1", b, 5.0)
    assert [sorted(idx.holders_at(a, k)) for k in range(3)] == [["r0", "r1"], ["r0", "r1"], ["r0"]]
    assert list(idx.holders_at(b, 2)) == ["r1"] and list(idx.holders_at((12345,), 0)) == []
    idx.record("r0", chained([7]), 6.0)  # capacity 3: r0's leaf a[2] (its least recently used) goes
    assert list(idx.holders_at(a, 2)) == []
    assert idx.match_blocks("r0", a, 12.0) == 0  # past the TTL: r0's a[0], a[1] expire; r1's stay
    assert [sorted(idx.holders_at(a, k)) for k in range(2)] == [["r1"], ["r1"]]
    idx.forget("r1")
    assert [list(idx.holders_at((*a, *b), k)) for k in range(6)] == [[]] * 6
    assert list(idx.holders_at(chained([7]), 0)) == ["r0"]


def test_holders_at_answers_for_the_marked_block_at_or_before_k() -> None:
    """With a stride of 2 only blocks 0, 2, 4, ... are kept: block 3's holders are block 2's, a superset."""
    idx = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None, holder_stride=2, holder_dense=0)
    a, b = chained([1, 2, 3, 4, 5]), chained([1, 2, 3, 9])
    idx.record("r0", a, 0.0)
    idx.record("r1", b, 1.0)
    assert [sorted(idx.holders_at(a, k)) for k in range(5)] == [["r0", "r1"]] * 4 + [["r0"]]
    assert sorted(idx._holders) == sorted({a[0], a[2], a[4]})  # b's marked blocks are a's two first
    assert sorted(idx.holders_at(b, 3)) == ["r0", "r1"]  # only r1 holds b[3]; both hold b[2]
    idx.forget("r0")
    assert [sorted(idx.holders_at(a, k)) for k in range(5)] == [["r1"]] * 4 + [[]]
    dense = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None, holder_stride=4, holder_dense=3)
    dense.record("r0", a, 0.0)  # marked: blocks 0, 1, 2 (below 3) and 4 (a multiple of 4)
    assert sorted(dense._holders) == sorted({a[0], a[1], a[2], a[4]})
    assert [dense.holders_at(a, k) == ("r0",) for k in range(5)] == [True] * 5


def test_emptied_runs_do_not_pile_up() -> None:
    """The same prompts recorded over and over empty every earlier run; an LRU that never fills nor ages must
    not keep them all (they are dropped once they outnumber the live runs), and its order stays the scan's."""
    idx = ApproxPrefixIndex(capacity_blocks=100, ttl_s=None)
    ref = ReferenceIndex(capacity_blocks=100, ttl_s=None)
    a, b = chained([1, 2, 3]), chained([1, 2, 4])
    for i in range(1000):
        idx.record("r0", b if i % 3 == 0 else a, float(i))
        ref.record("r0", b if i % 3 == 0 else a, float(i))
        assert len(idx._runs["r0"]) <= 2 * 2 + 64 + 1
        assert idx.lru_items("r0") == list(ref.lru["r0"].items())
    assert idx.lru_items("r0") == [
        (a[2], 998.0), (b[2], 999.0), (a[1], 999.0), (a[0], 999.0)]


def test_long_drives_through_the_dropping_of_emptied_runs() -> None:
    """Long random drives (hundreds of records on two replicas, so emptied runs are dropped many times), checked
    against the reference after every step as the property tests are."""
    rng = SplitMix64(7)
    for capacity, ttl in ((1000, None), (40, None), (1000, 30.0)):
        sessions = [[rng.randrange(3)] for _ in range(6)]
        ops = []
        for _ in range(400):
            s = sessions[rng.randrange(len(sessions))]
            if rng.random() < 0.5:
                s.append(rng.randrange(4))
            x = rng.random()
            kind = "forget" if x < 0.005 else "match" if x < 0.2 else "record"
            ops.append((kind, REPLICAS[rng.randrange(2)], list(s), rng.random()))
        idx = drive(ops, capacity=capacity, ttl=ttl, stride=3, dense=4)
        assert max(len(q) for q in idx._runs.values()) <= 2 * max(len(r) for r in idx._roots.values()) + 65
