"""The token-aware queue in front of the router: bounded by tokens, priorities by tier, an honest ETA.

Admission and ordering decisions come from a ``twin.policies`` queue policy; this component holds the
entries, measures the fleet's drain rate (an EWMA of tokens completed per second) and releases entries
to the router while some eligible replica has room. Deadlines and patience are the client's timers
("event OR timeout"): an entry that times out is removed here.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

import simpy

from twin.models.router import Router
from twin.policies import RequestFacts
from twin.policies.queueing import QueueSnapshot

_LN2 = math.log(2)


@dataclass(slots=True)
class QueueEntry:
    facts: RequestFacts
    tokens: int
    priority: int
    arrival_s: float
    # set when the entry leaves the queue; ``dispatched`` is an event only while a client waits for that
    # (an event nobody waits on would still cost a trip through SimPy's queue)
    is_dispatched: bool = False
    dispatched: simpy.Event | None = None
    seq: int = 0
    allowed_regions: tuple[str, ...] | None = None
    pool: str | None = None  # restrict to one pool (the prefill pool of a disaggregated model)
    replica_id: str | None = None
    removed: bool = False
    on_dispatch: object = None  # callback(entry, handle) that submits the generation
    key: tuple = ()  # model, allowed regions, long context, pool: the candidate set; set when queued


class TokenQueue:
    def __init__(self, env: simpy.Environment, *, policy, router: Router, max_waiting_per_replica: int,
                 ewma_halflife_s: float = 10.0) -> None:
        self.env = env
        self.policy = policy
        self.router = router
        self.max_waiting = max_waiting_per_replica
        self._heap: list[tuple[int, int, QueueEntry]] = []
        # queued (accepted, neither removed nor dispatched) entries and tokens per priority class, kept as
        # entries come and go so a snapshot does not walk the heap
        self._by_pri: dict[int, list[int]] = {}
        self._pris: list[int] = []  # the keys of _by_pri, sorted (the snapshot lists classes in this order)
        self._seq = 0
        self.queued_tokens = 0
        self.in_flight_tokens = 0
        self.count = 0
        self._drain = 0.0  # EWMA of completed tokens per second
        self._drain_t = 0.0
        self._halflife = ewma_halflife_s
        self._kicking = False
        # queued entries per candidate-set key: a kick stops once every key still queued is blocked
        self._live_keys: dict[tuple, int] = {}

    # ---- drain rate ------------------------------------------------------------------------------
    def drained(self, tokens: int) -> None:
        """A generation ended having used ``tokens`` (prompt + output): update the drain-rate EWMA."""
        now = self.env.now
        dt = now - self._drain_t
        decay = math.exp(-dt * _LN2 / self._halflife) if dt > 0 else 1.0
        self._drain = self._drain * decay + tokens * (_LN2 / self._halflife)
        self._drain_t = now
        self.in_flight_tokens = max(self.in_flight_tokens - tokens, 0)

    def drain_tokens_per_s(self) -> float:
        dt = self.env.now - self._drain_t
        return self._drain * (math.exp(-dt * _LN2 / self._halflife) if dt > 0 else 1.0)

    # ---- entries ---------------------------------------------------------------------------------
    def snapshot(self):
        if self.count == 0:  # nothing queued (the usual case): no class has entries
            by_pri = ()
        else:
            by_pri = self._by_pri
            by_pri = tuple([(pri, by_pri[pri][1]) for pri in self._pris if by_pri[pri][0] > 0])
        return QueueSnapshot(now_s=self.env.now, queued_tokens=self.queued_tokens,
                             capacity_tokens=getattr(self.policy, "capacity_tokens", None),
                             queued_by_priority=by_pri,
                             drain_tokens_per_s=self.drain_tokens_per_s(), in_flight_tokens=self.in_flight_tokens)

    def offer(self, entry: QueueEntry, item) -> object:
        """Ask the policy; on acceptance, queue the entry and try to dispatch. Returns the decision."""
        decision = self.policy.decide(item, self.snapshot())
        if not decision.accept:
            return decision
        entry.priority = decision.priority
        self._seq += 1
        entry.seq = self._seq
        heapq.heappush(self._heap, (entry.priority, entry.seq, entry))
        key = entry.key = (entry.facts.model, entry.allowed_regions, entry.facts.needs_long_context, entry.pool)
        live = self._live_keys
        live[key] = live.get(key, 0) + 1
        self._count_in(entry, 1)
        self.queued_tokens += entry.tokens
        self.count += 1
        self.kick()
        return decision

    def remove(self, entry: QueueEntry) -> bool:
        """Withdraw a queued entry (deadline, patience, cancel). False if already dispatched."""
        if entry.removed or entry.is_dispatched:
            return False
        entry.removed = True
        self._leave(entry)
        heap = self._heap
        if len(heap) > 2 * self.count + 1024 and not self._kicking:
            # withdrawn entries leave the heap only when popped, and a kick that finds every key blocked stops
            # at the top: rebuild without them once they outnumber the queued ones (pops keep their order,
            # (priority, seq) being unique)
            heap[:] = [item for item in heap if not item[2].removed]
            heapq.heapify(heap)
        return True

    def _leave(self, entry: QueueEntry) -> None:
        """A queued entry leaves the queue (withdrawn or dispatched): out of the counts by key, class and tokens."""
        live, key = self._live_keys, entry.key
        n = live[key] - 1
        if n:
            live[key] = n
        else:
            del live[key]
        self._count_in(entry, -1)
        self.queued_tokens -= entry.tokens
        self.count -= 1

    def _count_in(self, entry: QueueEntry, sign: int) -> None:
        c = self._by_pri.get(entry.priority)
        if c is None:
            c = self._by_pri[entry.priority] = [0, 0]
            bisect.insort(self._pris, entry.priority)
        c[0] += sign
        c[1] += sign * entry.tokens

    def kick(self) -> None:
        """Release entries, highest priority first, while their model has a replica with room."""
        if self._kicking or not self._heap:  # nothing queued: the usual case when a generation ends
            return
        self._kicking = True
        try:
            heap = self._heap
            blocked: list[tuple[int, int, QueueEntry]] = []
            blocked_models: set[tuple] = set()
            live = self._live_keys
            pop = heapq.heappop
            while heap:
                # the best entry is looked at in place and popped only once it leaves or is set aside: under a
                # backlog most kicks find no room for it, and a pop and push back would walk the heap twice
                # (the order entries leave in is the same: (priority, seq) is unique)
                item = heap[0]
                e = item[2]
                if e.removed:
                    pop(heap)
                    continue
                key = e.key  # same candidate set
                if key in blocked_models:
                    blocked.append(pop(heap))
                    if len(blocked) >= 64:  # the rest waits for the next kick; order is kept by the heap
                        break
                    continue
                cands = self.router.candidates_for(e.facts, e.allowed_regions, self.max_waiting, e.pool)
                decision = self.router.route(e.facts, cands) if cands else None
                if decision is None or decision.replica_id is None:
                    blocked_models.add(key)
                    # every key still queued is blocked: nothing further can leave in this kick (room only
                    # shrinks while it sends), so stop here, leaving this entry where it is
                    if len(blocked_models) == len(live):
                        break
                    blocked.append(pop(heap))
                    continue
                popped = pop(heap)
                assert popped is item, "routing does not change the queue"
                self._leave(e)
                self.in_flight_tokens += e.tokens
                e.replica_id = decision.replica_id
                self.router.sent(e.facts, decision.replica_id)
                e.on_dispatch(e, self.router.by_id[decision.replica_id])  # type: ignore[operator]
                e.on_dispatch = None  # called once; dropping it breaks a cycle (see Generations._submit)
                e.is_dispatched = True
                if e.dispatched is not None:
                    e.dispatched.succeed(decision.replica_id)
            for item in blocked:
                heapq.heappush(heap, item)
        finally:
            self._kicking = False
