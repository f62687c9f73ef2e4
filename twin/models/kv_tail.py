"""The tail of the block pool's free queue (the cached-free blocks, LRU by release time) as a queue of runs.

A release puts a request's registered blocks at the tail in one go (last block first), and pops take them
off the front in that order, so the tail is kept as the runs releases append (``_Run``: a range of the
released request's reversed block list, sharing that list) rather than block by block. Each tail entry has
an absolute *position* (``front`` is the next one to pop; positions only grow).

- A *plain* run is one lazily registered entry's blocks (``twin.models.kv_lazy._Lazy``): no block of it has a
  hash, none can be a prefix hit (a lookup could name them only once materialised), so none can leave the
  tail but by the front. It stores nothing per block: the release is a list reversal, a pop a list slice.
  Its blocks' state words keep their "held by one" value (see ``BlockPool.st``).
- Any other run (blocks registered with their hashes, a materialised entry's, or a release by the per-block
  path) has its blocks' tail positions in ``st``; a prefix hit takes a block out of the middle by changing its
  state, leaving a stale entry that pops skip (lazy deletion, as vLLM's doubly linked list would unlink it).

(The tail was an ``array`` of block ids with every position in ``st``: a release packed ~120 ids and stored
~120 positions, a pop converted the ids back to ints and read their hashes: for the usual request, all of
whose blocks are registered lazily, pops and releases were ~20% of the single-replica benchmark's py-spy
samples; the runs and per-entry lazy bookkeeping took ~14% of its instructions off, callgrind.)

``TailQueue`` is mixed into ``twin.models.kv.BlockPool`` and works on its attributes.
"""

from __future__ import annotations

from collections import deque
from itertools import islice, takewhile
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from twin.models.kv_lazy import _Lazy
    from twin.models.request import EngineRequest


class _Run:
    """Tail entries ``ids[a:b]`` (in tail order) at positions ``pos .. end - 1``; ``entry``: the lazy entry whose
    blocks they are (None for a run made with positions in ``st``). The run is plain while that entry is not
    materialised (``_flush`` then writes the positions). (The entry does not point back at its run: a cycle
    would leave every released request's entry, run and token sequence to the cyclic garbage collector.)"""

    __slots__ = ("ids", "a", "b", "pos", "end", "entry")

    def __init__(self, ids: list[int], a: int, b: int, pos: int, entry: _Lazy | None) -> None:
        self.ids = ids
        self.a = a
        self.b = b
        self.pos = pos
        self.end = pos + b - a
        self.entry = entry


