"""The llm-d scorer's scraped-signal terms per candidate, and what it keeps of them per host list.

``LlmDScorerRouter`` (in :mod:`twin.policies.cache_aware`) totals ``prefix + queue + kv`` per candidate.
Only the prefix term depends on the request's prompt; the queue and kv terms, the eligible candidates and
the bounds (the total at a full match) depend on the request only through its class (model, regions,
long-context need, and where its length falls among the listed ``max_model_len``s). A host that hands over
a :class:`~twin.policies.types.CandidateList` promises, by its ``epoch``, that those fields did not change,
so the router derives them once per list and class (``ListedTerms``), drops a replica from them when the
list loses it (``CandidateList.removed``), and per decision finds the candidates that can still win with
one pass in C and a short walk (``live_by_bound``) instead of several Python passes over all of them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, contains

from twin.policies.types import ReplicaSnapshot, RequestFacts

_NUM_WAITING = attrgetter("num_waiting")
_KV_USAGE = attrgetter("kv_usage")
_REPLICA_ID = attrgetter("replica_id")
_OUTSTANDING = attrgetter("outstanding_tokens")
_HEALTHY = attrgetter("healthy")
_MAX_MODEL_LEN = attrgetter("max_model_len")

# Host lists (epochs) whose terms a router keeps, cleared when full: they save work, never change a decision.
LISTS_MAX = 64


class ScorerTerms:
    """The queue, kv and bound terms of one candidate list, exactly as ``LlmDScorerRouter.scores`` computes
    them (its total is ``(prefix + queue) + kv``; the bound is that expression at a full match, where
    ``pw * (n_blocks / n_blocks) == pw``). ``listed`` adds what a kept list is read through: each
    replica_id's position, and the positions in descending bound order (equal bounds in replica_id order,
    as a stable reverse sort leaves them)."""

    __slots__ = ("ids", "queue", "kv", "bounds", "max_bound", "idle_best", "pos", "order", "margin", "size", "waiting",
                 "waiting_count", "q_lo", "q_hi")

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
        # Every term and partial sum lies in [0, pw + qw + kw], so each float addition errs by at most
        # 2**-53 of that; a few of them stay far below this margin (see live_by_bound).
        self.margin = 1e-9 * (pw + qw + kw + 1.0)
        self.size = len(candidates)  # candidates still listed (drop leaves a removed one's slot, ruled out)
        if listed:
            self.pos = {rid: i for i, rid in enumerate(self.ids)}
            self.order = sorted(range(len(self.ids)), key=self.bounds.__getitem__, reverse=True)
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
        self.order.remove(i)  # type: ignore[union-attr]
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


def live_by_bound(t: ScorerTerms, lrus: dict, *, first: int, best_total: float, best_id: str, at_k: float,
                  pw: float, block: int) -> list[int]:
    """The positions ``LlmDScorerRouter._best``'s one-pass filter keeps, in ascending order, without
    testing every candidate in Python: ``bounds[i] >= best_total``, ``i != first``, and either
    ``t = at_k + queue[i] + kv[i]`` beats the best (or ties it with a smaller replica_id) or the
    candidate's index holds ``block``.

    The holders of ``block`` are found in one pass in C. The ``t`` test is made in descending bound
    order and stops where no later candidate can pass it: ``t`` and the bound are the same two additions
    from ``at_k <= pw``, so in exact arithmetic ``t == bound - (pw - at_k)``, and in floats the few
    roundings (each at most 2**-53 of ``pw + qw + kw``) stay below ``t.margin``; once
    ``bound - (pw - at_k)`` is below ``best_total - margin`` this candidate's ``t`` is below the best,
    and so is every later one's (a smaller bound). ``at_k`` is picked so that this happens at once for
    most requests.
    """
    ids, queue, kv, bounds = t.ids, t.queue, t.kv, t.bounds
    held = compress(range(len(ids)), map(contains, map(lrus.get, ids, repeat(())), repeat(block)))
    live = {i for i in held if bounds[i] >= best_total and i != first}
    drop, floor = pw - at_k, best_total - t.margin
    for i in t.order:  # type: ignore[union-attr]
        b = bounds[i]
        if b - drop < floor:
            break
        if b >= best_total and i != first and ((s := at_k + queue[i] + kv[i]) > best_total
                                               or (s == best_total and ids[i] < best_id)):
            live.add(i)
    return sorted(live)
