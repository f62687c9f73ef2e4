"""The router-side approximate prefix index the prefix-cache-aware routers share.

A router cannot see a replica's KV cache. Like llm-d's approximate prefix-cache scorer and Dynamo's
KV router without KV events, the routers in :mod:`twin.policies.cache_aware` remember which block hashes
*they* sent where and assume those blocks are still cached until the per-replica LRU capacity pushes them
out or they age past a TTL.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from itertools import chain, filterfalse, takewhile


class ApproxPrefixIndex:
    """Per replica, an LRU of block hashes this router sent there, with capacity and aging.

    A match is the number of *leading* prompt blocks found in a replica's LRU, found block by block.

    Beside the LRUs it keeps an inverse for the scorer: which replicas may hold block k of a prompt
    (``holders_at``), so a router can find the few replicas that may hold it without asking every
    candidate's LRU. It is kept only for the *marked* blocks: every block below position ``holder_dense``
    and every ``holder_stride``-th one after it. Block hashes form a chain (block i's hash determines
    blocks 0..i, as vLLM's and llm-d's do), and a replica's LRU that holds block k also holds every block
    before it (each record that held k held them, and recorded them after k, so they leave the LRU after
    it): the holders of the marked block at or before k are a superset of block k's, and the scorer tests
    each of them with one lookup in its LRU. Keeping the inverse for every block cost more than the rest of
    the index together (a global map of every LRU's blocks: one cache miss per block recorded or evicted,
    ~48 of them per record at the fleet's peak). The first blocks are all marked because that is where a
    superset would cost the scorer most: a session's first turn is a shared system prompt and a few new
    blocks, and the scorer asks who holds the first new one; with only every 8th block marked, the answer
    would be every replica holding the system prompt (~12 candidates more to test a decision, against
    ~0.2). The default 64 blocks (1,024 tokens at 16 a block) covers the bundled scenarios' system
    prompts (800 tokens); a longer shared prefix costs the scorer lookups, never a different decision.
    A block held by one replica (most are: a session's history) is stored as that replica_id, not as a
    set of one. A list of two or more carries a stamp (``holders_stamp``) that changes when a replica
    joins it, so the scorer keeps its holders in bound order between decisions.
    """

    def __init__(self, *, capacity_blocks: int, ttl_s: float | None, holder_stride: int = 8,
                 holder_dense: int = 64) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        if holder_stride < 1 or holder_dense < 0:
            raise ValueError("holder_stride must be >= 1 and holder_dense >= 0")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.holder_stride = holder_stride
        self.holder_dense = holder_dense
        self._lru: dict[str, OrderedDict[int, float]] = {}
        # per replica, the marked blocks in its LRU: those a record put at a marked position (below
        # holder_dense, or a multiple of holder_stride) since they last entered it (expired entries included
        # until they are removed)
        self._marked: dict[str, set[int]] = {}
        # marked block hash -> the replica_id whose ``_marked`` holds it, or a set of two or more; exactly
        # the ``_marked`` sets' contents, kept by _hold and _unhold
        self._holders: dict[int, str | set[str]] = {}
        # marked block hash held by two or more -> its holders' stamp (``holders_stamp``): the count of
        # replicas that joined any such set so far, taken when one last joined this one
        self._joined: dict[int, int] = {}
        self._joins = 0

    def record(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        """Blocks were sent to ``replica_id`` at ``now_s``.

        Recorded leaf first, so the prefix root is the most recently used and is evicted last, as an
        engine evicts a freed request's blocks from the tail.
        """
        lru = self._lru.get(replica_id)
        if lru is None:
            lru = self._lru[replica_id] = OrderedDict()
            self._marked[replica_id] = set()
        move = lru.move_to_end
        for h in reversed(block_hashes):
            lru[h] = now_s
            move(h)
        marked = self._marked[replica_id]
        st, d = self.holder_stride, self.holder_dense
        new = list(filterfalse(marked.__contains__, chain(block_hashes[:d], block_hashes[d + (-d % st)::st])))
        if new:
            marked.update(new)
            self._hold(new, replica_id)
        over = len(lru) - self.capacity_blocks
        if over > 0:
            pop = lru.popitem
            self._left(replica_id, [pop(False)[0] for _ in range(over)])
        self._expire(replica_id, lru, now_s)

    def match_blocks(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> int:
        """How many leading blocks of the prompt the index believes are cached on ``replica_id``."""
        return self.matcher(block_hashes, now_s)(replica_id)

    def match_many(self, replica_ids: Sequence[str], block_hashes: Sequence[int], now_s: float) -> list[int]:
        """``match_blocks`` for each replica in turn (expiring each one's LRU as it goes)."""
        match = self.matcher(block_hashes, now_s)
        return [match(rid) for rid in replica_ids]

    def matcher(self, block_hashes: Sequence[int], now_s: float) -> Callable[[str], int]:
        """``replica_id -> match_blocks(replica_id, block_hashes, now_s)``, for a router that matches only
        some candidates; ``match_many`` calls it for every candidate."""
        lrus, expire = self._lru, self._expire

        def match(replica_id: str) -> int:
            lru = lrus.get(replica_id)
            if not lru:
                return 0
            expire(replica_id, lru, now_s)
            # "for h in block_hashes: stop at the first not in lru", counted in C: each lookup is a cache
            # miss in a large LRU, and a Python loop around it costs ~20% more (isolated timing)
            return len(list(takewhile(lru.__contains__, block_hashes)))

        return match

    def holds(self, replica_id: str, block_hash: int) -> bool:
        """False only when ``block_hash`` is surely not in ``replica_id``'s LRU, so a match there stops
        before it (True may still be an entry past its TTL, which a match would expire first)."""
        lru = self._lru.get(replica_id)
        return lru is not None and block_hash in lru

    def holders_at(self, block_hashes: Sequence[int], k: int) -> Collection[str]:
        """Every replica whose LRU may hold block ``k`` of the chain ``block_hashes`` (entries past their TTL
        included until a match, record or capacity eviction there removes them, as ``holds`` answers), and
        maybe others, in no particular order: exactly the replicas whose LRU holds the marked block at or
        before k (see the class docstring), so exactly block k's holders when k is marked (below
        ``holder_dense``, or a multiple of ``holder_stride``)."""
        v = self._holders.get(block_hashes[self._marked_at(k)])
        return () if v is None else (v,) if type(v) is str else v

    def holders_stamp(self, block_hashes: Sequence[int], k: int) -> int:
        """A stamp of what ``holders_at(block_hashes, k)`` lists now, for a caller that keeps something derived
        from that list: while it lists two or more replicas, the same stamp comes back until one joins it
        (one leaving keeps it), and no other list ever had that stamp; 0 while it lists fewer than two."""
        return self._joined.get(block_hashes[self._marked_at(k)], 0)

    def _marked_at(self, k: int) -> int:
        """The marked position at or before ``k`` (``record`` marks the same ones by slicing)."""
        return k if k < self.holder_dense else k - k % self.holder_stride

    def forget(self, replica_id: str) -> None:
        self._lru.pop(replica_id, None)
        marked = self._marked.pop(replica_id, None)
        if marked:
            unhold = self._unhold
            for h in marked:
                unhold(h, replica_id)

    def size(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ()))

    def _hold(self, hashes: list[int], replica_id: str) -> None:
        """``replica_id``'s marked blocks have just taken in ``hashes`` (none of them there before; repeats
        possible)."""
        holders, joined, joins = self._holders, self._joined, self._joins
        for h in hashes:
            v = holders.get(h)
            if v is None:
                holders[h] = replica_id
            elif type(v) is str:
                if v != replica_id:
                    holders[h] = {v, replica_id}
                    joins += 1
                    joined[h] = joins
            else:
                v.add(replica_id)
                joins += 1
                joined[h] = joins
        self._joins = joins

    def _unhold(self, block_hash: int, replica_id: str) -> None:
        """``block_hash`` has just left ``replica_id``'s marked blocks."""
        holders = self._holders
        v = holders[block_hash]
        if type(v) is str:
            del holders[block_hash]
        else:
            v.discard(replica_id)
            if len(v) == 1:
                holders[block_hash] = next(iter(v))
                del self._joined[block_hash]

    def _expire(self, replica_id: str, lru: OrderedDict[int, float], now_s: float) -> None:
        if self.ttl_s is None:
            return
        gone = []
        while lru:
            h, t = next(iter(lru.items()))
            if now_s - t <= self.ttl_s:
                break
            del lru[h]
            gone.append(h)
        if gone:
            self._left(replica_id, gone)

    def _left(self, replica_id: str, hashes: list[int]) -> None:
        """``hashes`` (distinct) have just left ``replica_id``'s LRU: the marked ones leave the holder map."""
        marked = self._marked[replica_id]
        gone = list(filter(marked.__contains__, hashes))
        if gone:
            marked.difference_update(gone)
            unhold = self._unhold
            for h in gone:
                unhold(h, replica_id)
