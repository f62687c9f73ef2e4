"""Prefix-cache-aware routers and the router-side approximate prefix index they share.

A router cannot see a replica's KV cache. Like llm-d's approximate prefix-cache scorer and Dynamo's
KV router without KV events, these routers remember which block hashes *they* sent where
(:class:`ApproxPrefixIndex`) and assume those blocks are still cached until the per-replica LRU
capacity pushes them out or they age past a TTL. The estimate is wrong when the engine evicts earlier
(memory pressure) or restarts; a replica seen unhealthy is forgotten, as its cache will be empty.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from twin.policies.routing import ROUTERS, BaseRouter, RouterParams
from twin.policies.types import ReplicaSnapshot, RequestFacts, RoutingDecision


_ROOT = object()  # the predecessor recorded for a prompt's first block


class ApproxPrefixIndex:
    """Per replica, an LRU of block hashes this router sent there, with capacity and aging.

    A match is the number of *leading* prompt blocks found in a replica's LRU; done block by block it
    costs as many lookups as the prompt shares with the replica (every replica holds a shared system
    prompt), for every candidate of every decision. It is found by binary search instead when that
    gives the same answer, i.e. when the blocks a replica holds form a prefix of the prompt. That holds
    for chained hashes (block k's hash determines block k-1's): a record stores a prompt's blocks leaf
    first, so a block's predecessor is always newer in the LRU and is evicted (capacity, TTL) after it.
    To stay exact on any input, the index remembers each recorded block's predecessor (``_pred``); a
    query is binary searched only if no block was ever recorded with two different predecessors (nor
    twice in one prompt) and each of the query's blocks that is in ``_pred`` has the query's previous
    block as its predecessor. Otherwise (hand-made hashes, a 64-bit collision) the block-by-block scan
    runs, so the answer is always the scan's. ``_pred`` is pruned to the blocks some LRU still holds
    whenever it has doubled since the last prune (an entry no LRU holds only makes the check stricter).
    """

    def __init__(self, *, capacity_blocks: int, ttl_s: float | None) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._pred: dict[int, object] = {}  # block hash -> the block recorded before it (_ROOT: first)
        self._prune_at = 4 * capacity_blocks
        # binary search allowed: no block was ever recorded after two different blocks, and the
        # owner did not turn it off (stop_searching)
        self._search = True
        # the last prompt checked against _pred, and the answer: a host routes a prompt, then records
        # it, and the check need not run twice while _pred is unchanged (it holds the prompt, so the
        # identity test cannot be fooled by a recycled object)
        self._checked: tuple[object, bool, int | None] = ((), True, None)

    def record(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        """Blocks were sent to ``replica_id`` at ``now_s``.

        Recorded leaf first, so the prefix root is the most recently used and is evicted last, as an
        engine evicts a freed request's blocks from the tail.
        """
        if self._search and block_hashes:
            self._note_chain(block_hashes)
        lru = self._lru.setdefault(replica_id, OrderedDict())
        for h in reversed(block_hashes):
            lru[h] = now_s
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
        self._expire(lru, now_s)

    def _note_chain(self, block_hashes: Sequence[int]) -> None:
        """Remember each block's predecessor; a conflict with an earlier record ends the binary search.

        Runs on every routed request, so its work is whole-prompt ``map`` / ``update`` / ``set`` passes
        in C, and in the usual case (the prompt's head recorded before, its tail new) only the tail is
        inserted: a loop per block here cost more than the search saves.
        """
        ok, known = self._analyse(block_hashes)
        pred = self._pred
        if known is not None:
            tail = block_hashes[known:]
            if len(set(tail)) != len(tail):
                self._conflict()
                return
        elif not ok or pred.get(block_hashes[0], _ROOT) is not _ROOT or len(set(block_hashes)) != len(block_hashes):
            self._conflict()
            return
        else:
            known = 0  # recorded blocks agree but are not one leading run: (re)insert them all
        if known == len(block_hashes):
            return
        if known == 0:
            pred[block_hashes[0]] = _ROOT
            known = 1
        pred.update(zip(block_hashes[known:], block_hashes[known - 1:-1]))
        self._checked = ((), True, None)  # new entries: an answer cached before may have changed
        if len(pred) > self._prune_at:
            # the blocks some LRU holds, each once (the shared system prompts sit in every replica's LRU,
            # so a comprehension over the LRUs looked up the same block once per replica), all in C
            keep = set(block_hashes).union(*self._lru.values())
            self._pred = pred = dict(zip(keep, map(pred.__getitem__, keep)))
            self._prune_at = max(2 * len(pred), 4 * self.capacity_blocks)

    def _conflict(self) -> None:
        self.stop_searching()

    def stop_searching(self) -> None:
        """Scan every match from now on and keep no predecessors (answers are the same either way)."""
        self._search = False
        self._pred = {}

    def match_blocks(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> int:
        """How many leading blocks of the prompt the index believes are cached on ``replica_id``."""
        return self.match_many((replica_id,), block_hashes, now_s)[0]

    def match_many(self, replica_ids: Sequence[str], block_hashes: Sequence[int], now_s: float) -> list[int]:
        """``match_blocks`` for each replica in turn (expiring each one's LRU as it goes)."""
        match = self.matcher(block_hashes, now_s)
        return [match(rid) for rid in replica_ids]

    def matcher(self, block_hashes: Sequence[int], now_s: float) -> Callable[[str], int]:
        """``replica_id -> match_blocks(replica_id, block_hashes, now_s)``, for a router that matches only
        some candidates; ``match_many`` calls it for every candidate."""
        search = self._search and self._prefix_closed(block_hashes)
        lrus, expire = self._lru, self._expire

        def match(replica_id: str) -> int:
            lru = lrus.get(replica_id)
            if not lru:
                return 0
            expire(lru, now_s)
            if search:
                lo, hi = 0, len(block_hashes)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if block_hashes[mid] in lru:
                        lo = mid + 1
                    else:
                        hi = mid
                return lo
            n = 0
            for h in block_hashes:
                if h not in lru:
                    break
                n += 1
            return n

        return match

    def holds(self, replica_id: str, block_hash: int) -> bool:
        """False only when ``block_hash`` is surely not in ``replica_id``'s LRU, so a match there stops
        before it (True may still be an entry past its TTL, which a match would expire first)."""
        lru = self._lru.get(replica_id)
        return lru is not None and block_hash in lru

    def _prefix_closed(self, block_hashes: Sequence[int]) -> bool:
        """Each block of the prompt after the first that has a recorded predecessor has the prompt's
        previous block."""
        return len(block_hashes) < 2 or self._analyse(block_hashes)[0]

    def _analyse(self, block_hashes: Sequence[int]) -> tuple[bool, int | None]:
        """``(closed, known)``: closed as in ``_prefix_closed``; ``known`` = k when exactly the first k
        blocks are recorded, each after the prompt's previous block (the first as a root), else None.
        The answer for the last prompt is kept while ``_pred`` does not change."""
        last, ok, known = self._checked
        if last is block_hashes:
            return ok, known
        pred = self._pred
        before = [_ROOT, *block_hashes[:-1]]
        recorded = list(map(pred.get, block_hashes))  # None: never recorded
        try:
            known = recorded.index(None)
        except ValueError:
            known = len(recorded)
        if recorded[:known] == before[:known] and recorded.count(None) == len(recorded) - known:
            ok = True
        else:
            known = None
            # pred.get(h, default=previous block) is the previous block exactly when h is unrecorded
            # or was recorded after it
            ok = list(map(pred.get, block_hashes[1:], before[1:])) == before[1:]
        self._checked = (block_hashes, ok, known)
        return ok, known

    def forget(self, replica_id: str) -> None:
        self._lru.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ()))

    def _expire(self, lru: OrderedDict[int, float], now_s: float) -> None:
        if self.ttl_s is None:
            return
        while lru:
            h, t = next(iter(lru.items()))
            if now_s - t <= self.ttl_s:
                break
            del lru[h]


