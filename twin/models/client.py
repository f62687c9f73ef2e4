"""Clients and the request path of one turn: gateway -> conversation -> queue -> router -> replica -> stream.

A session process plays one user's conversation. Each turn is retried under an idempotency key (its
turn id) after retryable rejections or failures, honouring or ignoring retry-after; the user abandons
(and the cancellation reaches the queue or the replica, freeing KV) when no token arrives within the
patience time, may cancel mid-stream, and may disconnect and resume from the last persisted token. Every
arrived turn ends in exactly one outcome: completed, cancelled, rejected (with a reason), abandoned, failed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from twin.models.generation import Generations, Outcome
from twin.models.population import LengthDraw, SessionSpec
from twin.models.waits import LongWaits
from twin.rng import stream

RETRYABLE = {"user_rate_limited", "tenant_quota_exceeded", "queue_full", "replica_failed", "region_unreachable"}
OUTCOME_EVENT = {"completed": "request.finished", "rejected": "request.rejected", "cancelled": "request.cancelled",
                 "abandoned": "request.abandoned", "failed": "request.failed"}  # outcome kind -> event kind


class SegmentHash:
    """``stable_hash(f"{prefix}/{key}")`` for one fixed prefix (``twin.rng.stable_hash``: the first 63 bits of
    the string's 8-byte BLAKE2b digest), from a copy of the hash state after the prefix: the same digest, since
    BLAKE2b hashes a stream and ``prefix/key`` is the stream ``prefix/`` then ``key``, without building the
    string and the hash object's arguments each time (a turn hashes two or three such names)."""

    __slots__ = ("_head",)

    def __init__(self, prefix: str) -> None:
        self._head = hashlib.blake2b(f"{prefix}/".encode("utf-8"), digest_size=8)

    def __call__(self, key: str) -> int:
        h = self._head.copy()
        h.update(key.encode("utf-8"))
        return int.from_bytes(h.digest(), "big") >> 1


NORMALS_BATCH = 512  # standard normal draws for lengths taken from numpy at a time (Clients._draw_length)

MESSAGE_SEG, ANSWER_SEG, RETRIEVED_SEG, TOOLCALL_SEG, TOOLRESULT_SEG = (
    SegmentHash(p) for p in ("message", "answer", "retrieved", "toolcall", "toolresult"))


@dataclass(slots=True)
class Turn:
    turn_id: str
    session: SessionSpec
    index: int
    klass: str
    arrival_s: float
    message_tokens: int
    output_tokens: int
    first_token_seen: bool = False
    region: str = ""
    version: str | None = None  # "stable" or "canary" when its class is canaried


class Clients:
    """Every session's process, sharing the gateway, conversation service, queue and router."""

    def __init__(self, world, *, seed: int, replication: int) -> None:
        self.w = world
        self.env = world.env
        self.cfg = world.cfg
        self.rng = stream(seed, replication, "client.behaviour")
        self.lengths = stream(seed, replication, "workload.lengths")
        # Every draw from ``lengths`` is one standard normal (LengthDraw), so they are drawn NORMALS_BATCH at a
        # time: numpy fills an array with the same values, in the same order, as that many single draws, and
        # a list index costs far less than a call into numpy (tests/test_population_draws.py). The stream is
        # left further on than it would be, which nothing reads.
        self._normals: list[float] = []
        self._normal_i = 0
        self.tool_runs: dict[str, int] = {}  # idempotent executor: key -> executions
        self.gen = Generations(world, rng=self.rng)
        self.think = LongWaits(self.env)  # think times between turns, out of SimPy's queue
        self._length_draws: dict[str, LengthDraw] = {}
        self._attrs: dict[tuple[str, str, str, str], tuple[str, str, str, str]] = {}  # interned turn_attrs

    def _draw_length(self, field: str) -> int:
        """A length from the traffic's ``field`` config (its draw built on first use)."""
        draw = self._length_draws.get(field)
        if draw is None:
            draw = self._length_draws[field] = LengthDraw(getattr(self.cfg.traffic, field))
        i = self._normal_i
        if i == len(self._normals):
            self._normals = self.lengths.standard_normal(NORMALS_BATCH).tolist()
            i = 0
        self._normal_i = i + 1
        return draw.of_normal(self._normals[i])

    # ---- sessions and turns --------------------------------------------------------------------
    def session(self, spec: SessionSpec):
        """One user's conversation from its start (the world starts it at ``spec.start_s`` and hears of its
        end through ``session_ended``)."""
        env, tr = self.env, self.cfg.traffic
        if spec.trace is not None:  # a replayed trace request: its own prompt content and output length
            r = spec.trace
            turn = Turn(turn_id=f"{spec.session_id}-t0", session=spec, index=0, klass="chat", arrival_s=env.now,
                        message_tokens=r.prompt_tokens, output_tokens=r.output_tokens)
            yield from self.turn(turn)
            self._session_over(spec)
            return
        for k in range(spec.turns):
            klass = spec.klass if k == 0 or spec.klass in ("tool", "retrieval", "background") else "followup"
            if spec.klass == "long_context" and k == 0:
                msg = self._draw_length("long_context_tokens")
            else:
                msg = self._draw_length("message_tokens")
            out = tr.background_output_tokens if klass == "background" else self._draw_length("output_tokens")
            turn = Turn(turn_id=f"{spec.session_id}-t{k}", session=spec, index=k, klass=klass, arrival_s=env.now,
                        message_tokens=msg, output_tokens=out)
            outcome = yield from self.turn(turn)
            if outcome.kind != "completed":
                break  # a user whose turn failed or who gave up leaves the session
            if k + 1 < spec.turns:
                # rng.exponential(scale) is scale * one standard exponential draw in numpy: the same float and
                # stream position, without exponential's per-call argument checks
                yield self.think.wait(tr.think_time_s * self.rng.standard_exponential())
        self._session_over(spec)

    def _session_over(self, spec: SessionSpec) -> None:
        """The session sends nothing more: its history and hash chain can go, and the world hears of its end."""
        self.w.conversation.end_session(spec.session_id)
        self.gen.end_session(spec.session_id)
        self.w.session_ended()

    def turn(self, turn: Turn):
        env, rec, ccfg = self.env, self.w.rec, self.cfg.client
        rec.event(env.now, "request.arrived", "client", turn.turn_id, float(turn.message_tokens), turn.klass)
        attrs = (turn.session.tenant.tier, turn.session.tenant.name, turn.klass, turn.session.region)
        # one shared tuple per distinct combination (a few dozen), not one per turn: 72 bytes a turn less
        self.w.turn_attrs[turn.turn_id] = self._attrs.setdefault(attrs, attrs)
        attempt = 0
        while True:
            outcome = yield from self.attempt(turn, attempt)
            if (outcome.kind in ("rejected", "failed") and outcome.reason in RETRYABLE and attempt < ccfg.max_retries):
                wait = outcome.retry_after_s if (ccfg.honour_retry_after and outcome.retry_after_s) else \
                    ccfg.retry_backoff_s * (2**attempt)
                rec.event(env.now, "request.retried", "client", turn.turn_id, float(attempt + 1), outcome.reason)
                yield env.timeout(wait)
                attempt += 1
                continue
            now = env.now
            rec.event(now, OUTCOME_EVENT[outcome.kind], "client", turn.turn_id, float(outcome.output_tokens),
                      outcome.reason)
            self.w.outcome_log.append((now, outcome.kind == "completed"))
            if turn.version is not None and outcome.kind in ("completed", "failed"):
                ttft = self.w.turn_ttft.pop(turn.turn_id, None)
                dur = env.now - turn.arrival_s - (ttft or 0.0)
                itl = dur / (outcome.output_tokens - 1) if outcome.output_tokens > 1 and ttft is not None else None
                self.w.control.observe_canary(version=turn.version, task_class=turn.klass, ttft_s=ttft, itl_s=itl,
                                              error=outcome.kind == "failed")
            # this key is never sent again: its turn record and tool executions can go
            self.w.conversation.end_turn(turn.turn_id)
            self.tool_runs.pop(turn.turn_id, None)
            return outcome

    def attempt(self, turn: Turn, attempt: int):
        w, env = self.w, self.env
        spec = turn.session
        region = w.steer(spec.region, spec.tenant.residency)
        if region is None:
            reason = "region_unreachable" if not w.failed_over.get(spec.region, False) else "no_region_in_residency"
            yield env.timeout(self.cfg.client.connect_timeout_s)
            return Outcome("failed", reason)
        turn.region = region
        extra = w.extra_latency_s.get(region, 0.0)
        if extra:
            yield env.timeout(extra)
        if spec.tenant.tier in w.shed_tiers:
            yield env.timeout(self.cfg.gateway.auth_latency_s)
            return Outcome("rejected", "shed")
        admission_id = f"{turn.turn_id}/a{attempt}"
        decision = yield from w.gateway.admit(
            request_id=admission_id, user_id=spec.user_id, tenant=spec.tenant.name,
            tier=spec.tenant.tier, prompt_tokens=turn.message_tokens, expected_output_tokens=turn.output_tokens,
            attempt=attempt)
        if not decision.admitted:
            return Outcome("rejected", decision.reason, decision.retry_after_s)
        record, generate = w.conversation.begin(turn.turn_id)
        if not generate:
            # served from the idempotency record (or by the attempt already generating it): nothing generated
            w.gateway.completed(admission_id, turn.message_tokens)
            if record.state == "completed":
                return Outcome("completed", "deduplicated", output_tokens=record.output_tokens)
            done = env.event()
            record.waiters.append(done)
            outcome = yield done
            return outcome
        outcome = yield from self._run_turn(turn, record)
        # the admission's true-up, in the unit it charged (the message plus the tokens streamed back)
        w.gateway.completed(admission_id, turn.message_tokens + outcome.generated_tokens)
        for ev in record.waiters:
            ev.succeed(outcome)
        record.waiters.clear()
        return outcome

    def _run_turn(self, turn: Turn, record):
        w, env, tr, conv = self.w, self.env, self.cfg.traffic, self.w.conversation
        spec = turn.session
        if conv.cfg.history_load_s:
            yield env.timeout(conv.cfg.history_load_s)
        message_seg = MESSAGE_SEG(turn.turn_id)
        answer_seg = ANSWER_SEG(turn.turn_id)
        extra: list[tuple[int, int]] = []
        if turn.klass == "retrieval":
            if tr.retrieval_latency_s:
                yield env.timeout(tr.retrieval_latency_s)
            extra.append((RETRIEVED_SEG(turn.turn_id), tr.retrieval_tokens))
        if spec.trace is not None:
            pieces, prompt_tokens = list(spec.trace.pieces), spec.trace.prompt_tokens
        else:
            pieces, prompt_tokens, _dropped = conv.assemble(session_id=spec.session_id, tenant=spec.tenant,
                                                            message_seg=message_seg,
                                                            message_tokens=turn.message_tokens, extra=extra)
        reason = None
        resume = record.persisted_tokens if record.persisted_tokens < turn.output_tokens else 0
        called = 0  # tokens the tool call streamed back
        if turn.klass == "tool":
            call_seg = TOOLCALL_SEG(turn.turn_id)
            call_tokens = 60
            if not resume:  # (a resumed answer's tool call and result came before it: the tool ran once)
                first = yield from self.gen.generate(turn, pieces=pieces, prompt_tokens=prompt_tokens,
                                                     output_tokens=call_tokens, output_segment=call_seg, gen="g0",
                                                     needs_tools=True)
                called = first.generated_tokens = first.output_tokens
                first.output_tokens = 0
                if first.kind != "completed":
                    conv.fail(record)
                    return first
                reason = yield from self.tool_step(turn)
            # the call and its result are in the answer's prompt, a resumed answer's too
            pieces = [*pieces, ("seg", (call_seg, call_tokens)),
                      ("seg", (TOOLRESULT_SEG(turn.turn_id), tr.tool_result_tokens))]
            prompt_tokens += call_tokens + tr.tool_result_tokens
        if resume:
            # resume after a failure from the last persisted token: prompt + generated tokens re-prefill
            pieces = [*pieces, ("seg", (answer_seg, resume))]
            prompt_tokens += resume
            w.rec.event(env.now, "request.resumed", "client", turn.turn_id, float(resume))
        outcome = yield from self.gen.generate(turn, pieces=pieces, prompt_tokens=prompt_tokens,
                                           output_tokens=turn.output_tokens - resume, output_segment=answer_seg,
                                           gen=f"g1r{resume}" if resume else "g1", needs_tools=turn.klass == "tool",
                                           output_offset=resume, record=record)
        outcome.generated_tokens = outcome.output_tokens + called
        outcome.output_tokens += resume
        if outcome.kind == "completed":
            if conv.cfg.persist_latency_s:
                yield env.timeout(conv.cfg.persist_latency_s)  # the committed response is durable
            conv.complete(record, session_id=spec.session_id, message_seg=message_seg,
                          message_tokens=turn.message_tokens, answer_seg=answer_seg, answer_tokens=outcome.output_tokens)
            if reason:
                outcome.reason = reason
        else:
            conv.fail(record)
        return outcome

    def tool_step(self, turn: Turn):
        """Policy check and (sometimes) user approval across the tool boundary, then an idempotent execution."""
        env, tr, rng = self.env, self.cfg.traffic, self.rng
        if rng.random() < tr.tool_approval_share:
            u = rng.random()
            yield env.timeout(rng.exponential(5.0))
            if u < tr.tool_approval_deny_share:
                self.w.rec.event(env.now, "tool.denied", "tools", turn.turn_id)
                return "tool_denied"
            if u < tr.tool_approval_deny_share + tr.tool_approval_timeout_share:
                self.w.rec.event(env.now, "tool.timed_out", "tools", turn.turn_id)
                return "tool_approval_timeout"
        runs = self.tool_runs.get(turn.turn_id, 0)
        if runs == 0:  # a retried call finds the recorded result and does not execute again
            yield env.timeout(tr.tool_exec_s)
            self.w.rec.event(env.now, "tool.executed", "tools", turn.turn_id)
        self.tool_runs[turn.turn_id] = runs + 1
        return None
