"""The engine's small containers: one step's schedule, the waiting queue, the inter-token-gap group column.

Split out of ``twin.models.engine`` to keep that module about scheduling; ``Step`` is re-exported there.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import insort
from collections import deque
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING

from twin.engine_profiles.step import StepShape

if TYPE_CHECKING:
    from twin.models.request import EngineRequest


_first, _second = itemgetter(0), itemgetter(1)


class Step:
    """One scheduled step: who computes how many tokens, and the shape the step-time model reads.

    The shape's five counts are plain fields (``d_req`` ...); the ``StepShape`` itself is built when first
    read: a decode run needs only ``d_req`` and ``d_ctx``, and a frozen dataclass costs a call per field."""

    __slots__ = ("reqs", "ns", "_shape", "d_req", "d_ctx", "p_req", "p_tok", "p_pairs", "ctx_requests",
                 "ctx_tokens", "gen_requests", "gen_tokens", "preempted", "admitted", "uniform_decode", "kv_usage",
                 "first_tokens", "g_n", "g_epoch")

    def __init__(self) -> None:
        self.reqs: list[EngineRequest] = []
        self.ns: list[int] = []
        self.preempted: list[EngineRequest] = []
        self.admitted: list[EngineRequest] = []
        self.first_tokens: list[EngineRequest] = []  # filled by Engine.complete: first token in this step, in reqs order
        self.g_n = 0  # reqs[:g_n] are the engine's decode-group members (see DecodeGroup)
        self.g_epoch = -1
        self._shape: StepShape | None = None

    @property
    def shape(self) -> StepShape:
        sh = self._shape
        if sh is None:
            # (positional, in field order: decode_requests, decode_context_tokens, prefill_requests,
            # prefill_tokens, prefill_attention_pairs; keywords cost more to bind)
            sh = self._shape = StepShape(self.d_req, self.d_ctx, self.p_req, self.p_tok, self.p_pairs)
        return sh


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
    """Group labels of the inter-token gap entries, one small code per entry instead of a pointer (a fleet
    run records millions of entries). Iterates, appends and extends like a list of labels."""

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


class DecodeGroup:
    """The steadily decoding prefix of an engine's ``running`` list, kept as offsets from a step counter.

    Members are ``running[:n]``. A member's ``num_computed``, ``num_output``, ``seq.num_tokens``,
    ``seq._out_len`` and ``last_token_s`` are stored as of group step ``r.g_base`` (after that step's
    completion); the true values add ``steps - r.g_base`` (and the in-flight token to ``num_computed``).
    So a decode step touches a member only at its *touches*: schedule-time ones (a block to allocate or to
    hash), kept in buckets per group step (every touch falls on a later step than the last one taken,
    ``scur``), and complete-time ones (it finishes, or reaches a watched output count), kept in a heap keyed
    by group step; both are taken in admission order (= running order) within a step. A member whose
    registration is deferred (``kv.pend``) is touched only to get a block, one every ``bs`` steps: its
    touches are in ``per``, a ring of ``bs`` lists where an entry stays between touches (no per-member push)
    and is taken out when its member leaves. ``EngineRequest.num_output`` reads through the offsets, so a
    member's count is right whenever it is read.
    """

    __slots__ = ("bs", "mml", "steps", "last_s", "n", "csum", "ncode", "hist", "sched", "per", "n_per", "scur",
                 "cheap", "ver", "infl", "epoch")

    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.bs = block_size
        self.mml = max_model_len
        self.steps = 0  # group steps completed
        self.last_s = float("nan")  # end time of the last completed step (every member's last_token_s)
        self.n = 0  # members: running[:n]
        self.csum = 0  # sum of the members' true num_computed (in-flight token included)
        # members per inter-token-gap group code (with groups): a group step writes one gap entry per code
        self.ncode: dict[int, int] = {}
        self.hist = [0] * block_size  # members by (stored num_computed - g_base) mod block size
        # schedule-time touches: step -> [(adm, ver, r)] (buckets, not a heap: a touch recurs every block, so
        # the heap's ordered pushes and pops were most of a touch's cost); steps <= scur are taken
        self.sched: dict[int, list[tuple[int, int, EngineRequest]]] = {}
        # deferred members' block touches, one every ``bs`` steps: a ring of ``bs`` lists by step mod bs, each in
        # admission order, an entry (adm, r) staying put between its touches; a member's entry is taken out when
        # it leaves (``drop_per``), so no entry is ever stale (the per-step buckets this replaces moved on every
        # step and were filtered for members that had left; every push falls within the next ``bs`` steps, so a
        # slot stands for exactly one pending step)
        self.per: list[list[tuple[int, EngineRequest]]] = [[] for _ in range(block_size)]
        self.n_per = 0  # entries in ``per``
        self.scur = 0
        self.cheap: list[tuple[int, int, int, EngineRequest]] = []  # (step, adm, ver, r) complete-time touches
        self.ver = 0  # join counter: a heap entry is live iff its ver is its request's g_ver
        self.infl = 0  # 1 while a scheduled step that includes the members has not completed
        self.epoch = 0  # bumped when the group is dissolved (a step scheduled before then is not a group step)

    def next_sched(self, s: int, c: int) -> int:
        """First group step >= ``s`` whose scheduling finds ``num_computed % bs`` at 0 (a block to allocate)
        or at bs - 1 (a block to hash), for a member with ``c`` computed tokens at the scheduling of step s."""
        bs = self.bs
        return s + min((-c) % bs, (bs - 1 - c) % bs)

    def push_sched(self, r: EngineRequest, s: int) -> None:
        lst = self.sched.get(s)
        if lst is None:
            self.sched[s] = [(r.adm, r.g_ver, r)]
        else:
            lst.append((r.adm, r.g_ver, r))

    def push_per(self, r: EngineRequest, s: int) -> None:
        """``r``'s next block touch at group step ``s`` (at most ``bs`` steps after the next step taken)."""
        lst = self.per[s % self.bs]
        e = (r.adm, r)
        if not lst or lst[-1][0] < r.adm:
            lst.append(e)  # (the usual case: a member that has just joined comes last in admission order)
        else:
            insort(lst, e)  # (adm is unique among members, so r itself is never compared)
        r.g_pl = lst
        self.n_per += 1

    def drop_per(self, r: EngineRequest) -> None:
        """A member that leaves: its block touch out of ``per``."""
        lst = r.g_pl
        if lst is not None:
            lst.remove((r.adm, r))
            r.g_pl = None
            self.n_per -= 1

    def take_per(self, s0: int, s1: int, move: bool) -> list[EngineRequest]:
        """Block touches of deferred members at group steps ``s0 .. s1``, in admission order. With ``move`` the
        entries stay for their next block step, ``bs`` later (callers pass ``move`` only when that is after
        ``s1``: each member then gets exactly one block in ``s0 .. s1``); without, they are taken out."""
        per, bs = self.per, self.bs
        if move:
            if s0 == s1:  # (one step: one slot, already in admission order)
                return list(map(_second, per[s0 % bs]))
            lists = [lst for t in range(s0, s1 + 1) if (lst := per[t % bs])]
            if len(lists) == 1:
                return list(map(_second, lists[0]))
            # by adm alone (unique among members): C-level int compares instead of tuple ones
            return list(map(_second, sorted(chain.from_iterable(lists), key=_first)))
        out: list[tuple[int, EngineRequest]] = []
        for t in range(s0, min(s1, s0 + bs - 1) + 1):
            lst = per[t % bs]
            if lst:
                out += lst
                for e in lst:
                    e[1].g_pl = None
                self.n_per -= len(lst)
                lst.clear()
        out.sort()
        return [e[1] for e in out]

    def take_sched(self, s: int) -> list[EngineRequest]:
        """Live schedule-time touches of group steps ``scur + 1 .. s``, in admission order (= running order;
        the callers apply one step's, or one decode run's, touches per request in that order)."""
        sched = self.sched
        if s == self.scur + 1:
            due = sched.pop(s, None)
            if due is None:
                self.scur = s
                return []
        else:
            due = []
            for t in range(self.scur + 1, s + 1):
                lst = sched.pop(t, None)
                if lst is not None:
                    due += lst
        self.scur = s
        if len(due) > 1:
            due.sort()  # (adm, ver): adm first; equal adm (a member that left and rejoined) differs in ver
        return [r for _, ver, r in due if r.g_ver == ver]

    def push_complete(self, r: EngineRequest) -> None:
        """The step at which a member (stored as of ``steps``) finishes or reaches its watched count."""
        o = r._nout
        rem = r.target_output_tokens - o
        by_len = self.mml - r.seq.num_tokens
        if by_len < rem:
            rem = by_len
        w = r.watch_output
        if w is not None and w - o < rem:
            rem = w - o
        heapq.heappush(self.cheap, (r.g_base + rem, r.adm, r.g_ver, r))

    def pop_due(self, heap: list, s: int) -> list[EngineRequest]:
        """Live entries of ``heap`` due at or before step ``s``, in (step, admission) order."""
        out = []
        while heap and heap[0][0] <= s:
            _, _, ver, r = heapq.heappop(heap)
            if r.g_ver == ver:
                out.append(r)
        return out

    def materialise(self, r: EngineRequest) -> None:
        """Write a member's true values into its fields (rebased to ``steps``; in-flight token included)."""
        d = self.steps - r.g_base
        r.num_computed += d + self.infl
        if d:
            r._nout += d
            seq = r.seq
            seq.num_tokens += d
            seq._out_len += d
            r.last_token_s = self.last_s
        r.g_base = self.steps