class _PrefixIndexParams(RouterParams):
    index_capacity_blocks: int = Field(31_250, ge=1, description="LRU capacity per replica, in blocks")
    index_ttl_s: float | None = Field(600.0, gt=0, description="forget a block this long after last use")


# Below this many candidates in its first decision, a router's index scans instead of binary searching:
# the search's bookkeeping (a dict pass over each routed prompt) then costs about what it saves (measured
# in the fleet benchmark: a wash at ~14 candidates a decision, a loss at ~4).
SEARCH_MIN_CANDIDATES = 24


class _PrefixIndexRouter(BaseRouter):
    params: _PrefixIndexParams

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self.index = ApproxPrefixIndex(capacity_blocks=self.params.index_capacity_blocks,
                                       ttl_s=self.params.index_ttl_s)
        self._index_sized = False

    def _size_index(self, num_candidates: int) -> None:
        """On the first decision, keep the index's binary search only for a fleet large enough to pay,
        and only while every candidate is matched: with scores omitted a decision matches a few
        candidates, and the search's bookkeeping on every routed prompt then costs more than it saves
        (measured in the fleet benchmark at scale 0.16 and 0.32: router CPU per turn about a third lower
        scanning). Answers are the same either way."""
        if not self._index_sized:
            self._index_sized = True
            if num_candidates < SEARCH_MIN_CANDIDATES or not self.keep_scores:
                self.index.stop_searching()

    def _observe(self, replicas: Sequence[ReplicaSnapshot], now_s: float) -> None:
        # one comprehension: this sees every snapshot of every decision, and nearly all are healthy
        for replica_id in [r.replica_id for r in replicas if not r.healthy]:
            self.index.forget(replica_id)

    def on_routed(self, request: RequestFacts, replica_id: str, now_s: float) -> None:
        self.index.record(replica_id, request.block_hashes, now_s)


