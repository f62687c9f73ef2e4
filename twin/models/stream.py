"""The client's view of one generation's token stream (``Stream``, also the generation's callbacks for the
queue and the engine) and what a client waits on for its first token. Split from ``generation.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import simpy

from twin.models.request import EngineRequest
from twin.models.token_queue import QueueEntry
from twin.models.tokens import TokenSeq
from twin.models.waits import CallOffTimers

if TYPE_CHECKING:
    from twin.models.client import Turn
    from twin.models.generation import Generations


def first_mark(a: int | None, b: int | None) -> int | None:
    """The smaller of two output-token marks, either of which may be None (None when both are)."""
    if a is None:
        return b
    return a if b is None or a <= b else b


def first_token_or_timeout(env: simpy.Environment, st: Stream, timers: CallOffTimers,
                           timeout_s: float | None) -> simpy.Event:
    """What a client waits on for its first token: ``st.first | env.timeout(timeout_s)`` (``st.first``
    alone without a timeout), with one event and one resume less in the usual case, and the timeout
    from ``timers`` (it is called off at the first token).

    The generation code does nothing when it resumes from the first token but wait for ``st.done``. So
    when the first token is processed while ``st.done`` is still pending, the waiting process is moved
    onto ``st.done`` (it would have been waiting there from this moment anyway) instead of being resumed
    through an event of its own, which would only put it there. Otherwise (the stream already ended, or
    the timeout came first) the event returned is scheduled exactly when ``st.first | timeout`` would be
    (without a timeout: the process resumes with ``st.first`` and then waits for ``st.done``, so it is
    moved whenever ``st.done`` can still be waited on).
    """
    waiter = env.event()
    decided = False

    def on_first(_event: simpy.Event) -> None:
        nonlocal decided
        if decided:
            return
        decided = True
        if timer is not None:
            timers.call_off(timer)
        done = st.done
        if done.callbacks is not None and (timeout_s is None or not done.triggered):
            done.callbacks.extend(waiter.callbacks)  # type: ignore[arg-type]
            waiter.callbacks.clear()  # type: ignore[union-attr]
        else:
            waiter.succeed()

    def on_timeout() -> None:
        nonlocal decided
        if decided:
            return
        decided = True
        waiter.succeed()

    timer = None if timeout_s is None else timers.start(timeout_s, on_timeout)
    st.first.callbacks.append(on_first)  # type: ignore[union-attr]
    return waiter


class Stream:
    """The client's view of one generation's token stream, and the generation's callbacks.

    ``first_seen`` is set at the first token; ``first`` is an event only while the client waits for that
    token (an event nobody waits on would still cost a trip through SimPy's queue). ``done`` succeeds when
    the generation ends.

    The queue entry's ``on_dispatch`` and the engine request's ``on_tokens`` / ``on_finished`` are this
    object's methods (set up by :meth:`Generations.generate`) rather than closures over the generation's
    locals: a turn then allocates one object where it allocated three functions and ~17 cells.
    """

    __slots__ = ("first", "first_seen", "done", "delivered", "cancel_at", "cancel_reason", "disconnect_at",
                 "cancelled", "req", "handle", "gens", "turn", "seq", "record", "output_tokens", "output_offset",
                 "max_tokens")

    def __init__(self, env: simpy.Environment) -> None:
        self.first: simpy.Event | None = None
        self.first_seen = False
        self.done = env.event()
        self.delivered = 0
        self.cancel_at: int | None = None
        self.cancel_reason = "user_cancelled"
        self.disconnect_at: int | None = None
        self.cancelled = False
        self.req: EngineRequest | None = None
        self.handle = None
        # the generation this stream belongs to (``generation``)
        self.gens: Generations | None = None
        self.turn: Turn | None = None
        self.seq: TokenSeq | None = None
        self.record = None
        self.output_tokens = 0
        self.output_offset = 0
        self.max_tokens = 0

    def generation(self, gens: Generations, turn: Turn, seq: TokenSeq, output_tokens: int, record,
                   output_offset: int, max_tokens: int) -> Stream:
        self.gens, self.turn, self.seq, self.record = gens, turn, seq, record
        self.output_tokens, self.output_offset, self.max_tokens = output_tokens, output_offset, max_tokens
        return self

    def dispatch(self, entry: QueueEntry, handle) -> None:
        """The queue entry's ``on_dispatch``: submit the generation to the chosen replica."""
        self.gens._submit(entry, handle, self)

    def on_tokens(self, r: EngineRequest, m: int, t: float) -> None:
        """The engine request's ``on_tokens``: the first token, and output reaching ``watch_output``."""
        self.delivered = r.num_output
        turn = self.turn
        if not self.first_seen:
            self.first_seen = True
            if self.first is not None:
                self.first.succeed()
            if not turn.first_token_seen:
                w = self.gens.w
                turn.first_token_seen = True
                w.rec.event(t, "request.first_token", "client", turn.turn_id, float(r.num_cached_tokens or 0))
                w.ttft_log.append((t, t - turn.arrival_s))
                if turn.version is not None:
                    w.turn_ttft[turn.turn_id] = t - turn.arrival_s
        if self.disconnect_at is not None and r.num_output >= self.disconnect_at:
            self.disconnect_at = None
            gens = self.gens
            gens.w.rec.event(t, "stream.disconnected", "client", turn.turn_id, float(r.num_output))
            gens.env.process(gens._reconnect(turn, self))
        if self.cancel_at is not None and r.num_output >= self.cancel_at and not self.cancelled:
            self.cancelled = True
            self.handle.replica.cancel(r, self.cancel_reason)
        r.watch_output = first_mark(self.cancel_at if not self.cancelled else None, self.disconnect_at)

    def on_finished(self, r: EngineRequest) -> None:
        """The engine request's ``on_finished``."""
        w = self.gens.w
        self.delivered = r.num_output
        record = self.record
        if record is not None:  # streamed batches persisted so far bound what a resume can recover
            record.persisted_tokens = max(record.persisted_tokens,
                                          w.conversation.persisted(self.output_offset + r.num_output))
        w.router.done(r.tag.facts, self.handle.scope)
        w.queue.drained(r.prompt_tokens + r.num_output)
        if not self.done.triggered:
            self.done.succeed()
        # The engine calls neither again (it finishes a request once, after its last tokens). Dropping
        # them (and the tag, the queue entry) breaks the cycle request -> callback -> stream -> request, so
        # the generation's objects are freed by reference counting now instead of by the cyclic collector,
        # which a fleet run otherwise spends ~10% of its time in (tests/test_gc_cycles.py).
        r.on_tokens = r.on_finished = r.tag = None
        w.queue.kick()
