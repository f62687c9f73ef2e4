"""One generation on the fleet: model choice (tier routing, capability, residency, canary), the token-aware
queue, the router and a replica (the client's view of the stream is ``twin.models.stream``), and the two
alternative paths — split prefill/decode pools and bursting to an external API provider."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from twin.models.request import EngineRequest
from twin.models.stream import Stream, first_mark, first_token_or_timeout
from twin.models.token_queue import QueueEntry
from twin.models.tokens import TokenSeq
from twin.models.waits import CallOffTimers, first_of_timer
from twin.policies import RequestFacts
from twin.policies.queueing import QueueItem

if TYPE_CHECKING:
    from twin.models.client import Turn


@dataclass(slots=True)
class Outcome:
    kind: str  # completed | rejected | cancelled | abandoned | failed
    reason: str | None = None
    retry_after_s: float | None = None
    output_tokens: int = 0
    generated_tokens: int = 0  # streamed back by this attempt's generations (tool call included, resumed part not)


class Generations:
    """The generation-level request path shared by every client session."""

    def __init__(self, world, *, rng) -> None:
        self.w = world
        self.env = world.env
        self.cfg = world.cfg
        self.rng = rng
        # model_for's two lookups, memoised: (cap, supports_tools) per model (config is frozen), and whether
        # a model is placed inside a residency, recomputed when placements grow (the autoscaler adds some)
        self._caps: dict[str, tuple[int, bool]] = {}
        self._placed: dict[tuple[str, tuple[str, ...] | None], bool] = {}
        self._placed_n = -1
        self.timers = CallOffTimers(self.env)
        # per live session, its latest generation's token sequence: the next prompt (a retry, the turn after a tool
        # call, the next turn) begins with its prompt, whose block hashes it then takes over (TokenSeq's parent)
        self._chains: dict[str, TokenSeq] = {}

    def end_session(self, session_id: str) -> None:
        """The session has ended: no later prompt of it will take over its hashes."""
        self._chains.pop(session_id, None)

    def _is_placed(self, name: str, allowed) -> bool:
        placements = self.w.placements
        if len(placements) != self._placed_n:
            self._placed.clear()
            self._placed_n = len(placements)
        key = (name, None if allowed is None else tuple(allowed))
        hit = self._placed.get(key)
        if hit is None:
            hit = self._placed[key] = any(w_model == name and (allowed is None or region in allowed)
                                          for (w_model, region) in placements)
        return hit

    # ---- one generation --------------------------------------------------------------------------
    def model_for(self, turn: Turn, total_tokens: int, needs_tools: bool) -> str | None:
        """Tier routing with capability checks; never a model that cannot serve the request or its residency."""
        cfg = self.cfg
        order = []
        if turn.session.tenant.tier == "free" and self.w.free_tier_model:
            order.append(self.w.free_tier_model)
        order.append(cfg.default_model)
        allowed = turn.session.tenant.residency
        c = cfg.canary
        if c is not None and turn.klass in self.w.control.canary.params.task_classes:
            if turn.version is None:  # a turn keeps its version across retries
                turn.version = "canary" if self.rng.random() < self.w.canary_share else "stable"
            if turn.version == "canary":
                order = [c.canary_model if n == c.model else n for n in order]
        for name in order:
            caps = self._caps.get(name)
            if caps is None:
                m = cfg.models[name]
                caps = self._caps[name] = (m.max_context_tokens or m.engine.max_model_len, m.supports_tools)
            if total_tokens > caps[0] or (needs_tools and not caps[1]):
                continue
            if not self._is_placed(name, allowed):
                continue
            return name
        return None

    def generate(self, turn: Turn, *, pieces, prompt_tokens: int, output_tokens: int, output_segment: int, gen: str,
                 needs_tools: bool, output_offset: int = 0, record=None, pool: str | None = None,
                 model: str | None = None):
        w, env, ccfg, rng = self.w, self.env, self.cfg.client, self.rng
        spec = turn.session
        if model is None:
            model = self.model_for(turn, prompt_tokens + output_tokens, needs_tools)
        if model is None:
            return Outcome("rejected", "no_capable_model")
        if pool is None and model in w.disagg_models:
            out = yield from self._disaggregated(turn, pieces=pieces, prompt_tokens=prompt_tokens,
                                                 output_tokens=output_tokens, output_segment=output_segment, gen=gen,
                                                 needs_tools=needs_tools, output_offset=output_offset, record=record,
                                                 model=model)
            return out
        if turn.version is not None and model in (self.cfg.canary.model, self.cfg.canary.canary_model):
            vc = self.cfg.canary.canary if turn.version == "canary" else self.cfg.canary.stable
            output_tokens = max(1, round(output_tokens * vc.output_scale))
            if vc.error_rate and self.rng.random() < vc.error_rate:
                return Outcome("failed", "model_error")
            if turn.version == "canary":
                w.canary_turns += 1
        max_tokens = output_tokens if w.output_cap is None else min(output_tokens, w.output_cap)
        if w.burst_share > 0 and self.rng.random() < w.burst_share and self._provider_ok():
            out = yield from self._burst(turn, max_tokens)
            return out
        # time does not move before the first yield below: read the clock once
        now = env.now
        block_size = self.cfg.models[model].engine.block_size
        gen_id = f"{turn.turn_id}/{gen}"
        tenant = spec.tenant
        chains = self._chains
        seq = chains[spec.session_id] = TokenSeq(pieces, block_size=block_size, output_segment=output_segment,
                                                 output_offset=output_offset, parent=chains.get(spec.session_id))
        n_hash = prompt_tokens // block_size
        facts = RequestFacts(request_id=gen_id, tenant=tenant.name, tier=tenant.tier,
                             session_id=spec.session_id, prompt_tokens=prompt_tokens,
                             expected_output_tokens=output_tokens, block_hashes=tuple(seq.block_hashes(n_hash)),
                             model=model, region=turn.region or spec.region,
                             allowed_regions=tuple(tenant.residency) if tenant.residency else None,
                             needs_long_context=turn.klass == "long_context")
        st = Stream(env)
        if turn.klass != "background":
            if rng.random() < ccfg.cancel_share:
                st.cancel_at = int(rng.integers(1, output_tokens + 1))
            elif rng.random() < w.conversation.cfg.moderation_cut_share:
                st.cancel_at = int(rng.integers(1, output_tokens + 1))
                st.cancel_reason = "moderation_cut"
            if rng.random() < ccfg.disconnect_share:
                st.disconnect_at = int(rng.integers(1, output_tokens + 1))
        entry = QueueEntry(facts=facts, tokens=prompt_tokens + output_tokens, priority=0, arrival_s=now,
                           allowed_regions=facts.allowed_regions, pool=pool)
        entry.on_dispatch = st.generation(self, turn, seq, output_tokens, record, output_offset, max_tokens).dispatch
        deadline = None if w.queue_eta_mode else self.cfg.queue.deadline_s
        item = QueueItem(request_id=gen_id, tier=tenant.tier, tenant=tenant.name,
                         prompt_tokens=prompt_tokens, expected_output_tokens=output_tokens,
                         deadline_s=None if deadline is None else now + deadline, arrival_s=now)
        decision = w.queue.offer(entry, item)
        if not decision.accept:
            return Outcome("rejected", decision.reason, getattr(decision, "retry_after_s", None))
        w.rec.event(now, "request.queued", "queue", turn.turn_id, float(decision.eta_s), gen)
        patience = None if turn.klass == "background" else ccfg.patience_s
        if w.queue_eta_mode and patience is not None and decision.eta_s > patience and not entry.is_dispatched:
            w.queue.remove(entry)  # told an honest ETA longer than they will wait, users leave at once
            return Outcome("abandoned", "eta_too_long")
        t0 = now
        if not entry.is_dispatched:  # usually it left the queue inside offer(); else wait for it
            entry.dispatched = env.event()
            limits = [x for x in (patience, deadline) if x is not None]
            if limits:
                yield first_of_timer(env, entry.dispatched, self.timers, min(limits))
            else:
                yield entry.dispatched
            if not entry.is_dispatched:
                w.queue.remove(entry)
                if patience is not None and (deadline is None or patience <= deadline):
                    return Outcome("abandoned", "no_first_token")
                return Outcome("rejected", "deadline_exceeded")
        w.rec.event(env.now, "request.dispatched", "router", turn.turn_id, None, entry.replica_id)
        if not turn.first_token_seen and not st.first_seen:
            st.first = env.event()
            if patience is not None:
                remaining = max(patience - (env.now - t0), 0.0)
                yield first_token_or_timeout(env, st, self.timers, remaining)
                if not st.first_seen:
                    st.cancelled = True
                    st.handle.replica.cancel(st.req, "abandoned")
                    yield st.done
                    return Outcome("abandoned", "no_first_token", output_tokens=st.delivered)
            else:
                yield first_token_or_timeout(env, st, self.timers, None)
        yield st.done
        reason = st.req.finished_reason
        if st.cancelled:
            return Outcome("cancelled", st.cancel_reason, output_tokens=st.delivered)
        if reason in ("abort", "crashed"):
            return Outcome("failed", "replica_failed", output_tokens=0)
        return Outcome("completed", reason, output_tokens=st.req.num_output)

    def _submit(self, entry: QueueEntry, handle, st: Stream, preloaded: tuple[int, float] | None = None) -> None:
        """Submit the generation ``st`` carries to ``handle``'s replica (``st`` takes the engine's callbacks)."""
        req = EngineRequest(request_id=entry.facts.request_id, arrival_s=self.env.now, seq=st.seq,
                            max_tokens=st.max_tokens, target_output_tokens=st.output_tokens, tag=entry)
        if preloaded is not None:  # disaggregated decode: the prompt's KV and the first token arrived
            req.prompt_tokens, t_first = preloaded
            req.kv_preloaded = req.prompt_tokens
            req.num_output = 1
            req.first_token_s = req.last_token_s = t_first
        req.group = st.turn.session.tenant.tier
        st.req = req
        st.handle = handle
        req.watch_output = first_mark(st.cancel_at, st.disconnect_at)
        req.on_tokens = st.on_tokens
        req.on_finished = st.on_finished
        handle.replica.submit(req)

    def _reconnect(self, turn: Turn, st: Stream):
        """The browser reconnects and resumes from the last persisted token (retained events after it)."""
        yield self.env.timeout(self.cfg.client.reconnect_delay_s)
        persisted = self.w.conversation.persisted(st.req.num_output if st.req is not None else st.delivered)
        self.w.rec.event(self.env.now, "stream.resumed", "client", turn.turn_id, float(persisted))

    # ---- bursting to an external API provider ------------------------------------------------------
    def _provider_ok(self) -> bool:
        """The provider's rate limit (turns per second over the last second)."""
        prov = self.cfg.autoscaling.provider
        win = self.w._provider_window
        now = self.env.now
        while win and win[0] < now - 1.0:
            win.pop(0)
        return len(win) < prov.max_rps

    def _burst(self, turn: Turn, max_tokens: int):
        """Served by the external provider through the gateway: its own latency and token rate."""
        prov = self.cfg.autoscaling.provider
        self.w._provider_window.append(self.env.now)
        self.w.rec.event(self.env.now, "request.dispatched", "provider", turn.turn_id, None, "provider")
        yield self.env.timeout(prov.ttft_s)
        if not turn.first_token_seen:
            turn.first_token_seen = True
            self.w.rec.event(self.env.now, "request.first_token", "client", turn.turn_id, 0.0)
            self.w.ttft_log.append((self.env.now, self.env.now - turn.arrival_s))
        yield self.env.timeout(max(max_tokens - 1, 0) / prov.tokens_per_s)
        self.w.provider_turns += 1
        self.w.provider_tokens += max_tokens
        return Outcome("completed", "burst_provider", output_tokens=max_tokens)

    # ---- disaggregated prefill and decode pools -------------------------------------------------------
    def _disaggregated(self, turn: Turn, *, pieces, prompt_tokens: int, output_tokens: int, output_segment: int,
                       gen: str, needs_tools: bool, output_offset: int, record, model: str):
        """Prefill (and the first token) on the prefill pool, KV transfer, then decode on the decode pool."""
        w, env = self.w, self.env
        first = yield from self.generate(turn, pieces=pieces, prompt_tokens=prompt_tokens, output_tokens=1,
                                         output_segment=output_segment, gen=f"{gen}p", needs_tools=needs_tools,
                                         output_offset=output_offset, record=record, pool="prefill", model=model)
        if first.kind != "completed" or output_tokens <= 1:
            return first
        t_first = env.now
        dcfg = self.cfg.disaggregation
        kv_bytes = w.model_info[model]["profile"].kv_bytes_per_token * prompt_tokens
        transfer = dcfg.transfer_overhead_s + kv_bytes / dcfg.kv_transfer_bytes_per_s
        yield env.timeout(transfer)
        w.rec.event(env.now, "request.kv_transferred", "router", turn.turn_id, transfer)
        spec = turn.session
        allowed = tuple(spec.tenant.residency) if spec.tenant.residency else None
        mcfg = self.cfg.models[model]
        # the same prompt the prefill generation hashed: its hashes taken over, not computed again
        seq = TokenSeq(pieces, block_size=mcfg.engine.block_size, output_segment=output_segment,
                       output_offset=output_offset, parent=self._chains.get(spec.session_id))
        seq.append_output(1)
        facts = RequestFacts(request_id=f"{turn.turn_id}/{gen}d", tenant=spec.tenant.name, tier=spec.tenant.tier,
                             session_id=spec.session_id, prompt_tokens=prompt_tokens,
                             expected_output_tokens=output_tokens, block_hashes=(), model=model,
                             region=turn.region or spec.region, allowed_regions=allowed,
                             needs_long_context=turn.klass == "long_context")
        cands = w.router.candidates(model, allowed, 0, "decode")
        decision = w.router.route(facts, cands) if cands else None
        if decision is None or decision.replica_id is None:
            return Outcome("failed", "no_decode_replica", output_tokens=1)
        w.router.sent(facts, decision.replica_id)
        handle = w.router.by_id[decision.replica_id]
        max_tokens = output_tokens if w.output_cap is None else min(output_tokens, w.output_cap)
        st = Stream(env).generation(self, turn, seq, output_tokens, record, output_offset, max(max_tokens, 2))
        st.first_seen = True
        entry = QueueEntry(facts=facts, tokens=prompt_tokens + output_tokens, priority=0, arrival_s=env.now,
                           allowed_regions=allowed, pool="decode", replica_id=decision.replica_id, is_dispatched=True)
        self._submit(entry, handle, st, preloaded=(prompt_tokens, t_first))
        yield st.done
        reason = st.req.finished_reason
        if st.cancelled:
            return Outcome("cancelled", st.cancel_reason, output_tokens=st.req.num_output)
        if reason in ("abort", "crashed"):
            return Outcome("failed", "replica_failed", output_tokens=0)
        return Outcome("completed", reason, output_tokens=st.req.num_output)
