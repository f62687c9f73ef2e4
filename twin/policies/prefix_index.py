"""The router-side approximate prefix index the prefix-cache-aware routers share.

A router cannot see a replica's KV cache. Like llm-d's approximate prefix-cache scorer and Dynamo's
KV router without KV events, the routers in :mod:`twin.policies.cache_aware` remember which block hashes
*they* sent where and assume those blocks are still cached until the per-replica LRU capacity pushes them
out or they age past a TTL.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence


class _Run:
    """Blocks ``hashes[a:b]`` of one recorded prompt, in one replica's LRU, all last used at ``t``. In LRU order
    (least recent first) they are ``hashes[b - 1]``, ..., ``hashes[a]``: recorded leaf first."""

    __slots__ = ("hashes", "a", "b", "t")

    def __init__(self, hashes: Sequence[int], a: int, b: int, t: float) -> None:
        self.hashes = hashes
        self.a = a
        self.b = b
        self.t = t


class ApproxPrefixIndex:
    """Per replica, an LRU of block hashes this router sent there, with capacity and aging.

    A match is the number of *leading* prompt blocks found in a replica's LRU.

    **Block hashes must chain**, as vLLM's, llm-d's and twin's own do (``twin.models.tokens``,
    ``twin.router.prompt.block_hashes``): block i's hash determines the prompt's blocks 0..i, so two prompts that
    share a hash at position i share every block before it, and no hash appears at two positions. The index
    relies on it throughout:

    - *A replica's LRU holds a prefix of any prompt.* Each record that held block k held blocks 0..k-1 too and
      used them after k (recorded leaf first), so they leave the LRU after it, by capacity or by age.
    - *The LRU is kept as runs of blocks, not block by block.* A record appends one run (``_Run``: its prompt's
      blocks, all last used now) at the most recent end. The blocks it takes from older runs are the ones it
      shares with their prompts, a leading range of each (the chain), so an older run only shortens at its root
      end; capacity and age take blocks off the least recent run's leaf end. Each replica keeps its runs in LRU
      order (``_runs``, emptied runs left in place until they reach the front), its live runs by their root
      block's hash (``_roots``) and a count of its blocks; nothing is stored per block.
    - *A match walks runs.* The held blocks of a prompt lie in a run rooted at block 0, which holds them up to
      where its own prompt parts from the new one (a bisection) or it ends, then in the run rooted at that
      block, and so on (``_held``): usually one or two runs (a tenant's system prompt, the session's own
      history), a small map's lookup and a bisection each. A record walks the same runs and shortens them; a
      test of one block (``holds``, ``holder_test``: the scorer's) walks them up to that block.

    Per record that is a lookup and a bisection per run it shortens, and an eviction changes a run's bounds:
    a block-by-block LRU moved every block of the prompt (~114 at the fleet's peak, ~66 of them already there)
    in a table of millions (~40 % of the index's time on records captured from the fleet benchmark,
    docs/performance-rounds.md round 17), and a dict of every held block, kept for the scorer's one-lookup test, cost
    an insertion per new block and a deletion per evicted one (round 18). The LRU order, sizes, matches and
    holders are those of the block-by-block LRU (``tests/test_prefix_index.py`` drives both).

    Beside the LRUs it keeps an inverse for the scorer: which replicas may hold block k of a prompt
    (``holders_at``), so a router can find the few replicas that may hold it without asking every
    candidate's LRU. It is kept only for the *marked* positions: every block below position ``holder_dense``
    and every ``holder_stride``-th one after it. A replica's LRU that holds block k also holds every block
    before it (above), so the holders of the marked block at or before k are a superset of block k's, and
    the scorer tests each of them (``holder_test``). Keeping the inverse for every block cost more
    than the rest of the index together (a global map of every LRU's blocks: one cache miss per block
    recorded or evicted, ~48 of them per record at the fleet's peak). The first blocks are all marked because
    that is where a superset would cost the scorer most: a session's first turn is a shared system prompt and
    a few new blocks, and the scorer asks who holds the first new one; with only every 8th block marked, the
    answer would be every replica holding the system prompt (~12 candidates more to test a decision, against
    ~0.2). The default 64 blocks (1,024 tokens at 16 a block) covers the bundled scenarios' system prompts
    (800 tokens); a longer shared prefix costs the scorer lookups, never a different decision. A block held
    by one replica (most are: a session's history) is stored as that replica_id, not as a set of one. A list
    of two or more carries a stamp (``holders_stamp``) that changes when a replica joins it, so the scorer
    keeps its holders in bound order between decisions.
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
        # per replica: how many blocks its LRU holds, its runs least recent first (emptied ones included until
        # they reach the front), and its live runs by their root block's hash
        self._size: dict[str, int] = {}
        self._runs: dict[str, deque[_Run]] = {}
        self._roots: dict[str, dict[int, _Run]] = {}
        # marked block hash -> the replica_id whose LRU holds it, or a set of two or more
        self._holders: dict[int, str | set[str]] = {}
        # marked block hash held by two or more -> its holders' stamp (``holders_stamp``): the count of
        # replicas that joined any such set so far, taken when one last joined this one
        self._joined: dict[int, int] = {}
        self._joins = 0

    def record(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        """Blocks were sent to ``replica_id`` at ``now_s``.

        Recorded leaf first, so the prefix root is the most recently used and is evicted last, as an
        engine evicts a freed request's blocks from the tail. ``block_hashes`` is kept (by reference) while
        any of its blocks is in the LRU: pass an immutable sequence.
        """
        size = self._size.get(replica_id)
        if size is None:
            size = 0
            runs = self._runs[replica_id] = deque()
            roots = self._roots[replica_id] = {}
        else:
            runs = self._runs[replica_id]
            roots = self._roots[replica_id]
        hs = block_hashes
        n = len(hs)
        if n:
            # The runs holding the prompt's leading blocks, in order (``_held``'s walk): each gives up the blocks
            # it shares with hs to the new run, so it keeps its blocks from where its prompt parts from hs on.
            j = 0
            while j < n:
                r = roots.pop(hs[j], None)
                if r is None:
                    break
                g, b = r.hashes, r.b
                e = n if n < b else b
                if g[e - 1] != hs[e - 1]:
                    e = _parting(g, hs, j + 1, e - 1)
                r.a = e
                if e < b:
                    roots[g[e]] = r
                j = e
            if j < n:  # blocks j..n-1 are new to the replica
                size += n - j
                self._hold(self._marks(hs, j, n), replica_id)
            r = _Run(hs, 0, n, now_s)
            runs.append(r)
            roots[hs[0]] = r
            if len(runs) > 2 * len(roots) + 64:
                # emptied runs leave at the front; when they outnumber the live ones (each has one root), drop them
                # all here, so an LRU that is neither full nor aged (the same prompt recorded over and over)
                # does not keep every run it ever had
                runs = self._runs[replica_id] = deque(r for r in runs if r.a < r.b)
        self._size[replica_id] = size
        over = size - self.capacity_blocks
        if over > 0:
            self._evict(replica_id, runs, roots, over)
        if self.ttl_s is not None:
            self._expire(replica_id, now_s)

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
        all_roots, expire, ttl = self._roots, self._expire, self.ttl_s

        def match(replica_id: str) -> int:
            roots = all_roots.get(replica_id)
            if not roots:
                return 0
            if ttl is not None:
                expire(replica_id, now_s)
            return _held(roots, block_hashes)

        return match

    def holds(self, replica_id: str, block_hashes: Sequence[int], k: int) -> bool:
        """False only when block ``k`` of the chain ``block_hashes`` is surely not in ``replica_id``'s LRU, so a
        match there stops before it (True may still be an entry past its TTL, which a match would expire
        first). The match's walk (``_held``), stopped at block k."""
        roots = self._roots.get(replica_id)
        return bool(roots) and _held(roots, block_hashes, k + 1) > k

    def holder_test(self, block_hashes: Sequence[int], k: int) -> Callable[[str], bool]:
        """``replica_id -> holds(replica_id, block_hashes, k)``, for a router that asks it of several replicas."""
        all_roots, hs, upto = self._roots, block_hashes, k + 1

        def test(replica_id: str) -> bool:
            roots = all_roots.get(replica_id)
            return bool(roots) and _held(roots, hs, upto) > k

        return test

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
        """The marked position at or before ``k`` (``_marks`` lists the same ones by slicing)."""
        return k if k < self.holder_dense else k - k % self.holder_stride

    def forget(self, replica_id: str) -> None:
        self._size.pop(replica_id, None)
        self._roots.pop(replica_id, None)
        for r in self._runs.pop(replica_id, ()):
            if r.a < r.b:
                self._unhold_marks(replica_id, r.hashes, r.a, r.b)

    def size(self, replica_id: str) -> int:
        return self._size.get(replica_id, 0)

    def replicas(self) -> list[str]:
        """The replicas this index has recorded to and not forgotten (for tests and inspection)."""
        return list(self._runs)

    def lru_items(self, replica_id: str) -> list[tuple[int, float]]:
        """``replica_id``'s LRU as (block hash, last used), least recent first (for tests and inspection)."""
        out: list[tuple[int, float]] = []
        for r in self._runs.get(replica_id, ()):
            hs, t = r.hashes, r.t
            out.extend((hs[j], t) for j in range(r.b - 1, r.a - 1, -1))
        return out

    def _marks(self, hashes: Sequence[int], a: int, b: int) -> list[int]:
        """The blocks at marked positions among ``hashes[a:b]``, in order."""
        d, st = self.holder_dense, self.holder_stride
        if a < d:
            out = list(hashes[a:min(b, d)])
            a = d
        else:
            out = []
        out.extend(hashes[a + (-a % st):b:st])
        return out

    def _hold(self, hashes: list[int], replica_id: str) -> None:
        """``hashes``, blocks at marked positions, have just entered ``replica_id``'s LRU."""
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
        """``block_hash``, a block at a marked position, has just left ``replica_id``'s LRU."""
        holders = self._holders
        v = holders[block_hash]
        if type(v) is str:
            del holders[block_hash]
        else:
            v.discard(replica_id)
            if len(v) == 1:
                holders[block_hash] = next(iter(v))
                del self._joined[block_hash]

    def _unhold_marks(self, replica_id: str, hashes: Sequence[int], a: int, b: int) -> None:
        """Blocks ``hashes[a:b]`` have just left ``replica_id``'s LRU: the marked ones leave the holder map."""
        unhold = self._unhold
        for h in self._marks(hashes, a, b):
            unhold(h, replica_id)

    def _evict(self, replica_id: str, runs: deque[_Run], roots: dict[int, _Run], over: int) -> None:
        """Take the ``over`` least recently used blocks out of ``replica_id``'s LRU (and the holder map): off
        the leaf end of the least recent runs, nothing stored per block."""
        self._size[replica_id] -= over
        while over:
            r = runs[0]
            a, b = r.a, r.b
            if a == b:
                runs.popleft()
                continue
            c = b - over if b - over > a else a
            hs = r.hashes
            self._unhold_marks(replica_id, hs, c, b)
            over -= b - c
            if c == a:
                del roots[hs[a]]
                runs.popleft()
            else:
                r.b = c

    def _expire(self, replica_id: str, now_s: float) -> None:
        """Take the blocks last used more than ``ttl_s`` before ``now_s`` out of the LRU."""
        runs = self._runs[replica_id]
        while runs and runs[0].a == runs[0].b:  # (emptied runs at the front go here, so a check reads one run)
            runs.popleft()
        ttl, n = self.ttl_s, 0
        for r in runs:
            if r.a < r.b:
                if now_s - r.t <= ttl:
                    break
                n += r.b - r.a
        if n:
            self._evict(replica_id, runs, self._roots[replica_id], n)


def _held(roots: dict[int, _Run], hashes: Sequence[int], n: int | None = None) -> int:
    """How many leading blocks of ``hashes`` (of its first ``n``, if given) a replica's LRU holds, given its live runs
    by root (see ApproxPrefixIndex): the run holding block 0 is rooted there and holds the prompt's blocks up to
    where its own prompt parts from it (a bisection) or it ends; the run holding the next block is rooted at that
    one, and so on until no run is. Usually one or two runs (a shared system prompt's, the session's own)."""
    if n is None:
        n = len(hashes)
    j = 0
    while j < n:
        r = roots.get(hashes[j])
        if r is None:
            return j
        g, b = r.hashes, r.b
        e = n if n < b else b
        j = e if g[e - 1] == hashes[e - 1] else _parting(g, hashes, j + 1, e - 1)
    return n


def _parting(g: Sequence[int], hs: Sequence[int], lo: int, hi: int) -> int:
    """Where two chains part: the first position in ``lo..hi`` at which ``g`` and ``hs`` differ, given that they
    agree at ``lo - 1`` and differ at ``hi`` (a chain that differs at a position differs at every later one)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if g[mid] == hs[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
