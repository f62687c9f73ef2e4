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
        # one heap of (priority, seq, entry) per candidate-set key (``QueueEntry.key``): a kick takes the best
        # entry over the keys it has not found blocked, so the entries of a blocked key are never walked
        self._heaps: dict[tuple, list[tuple[int, int, QueueEntry]]] = {}
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
        # queued entries per candidate-set key (a key's heap may also hold withdrawn entries, dropped when they
        # reach its top or when they outnumber its queued ones; a key with none queued has its heap dropped)
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
        key = entry.key = (entry.facts.model, entry.allowed_regions, entry.facts.needs_long_context, entry.pool)
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = []
        heapq.heappush(heap, (entry.priority, entry.seq, entry))
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
        if not self._kicking:  # (a kick holds its keys' heaps)
            key = entry.key
            n = self._live_keys.get(key, 0)
            heap = self._heaps[key]
            if not n:
                del self._heaps[key]  # every entry left in it is withdrawn
            elif len(heap) > 2 * n + 1024:
                # withdrawn entries leave a heap only when they reach its top: rebuild it without them once they
                # outnumber the queued ones (pops keep their order, (priority, seq) being unique)
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
        """Release entries, highest priority first, while their model has a replica with room.

        Entries are looked at in (priority, seq) order across all keys; once a key finds no replica with room
        it is *blocked* for the rest of the kick (room only shrinks while a kick sends) and its entries are
        passed over, so a later entry of another key may still leave. The kick ends when every key still
        queued is blocked or empty. (Until 2026-11-30 the queue was one heap: entries of blocked keys were
        popped, set aside and pushed back, and a kick stopped after setting aside 64, so an entry with room
        could wait behind 64 blocked ones for a later kick.)"""
        if self._kicking or not self.count:  # nothing queued: the usual case when a generation ends
            return
        self._kicking = True
        try:
            heaps, live = self._heaps, self._live_keys
            blocked: set[tuple] = set()
            pop = heapq.heappop
            router = self.router
            while True:
                best = None
                bkey: tuple = ()
                gone = None
                for key, heap in heaps.items():
                    if key in blocked:
                        continue
                    if key not in live:  # all it holds is withdrawn
                        gone = [key] if gone is None else [*gone, key]
                        continue
                    top = heap[0]
                    while top[2].removed:  # (a queued entry is still in it, so this stops)
                        pop(heap)
                        top = heap[0]
                    if best is None or top < best:  # (priority, seq) is unique: entries are never compared
                        best, bkey = top, key
                if gone is not None:
                    for key in gone:
                        del heaps[key]
                if best is None:
                    break
                e = best[2]
                cands = router.candidates_for(e.facts, e.allowed_regions, self.max_waiting, e.pool)
                decision = router.route(e.facts, cands) if cands else None
                if decision is None or decision.replica_id is None:
                    blocked.add(bkey)
                    continue
                popped = pop(heaps[bkey])
                assert popped is best, "routing does not change the queue"
                self._leave(e)
                self.in_flight_tokens += e.tokens
                e.replica_id = decision.replica_id
                router.sent(e.facts, decision.replica_id)
                e.on_dispatch(e, router.by_id[decision.replica_id])  # type: ignore[operator]
                e.on_dispatch = None  # called once; dropping it breaks a cycle (see Generations._submit)
                e.is_dispatched = True
                if e.dispatched is not None:
                    e.dispatched.succeed(decision.replica_id)
        finally:
            self._kicking = False
