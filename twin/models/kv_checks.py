"""The block pool's inspection helpers for tests: its free queue, a block's ref count, and the invariants that tie
its arrays together. ``PoolChecks`` is mixed into ``twin.models.kv.BlockPool`` and reads its attributes (split
out to keep ``kv.py`` about the pool's operations)."""

from __future__ import annotations


class PoolChecks:
    """``BlockPool``'s read-only helpers for tests (see the module docstring)."""

    __slots__ = ()

    def free_order(self) -> list[int]:
        """The free queue, head first (for tests)."""
        return [*self.head, *range(self.fresh, self.num_blocks), *self._tail_order()]

    def ref_count(self, b: int) -> int:
        """Requests holding block ``b``."""
        x = self.st[b]
        if x >= 0:
            return 1 if x < self.tail_base + self.tail_first else 0
        return -1 - x if x <= -2 else 0

    def check_invariants(self) -> None:
        """For tests: ref counts, free queue and hash map agree; nothing leaks."""
        free = set(self.free_order())
        assert len(free) == self.num_free, "a block is in the free queue twice"
        tail = set(self._tail_order())
        for b in range(1, self.num_blocks):
            ref = self.ref_count(b)
            assert (ref == 0) == (b in free), f"block {b}: ref {ref} vs free queue"
            front = self.tail_base + self.tail_first
            assert (self.st[b] >= front) == (b in tail), f"block {b}: state {self.st[b]} vs the tail"
        for h, b in self.cached.items():
            assert self.bhash[b] == h
        assert 0 not in free
        for key, r in self.pend.items():
            assert r.seq._out_seg == key and r._grp is not None, f"deferred registration of a non-member under {key}"
        entries = [e for lst in self.lazy.values() for e in lst]
        assert len(entries) == self.n_lazy
        front = self.tail_base + self.tail_first
        runs = list(self.runs)
        assert all(a.end <= b.end for a, b in zip(runs, runs[1:])), "released lazy entries out of tail order"
        covered: set[int] = set()
        for e in entries:
            assert not e.flushed, "a materialised entry still indexed"
            if e.end is None:  # held by its request
                live = e.blocks[e.i0:e.i1]
                assert all(self.ref_count(b) == 1 for b in live), "a lazy block held by another request too"
            else:
                assert any(x is e for x in runs), "a released lazy entry not in runs"
                low = max(front, e.pos)
                k = e.end - low
                assert 0 < k <= e.i1 - e.i0, "a lazy entry's run"
                live = e.blocks[e.i0:e.i0 + k]
                assert [self.st[b] for b in live] == list(range(low + k - 1, low - 1, -1)), "lazy run vs the tail"
            for b in live:
                assert self.bhash[b] is None, f"block {b}: a lazily registered block with a hash"
                assert b not in covered, f"block {b}: in two lazy entries"
                covered.add(b)
        for b in tail:  # a freed block goes to the tail iff registered: by hash or by a lazy entry
            assert self.bhash[b] is not None or b in covered, f"block {b}: in the tail, not registered"
