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

    def _in_plain_runs(self) -> set[int]:
        """Blocks in the tail's plain runs (their state words keep a "held by one" value: see kv_tail)."""
        f, out = self.front, set()
        for r in self.tail:
            if r.entry is not None and not r.entry.flushed:
                out.update(r.ids[r.a + max(f - r.pos, 0):r.b])
        return out

    def ref_count(self, b: int, plain: set[int] | None = None) -> int:
        """Requests holding block ``b`` (``plain``: ``_in_plain_runs()``, if the caller has it)."""
        if b >= len(self.st) or b in (self._in_plain_runs() if plain is None else plain):
            return 0  # (past the per-block arrays: never used)
        x = self.st[b]
        if x >= 0:
            return 1 if x < self.front else 0
        return -1 - x if x <= -2 else 0

    def check_invariants(self) -> None:
        """For tests: ref counts, free queue and hash map agree; nothing leaks."""
        order = self.free_order()
        free = set(order)
        assert len(free) == len(order) == self.num_free, "a block is in the free queue twice"
        tail = set(self._tail_order())
        plain = self._in_plain_runs()
        assert plain <= tail
        front = self.front
        runs_q = list(self.tail)
        assert all(a.end == b.pos for a, b in zip(runs_q, runs_q[1:])), "tail runs not contiguous"
        assert not runs_q or (runs_q[0].pos <= front < runs_q[0].end and runs_q[-1].end == self.tail_end)
        assert len(self.st) == len(self.bhash) and self.fresh <= len(self.st) <= self.num_blocks, \
            "the per-block arrays do not cover the blocks handed out"
        assert all(x == -1 for x in self.st[self.fresh:]) and all(h is None for h in self.bhash[self.fresh:]), \
            "a block never handed out has a state or a hash"
        for b in range(1, self.fresh):  # (blocks from fresh on are never used: free, no state, no hash)
            ref = self.ref_count(b, plain)
            assert (ref == 0) == (b in free), f"block {b}: ref {ref} vs free queue"
            assert (self.st[b] >= front) == (b in tail and b not in plain), f"block {b}: state {self.st[b]} vs the tail"
        for h, b in self.cached.items():
            assert self.bhash[b] == h
        assert self.shared == {b for b in range(1, self.fresh) if self.ref_count(b, plain) >= 2}, \
            "the shared set is not the blocks with two or more holders"
        assert 0 not in free
        for key, r in self.pend.items():
            assert r.seq._out_seg == key and r._grp is not None, f"deferred registration of a non-member under {key}"
        entries = [e for lst in self.lazy.values() for e in lst]
        assert len(entries) == self.n_lazy
        runs = list(self.runs)
        assert all(a.end <= b.end for a, b in zip(runs, runs[1:])), "released lazy entries out of tail order"
        covered: set[int] = set()
        for e in entries:
            assert not e.flushed, "a materialised entry still indexed"
            if e.end is None:  # held by its request
                live = e.blocks[e.i0:e.i1]
                assert all(self.ref_count(b, plain) == 1 for b in live), "a lazy block held by another request too"
            else:
                assert any(x is e for x in runs), "a released lazy entry not in runs"
                low = max(front, e.pos)
                k = e.end - low
                assert 0 < k <= e.i1 - e.i0, "a lazy entry's run"
                live = e.blocks[e.i0:e.i0 + k]
                mine = [r for r in self.tail if r.entry is e]  # a released entry's blocks are a plain run (kv_tail)
                assert len(mine) == 1, "the entry's plain run"
                r = mine[0]
                assert r.pos == e.pos and r.end == e.end, "the entry's plain run"
                assert r.ids[r.a + max(front - r.pos, 0):r.b] == live[::-1], "the entry's plain run"
            for b in live:
                assert self.bhash[b] is None, f"block {b}: a lazily registered block with a hash"
                assert b not in covered, f"block {b}: in two lazy entries"
                covered.add(b)
        assert plain <= covered, "a plain run's block outside a live lazy entry"
        for b in tail:  # a freed block goes to the tail iff registered: by hash or by a lazy entry
            assert self.bhash[b] is not None or b in covered, f"block {b}: in the tail, not registered"
