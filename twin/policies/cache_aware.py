"""Prefix-cache-aware routers.

A router cannot see a replica's KV cache. Like llm-d's approximate prefix-cache scorer and Dynamo's
KV router without KV events, these routers remember which block hashes *they* sent where
(:class:`ApproxPrefixIndex`, in :mod:`twin.policies.prefix_index`) and assume those blocks are still
cached until the per-replica LRU capacity pushes them out or they age past a TTL. The estimate is wrong
when the engine evicts earlier (memory pressure) or restarts; a replica seen unhealthy is forgotten, as
its cache will be empty.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from twin.policies.prefix_index import ApproxPrefixIndex
from twin.policies.eligibility import candidate_replicas
from twin.policies.routing import NO_ELIGIBLE_REPLICA, ROUTERS, BaseRouter, RouterParams
from twin.policies.scorer_terms import (
    _HEALTHY, _OUTSTANDING, _REPLICA_ID, LISTS_MAX, ListedTerms, ScorerTerms, kept_live, session_position,
)
from twin.policies.types import ReplicaSnapshot, RequestFacts, RoutingDecision

__all__ = ["ApproxPrefixIndex", "DynamoKvCostRouter", "LlmDScorerRouter"]

class _PrefixIndexParams(RouterParams):
    index_capacity_blocks: int = Field(31_250, ge=1, description="LRU capacity per replica, in blocks")
    index_ttl_s: float | None = Field(600.0, gt=0, description="forget a block this long after last use")


# Below this many candidates the one-pass filter of LlmDScorerRouter._best costs more than the exact loop
# it spares (fleet benchmark at scale 0.02: ~4 candidates a decision).
_ONE_PASS_MIN = 8

# The session hints kept (cleared when full): a hint saves work, never changes a decision.
SESSION_SEEDS_MAX = 1 << 20


class _PrefixIndexRouter(BaseRouter):
    params: _PrefixIndexParams

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self.index = ApproxPrefixIndex(capacity_blocks=self.params.index_capacity_blocks,
                                       ttl_s=self.params.index_ttl_s)
        self._session_at: dict[str, str] = {}  # session id -> replica its last request was sent to

    def _observe(self, replicas: Sequence[ReplicaSnapshot], now_s: float) -> None:
        # this sees every snapshot of every decision, and nearly all are healthy: one pass in C first
        if not all(map(_HEALTHY, replicas)):
            for replica_id in [r.replica_id for r in replicas if not r.healthy]:
                self.index.forget(replica_id)

    def on_routed(self, request: RequestFacts, replica_id: str, now_s: float) -> None:
        self.index.record(replica_id, request.block_hashes, now_s)
        if request.session_id is not None:
            last = self._session_at
            if len(last) >= SESSION_SEEDS_MAX and request.session_id not in last:
                last.clear()  # only a hint for the order of work, so forgetting it is safe
            last[request.session_id] = replica_id

    def _session_seed(self, request: RequestFacts, ids: list[str]) -> int:
        """Where in ``ids`` the replica this request's session was last sent to is (-1: unknown or not a
        candidate). Its index holds the session's history, so it usually has the best match, and
        matching it first lets one cheap lookup rule out most other candidates."""
        rid = None if request.session_id is None else self._session_at.get(request.session_id)
        if rid is None:
            return -1
        try:
            return ids.index(rid)
        except ValueError:
            return -1


# -------------------------------------------------------------------------------------------- llm-d scorer
class LlmDScorerParams(_PrefixIndexParams):
    kind: Literal["llm_d_scorer"] = "llm_d_scorer"
    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_usage_weight: float = Field(2.0, ge=0)
    # replica_id: ties go to the smallest id (repeatable; the pruned path relies on it). random: a seeded
    # uniform draw among the tied best, as llm-d's max-score picker (shuffle, then a stable sort); every
    # candidate is then scored in full, so it costs a full scan per decision.
    tie_break: Literal["replica_id", "random"] = "replica_id"


@ROUTERS.register("llm_d_scorer")
class LlmDScorerRouter(_PrefixIndexRouter):
    """Weighted scorers in the style of llm-d's inference scheduler; the highest total wins.

    - prefix: leading prompt blocks found in the router's own index for that replica / prompt blocks;
    - queue: min-max normalised scraped waiting queue, 1 for the shortest and 0 for the longest
      (1 for all when equal), so it is relative: a longer queue by one request scores like one longer
      by a hundred;
    - kv usage: 1 - scraped KV cache usage.
    Ties break by ``replica_id``, or (``tie_break: random``) by a seeded draw among the tied best.
    """

    Params = LlmDScorerParams
    params: LlmDScorerParams

    def __init__(self, params: RouterParams, *, seed: int) -> None:
        super().__init__(params, seed=seed)
        self._listed: dict[object, ListedTerms] = {}  # CandidateList.epoch -> what was derived from it

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
        random_ties = self.params.tie_break == "random"
        if not self.keep_scores and not random_ties:
            return RoutingDecision(self._best(request, candidates, now_s), "llm_d_scorer (score, higher wins)")
        totals = self.scores(request, candidates, now_s)
        if random_ties:
            top = max(totals)
            tied = sorted((candidates[i].replica_id, i) for i, t in enumerate(totals) if t == top)
            best = tied[self.rng.randrange(len(tied))][1] if len(tied) > 1 else tied[0][1]
        else:
            best = min(range(len(candidates)), key=lambda i: (-totals[i], candidates[i].replica_id))
        if not self.keep_scores:
            return RoutingDecision(candidates[best].replica_id, "llm_d_scorer (score, higher wins)")
        scores = tuple(zip([c.replica_id for c in candidates], totals, strict=True))
        return RoutingDecision(candidates[best].replica_id, "llm_d_scorer (score, higher wins)", scores)

    def _best(self, request: RequestFacts, candidates: list[ReplicaSnapshot], now_s: float) -> str:
        """The replica ``scores`` ranks first (ties by ``replica_id``), matching only the candidates that
        can still win.

        A candidate's total is at most its total with a full prefix match (``m / n_blocks <= 1.0``, and
        float multiplication by a weight >= 0 and float addition are monotone, so the bound is exact:
        it is the same expression evaluated at 1.0). The replica this request's session last went to
        (``_session_seed``), which usually holds the longest match, is matched first and sets a high
        best total at once; then candidates are matched in descending bound order until a bound falls
        below the best exact total found, so the index is asked about the few replicas whose queue and
        KV scores leave them a chance, not every replica of the fleet; equal bounds are still matched,
        so ties break as in the full scan. Which candidate is matched first changes only the work: every
        candidate not matched is ruled out by an exact bound. Lookups skipped here also skip those
        replicas' TTL expiry, which changes no answer: expired blocks are the oldest in an LRU, so the
        next match, record or capacity eviction there removes them first all the same.
        """
        p = self.params
        return self._pick(request, ScorerTerms(p.prefix_weight, p.queue_weight, p.kv_usage_weight, candidates,
                                               listed=False), now_s)

    def route(self, request: RequestFacts, replicas: Sequence[ReplicaSnapshot], now_s: float) -> RoutingDecision:
        epoch = getattr(replicas, "epoch", None)
        if epoch is None or self.keep_scores or self.params.tie_break == "random":
            return super().route(request, replicas, now_s)
        # A host list with an epoch (CandidateList): the candidates and their scraped-signal terms are
        # derived once per list and request class, so a decision does not pass over every replica listed.
        removed = getattr(replicas, "removed", ())
        kept = self._listed.get(epoch)
        if kept is None or len(removed) < kept.applied:  # (fewer removed than before: a broken promise)
            if len(self._listed) >= LISTS_MAX:
                self._listed.clear()
            kept = self._listed[epoch] = ListedTerms(replicas, len(removed))
        elif len(removed) > kept.applied:
            kept.drop(removed[kept.applied:])
        for replica_id in kept.unhealthy:  # what _observe does at every decision
            self.index.forget(replica_id)
        key = kept.class_key(request)
        try:
            terms = kept.classes[key]
        except KeyError:
            candidates = candidate_replicas(request, replicas)
            p = self.params
            terms = kept.classes[key] = ScorerTerms(p.prefix_weight, p.queue_weight, p.kv_usage_weight, candidates,
                                                    listed=True) if candidates else None
        if terms is None:
            return RoutingDecision(None, NO_ELIGIBLE_REPLICA)
        best_id = self._pick(request, terms, now_s)
        if best_id not in terms.pos:  # type: ignore[operator]
            raise RuntimeError(f"{type(self).__name__} chose ineligible replica {best_id!r}")
        return RoutingDecision(best_id, "llm_d_scorer (score, higher wins)")

    def _pick(self, request: RequestFacts, t: ScorerTerms, now_s: float) -> str:
        """``_best`` on the candidates' terms (kept ones, ``t.order`` set, or made for this decision)."""
        pw = self.params.prefix_weight
        hashes = request.block_hashes
        n_blocks = len(hashes)
        ids, queue, kv, bounds = t.ids, t.queue, t.kv, t.bounds
        n = len(ids)  # with kept terms, slots of candidates dropped since (bound -inf) count here too
        if not n_blocks:
            if t.idle_best is None:
                zero = pw * 0.0
                totals = [zero + a + b for a, b in zip(queue, kv)]
                t.idle_best = min(range(n), key=lambda i: (-totals[i], ids[i]))
            return ids[t.idle_best]
        index = self.index
        match = index.matcher(hashes, now_s)
        if t.order is not None:
            # kept terms: the session's replica first, else the first candidate of highest bound
            first = session_position(self._session_at, request, t.pos)  # type: ignore[arg-type]
            if first < 0:
                first = t.order[0]
            m_first = match(ids[first])
            if pw and t.size > _ONE_PASS_MIN:
                live, best_total, best_id = kept_live(t, index, hashes, match, first=first, m_first=m_first, pw=pw)
            else:
                best_id = ids[first]
                best_total = pw * (m_first / n_blocks) + queue[first] + kv[first]
                live = [i for i in t.order if bounds[i] >= best_total and i != first]
            return self._exact(live, t, hashes, match, best_total, best_id)
        # The first exact total: the session's replica, else the first candidate of highest bound (the one
        # a descending sort would put first).
        first = self._session_seed(request, ids)
        if first < 0:
            first = max(range(n), key=bounds.__getitem__)
        best_id = ids[first]
        best_total = pw * (match(best_id) / n_blocks) + queue[first] + kv[first]
        # Candidates that may still win, in one pass. With the match stopped before block k a candidate
        # totals at most t(k) = pw * (k / n_blocks) + queue + kv, and loses if t(k) is below the best, or
        # equal to it with a larger replica_id. One k for all (from the highest queue + kv) is picked by a
        # float estimate; the test is the exact expression, and a candidate that fails it or holds block
        # k in its index goes to the exact loop below.
        if pw and t.size > _ONE_PASS_MIN:
            k = min(max(math.ceil((best_total - (t.max_bound - pw)) / pw * n_blocks) - 1, 0), n_blocks - 1)
            at_k = pw * (k / n_blocks)
            holds = index.holder_test(hashes, k)
            live = [i for i in range(n) if bounds[i] >= best_total and i != first
                    and ((s := at_k + queue[i] + kv[i]) > best_total or (s == best_total and ids[i] < best_id)
                         or holds(ids[i]))]
        else:
            live = [i for i in range(n) if bounds[i] >= best_total and i != first]
        return self._exact(live, t, hashes, match, best_total, best_id)

    def _exact(self, live: list[int], t: ScorerTerms, hashes: Sequence[int], match: Callable[[str], int],
               best_total: float, best_id: str) -> str:
        """The best of ``best_id`` (totalling ``best_total``) and the candidates at positions ``live``, each
        matched only if one test of a block does not rule it out."""
        pw = self.params.prefix_weight
        n_blocks = len(hashes)
        ids, queue, kv, bounds = t.ids, t.queue, t.kv, t.bounds
        holds = self.index.holds
        # descending bound; equal bounds keep the candidates' replica_id order (a reverse sort is stable)
        for i in sorted(live, key=bounds.__getitem__, reverse=True):
            if bounds[i] < best_total:
                break
            rid = ids[i]
            a, b = queue[i], kv[i]
            if pw:
                # A tighter bound for one test: if block k is not held there, the match stops at or
                # before it, so the total is at most t(k). k is picked as the largest count whose total
                # may lose to the best (the float estimate only picks k; the test is exact).
                k = min(max(math.ceil((best_total - a - b) / pw * n_blocks) - 1, 0), n_blocks - 1)
                s = pw * (k / n_blocks) + a + b
                if s < best_total or (s == best_total and rid > best_id):
                    # and one block further while that still loses: a candidate whose terms tie with the
                    # best's needs a longer match than the best's, not an equal one (the estimate gives k
                    # one short of it), so it is ruled out without a match
                    while k + 1 < n_blocks and ((s := pw * ((k + 1) / n_blocks) + a + b) < best_total
                                                or (s == best_total and rid > best_id)):
                        k += 1
                    if not holds(rid, hashes, k):
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
        u = self.rng.random() * math.fsum(weights)
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
        prompt_blocks = math.ceil(request.prompt_tokens / bs)
        decode = [math.ceil(t / bs) + prompt_blocks for t in map(_OUTSTANDING, candidates)]
        ids = list(map(_REPLICA_ID, candidates))
        most = min(len(hashes), prompt_blocks)
        bounds = [w * (prompt_blocks - most) + d for d in decode]
        index = self.index
        match = index.matcher(hashes, now_s) if most else None
        best_cost = math.inf
        best_id = ""
        first = self._session_seed(request, ids) if most else -1
        if first >= 0:
            best_id = ids[first]
            best_cost = w * (prompt_blocks - min(match(best_id), prompt_blocks)) + decode[first]
        # ascending bound; equal bounds keep the candidates' replica_id order (the sort is stable)
        order = sorted(range(len(candidates)), key=bounds.__getitem__)
        holds = index.holds
        for i in order:
            if bounds[i] > best_cost:
                break
            if i == first:
                continue
            rid = ids[i]
            d = decode[i]
            if match is None:
                cost = w * prompt_blocks + d  # nothing to match: cached is 0
            else:
                if w and best_cost < math.inf:
                    # one test: without block k the match stops at or before it (k picked by a float
                    # estimate; the pruning test is the exact expression)
                    k = min(math.ceil(prompt_blocks - (best_cost - d) / w) - 1, most - 1)
                    if k >= 0 and w * (prompt_blocks - k) + d > best_cost:
                        if not holds(rid, hashes, k):
                            continue
                cost = w * (prompt_blocks - min(match(rid), prompt_blocks)) + d
            if cost < best_cost or (cost == best_cost and rid < best_id):
                best_cost, best_id = cost, rid
        return best_id
