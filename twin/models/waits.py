"""Waiting in SimPy without the cost of its general machinery, at exactly the place in the event order the
general form would take: ``first_of`` (``a | b`` without a ``Condition``), ``first_of_timer`` (``a |
timeout`` with the timeout called off when ``a`` comes first), ``schedule_at`` (an event at an
earlier-taken place), ``CallOffTimers`` (timeouts that are nearly always called off) and ``LongWaits``
(long timeouts, such as a user's think time, kept out of SimPy's queue).

These reach into SimPy 4.1's event queue (``env._queue``: ``(time, priority, id, event)``) and its event-id
counter (``env._eid``); pyproject pins simpy below 4.2 for that reason, and tests/test_client_paths.py checks
each one against the construction it replaces.
"""

from __future__ import annotations

import heapq

import simpy
from simpy.events import NORMAL


def first_of(env: simpy.Environment, a: simpy.Event, b: simpy.Event) -> simpy.Event:
    """``a | b`` for two pending events that never fail, without a ``Condition``.

    The event returned is scheduled when the first of ``a`` and ``b`` is processed, which is exactly when
    ``a | b`` would be scheduled, so a process waiting on it resumes at the same point of the event order.
    It carries no value: callers read their own flags, as they did with the condition. Spelled out for
    speed: a turn waits like this once or twice, and a ``Condition`` builds its value and unhooks itself
    from both events each time.
    """
    w = env.event()

    def fire(_event: simpy.Event) -> None:
        if not w.triggered:
            w.succeed()

    a.callbacks.append(fire)  # type: ignore[union-attr]
    b.callbacks.append(fire)  # type: ignore[union-attr]
    return w


def first_of_timer(env: simpy.Environment, a: simpy.Event, timers: CallOffTimers, delay_s: float) -> simpy.Event:
    """``first_of(env, a, env.timeout(delay_s))`` with the timeout from ``timers``, called off when ``a`` comes
    first (a queued turn's patience: it is nearly always dispatched first). The waiter is scheduled where
    ``first_of``'s would be: the timer takes its event id where the ``Timeout`` would and fires at its place.

    What it saves: a ``Timeout`` per queued turn that sat in SimPy's queue for the whole patience and then
    fired as a no-op. Under a backlog those were nearly all of SimPy's queue (~8,300 of ~8,400 events at the
    10M-user note's peak at 0.0625x), which every other event's push and pop then had to work through.
    """
    w = env.event()

    def on_timer() -> None:
        if not w.triggered:
            w.succeed()

    timer = timers.start(delay_s, on_timer)

    def on_a(_event: simpy.Event) -> None:
        if not w.triggered:
            timers.call_off(timer)
            w.succeed()

    a.callbacks.append(on_a)  # type: ignore[union-attr]
    return w


def schedule_at(env: simpy.Environment, event: simpy.Event, t_s: float, place: float) -> None:
    """``env.schedule`` (normal priority) at the absolute time ``t_s`` with the given place among events
    at that time (an event id, possibly taken earlier). Lets a timer keep the place in SimPy's event order
    that a ``Timeout`` created earlier would have had, without sitting in the queue until then."""
    heapq.heappush(env._queue, (t_s, NORMAL, place, event))


class CallOffTimers:
    """Timeouts that are nearly always called off before they fire (a client's patience for its first
    token, 30 s, against a first token within a second): kept in a heap of their own, with only the
    earliest one in SimPy's queue.

    A timer takes its event id when it starts, as a ``Timeout`` created then would, and that one fires at
    the same place in the event order (see :func:`schedule_at`); a called-off timer that is in SimPy's
    queue fires as a no-op, as its ``Timeout`` would have, and puts the next one there. So the order of
    everything that happens is unchanged, and a turn costs no timer event in the usual case.
    """

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._heap: list[tuple[float, int, list]] = []  # (t_s, event id, entry); entry = [callback, armed]

    def start(self, delay_s: float, callback) -> list:
        """``callback()`` after ``delay_s`` unless called off; returns the handle for :meth:`call_off`."""
        env = self.env
        entry = [callback, False]
        heapq.heappush(self._heap, (env.now + delay_s, next(env._eid), entry))
        if self._heap[0][2] is entry:
            self._arm()
        return entry

    @staticmethod
    def call_off(entry: list) -> None:
        entry[0] = None

    def _arm(self) -> None:
        t_s, place, entry = self._heap[0]
        entry[1] = True
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, entry
        ev.callbacks.append(self._fire)  # type: ignore[union-attr]
        schedule_at(self.env, ev, t_s, place)

    def _fire(self, ev: simpy.Event) -> None:
        entry = ev._value
        callback, entry[0] = entry[0], None
        heap = self._heap
        while heap and heap[0][2][0] is None:  # fired or called off
            heapq.heappop(heap)
        if heap and not heap[0][2][1]:
            self._arm()
        if callback is not None:
            callback()


class _Due:
    """What a process waiting in :class:`LongWaits` yields: the three fields SimPy's ``Process._resume``
    and ``Environment.step`` read of an event, and whether it is in SimPy's queue yet. It succeeds with
    no value, as a ``Timeout`` does; nothing else ever sees it."""

    __slots__ = ("callbacks", "_ok", "_value", "armed")


class LongWaits:
    """``env.timeout(delay_s)`` for long waits that many processes sit in at once (a user's think time
    between turns: one per live session), kept in a heap of their own with only the earliest one in
    SimPy's queue. SimPy's queue then holds O(replicas + turns in flight) events instead of one more per
    live session (95 % of it at 0.25x), and every other event's push and pop works on a heap that stays
    small and in cache as the fleet grows.

    The order is exactly a ``Timeout``'s, ties included: a wait takes its event id when it starts, at the
    moment the ``Timeout`` would have taken it, and its due time is the same float (``now + delay_s``), so
    its key ``(due, NORMAL, id)`` in SimPy's queue is the key the ``Timeout`` had (:func:`schedule_at`).
    The heap is ordered by ``(due, id)``, the same order, and its earliest wait is always in SimPy's queue
    (put there when it starts as the earliest, or when the one before it fires), so no wait can be due
    before SimPy's queue reaches it. A wait that fires is its own event: the waiting process resumes from
    it directly, as from its ``Timeout``, with no event in between.
    """

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._heap: list[tuple[float, int, _Due]] = []  # (due t_s, event id, wait); ids are unique

    def wait(self, delay_s: float) -> _Due:
        """The event to yield for a wait of ``delay_s`` (>= 0) from now."""
        if delay_s < 0:
            raise ValueError(f"Negative delay {delay_s}")
        env = self.env
        ev = _Due()
        ev.callbacks = [self._on_due]  # first: the next wait is armed before the process resumes
        ev._ok, ev._value, ev.armed = True, None, False
        entry = (env._now + delay_s, next(env._eid), ev)
        heap = self._heap
        heapq.heappush(heap, entry)
        if heap[0] is entry:
            ev.armed = True
            schedule_at(env, ev, entry[0], entry[1])  # type: ignore[arg-type]
        return ev

    def _on_due(self, ev: _Due) -> None:
        heap = self._heap
        due = heapq.heappop(heap)[2]
        assert due is ev, "SimPy's queue reaches the waits in the heap's order"
        if heap:
            t_s, place, nxt = heap[0]
            if not nxt.armed:
                nxt.armed = True
                schedule_at(self.env, nxt, t_s, place)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._heap)
