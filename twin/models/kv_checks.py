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
        for b in range(1, self.num_blocks):
            e = self.bhash[b]
            if e is not None and e.__class__ is not int:
                assert any(x is e for x in entries), f"block {b}: lazy entry not indexed"
                assert b in e.blocks[e.i0:e.i1], f"block {b}: outside its lazy entry"
        for e in entries:
            assert e.live == sum(1 for b in e.blocks[e.i0:e.i1] if self.bhash[b] is e) > 0, "lazy entry's live count"
