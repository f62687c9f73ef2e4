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
from collections.abc import Sequence
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
    To stay exact on any input, the index remembers each live block's predecessor as recorded
    (``_pred``, reference counted over replicas); a query is binary searched only if no recorded block
    ever had two different predecessors and each of the query's blocks that is recorded anywhere has
    the query's previous block as its predecessor. Otherwise (hand-made hashes, a 64-bit collision) the
    block-by-block scan runs, so the answer is always the scan's.
    """

    def __init__(self, *, capacity_blocks: int, ttl_s: float | None) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._pred: dict[int, object] = {}  # block hash -> its predecessor when recorded
        self._refs: dict[int, int] = {}  # block hash -> number of replica LRUs holding it
        self._consistent = True  # no block was ever recorded with two different predecessors

    def record(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        """Blocks were sent to ``replica_id`` at ``now_s``.

        Recorded leaf first, so the prefix root is the most recently used and is evicted last, as an
        engine evicts a freed request's blocks from the tail.
        """
        lru = self._lru.setdefault(replica_id, OrderedDict())
        pred, refs = self._pred, self._refs
        for k in range(len(block_hashes) - 1, -1, -1):
            h = block_hashes[k]
            before = block_hashes[k - 1] if k else _ROOT
            if h in lru:
                lru[h] = now_s
                lru.move_to_end(h)
                if pred[h] != before:
                    self._consistent = False
                continue
            lru[h] = now_s
            n = refs.get(h)
            if n is None:
                refs[h] = 1
                pred[h] = before
            else:
                refs[h] = n + 1
                if pred[h] != before:
                    self._consistent = False
        while len(lru) > self.capacity_blocks:
            self._drop(lru.popitem(last=False)[0])
        self._expire(lru, now_s)

    def match_blocks(self, replica_id: str, block_hashes: Sequence[int], now_s: float) -> int:
        """How many leading blocks of the prompt the index believes are cached on ``replica_id``."""
        return self.match_many((replica_id,), block_hashes, now_s)[0]

    def match_many(self, replica_ids: Sequence[str], block_hashes: Sequence[int], now_s: float) -> list[int]:
        """``match_blocks`` for each replica in turn (expiring each one's LRU as it goes)."""
        search = self._prefix_closed(block_hashes)
        out = []
        for rid in replica_ids:
            lru = self._lru.get(rid)
            if not lru:
                out.append(0)
                continue
            self._expire(lru, now_s)
            if search:
                lo, hi = 0, len(block_hashes)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if block_hashes[mid] in lru:
                        lo = mid + 1
                    else:
                        hi = mid
                out.append(lo)
                continue
            n = 0
            for h in block_hashes:
                if h not in lru:
                    break
                n += 1
            out.append(n)
        return out

    def _prefix_closed(self, block_hashes: Sequence[int]) -> bool:
        """Whether, in every LRU, the blocks of this prompt that are held form a leading run."""
        if not self._consistent:
            return False
        if len(block_hashes) < 2:
            return True
        # pred.get(h, default=previous block): equal to the previous block exactly when h is not
        # recorded anywhere or was recorded after it; map/compare keep this one pass in C
        prev = list(block_hashes[:-1])
        return list(map(self._pred.get, block_hashes[1:], prev)) == prev

    def forget(self, replica_id: str) -> None:
        lru = self._lru.pop(replica_id, None)
        if lru:
            for h in lru:
                self._drop(h)

    def size(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ()))

    def _drop(self, h: int) -> None:
        """One LRU let go of ``h``."""
        n = self._refs[h] - 1
        if n:
            self._refs[h] = n
        else:
            del self._refs[h]
            del self._pred[h]

    def _expire(self, lru: OrderedDict[int, float], now_s: float) -> None:
        if self.ttl_s is None:
            return
        while lru:
            h, t = next(iter(lru.items()))
            if now_s - t <= self.ttl_s:
                break
            del lru[h]
            self._drop(h)


class _PrefixIndexParams(RouterParams):
    index_capacity_blocks: int = Field(31_250, ge=1, description="LRU capacity per replica, in blocks")
    index_ttl_s: float | None = Field(600.0, gt=0, description="forget a block this long after last use")


class _PrefixIndexRouter(BaseRouter):
    params: _PrefixIndexParams

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self.index = ApproxPrefixIndex(capacity_blocks=self.params.index_capacity_blocks,
                                       ttl_s=self.params.index_ttl_s)

    def _observe(self, replicas: Sequence[ReplicaSnapshot], now_s: float) -> None:
        for r in replicas:
            if not r.healthy:
                self.index.forget(r.replica_id)

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
        totals = self.scores(request, candidates, now_s)
        best = min(range(len(candidates)), key=lambda i: (-totals[i], candidates[i].replica_id))
        scores = tuple(zip([c.replica_id for c in candidates], totals, strict=True))
        return RoutingDecision(candidates[best].replica_id, "llm_d_scorer (score, higher wins)", scores)


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
