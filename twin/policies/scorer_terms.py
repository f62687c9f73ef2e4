"""The llm-d scorer's scraped-signal terms per candidate, and what it keeps of them per host list.

``LlmDScorerRouter`` (in :mod:`twin.policies.cache_aware`) totals ``prefix + queue + kv`` per candidate.
Only the prefix term depends on the request's prompt; the queue and kv terms, the eligible candidates and
the bounds (the total at a full match) depend on the request only through its class (model, regions,
long-context need, and where its length falls among the listed ``max_model_len``s). A host that hands over
a :class:`~twin.policies.types.CandidateList` promises, by its ``epoch``, that those fields did not change,
so the router derives them once per list and class (``ListedTerms``), drops a replica from them when the
list loses it (``CandidateList.removed``), and per decision finds the candidates that can still win from
the prefix index's holders of one block and a short walk over runs of equal terms (``kept_live``), not
from a pass over all of them.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from itertools import groupby, islice
from operator import attrgetter

from twin.policies.prefix_index import ApproxPrefixIndex
from twin.policies.types import ReplicaSnapshot, RequestFacts

_NUM_WAITING = attrgetter("num_waiting")
_KV_USAGE = attrgetter("kv_usage")
_REPLICA_ID = attrgetter("replica_id")
_OUTSTANDING = attrgetter("outstanding_tokens")
_HEALTHY = attrgetter("healthy")
_MAX_MODEL_LEN = attrgetter("max_model_len")

# Host lists (epochs) whose terms a router keeps, cleared when full: they save work, never change a decision.
LISTS_MAX = 64
# Holder lists in rank order a terms object keeps (_first_holder), cleared when full: the same.
RANKED_MAX = 256


class ScorerTerms:
    """The queue, kv and bound terms of one candidate list, exactly as ``LlmDScorerRouter.scores`` computes
    them (its total is ``(prefix + queue) + kv``; the bound is that expression at a full match, where
    ``pw * (n_blocks / n_blocks) == pw``). ``listed`` adds what a kept list is read through: each
    replica_id's position, and the positions in descending bound order (equal bounds in replica_id order,
    as a stable reverse sort leaves them), with each position's place in that order as first derived
    (``rank``: drops keep ``order`` and every run sorted by it, so a candidate is found there by bisection)."""

    __slots__ = ("ids", "queue", "kv", "bounds", "max_bound", "idle_best", "pos", "order", "rank", "runs", "run_of",
                 "holders_ranked", "margin", "size", "waiting", "waiting_count", "q_lo", "q_hi")

    def __init__(self, pw: float, qw: float, kw: float, candidates: Sequence[ReplicaSnapshot], *,
                 listed: bool) -> None:
        q = list(map(_NUM_WAITING, candidates))
        q_lo, q_hi = self.q_lo, self.q_hi = min(q), max(q)
        if q_hi == q_lo:
            self.queue = [qw * 1.0] * len(candidates)
        else:
            span = q_hi - q_lo
            self.queue = [qw * ((q_hi - w) / span) for w in q]
        self.kv = [kw * (1.0 - u) for u in map(_KV_USAGE, candidates)]
        self.ids = list(map(_REPLICA_ID, candidates))
        self.bounds = [pw + a + b for a, b in zip(self.queue, self.kv)]
        self.max_bound = max(self.bounds)
        self.idle_best: int | None = None  # the winner of a prompt with no full block, once computed
        self.pos: dict[str, int] | None = None
        self.order: list[int] | None = None
        self.runs: list[list[int]] | None = None  # see runs()
        self.run_of: list[int] = []  # position -> its run's index in runs (once runs() has run)
        # holders stamp (ApproxPrefixIndex.holders_stamp) -> the positions that list held, by rank (see
        # _first_holder)
        self.holders_ranked: dict[int, list[int]] = {}
        # Every term and partial sum lies in [0, pw + qw + kw], so each float addition errs by at most
        # 2**-53 of that; a few of them stay far below this margin (see kept_live).
        self.margin = 1e-9 * (pw + qw + kw + 1.0)
        self.size = len(candidates)  # candidates still listed (drop leaves a removed one's slot, ruled out)
        if listed:
            self.pos = {rid: i for i, rid in enumerate(self.ids)}
            self.order = sorted(range(len(self.ids)), key=self.bounds.__getitem__, reverse=True)
            self.rank = [0] * len(self.ids)
            for r, i in enumerate(self.order):
                self.rank[i] = r
            self.waiting = q
            self.waiting_count = Counter(q)

    def drop(self, replica_id: str) -> bool:
        """The candidate ``replica_id`` left the list: rule it out where it stands (the others keep their
        positions, so their order is still replica_id order). False when the terms must be derived again:
        it held the only shortest or longest queue (the queue term's min-max moves) or was the last one."""
        i = self.pos.pop(replica_id)  # type: ignore[union-attr]
        w = self.waiting[i]
        left = self.waiting_count[w] - 1
        self.waiting_count[w] = left
        if self.size == 1 or (not left and (w == self.q_lo or w == self.q_hi)):
            return False
        self.size -= 1
        # found by bisection on rank, not by a scan: a list holds a region's replicas, and drops are per
        # replica that runs out of room
        by_rank, r = self.rank.__getitem__, self.rank[i]
        order = self.order
        del order[bisect_left(order, r, key=by_rank)]  # type: ignore[arg-type, index]
        if self.runs is not None:
            run = self.runs[self.run_of[i]]
            del run[bisect_left(run, r, key=by_rank)]  # its run may be left empty: runs() users skip those
        was = self.bounds[i]
        # below every bound and total, so no filter keeps it and no comparison picks it
        self.bounds[i] = self.queue[i] = self.kv[i] = -math.inf
        if was == self.max_bound:
            self.max_bound = self.bounds[self.order[0]]  # type: ignore[index]
        if self.idle_best == i:
            self.idle_best = None
        return True


class ListedTerms:
    """What a router derived from one host list (one ``CandidateList.epoch``): the replicas listed down
    (forgotten at each decision, as ``_observe`` does), and per request class the candidates' terms
    (``None``: no candidate)."""

    __slots__ = ("unhealthy", "lengths", "classes", "applied")

    def __init__(self, replicas: Sequence[ReplicaSnapshot], applied: int) -> None:
        self.unhealthy = () if all(map(_HEALTHY, replicas)) else tuple(r.replica_id for r in replicas
                                                                        if not r.healthy)
        self.lengths = sorted(set(map(_MAX_MODEL_LEN, replicas)))
        self.classes: dict[tuple, ScorerTerms | None] = {}
        self.applied = applied  # how many of the list's ``removed`` this already leaves out

    def drop(self, replica_ids: Sequence[str]) -> None:
        """These replicas left the list: drop them from every class's terms (a class whose terms must be
        derived again is forgotten and derived at its next request). A class with no candidate keeps
        none; one that keeps others keeps them, as each steering step still leaves some (so the
        eligibility rule picks the same subset less the one that left). ``lengths`` may keep a length no
        replica has any more: class keys are then finer than they need be, never wrong."""
        for rid in replica_ids:
            if rid in self.unhealthy:
                self.unhealthy = tuple(u for u in self.unhealthy if u != rid)
            for key, terms in list(self.classes.items()):
                if terms is not None and rid in terms.pos and not terms.drop(rid):  # type: ignore[operator]
                    del self.classes[key]
        self.applied += len(replica_ids)

    def class_key(self, request: RequestFacts) -> tuple:
        """Requests with equal keys have the same candidates in this list: eligibility reads their length
        only as ``max_model_len >= total_tokens``, which is the same for every total between the same two
        listed lengths."""
        return (request.model, request.allowed_regions, request.region, request.needs_long_context,
                bisect_left(self.lengths, request.total_tokens))


def session_position(session_at: dict[str, str], request: RequestFacts, pos: dict[str, int]) -> int:
    """``_PrefixIndexRouter._session_seed`` through a kept list's positions (replica ids are unique)."""
    rid = None if request.session_id is None else session_at.get(request.session_id)
    return -1 if rid is None else pos.get(rid, -1)


# A prompt block held by more replicas than this makes the scorer look for a better first total before
# filtering (``kept_live``): its holders would all pass the filter. Only the amount of work depends on it.
FEW_HOLDERS = 8


def runs(t: ScorerTerms) -> list[list[int]]:
    """``t.order`` cut into runs of candidates with equal queue and kv terms (in replica_id order inside a
    run), which total the same at every match length: idle replicas form one long run. A drop takes its
    candidate out of its run, which may leave it empty."""
    if t.runs is None:
        pair = list(zip(t.queue, t.kv))
        t.runs = [list(g) for _, g in groupby(t.order, key=pair.__getitem__)]  # type: ignore[arg-type]
        run_of = [0] * len(t.ids)
        for x, run in enumerate(t.runs):
            for i in run:
                run_of[i] = x
        t.run_of = run_of
    return t.runs


def _first_holder(t: ScorerTerms, held: Collection[str], first: int, *, stamp: int = 0,
                  holds: Callable[[str], bool] | None = None) -> int:
    """The position of the first candidate in bound order, ``first`` aside, whose index holds the block
    ``held`` lists the holders of (-1: none); ``held`` may list more (``ApproxPrefixIndex.holders_at``), and
    ``holds`` (replica_id -> bool), when given, is the exact test for those it lists.

    The positions ``held`` lists are put in rank order and kept under ``stamp`` (its
    ``ApproxPrefixIndex.holders_stamp``; 0: not kept), so the next request asking about the same block
    reads them in order from the top and, as a rule, stops at the first: the holders of a widely held block
    (a tenant's system prompt) are mostly busy replicas ranked below many others, and a walk down the bound
    order grew with the region (~44 runs of ~94 a decision at 540 replicas, ~4x that at 2,160). A kept
    list stays right while its stamp does: a replica that left ``held`` since fails ``holds``, and one that
    joined would have changed the stamp; a candidate dropped from the terms since is taken out of it when
    passed over (found by its bound)."""
    ranked = t.holders_ranked.get(stamp) if stamp else None
    if ranked is None:
        ranked = sorted([i for i in map(t.pos.get, held) if i is not None],  # type: ignore[union-attr]
                        key=t.rank.__getitem__)
        if stamp:
            if len(t.holders_ranked) >= RANKED_MAX:
                t.holders_ranked.clear()
            t.holders_ranked[stamp] = ranked
    ids, bounds = t.ids, t.bounds
    found, gone = -1, 0
    for x, j in enumerate(ranked):
        if bounds[j] == -math.inf:
            gone += 1
        elif j != first and (holds is None or holds(ids[j])):
            found = j
            break
    else:
        x = len(ranked)
    if gone:  # candidates dropped since are passed over once: at a ramp's peak they are the holders ranked first
        ranked[:x] = [j for j in islice(ranked, x) if bounds[j] != -math.inf]
    return found


def kept_live(t: ScorerTerms, index: ApproxPrefixIndex, hashes: Sequence[int], match: Callable[[str], int], *,
              first: int, m_first: int, pw: float) -> tuple[list[int], float, str]:
    """``LlmDScorerRouter._pick``'s filter on kept terms: the positions that may still beat the best total
    found so far (ascending), with that best total and replica_id. Its cost depends on how many replicas
    hold the blocks it asks about and how many candidates tie near the best, not on how many are listed.

    With the match stopped before block k a candidate totals at most ``t(k) = at_k + queue + kv`` (``at_k =
    pw * (k / n)``); so it may win only if ``t(k)`` beats the best (is larger, or equal with a smaller
    replica_id) or its index holds block k. Any k gives an exact filter; k only moves work between the two
    tests. The holders of block k come from the index's holders map (no lookup per candidate): it lists a
    superset (``ApproxPrefixIndex.holders_at``), so each candidate it lists is tested exactly
    (``ApproxPrefixIndex.holder_test``), and the filter's sets are exactly those of block k's holders (the choice
    of k below reads the superset's size, which moves only work).
    The ``t(k)`` test runs over ``runs(t)`` in descending bound order, one test per run, and stops where
    no later run can pass it: ``t`` and the bound are the same two additions from ``at_k <= pw``, so in
    exact arithmetic ``t == bound - (pw - at_k)``, and in floats the few roundings (each at most 2**-53 of
    ``pw + qw + kw``) stay below ``t.margin``. The runs ranked above the first holder of block k1 (see
    below) are tested at ``t(k1)``, and once one of them falls below the best by that rule, the walk goes
    on from the holder's run: without that step it passed over every busy run above the holder, a number
    that grows with the region (~40 runs a decision at 540 replicas).

    k is first the largest count at which even the highest bound's ``t(k)`` may lose to the best (the
    float estimate only picks it). If many replicas hold that block (the tenant's system prompt, say),
    they would all pass, so the best total is raised first: the first candidate in bound order that holds
    it is matched exactly (a second seed, like the session's replica). If the block is still widely held,
    k becomes the best's own match length (the first block the best lacks, which few hold): then ``t(k)``
    passes only for runs whose queue and kv terms are at least the best's, which lie before the best in
    bound order, and for the best's own run only below its replica_id.
    """
    ids, queue, kv, bounds, n = t.ids, t.queue, t.kv, t.bounds, len(hashes)
    best_id, m_best = ids[first], m_first
    best_total = pw * (m_first / n) + queue[first] + kv[first]
    second = -1
    k = min(max(math.ceil((best_total - (t.max_bound - pw)) / pw * n) - 1, 0), n - 1)
    held = index.holders_at(hashes, k)
    pos, rank = t.pos, t.rank
    # every candidate but ``first`` ranked below ``lacking`` in t.order lacks block k1; ``holder`` is the first
    # that holds it (-1: none, or not looked for)
    k1, lacking, holder = k, -1, -1
    if len(held) > FEW_HOLDERS:
        holder = _first_holder(t, held, first, stamp=index.holders_stamp(hashes, k),
                               holds=index.holder_test(hashes, k))
        lacking = math.inf if holder < 0 else rank[holder]
        if holder >= 0 and bounds[holder] >= best_total:
            second = holder
        if second >= 0:
            m = match(ids[second])
            total = pw * (m / n) + queue[second] + kv[second]
            if total > best_total or (total == best_total and ids[second] < best_id):
                best_total, best_id, m_best = total, ids[second], m
            k = min(max(math.ceil((best_total - (t.max_bound - pw)) / pw * n) - 1, 0), n - 1)
            held = index.holders_at(hashes, k)
        if len(held) > FEW_HOLDERS:
            k_own = min(m_best, n - 1)
            held_own = index.holders_at(hashes, k_own)
            if len(held_own) < len(held):
                k, held = k_own, held_own
    # the holders of block k that may still win: those whose bound reaches the best total, which are a
    # prefix of t.order (found by bisection); whichever of the two is shorter is walked (a block held all
    # over a large fleet has many holders outside this list)
    order = t.order
    top = bisect_right(order, -best_total, key=lambda i: -bounds[i])  # type: ignore[arg-type]
    holds = index.holder_test(hashes, k)  # the exact test for the replicas holders_at lists
    if top < len(held):
        live = {i for i in islice(order, top) if ids[i] in held and holds(ids[i])}  # type: ignore[arg-type]
    else:
        live = {i for i in map(pos.get, held)  # type: ignore[union-attr]
                if i is not None and bounds[i] >= best_total and holds(ids[i])}
    at_k, at_k1 = pw * (k / n), pw * (k1 / n)
    drop, drop1, floor = pw - at_k, pw - at_k1, best_total - t.margin
    rs = runs(t)
    x, end = 0, len(rs)
    while x < end:
        run = rs[x]
        x += 1
        if not run:
            continue
        i = run[0]
        b = bounds[i]
        if b - drop < floor:
            break
        if b < best_total:
            continue
        # a run whose members all lack block k1 totals at most t(k1) (idle replicas that never served
        # the tenant lie here, above the second seed in bound order); its last member ranks highest
        if rank[run[-1]] < lacking:
            if b - drop1 < floor:
                # so does every later run ranked above the first holder of block k1, with a lower t(k1)
                # (the same float argument as the break above): go on from the first holder's run
                if holder < 0:
                    break
                x = t.run_of[holder]
                continue
            s = at_k1 + queue[i] + kv[i]
        else:
            s = at_k + queue[i] + kv[i]
        if s > best_total:
            live.update(run)
        elif s == best_total:
            for j in run:  # replica_id order: the ones below best_id tie and win
                if ids[j] >= best_id:
                    break
                live.add(j)
    live.discard(first)
    live.discard(second)
    return sorted(live), best_total, best_id