# -------------------------------------------------------------------------------------------- llm-d scorer
class LlmDScorerParams(_PrefixIndexParams):
    kind: Literal["llm_d_scorer"] = "llm_d_scorer"
    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_usage_weight: float = Field(2.0, ge=0)


@ROUTERS.register("llm_d_scorer")
class LlmDScorerRouter(_PrefixIndexRouter):
    """Weighted scorers in the style of llm-d's inference scheduler; the highest total wins.

    - prefix: leading prompt blocks found in the router's own index for that replica / prompt blocks;
    - queue: min-max normalised scraped waiting queue, 1 for the shortest and 0 for the longest
      (1 for all when equal), so it is relative: a longer queue by one request scores like one longer
      by a hundred;
    - kv usage: 1 - scraped KV cache usage.
    Ties break by ``replica_id``.
    """

    Params = LlmDScorerParams
    params: LlmDScorerParams

    def scores(self, request: RequestFacts, candidates: Sequence[ReplicaSnapshot], now_s: float) -> list[float]:
        p = self.params
        n_blocks = len(request.block_hashes)
        q = [c.num_waiting for c in candidates]
        q_lo, q_hi = min(q), max(q)
        matched = (self.index.match_many([c.replica_id for c in candidates], request.block_hashes, now_s) if n_blocks
                   else [0] * len(candidates))
        out = []
        for c, m in zip(candidates, matched, strict=True):
            prefix = m / n_blocks if n_blocks else 0.0
            queue = 1.0 if q_hi == q_lo else (q_hi - c.num_waiting) / (q_hi - q_lo)
            kv = 1.0 - c.kv_usage
            out.append(p.prefix_weight * prefix + p.queue_weight * queue + p.kv_usage_weight * kv)
        return out

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        self._size_index(len(candidates))
        if not self.keep_scores:
            return RoutingDecision(self._best(request, candidates, now_s), "llm_d_scorer (score, higher wins)")
        totals = self.scores(request, candidates, now_s)
        best = min(range(len(candidates)), key=lambda i: (-totals[i], candidates[i].replica_id))
        scores = tuple(zip([c.replica_id for c in candidates], totals, strict=True))
        return RoutingDecision(candidates[best].replica_id, "llm_d_scorer (score, higher wins)", scores)

    def _best(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> str:
        """The replica ``scores`` ranks first (ties by ``replica_id``), matching only the candidates that
        can still win.

        A candidate's total is at most its total with a full prefix match (``m / n_blocks <= 1.0``, and
        float multiplication by a weight >= 0 and float addition are monotone, so the bound is exact:
        it is the same expression evaluated at 1.0). Candidates are matched in descending bound order
        until a bound falls below the best exact total found, so the index is asked about the few
        replicas whose queue and KV scores leave them a chance, not every replica of the fleet; equal
        bounds are still matched, so ties break as in the full scan. Lookups skipped here also skip
        those replicas' TTL expiry, which changes no answer: expired blocks are the oldest in an LRU,
        so the next match, record or capacity eviction there removes them first all the same.
        """
        p = self.params
        pw, qw, kw = p.prefix_weight, p.queue_weight, p.kv_usage_weight
        hashes = request.block_hashes
        n_blocks = len(hashes)
        q = [c.num_waiting for c in candidates]
        q_lo, q_hi = min(q), max(q)
        # the queue and kv terms exactly as scores() computes them; its total is (prefix + queue) + kv
        if q_hi == q_lo:
            queue = [qw * 1.0] * len(candidates)
        else:
            span = q_hi - q_lo
            queue = [qw * ((q_hi - w) / span) for w in q]
        kv = [kw * (1.0 - c.kv_usage) for c in candidates]
        if not n_blocks:
            zero = pw * 0.0
            totals = [zero + a + b for a, b in zip(queue, kv)]
            best = min(range(len(candidates)), key=lambda i: (-totals[i], candidates[i].replica_id))
            return candidates[best].replica_id
        bounds = [pw + a + b for a, b in zip(queue, kv)]  # pw * (n_blocks / n_blocks) == pw
        # descending bound; equal bounds keep the candidates' replica_id order (a reverse sort is stable)
        order = sorted(range(len(candidates)), key=bounds.__getitem__, reverse=True)
        index = self.index
        match = index.matcher(hashes, now_s)
        best_total = -math.inf
        best_id = ""
        for i in order:
            if bounds[i] < best_total:
                break
            rid = candidates[i].replica_id
            a, b = queue[i], kv[i]
            if pw and best_total > -math.inf:
                # A tighter bound for one lookup: if block k is not held there, the match stops at or
                # before it, so the total is at most its value at k blocks. k is picked as the largest
                # count whose total may fall below the best (the float estimate only picks k; the
                # pruning test is the exact expression).
                k = min(math.ceil((best_total - a - b) / pw * n_blocks) - 1, n_blocks - 1)
                if k >= 0 and pw * (k / n_blocks) + a + b < best_total and not index.holds(rid, hashes[k]):
                    continue
            total = pw * (match(rid) / n_blocks) + a + b
            if total > best_total or (total == best_total and rid < best_id):
                best_total, best_id = total, rid
        return best_id


# ------------------------------------------------------------------------------------------ Dynamo KV cost
class DynamoKvCostParams(_PrefixIndexParams):
    kind: Literal["dynamo_kv_cost"] = "dynamo_kv_cost"
    block_size_tokens: int = Field(16, ge=1, description="engine KV block size the block hashes use")
    overlap_score_weight: float = Field(1.0, ge=0, description="weight of uncached prefill blocks")
    temperature: float = Field(0.0, ge=0, description="0: argmin; > 0: softmax sampling on -cost")
    index_ttl_s: float | None = Field(120.0, gt=0)


@ROUTERS.register("dynamo_kv_cost")
class DynamoKvCostRouter(_PrefixIndexRouter):
    """Cost in the style of Dynamo's KV router; the lowest cost wins.

    ``cost = overlap_score_weight * prefill_blocks + decode_blocks`` where
    ``prefill_blocks`` = prompt blocks minus the leading blocks the router's index says are cached there,
    ``decode_blocks`` = blocks of the tokens the router has in flight there (``outstanding_tokens``)
    plus the new request's prompt blocks. With ``temperature > 0`` the pick is sampled with probability
    proportional to ``exp(-(cost / max cost) / temperature)`` from the router's seeded stream.
    """

    Params = DynamoKvCostParams
    params: DynamoKvCostParams

    def costs(self, request: RequestFacts, candidates: Sequence[ReplicaSnapshot], now_s: float) -> list[float]:
        p = self.params
        bs = p.block_size_tokens
        prompt_blocks = math.ceil(request.prompt_tokens / bs)
        matched = self.index.match_many([c.replica_id for c in candidates], request.block_hashes, now_s)
        out = []
        for c, m in zip(candidates, matched, strict=True):
            cached = min(m, prompt_blocks)
            decode = math.ceil(c.outstanding_tokens / bs) + prompt_blocks
            out.append(p.overlap_score_weight * (prompt_blocks - cached) + decode)
        return out

    def _choose(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        self._size_index(len(candidates))
        if not self.keep_scores and self.params.temperature == 0.0:
            return RoutingDecision(self._cheapest(request, candidates, now_s), "dynamo_kv_cost (cost, lower wins)")
        costs = self.costs(request, candidates, now_s)
        scores = tuple(zip([c.replica_id for c in candidates], costs, strict=True))
        if self.params.temperature == 0.0:
            best = min(range(len(candidates)), key=lambda i: (costs[i], candidates[i].replica_id))
            return RoutingDecision(candidates[best].replica_id, "dynamo_kv_cost (cost, lower wins)", scores)
        top = max(costs)
        norm = [c / top if top > 0 else 0.0 for c in costs]
        lo = min(norm)
        weights = [math.exp(-(x - lo) / self.params.temperature) for x in norm]
        u = self.rng.random() * sum(weights)
        acc = 0.0
        pick = len(candidates) - 1
        for i, w in enumerate(weights):
            acc += w
            if u < acc:
                pick = i
                break
        return RoutingDecision(candidates[pick].replica_id, "dynamo_kv_cost: softmax sample (cost, lower wins)", scores)

    def _cheapest(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> str:
        """The replica ``costs`` ranks first (ties by ``replica_id``), matching only the candidates that
        can still win: ``LlmDScorerRouter._best`` turned around. A candidate's cost is at least its cost
        with every matchable block cached (the same integer and float expression, which only grows as
        fewer blocks are cached), and if the block a cheaper match would need is not in its index, at
        least its cost with the match stopping there."""
        p = self.params
        bs, w = p.block_size_tokens, p.overlap_score_weight
        hashes = request.block_hashes
        n_blocks = len(hashes)
        prompt_blocks = math.ceil(request.prompt_tokens / bs)
        decode = [math.ceil(c.outstanding_tokens / bs) + prompt_blocks for c in candidates]
        most = min(n_blocks, prompt_blocks)
        bounds = [w * (prompt_blocks - most) + d for d in decode]
        # ascending bound; equal bounds keep the candidates' replica_id order (the sort is stable)
        order = sorted(range(len(candidates)), key=bounds.__getitem__)
        index = self.index
        match = index.matcher(hashes, now_s) if most else None
        best_cost = math.inf
        best_id = ""
        for i in order:
            if bounds[i] > best_cost:
                break
            rid = candidates[i].replica_id
            d = decode[i]
            if match is None:
                cost = w * prompt_blocks + d  # nothing to match: cached is 0
            else:
                if w and best_cost < math.inf:
                    # one lookup: without block k the match stops at or before it (k picked by a float
                    # estimate; the pruning test is the exact expression)
                    k = min(math.ceil(prompt_blocks - (best_cost - d) / w) - 1, most - 1)
                    if k >= 0 and w * (prompt_blocks - k) + d > best_cost and not index.holds(rid, hashes[k]):
                        continue
                cost = w * (prompt_blocks - min(match(rid), prompt_blocks)) + d
            if cost < best_cost or (cost == best_cost and rid < best_id):
                best_cost, best_id = cost, rid
        return best_id
