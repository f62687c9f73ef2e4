"""The block pool's lazy prefix-cache registration: blocks registered without their hashes (docs/engine.md,
"Speed by design"; tests/test_kv_lazy.py).

Blocks whose content starts with a virtual segment are marked cached (``bhash[b]`` is a ``_Lazy`` entry) and
indexed by that segment; their hashes go into the hash map only before a lookup that could name them
(``_flush``), so the map then holds what eager registration would. A decode-group member's output blocks
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
        for e in entries:
            blocks, i1 = e.blocks, e.i1
            hashes = e.seq.block_hashes(i1)
            for i in range(e.i0, i1):
                b = blocks[i]
                if bhash[b] is e:
                    h = hashes[i]
                    bhash[b] = h
                    if h in cached:
                        dups.setdefault(h, []).append(b)
                    else:
                        cached[h] = b

    def materialise(self) -> dict[int, int]:
        """Every lazily registered block's hash into ``cached`` (for tests and inspection); returns ``cached``.
        Changes no behaviour: materialising early is what eager registration does."""
        for r in list(self.pend.values()):
            self._write_pending(r)
        for key in list(self.lazy):
            self._flush(key)
        return self.cached

    def _register_lazy(self, req: EngineRequest, key: int, i0: int, i1: int) -> None:
        """Blocks ``i0 .. i1 - 1`` of ``req`` become cached under ``key`` without their hashes: ``bhash[b]`` is
        the entry (continuing the request's last entry when it is the newest under ``key``)."""
        if self.pend:
            o = self.pend.get(key)
            if o is not None and o is not req:  # another request's deferred blocks under key come first
                self._write_pending(o)
        lst = self.lazy.get(key)
        e = req.kv_entry
        if lst is not None and lst[-1] is e and e.i1 == i0 and e.blocks is req.blocks:
            e.i1 = i1
            e.live += i1 - i0
        else:
            e = req.kv_entry = _Lazy(key, req.seq, req.blocks, i0, i1)
            if lst is None:
                self.lazy[key] = [e]
            else:
                lst.append(e)
            self.n_lazy += 1
        bhash = self.bhash
        if i1 - i0 == 1:
            bhash[req.blocks[i0]] = e
        else:
            for b in req.blocks[i0:i1]:
                bhash[b] = e

    def _write_pending(self, req: EngineRequest) -> None:
        """Register ``req``'s deferred full blocks (see ``pend``), as scheduling-time registration would have."""
        full = req.computed_now // self.block_size  # (a member's seq.num_tokens lags; its computed count <= it)
        if full > req.num_cached_blocks:
            self._cache_upto(req, full)

    def _drop(self, e: _Lazy) -> None:
        """Forget an entry none of whose blocks is cached any more (it would materialise nothing)."""
        lst = self.lazy[e.key]
        if len(lst) == 1:
            del self.lazy[e.key]
        else:
            lst.remove(e)  # (identity: _Lazy has no __eq__)
        self.n_lazy -= 1


class _Lazy:
    """Blocks ``blocks[i0:i1]`` of a request, cached (``bhash[b] is`` this entry) but not yet in ``cached``.

    Most cached blocks are evicted without any lookup ever naming them, so their hashes are computed only
    when a lookup could (``BlockPool._flush``): a lookup of a block whose content starts with segment ``k``
    first materialises every entry under ``k``, and equal hashes mean equal content, hence equal keys. The
    dictionary then holds what eager registration would hold, in the same order (``dups``, earliest first).
    ``blocks`` is the request's block list at registration (a released request gets a new list).
    """

    __slots__ = ("key", "seq", "blocks", "i0", "i1", "live")

    def __init__(self, key: int, seq: TokenSeq, blocks: list[int], i0: int, i1: int) -> None:
        self.key = key
        self.seq = seq
        self.blocks = blocks
        self.i0 = i0
        self.i1 = i1
        self.live = i1 - i0  # blocks whose ``bhash`` is this entry; dropped from the index at 0
