"""Paged KV blocks with prefix caching, following vLLM V1's BlockPool (semantics §3).

- A real block count: block 0 is the permanent null block, so ``num_gpu_blocks - 1`` are usable.
- Free queue = every block with ref_cnt 0, cached ones included (they are eviction candidates). Popped
  from the head on allocation; a popped block that carries a hash is evicted from the hash map then
  (lazy eviction, the only eviction point).
- Freed blocks are released tail-first; a block that reaches ref_cnt 0 goes to the *tail* if it carries a
  hash (LRU by release time) and to the *head* if not (reused first).
- Only full blocks are hashed, when the step that computes them is scheduled. Duplicate hashes (two
  requests computing the same block at once) keep both copies; lookups return the earliest.
- Prefix hits are capped at ``num_tokens - 1`` tokens (one token must be recomputed for logits).

Hot-path code: plain lists and typed arrays, no per-block objects. The tail of the free queue (cached
blocks, LRU by release time) is a queue of runs of released block lists read from a moving front with lazy
deletion (``twin.models.kv_tail``; a list entry's 8 bytes instead of an OrderedDict node's ~100: a fleet holds
hundreds of pools of ~87k blocks). A block's ref count and tail position share one state word (``st``).

Blocks whose content starts with a virtual segment are registered lazily (``twin.models.kv_lazy``): counted
as cached by an entry per run of a request's blocks (no hash, nothing stored per block), hashed and put into
``cached`` only before a lookup that could name them; the map then holds what eager registration would
(docs/engine.md, "Speed by design"; tests/test_kv_lazy.py, tests/test_kv_runs.py).

Memory note: a pool whose blocks are all cached holds ``cached`` (hash -> block) and the hashes
themselves for the blocks materialised; those dominate what is left (~11 MB for 87k blocks, all hashed). Block ids
are int objects shared by every pool (``_block_ids``), not one per block of each.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import numpy as np

from twin.models.kv_checks import PoolChecks
from twin.models.kv_lazy import LazyIndex
from twin.models.kv_tail import TailQueue

if TYPE_CHECKING:
    from twin.models.kv_lazy import _Lazy
    from twin.models.kv_tail import _Run
    from twin.models.request import EngineRequest


_FIRST_CAP = 4096  # blocks the per-block arrays cover before a pool's first _grow

# Block ids handed out by every pool: id k is the same int object in all of them. Ids past 256 are not CPython's
# cached small ints, so ``range`` made a new object per block of every pool (a fleet of 540 pools of ~87k blocks:
# ~47M ints, ~1.5 GB, each read wherever its block is, a cache miss when cold); shared, they are one per id.
_BLOCK_IDS: list[int] = []
_BLOCK_IDS_GROW = threading.Lock()  # runs in threads (the dashboard's sessions) must not both extend it


def _block_ids(a: int, b: int) -> list[int]:
    """Ids ``a .. b - 1`` as the shared int objects."""
    if b > len(_BLOCK_IDS):
        with _BLOCK_IDS_GROW:
            if b > len(_BLOCK_IDS):
                _BLOCK_IDS.extend(range(len(_BLOCK_IDS), b))
    return _BLOCK_IDS[a:b]


class BlockPool(TailQueue, LazyIndex, PoolChecks):
    __slots__ = (
        "num_blocks", "block_size", "caching", "bhash", "head", "fresh", "cached", "dups",
        "max_model_len", "tail", "front", "tail_end", "st", "tail_len", "lazy", "n_lazy", "pend",
        "shared", "stv", "runs",
    )

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_model_len: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.max_model_len = max_model_len
        # The two per-block arrays (``bhash`` and ``st`` below) cover the blocks handed out so far, [0, fresh), and
        # grow with ``fresh`` (``_grow``): the never-used blocks are read by nothing, so a pool costs memory for the
        # blocks it has used. A fleet's pools are large (~87k blocks each for 70B FP8 on TP4) and a short run uses a
        # fraction of them, where writing every pool's arrays at build took ~0.7 GB per 540 replicas.
        cap = min(num_blocks, _FIRST_CAP)
        self.bhash: list[int | None] = [None] * cap
        # The free queue is head + [fresh, num_blocks) + tail: blocks never used yet sit in the middle in id
        # order (vLLM's initial order) without being materialised; freed unhashed blocks go to the head,
        # freed hashed blocks to the tail.
        self.head: OrderedDict[int, None] = OrderedDict()
        # The tail: runs of entries at absolute positions front .. tail_end - 1 (see kv_tail); an entry of a run
        # that is not plain is valid iff st[block] is its position: a block taken out of the middle (a prefix
        # hit) just changes its state.
        self.tail: deque[_Run] = deque()
        self.front = 0
        self.tail_end = 0
        # One state word per block, for ref count and tail position together (the block arrays are read at
        # random block ids, so fewer arrays means fewer cache misses), with F = ``front``: st >= F: free, in
        # the tail at that position (a plain run's blocks keep their "held by one" value instead: nothing reads
        # it while they are in the tail, see kv_tail); 0 <= st < F: held by one
        # request (popped off the tail, which leaves the consumed position in place rather than write -2: one
        # store at a scattered block id fewer per popped block); -1: free elsewhere (head, never
        # used); <= -2: held by -1 - st requests. (Positions only grow, and the front only passes a valid entry
        # by popping its block, so a consumed position never reads as free or as a valid entry again.)
        self.st = array("q", [-1]) * cap
        self.stv = np.frombuffer(self.st, np.int64)  # a numpy view of ``st`` for bulk stores (made again by _grow)
        # The blocks with more than one holder (st <= -3): a release whose blocks are none of them is each block's
        # only holder (a set, not a count: checking a request's ~100 block ids against it is a hash lookup each,
        # where reading their states was an array read and an int object each, 6x the time in isolation)
        self.shared: set[int] = set()
        self.tail_len = 0
        self.fresh = 1
        self.cached: dict[int, int] = {}  # hash -> earliest block holding it
        self.dups: dict[int, list[int]] = {}  # hash -> later duplicate blocks
        # Blocks registered without their hash (see _Lazy): key -> entries in registration order.
        self.lazy: dict[int, list[_Lazy]] = {}
        self.n_lazy = 0  # entries in ``lazy``
        # Released lazy entries in tail order (by ``end``), each dropped from ``lazy`` once the front passes it.
        self.runs: deque[_Lazy] = deque()
        # Deferred registration (the engine's decode group): output segment -> the one request whose full blocks
        # past ``num_cached_blocks`` count as registered without being written (up to ``computed_now // bs``).
        # Written out (``_write_pending``) before any lookup or other request's registration under that segment,
        # and by the engine when the request leaves the group, so every map holds what scheduling-time
        # registration would hold whenever it is read.
        self.pend: dict[int, EngineRequest] = {}

    # ---- gauges -------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.head) + (self.num_blocks - self.fresh) + self.tail_len

    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: blocks referenced by live requests (cached-free ones excluded)."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    # ---- lookup -------------------------------------------------------------------------------
    def find_hit(self, req: EngineRequest) -> list[int]:
        """Longest cached prefix of ``req`` as block ids (``find_longest_cache_hit``).

        Hashes are computed only as far as the walk goes (the first block, then all of them after a hit),
        and a key's lazily registered blocks are materialised before the first lookup that could name them."""
        if not self.caching:
            return []
        seq = req.seq
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        lazy, pend = self.lazy, self.pend
        cached = self.cached
        hashes = seq._hashes
        if not cached and not hashes:
            # Nothing in the pool is hashed yet, so the walk can only hit through the first block's key
            # (a lazily registered or pending entry it would materialise first); without one the first
            # lookup misses and the walk ends there. Exact, and no hash is computed for a sure miss.
            key = seq.key_runs(0, 1)[0][0]
            if key is None or (key not in lazy and key not in pend):
                return []
        if not hashes:
            seq._head(max_blocks)  # the memoised chain of the leading pieces, if any
            if not hashes:
                seq._extend_from(1)
        hits: list[int] = []
        for key, i0, i1 in (seq.key_runs(0, max_blocks) if lazy or pend else ((None, 0, max_blocks),)):
            if key is not None:
                if key in pend:
                    self._write_pending(pend[key])
                if key in lazy:
                    self._flush(key)
            # blocks i0 .. i1 - 1 looked up in C, stopping at the first miss: the hashes already computed first,
            # then, if all of those hit, the rest (computed up to max_blocks at the first block without a hash, as
            # a block-by-block walk would); a lookup past the first miss is wasted but changes nothing
            while i0 < i1:
                if i0 >= len(hashes):
                    seq._extend(max_blocks)
                    if i0 >= len(hashes):
                        raise RuntimeError(f"request {req.request_id}: block {i0} has no hash after extending")
                part = list(map(cached.get, hashes[i0:i1]))
                if None in part:
                    hits += part[:part.index(None)]
                    return hits
                hits += part
                i0 += len(part)
        return hits

    # ---- allocation ---------------------------------------------------------------------------
    def _pop_free(self, n: int, out: list[int]) -> None:
        """Pop ``n`` blocks off the free queue (head, then never-used blocks, then tail) into ``out``."""
        head = self.head
        if not head and self.fresh == self.num_blocks and n:
            # The usual pop once the pool has cycled: all n off the plain run at the tail's front (_pop_tail's
            # first case, inlined: most pops are a decode group's few blocks, where the calls cost the most).
            r = self.tail[0]
            e = r.entry
            f = self.front
            j = r.a + f - r.pos
            if e is not None and not e.flushed and j + n < r.b:
                out.extend(r.ids[j:j + n])
                self.tail_len -= n
                self.front = f = f + n
                runs = self.runs
                if runs and runs[0].end <= f:
                    self._runs_passed()
                return
        bhash, st = self.bhash, self.st
        while n and head:
            b, _ = head.popitem(last=False)
            h = bhash[b]
            if h is not None:  # evict
                self._uncache(b, h)
            st[b] = -2  # ref 1
            out.append(b)
            n -= 1
        if n:
            fresh = self.fresh
            k = min(n, self.num_blocks - fresh)
            if k:  # never used: no hash, ref 0
                if fresh + k > len(st):
                    self._grow(fresh + k)
                st[fresh:fresh + k] = array("q", [-2]) * k
                out += _block_ids(fresh, fresh + k)
                self.fresh = fresh + k
                n -= k
        if n:  # the LRU end of the cached-free blocks: evict as we go
            self._pop_tail(n, out)

    def _grow(self, need: int) -> None:
        """Extend ``st`` and ``bhash`` in place (blocks never used: state -1, no hash) to cover at least ``need``
        blocks, doubling (at most to ``num_blocks``) so a pool grows a few times in all. The numpy view is made
        again: an array cannot be resized while a view of it is alive."""
        st = self.st
        old = len(st)
        cap = min(self.num_blocks, max(need, 2 * old))
        self.stv = None  # type: ignore[assignment]
        st.extend(array("q", [-1]) * (cap - old))
        self.bhash.extend([None] * (cap - old))
        self.stv = np.frombuffer(st, np.int64)

    def _uncache(self, b: int, h: int) -> None:
        self.bhash[b] = None
        if self.cached.get(h) == b:
            extra = self.dups.get(h)
            if extra:
                self.cached[h] = extra.pop(0)
                if not extra:
                    del self.dups[h]
            else:
                del self.cached[h]
        else:
            extra = self.dups.get(h)
            if extra and b in extra:
                extra.remove(b)
                if not extra:
                    del self.dups[h]

    def admit(self, req: EngineRequest, n: int, hits: list[int], *, full_isl: bool, watermark_blocks: int) -> bool:
        """Admission of a waiting request with ``len(hits)`` hit blocks and a first chunk of ``n``.

        The full-sequence check (``scheduler_reserve_full_isl``) is a check, not a reservation.
        """
        bs = self.block_size
        st = self.st
        nh = len(hits)
        front = self.front
        evictable = 0
        for b in hits:
            x = st[b]
            if x >= front or x == -1:  # free (ref 0)
                evictable += 1
        free = self.num_free
        if full_isl:
            whole = min(req.seq.num_tokens, self.max_model_len)
            if -(-whole // bs) - nh + evictable + watermark_blocks > free:
                return False
        h_tokens = nh * bs
        new = -(-min(h_tokens + n, self.max_model_len) // bs) - nh
        if new + evictable + watermark_blocks > free:
            return False
        # Touch the hit blocks (out of the free queue; one compaction check at the end: it only tidies the
        # tail array, whose valid entries and so the queue order are the same either way).
        head = self.head
        taken = 0
        for b in hits:
            x = st[b]
            if x >= front:  # free, in the tail: its entry goes stale
                taken += 1
                st[b] = -2
            elif x == -1:  # free elsewhere (the head)
                del head[b]
                st[b] = -2
            elif x >= 0:  # held by one (a consumed tail position): now two
                st[b] = -3
                self.shared.add(b)
            else:
                st[b] = x - 1  # one more holder
                if x == -2:
                    self.shared.add(b)
        req.blocks.extend(hits)
        if taken:
            self.tail_len -= taken
            self._maybe_rebuild()
        blocks = req.blocks
        req.num_cached_blocks = nh
        if new > 0:
            self._pop_free(new, blocks)
        self._cache(req, h_tokens + n)
        return True

    def allocate(self, req: EngineRequest, n: int) -> bool:
        """``allocate_slots`` for a running request scheduling ``n`` more tokens."""
        bs = self.block_size
        need = -(-min(req.num_computed + n, self.max_model_len) // bs)
        new = need - len(req.blocks)
        if new > 0:
            if new > self.num_free:
                return False
            self._pop_free(new, req.blocks)
        self._cache(req, req.num_computed + n)
        return True

    def allocate_decode(self, req: EngineRequest, computed_after: int) -> bool:
        """``allocate`` for a decoding request whose KV will cover ``computed_after`` tokens, all of them
        known (``computed_after`` equals the sequence length the scheduled steps have produced)."""
        if not self.grow_decode(req, computed_after):
            return False
        if self.caching and computed_after // self.block_size > req.num_cached_blocks:
            self._cache_upto(req, computed_after // self.block_size)
        return True

    def grow_decode(self, req: EngineRequest, computed_after: int) -> bool:
        """The block half of ``allocate_decode``: ``req``'s blocks grown to cover ``computed_after`` tokens, no
        registration (a decode-group member's is deferred, see ``pend``)."""
        bs = self.block_size
        mml = self.max_model_len
        new = -(-(computed_after if computed_after < mml else mml) // bs) - len(req.blocks)
        if (new == 1 and self.tail_len and not self.head and self.fresh == self.num_blocks
                and (e := (r := self.tail[0]).entry) is not None and not e.flushed):
            # One block off a plain run at the front of the tail (the usual decode allocation once the pool has
            # cycled): _pop_free(1) without the general case.
            f = self.front
            req.blocks.append(r.ids[r.a + f - r.pos])
            self.tail_len -= 1
            self.front = f = f + 1
            if f == r.end:
                self.tail.popleft()
                if self.runs[0].end <= f:
                    self._runs_passed()
        elif new > 0:
            if new > self.num_free:
                return False
            self._pop_free(new, req.blocks)
        return True

    def blocks_needed(self, req: EngineRequest, n: int) -> int:
        need = -(-min(req.num_computed + n, self.max_model_len) // self.block_size)
        return max(need - len(req.blocks), 0)

    def _cache(self, req: EngineRequest, computed_after: int) -> None:
        """Register every full block the scheduled tokens complete (``cache_blocks``)."""
        if not self.caching:
            return
        n_tok = req.seq.num_tokens
        full = (computed_after if computed_after < n_tok else n_tok) // self.block_size
        if full > req.num_cached_blocks:
            self._cache_upto(req, full)

    def _cache_upto(self, req: EngineRequest, full: int) -> None:
        """Register blocks ``num_cached_blocks .. full - 1`` of ``req``: lazily (``_register_lazy``) when their
        content starts with a segment, eagerly (hash into ``cached``) when it starts with real token ids."""
        start = req.num_cached_blocks
        seq = req.seq
        if start * self.block_size >= seq._length:  # only output blocks (a decode filling a block)
            self._register_lazy(req, seq._out_seg, start, full)
        else:
            for key, i0, i1 in seq.key_runs(start, full):
                if key is None:
                    self._register(req, i0, i1)
                else:
                    self._register_lazy(req, key, i0, i1)
        req.num_cached_blocks = full

    def _register(self, req: EngineRequest, start: int, full: int) -> None:
        """Eager registration of blocks ``start .. full - 1`` (their hashes into ``cached``, later copies of a
        hash into ``dups``)."""
        seq = req.seq
        hashes = seq._hashes
        if full > len(hashes):
            seq._extend(full)  # extends ``hashes`` in place
        bhash, cached = self.bhash, self.cached
        blks = req.blocks[start:full]
        hs = hashes[start:full]
        for b, h in zip(blks, hs):
            bhash[b] = h
        # Register in bulk when no hash is taken yet (the usual case). A hash repeated inside ``hs`` shows as
        # fewer new keys than hashes: undo and take the per-block path (the later copies go to ``dups``).
        n0 = len(cached)
        if cached.keys().isdisjoint(hs):
            cached.update(zip(hs, blks))
            if len(cached) == n0 + len(hs):
                return
            for h in hs:
                cached.pop(h, None)
        for b, h in zip(blks, hs):
            if h in cached:
                self.dups.setdefault(h, []).append(b)
            else:
                cached[h] = b
