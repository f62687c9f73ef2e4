"""TokenQueue.kick under a backlog: entries leave in (priority, seq) order across candidate-set keys, a key
that finds no room is passed over for the rest of the kick (its entries are not walked: the queue keeps a
heap per key), the kick stops as soon as every key still queued is blocked, and withdrawn entries are swept
out once they outnumber the queued ones. Checked against a plain reference that walks every entry in order,
with stub router and policy."""

from __future__ import annotations

import random

import simpy

from twin.models.token_queue import QueueEntry, TokenQueue
from twin.policies import RequestFacts
from twin.policies.queueing import QueueDecision


class _Policy:
    def decide(self, item, snapshot):
        return QueueDecision(accept=True, reason=None, priority=item, eta_s=0.0)


class _Router:
    """Room per model: ``room[model]`` sends left; every call is logged."""

    def __init__(self, room: dict[str, int]) -> None:
        self.room = dict(room)
        self.calls: list[tuple[str, str]] = []
        self.by_id = {m: m for m in room}

    def candidates_for(self, facts, allowed_regions, max_waiting, pool=None):
        self.calls.append(("candidates", facts.request_id))
        return [facts.model] if self.room[facts.model] > 0 else []

    def route(self, facts, cands):
        from twin.policies.types import RoutingDecision
        self.calls.append(("route", facts.request_id))
        return RoutingDecision(replica_id=cands[0], reason="stub")

    def sent(self, facts, replica_id):
        self.room[replica_id] -= 1


def _facts(i: int, model: str) -> RequestFacts:
    return RequestFacts(request_id=f"r{i}", tenant="t", tier="free", session_id=None, prompt_tokens=10,
                        expected_output_tokens=5, block_hashes=(), model=model, region=None, allowed_regions=None,
                        needs_long_context=False)


def _entry(i: int, model: str, sent: list[str]) -> QueueEntry:
    return QueueEntry(facts=_facts(i, model), tokens=15, priority=0, arrival_s=0.0,
                      on_dispatch=lambda e, handle: sent.append(e.facts.request_id))


def _reference_kick(heap_items: list, room: dict[str, int]) -> list[str]:
    """In (priority, seq) order: skip withdrawn entries and blocked keys, send while a key has room."""
    out, blocked_keys = [], set()
    for pri, seq, e, model in sorted(heap_items, key=lambda x: (x[0], x[1])):
        if e.removed or model in blocked_keys:
            continue
        if room[model] <= 0:
            blocked_keys.add(model)
            continue
        room[model] -= 1
        out.append(e.facts.request_id)
    return out


def _heaped(q: TokenQueue) -> int:
    return sum(map(len, q._heaps.values()))


def test_a_kick_with_every_key_blocked_stops_at_once_and_sends_the_same() -> None:
    env = simpy.Environment()
    sent: list[str] = []
    router = _Router({"a": 0, "b": 0})  # no room while the backlog is queued
    q = TokenQueue(env, policy=_Policy(), router=router, max_waiting_per_replica=1)
    for i in range(200):
        q.offer(_entry(i, "b" if i % 3 == 0 else "a", sent), item=i % 2)
    assert sent == [] and q.count == 200
    router.room["b"] = 2
    router.calls.clear()
    q.kick()
    # in (priority, seq) order: r0 (b) leaves, r2 (a) is blocked, r6 (b) leaves, r12 (b) finds no room: both
    # keys are blocked, so the kick ends there, having asked the router about four entries
    assert sent == ["r0", "r6"]
    assert router.calls == [("candidates", "r0"), ("route", "r0"), ("candidates", "r2"), ("candidates", "r6"),
                            ("route", "r6"), ("candidates", "r12")]
    assert q.count == 198 and _heaped(q) == 198


def test_random_backlogs_send_what_the_former_kick_sent() -> None:
    rng = random.Random(7)
    for trial in range(40):
        env = simpy.Environment()
        sent: list[str] = []
        models = ["a", "b", "c"][: rng.randint(1, 3)]
        router = _Router({m: 0 for m in models})
        q = TokenQueue(env, policy=_Policy(), router=router, max_waiting_per_replica=1)
        mirror = []  # (priority, seq, entry, model) as queued
        n = 0
        for _round in range(30):
            for _ in range(rng.randint(0, 60)):
                m, pri = rng.choice(models), rng.randint(0, 2)
                e = _entry(n, m, sent)
                q.offer(e, item=pri)
                mirror.append((pri, e.seq, e, m))
                n += 1
            for item in rng.sample(mirror, k=min(len(mirror), rng.randint(0, 40))):  # deadlines, patience
                q.remove(item[2])
            room = {m: rng.randint(0, 4) for m in models}
            want = _reference_kick([x for x in mirror if not x[2].is_dispatched], dict(room))
            router.room = room
            before = len(sent)
            q.kick()
            assert sent[before:] == want, trial
            mirror = [x for x in mirror if not x[2].is_dispatched and not x[2].removed]
            assert q.count == len(mirror)
        assert _heaped(q) <= 2 * q.count + 1024 + 60  # swept: withdrawn entries do not pile up


def test_sweeping_withdrawn_entries_keeps_the_order() -> None:
    rng = random.Random(3)
    env = simpy.Environment()
    sent: list[str] = []
    router = _Router({"a": 0})
    q = TokenQueue(env, policy=_Policy(), router=router, max_waiting_per_replica=1)
    entries = []
    for i in range(3000):
        e = _entry(i, "a", sent)
        q.offer(e, item=rng.randint(0, 3))
        entries.append(e)
    gone = rng.sample(entries, k=2600)
    for e in gone:
        q.remove(e)
    assert _heaped(q) < 3000  # swept at least once
    left = sorted((e.priority, e.seq, e.facts.request_id) for e in entries if not e.removed)
    router.room["a"] = len(left)
    q.kick()
    assert sent == [r for *_, r in left]


def test_an_entry_with_room_leaves_behind_any_number_of_blocked_ones() -> None:
    """The former single heap set at most 64 blocked entries aside per kick: the 65th blocked entry ended the
    kick, and an entry of a key with room behind it waited for a later kick."""
    env = simpy.Environment()
    sent: list[str] = []
    router = _Router({"a": 0, "b": 0})
    q = TokenQueue(env, policy=_Policy(), router=router, max_waiting_per_replica=1)
    for i in range(100):
        q.offer(_entry(i, "a", sent), item=0)
    q.offer(_entry(100, "b", sent), item=0)
    router.room["b"] = 1
    router.calls.clear()
    q.kick()
    assert sent == ["r100"]
    # one look at key a's best entry, none at the 99 behind it
    assert router.calls == [("candidates", "r0"), ("candidates", "r100"), ("route", "r100")]
    assert q.count == 100 and "b" not in {k[0] for k in q._heaps}  # an emptied key's heap is dropped
