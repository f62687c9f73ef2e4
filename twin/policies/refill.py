"""When per-user token buckets can be full again, so that a token-bucket policy forgets full buckets without
a pass over every bucket it holds.

``TokenBucketAdmission`` forgets a user's bucket once it is full again (it then equals a fresh one). It used
to look at every bucket each 4,096 commits, so the cost per turn grew with the number of users remembered,
i.e. with the fleet (~7,000 buckets at 0.25x, four times that at 1x). Here each bucket has one entry in a
heap keyed by the earliest time it can be full, and a sweep visits only buckets whose time has come.

The key errs early: the policy's exact test is ``level + (now - t_s) * rate >= burst`` in floats, and
``t_s + (burst - level) / rate`` in floats may be a few units in the last place after the first ``now``
that passes it, so the key is that time less a slack a million times larger than any such rounding. A
bucket popped before it passes the exact test is pushed again; no bucket that passes it is missed.
Pure Python; no simpy.
"""

from __future__ import annotations

import heapq
import math


def earliest_full_s(level: float, t_s: float, rate: float, burst: float) -> float:
    """A time no later than the first ``now`` at which ``level + (now - t_s) * rate >= burst`` holds in
    floats (``math.inf``: never, without a new level)."""
    if level >= burst:
        return t_s
    if rate <= 0.0:
        return math.inf
    full_s = t_s + (burst - level) / rate
    return full_s - 1e-9 * (1.0 + abs(full_s) + (abs(level) + burst) / rate)


class RefillSchedule:
    """Keys (user ids) in order of the time their bucket can be full again.

    The owner stores each bucket's scheduled time (``due_s``) on the bucket: an entry whose time is not its
    bucket's ``due_s`` is stale and skipped. :meth:`schedule` pushes only when a bucket's time moves
    earlier (a later time is found when the earlier entry comes due and is rescheduled), so a bucket has
    at most a few entries.
    """

    __slots__ = ("_heap", "_n")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._n = 0  # push order: ties never compare keys, and the order is deterministic

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due_s: float, key: str) -> None:
        if due_s < math.inf:
            self._n += 1
            heapq.heappush(self._heap, (due_s, self._n, key))

    def note(self, key: str, bucket, rate: float, burst: float) -> None:
        """``bucket`` (``level``, ``t_s``, ``due_s``) was just set: a new entry if it can be full sooner than
        its entry says (the old one goes stale)."""
        due_s = earliest_full_s(bucket.level, bucket.t_s, rate, burst)
        if due_s < bucket.due_s:
            bucket.due_s = due_s
            self.push(due_s, key)

    def sweep(self, buckets: dict, limits, now_s: float, slack: int) -> None:
        """Delete from ``buckets`` (key -> bucket with ``level``, ``t_s``, ``tier``, ``due_s``) every bucket
        full at ``now_s``: ``min(burst, level + (now_s - t_s) * rate) >= burst`` with ``limits(tier)``,
        the owner's exact test. Only buckets whose entry has come due are tested; one that does not pass
        yet is scheduled again. The set deleted is the one a pass over every bucket would delete (and a
        dict keeps the order of what remains either way). Rebuilds the heap when it holds more than
        ``slack`` entries beyond two per bucket."""
        again = []
        for due_s, key in self.due(now_s):
            b = buckets.get(key)
            if b is None or b.due_s != due_s:
                continue  # forgotten, or rescheduled sooner: a stale entry
            rate, burst = limits(b.tier)
            if min(burst, b.level + (now_s - b.t_s) * rate) >= burst:
                del buckets[key]
            else:
                b.due_s = earliest_full_s(b.level, b.t_s, rate, burst)
                again.append((b.due_s, key))
        for due_s, key in again:
            self.push(due_s, key)
        if len(self._heap) > 2 * len(buckets) + slack:
            self.rebuild([(b.due_s, key) for key, b in buckets.items()])

    def rebuild(self, live: list[tuple[float, str]]) -> None:
        """Keep only ``live`` ``(due_s, key)`` entries (the owner's buckets' times): stale entries of
        buckets rescheduled sooner or forgotten otherwise stay until their time, which a slow refill
        puts far off."""
        self._heap = []
        for due_s, key in live:
            if due_s < math.inf:
                self._n += 1
                self._heap.append((due_s, self._n, key))
        heapq.heapify(self._heap)

    def due(self, now_s: float) -> list[tuple[float, str]]:
        """Pop every entry whose time is at or before ``now_s``: ``(due_s, key)`` in time order."""
        heap = self._heap
        out = []
        while heap and heap[0][0] <= now_s:
            due_s, _, key = heapq.heappop(heap)
            out.append((due_s, key))
        return out
