"""The engine's small containers: one step's schedule, the waiting queue, the inter-token-gap group column.

Split out of ``twin.models.engine`` to keep that module about scheduling; ``Step`` is re-exported there.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twin.models.request import EngineRequest


class Step:
    """One scheduled step: who computes how many tokens, and the shape the step-time model reads."""

    __slots__ = ("reqs", "ns", "shape", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens",
                 "preempted", "admitted", "uniform_decode", "kv_usage", "first_tokens")

    def __init__(self) -> None:
        self.reqs: list[EngineRequest] = []
        self.ns: list[int] = []
        self.preempted: list[EngineRequest] = []
        self.admitted: list[EngineRequest] = []
        self.first_tokens: list[EngineRequest] = []  # filled by Engine.complete: first token in this step, in reqs order


class WaitingQueue:
    """FCFS deque (preempted requests go back to the front) or a priority heap."""

    __slots__ = ("fcfs", "dq", "heap", "count", "_n")

    def __init__(self, fcfs: bool) -> None:
        self.fcfs = fcfs
        self.dq: deque[EngineRequest] = deque()
        self.heap: list[tuple[int, float, int, EngineRequest]] = []
        self.count = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push(self, r: EngineRequest, *, front: bool = False) -> None:
        self._n += 1
        if self.fcfs:
            (self.dq.appendleft if front else self.dq.append)(r)
        else:
            self.count += 1
            heapq.heappush(self.heap, (r.priority, r.arrival_s, self.count, r))

    def peek(self) -> EngineRequest:
        return self.dq[0] if self.fcfs else self.heap[0][3]

    def pop(self) -> EngineRequest:
        self._n -= 1
        return self.dq.popleft() if self.fcfs else heapq.heappop(self.heap)[3]

    def remove(self, r: EngineRequest) -> bool:
        if self.fcfs:
            try:
                self.dq.remove(r)
            except ValueError:
                return False
        else:
            idx = next((i for i, e in enumerate(self.heap) if e[3] is r), None)
            if idx is None:
                return False
            self.heap.pop(idx)
            heapq.heapify(self.heap)
        self._n -= 1
        return True

    def items(self) -> list[EngineRequest]:
        return list(self.dq) if self.fcfs else [e[3] for e in sorted(self.heap)]


class GroupColumn:
    """Group labels of the inter-token gaps, one small code per gap instead of a pointer (a fleet run
    records hundreds of millions of gaps). Iterates, appends and extends like a list of labels."""

    __slots__ = ("codes", "labels", "_index")

    def __init__(self) -> None:
        self.codes = array("H")
        self.labels: list[str | None] = []
        self._index: dict[str | None, int] = {}

    def code(self, label: str | None) -> int:
        c = self._index.get(label)
        if c is None:
            c = self._index[label] = len(self.labels)
            self.labels.append(label)
            if c == 65536 and self.codes.typecode == "H":  # more labels than 2-byte codes hold
                self.codes = array("I", self.codes)
        return c

    def append(self, label: str | None) -> None:
        c = self.code(label)  # first: a new label may widen the codes array
        self.codes.append(c)

    def extend(self, labels) -> None:
        codes = [self.code(g) for g in labels]
        self.codes.extend(codes)

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self):
        return map(self.labels.__getitem__, self.codes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.labels[c] for c in self.codes[i]]
        return self.labels[self.codes[i]]