class TailQueue:
    """``BlockPool``'s tail operations (see the module docstring)."""

    __slots__ = ()

    def _pop_tail(self, n: int, out: list[int]) -> None:
        """Pop ``n`` blocks off the front of the tail into ``out`` (n <= tail_len), evicting their hashes."""
        q, st, bhash = self.tail, self.st, self.bhash
        self.tail_len -= n
        f = self.front
        while n:
            r = q[0]
            j = r.a + f - r.pos
            e = r.entry
            if e is not None and not e.flushed:  # plain: every entry valid, no hash
                k = r.b - j
                if k > n:
                    k = n
                out.extend(r.ids[j:j + k])
                n -= k
                f += k
            else:
                ids, b_end = r.ids, r.b
                cached, dups = self.cached, self.dups
                k = b_end - j
                if k > n:
                    k = n
                if k > 1 and not dups:
                    # Bulk: when the next k entries are all valid (their states read in one C-level pass), pop
                    # them at once; with no duplicate hash, each block's hash maps to that very block.
                    blk = ids[j:j + k]
                    if itemgetter(*blk)(st) == tuple(range(f, f + k)):
                        hs = itemgetter(*blk)(bhash)
                        if hs.count(None) != k:
                            for b, h in zip(blk, hs):
                                if h is not None:
                                    bhash[b] = None
                                    del cached[h]
                        out.extend(blk)
                        n -= k
                        f += k
                        j = b_end  # (ends the loop below when the run is done; else n is 0)
                while n and j < b_end:
                    b = ids[j]
                    if st[b] == f:  # (else a stale entry: its block was taken by a prefix hit)
                        # (st keeps the consumed position: "held by one", see BlockPool.__init__)
                        h = bhash[b]
                        if h is not None:
                            if h in dups:
                                self._uncache(b, h)
                            else:
                                bhash[b] = None
                                if cached.get(h) == b:
                                    del cached[h]
                        out.append(b)
                        n -= 1
                    j += 1
                    f += 1
            if f == r.end:
                q.popleft()
        self.front = f
        runs = self.runs
        if runs and runs[0].end <= f:
            self._runs_passed()

    def _hashed_run(self, ids: list[int], a: int, b: int, pos: int) -> None:
        """Append ``ids[a:b]`` as a run with positions: ``st[ids[k]] = pos + k - a``."""
        self.tail.append(_Run(ids, a, b, pos, None))
        if b - a > 16:  # one numpy store (a Python loop of stores at scattered block ids costs more)
            self.stv[np.array(ids[a:b], np.intp)] = np.arange(pos, pos + b - a)
        else:
            st = self.st
            for k in range(a, b):
                st[ids[k]] = pos + k - a

    def release(self, req: EngineRequest) -> None:
        """Free a finished or preempted request's blocks, tail first."""
        st, head = self.st, self.head
        blocks = req.blocks
        nb = len(blocks)
        ncb = req.num_cached_blocks
        shared = self.shared
        # The blocks with other holders too, when they lead the request's blocks: prefix hits on blocks that
        # running requests hold (a tenant's system prompt), which come first in ``blocks``. (In the fleet
        # benchmark at 0.0625x they lead in every release that has any: ~50 of ~131 blocks.) ``alone``: no block
        # after those has another holder either.
        if not shared:
            m, alone = 0, True
        elif not self.dups:
            m, alone = _leading(shared, blocks), True  # (they can only lead: see _leading)
        else:
            m = len(list(takewhile(shared.__contains__, blocks)))
            alone = shared.isdisjoint(islice(blocks, m, None))
        if nb - m > 8 and ncb >= nb - 1 and alone:
            # The usual case: the request is the only holder of each of its blocks past those ``m``, and only
            # its last block may be unregistered (``num_cached_blocks`` counts the registered ones, by hash or
            # lazily). The loop below would lose one holder of each of the ``m`` (none of them its last), put the
            # last block at the head and append the others to the tail in reverse order: the same, with the
            # others as a list reversal.
            for i in range(m):
                b = blocks[i]
                x = st[b]
                st[b] = x + 1
                if x == -3:
                    shared.remove(b)
            rev = blocks[::-1]
            if ncb < nb:
                last = rev[0]
                st[last] = -1
                head[last] = None
                head.move_to_end(last, last=False)
                self._append(req, rev, 1, nb - m, True)
            else:
                self._append(req, rev, 0, nb - m, True)
        else:
            tail = []
            for i in range(nb - 1, -1, -1):
                b = blocks[i]
                x = st[b]
                if x == -2 or x >= 0:  # its last holder (held, so x >= 0 is a consumed tail position)
                    if i >= ncb:  # not registered (a held block is registered iff it is among the first ncb)
                        st[b] = -1
                        head[b] = None
                        head.move_to_end(b, last=False)
                    else:
                        tail.append(b)
                else:
                    st[b] = x + 1
                    if x == -3:
                        shared.remove(b)
            if tail:
                self._append(req, tail, 0, len(tail), False)
        req.blocks = []
        req.num_cached_blocks = 0
        req.kv_entry = None

    def _append(self, req: EngineRequest, ids: list[int], a: int, b: int, whole: bool) -> None:
        """``req``'s blocks ``ids[a:b]`` (tail order) onto the tail: a plain run for each of its lazy entries (whose
        blocks are all here, one after another: they are registered and held by ``req`` alone) and runs with
        positions between them. ``whole``: ``ids`` is ``req.blocks`` reversed, so an entry's place is known."""
        start = self.tail_end - a  # (the position of ids[k] is start + k)
        self.tail_end = start + b
        self.tail_len += b - a
        e = req.kv_entry
        if e is None:
            self._hashed_run(ids, a, b, start + a)
            return
        q, runs = self.tail, self.runs
        nb = len(ids)
        cur = a
        while e is not None:  # newest first: its blocks are the request's later ones, first in ``ids``
            if not e.flushed:
                ra = nb - e.i1 if whole else ids.index(e.blocks[e.i1 - 1], cur)  # (block i is rev[nb - 1 - i])
                if ra > cur:
                    self._hashed_run(ids, cur, ra, start + cur)
                cur = ra + e.i1 - e.i0
                run = _Run(ids, ra, cur, start + ra, e)
                q.append(run)
                e.pos = run.pos
                e.end = run.end
                runs.append(e)
            nxt = e.prev
            e.prev = None
            e = nxt
        if cur < b:
            self._hashed_run(ids, cur, b, start + cur)

    def _tail_order(self) -> list[int]:
        """The tail's valid entries, front first."""
        st, f, out = self.st, self.front, []
        for r in self.tail:
            j = r.a + max(f - r.pos, 0)
            if r.entry is not None and not r.entry.flushed:
                out.extend(r.ids[j:r.b])
            else:
                p = r.pos + j - r.a
                out.extend(b for k, b in enumerate(r.ids[j:r.b]) if st[b] == p + k)
        return out

    def _maybe_rebuild(self) -> None:
        """After prefix hits took blocks out of the middle of the tail: once its stale entries outnumber the
        valid ones (+ 4096), rebuild it with fresh positions (amortised O(1); the queue order is the same)."""
        if self.tail_end - self.front - self.tail_len <= self.tail_len + 4096:
            return
        st, f = self.st, self.front
        pos = self.tail_end  # fresh positions: no old entry or consumed position can match them
        self.front = pos
        q = deque()
        for r in self.tail:
            j = r.a + max(f - r.pos, 0)
            e = r.entry
            if e is not None and not e.flushed:  # plain: the entry's blocks still cached, at their new positions
                run = _Run(r.ids, j, r.b, pos, e)
                e.pos = run.pos
                e.end = run.end
            else:
                p = r.pos + j - r.a
                keep = [b for k, b in enumerate(r.ids[j:r.b]) if st[b] == p + k]
                if not keep:
                    continue
                run = _Run(keep, 0, len(keep), pos, None)
                for k, b in enumerate(keep):
                    st[b] = pos + k
            q.append(run)
            pos = run.end
        self.tail = q
        self.tail_end = pos
        # (every released entry's run is plain, so ``runs`` holds them in the new order; the flushed ones and
        # those the front has passed are dropped, as _runs_passed would)
        runs = deque()
        for e in self.runs:
            if not e.flushed:
                if e.end <= f:  # (unreachable: pops drop them first)
                    self._drop(e)
                else:
                    runs.append(e)
        self.runs = runs


def _leading(shared: set[int], blocks: list[int]) -> int:
    """How many of a request's blocks lead it with another holder, while no hash has two cached copies
    (``BlockPool.dups`` empty): its blocks with another holder are then a prefix of ``blocks``, so a bisection
    finds where it ends.

    Why: another holder of the request's block i took it by a prefix hit (of the request's block, or the request
    took its), and a hit takes the cached block of every hash before i too. Either that is the request's own
    block j for each j < i (then it has another holder as well), or a second copy with the same hash, which the
    other holder still holds, as the request holds its own: two held, registered copies, one of them in ``dups``
    (a held block keeps its hash; only a pop of a free block drops it, and a lookup materialises the lazily
    registered copies under its keys first, ``_flush``). ``tests/test_kv_release_shared.py`` checks the prefix
    at every release of random drives and of a fleet run."""
    n = len(blocks)
    if not n or blocks[0] not in shared:
        return 0
    if blocks[n - 1] in shared:
        return n
    lo, hi = 1, n - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if blocks[mid] in shared:
            lo = mid + 1
        else:
            hi = mid
    return lo
