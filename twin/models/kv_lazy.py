"""The block pool's lazy prefix-cache registration: blocks registered without their hashes (docs/engine.md,
"Speed by design"; tests/test_kv_lazy.py).

Blocks whose content starts with a virtual segment are registered (counted in their request's
``num_cached_blocks``, so they go to the tail when freed) without a hash, and indexed by that segment
(``_Lazy`` entries, one per run of a request's blocks, with nothing stored per block); their hashes go into
the hash map only before a lookup that could name them (``_flush``), so the map then holds what eager
registration would. A decode-group member's output blocks
are registered later still, deferred until it leaves the group or a lookup or another registration under
its output segment comes first (``BlockPool.pend``, ``_write_pending``).

``LazyIndex`` is mixed into ``twin.models.kv.BlockPool`` and works on its attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twin.models.request import EngineRequest
    from twin.models.tokens import TokenSeq


class LazyIndex:
    """``BlockPool``'s lazy-registration methods (see the module docstring)."""

    __slots__ = ()

    def _flush(self, key: int) -> None:
        """Materialise the blocks registered under ``key`` that are still cached: their hashes into ``cached``
        (or ``dups``) in registration order, as eager registration would have left them."""
        entries = self.lazy.pop(key)
        self.n_lazy -= len(entries)
        bhash, cached, dups = self.bhash, self.cached, self.dups
        front = self.front
        for e in entries:
            e.flushed = True
            i0, i1 = e.i0, e.i1
            if e.end is not None:  # released: the front has evicted its blocks from i1 - 1 down (see _Lazy)
                i1 = i0 + e.end - max(front, e.pos)
            blocks = e.blocks
            hashes = e.seq.block_hashes(i1)
            e.seq = e.blocks = None  # (its tail run may keep the entry a while: not its request's sequence)
            for i in range(i0, i1):
                b = blocks[i]
                h = hashes[i]
                bhash[b] = h
                if h in cached:
                    dups.setdefault(h, []).append(b)
                else:
                    cached[h] = b
            if e.end is not None:  # its tail run is no longer plain (kv_tail): positions into ``st``
                st, top = self.st, e.end - 1 + i0  # (blocks[i] sits at position e.end - 1 - (i - i0))
                for i in range(i0, i1):
                    st[blocks[i]] = top - i

    def materialise(self) -> dict[int, int]:
        """Every lazily registered block's hash into ``cached`` (for tests and inspection); returns ``cached``.
        Changes no behaviour: materialising early is what eager registration does."""
        for r in list(self.pend.values()):
            self._write_pending(r)
        for key in list(self.lazy):
            self._flush(key)
        return self.cached

    def _register_lazy(self, req: EngineRequest, key: int, i0: int, i1: int) -> None:
        """Blocks ``i0 .. i1 - 1`` of ``req`` become cached under ``key`` without their hashes (``bhash`` stays
        None): an entry, or the request's last entry continued when it is the newest under ``key``. Nothing is
        stored per block: which of an entry's blocks are still cached follows from its tail run (see _Lazy)."""
        if self.pend:
            o = self.pend.get(key)
            if o is not None and o is not req:  # another request's deferred blocks under key come first
                self._write_pending(o)
        lst = self.lazy.get(key)
        e = req.kv_entry
        if lst is not None and lst[-1] is e and e.i1 == i0 and e.blocks is req.blocks:
            e.i1 = i1
        else:
            req.kv_entry = e = _Lazy(key, req.seq, req.blocks, i0, i1, e)
            if lst is None:
                self.lazy[key] = [e]
            else:
                lst.append(e)
            self.n_lazy += 1

    def _write_pending(self, req: EngineRequest) -> None:
        """Register ``req``'s deferred full blocks (see ``pend``), as scheduling-time registration would have."""
        full = req.computed_now // self.block_size  # (a member's seq.num_tokens lags; its computed count <= it)
        if full > req.num_cached_blocks:
            self._cache_upto(req, full)

    def _runs_passed(self) -> None:
        """Forget the entries whose whole run the tail's front has passed (every block evicted). Hot callers
        test ``runs and runs[0].end <= front`` themselves before calling."""
        runs, front = self.runs, self.front
        while runs and runs[0].end <= front:
            e = runs.popleft()
            if not e.flushed:
                self._drop(e)

    def _drop(self, e: _Lazy) -> None:
        """Forget an entry none of whose blocks is cached any more (it would materialise nothing)."""
        lst = self.lazy[e.key]
        if len(lst) == 1:
            del self.lazy[e.key]
        else:
            lst.remove(e)  # (identity: _Lazy has no __eq__)
        self.n_lazy -= 1


class _Lazy:
    """Blocks ``blocks[i0:i1]`` of a request, cached but not yet in ``cached`` (their ``bhash`` is None).

    Most cached blocks are evicted without any lookup ever naming them, so their hashes are computed only
    when a lookup could (``BlockPool._flush``): a lookup of a block whose content starts with segment ``k``
    first materialises every entry under ``k``, and equal hashes mean equal content, hence equal keys. The
    dictionary then holds what eager registration would hold, in the same order (``dups``, earliest first).
    ``blocks`` is the request's block list at registration (a released request gets a new list).

    Which blocks are still cached needs no per-block state: an entry's blocks are held by its request alone
    (a lookup could name them only once materialised) until it releases them; the release appends them to
    the tail as one plain run (``twin.models.kv_tail``), ``blocks[i1 - 1]`` at position ``pos`` to ``blocks[i0]``
    at ``end - 1``; nothing takes them out of the middle of the tail (only a prefix hit does), so the front
    evicts them in that order and ``blocks[i0:i0 + end - max(front, pos)]`` are the ones left. ``end`` is None
    while the request holds them.
    (Registering a block was a store per block and evicting one a read per block; the bookkeeping is now per
    entry: a prompt's ~100 blocks are one entry.)
    """

    __slots__ = ("key", "seq", "blocks", "i0", "i1", "prev", "pos", "end", "flushed")

    def __init__(self, key: int, seq: TokenSeq, blocks: list[int], i0: int, i1: int, prev: _Lazy | None) -> None:
        self.key = key
        self.seq = seq
        self.blocks = blocks
        self.i0 = i0
        self.i1 = i1
        self.prev = prev  # the request's previous entry (the release makes a run of each; then None)
        self.pos: int = 0
        self.end: int | None = None
        self.flushed = False  # materialised (out of the index; its blocks carry their hashes)
