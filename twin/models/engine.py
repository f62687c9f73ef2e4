"""A vLLM-V1 replica scheduler as a pure state machine (no SimPy, no clock).

``Engine.schedule()`` forms one step exactly as ``Scheduler.schedule()`` does (semantics §2):

* Phase A: running requests in admission order share one token budget; a request whose allocation
  fails preempts the *last* running request (FCFS) or the lowest-priority one, by recompute, until it
  fits or preempts itself; any preemption skips Phase B for the step.
* Phase B: waiting requests in FCFS (or priority) order; prefix-cache lookup; admission stops at the
  first request that does not fit (head-of-line), never preempts; ``max_num_seqs`` caps running.
* Chunked prefill on: a request takes whatever budget remains; off: a waiting request is admitted only
  if its whole remaining sequence fits the remaining budget. ``long_prefill_token_threshold`` caps a
  chunk unless the system holds a single request.

``Engine.complete()`` applies one step's outputs at its end time; ``max_decode_run()`` and
``complete_decode_run()`` let the caller advance many identical decode steps in one event.

Synchronous scheduling (vLLM's CPU backend): a request that arrives while a step runs is eligible for the next
step. ``async_scheduling`` (vLLM's GPU default, semantics §2.12; the scenario's setting resolves it as vLLM does)
makes it the step after: the replica hands such a request in with ``add(r, held=True)`` and releases it
(``release_held``) once the next step is formed, which vLLM formed while the step in flight ran.

Simplifications (also in docs/engine.md): with async scheduling a request that finishes in a step is not carried
into the next one as a wasted slot; no speculative decoding, LoRA, encoder cache or KV connectors; stop strings are
modelled as the drawn output length.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.engine_profiles.step import prefill_attention_work
from twin.models.engine_gaps import GapColumns
from twin.models.engine_group import GroupPath
from twin.models.engine_parts import DecodeGroup, GroupColumn, Step, WaitingQueue
from twin.models.engine_runs import RunPath
from twin.models.kv import BlockPool
from twin.models.request import EngineRequest, Status


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and cache limits actually in force on one replica (vLLM's names)."""

    num_gpu_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: int = 32768
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    policy: str = "fcfs"  # or "priority"
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    async_scheduling: bool = False  # the replica holds arrivals back one step (module doc; vLLM's GPU default)

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', not {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("with chunked prefill off, max_num_batched_tokens must be >= max_model_len (as vLLM requires)")


class Engine(GroupPath, RunPath, GapColumns):
    """vLLM V1 scheduling + KV cache for one replica. Times are passed in; the engine has no clock.

    The decode group's path (``_g_*``) is in ``twin.models.engine_group``; many identical decode steps in one
    event (``max_decode_run``, ``complete_decode_run``) in ``twin.models.engine_runs``."""

    def __init__(self, config: EngineConfig, *, track_groups: bool = False) -> None:
        self.cfg = config
        self.kv = BlockPool(num_blocks=config.num_gpu_blocks, block_size=config.block_size,
                            enable_prefix_caching=config.enable_prefix_caching, max_model_len=config.max_model_len)
        self.running: list[EngineRequest] = []
        self.waiting = WaitingQueue(config.policy == "fcfs")
        self.held: list[EngineRequest] = []  # arrived while a step ran, under async scheduling (``add``)
        self.watermark_blocks = int(config.watermark * self.kv.num_usable)
        # Counters, named as vLLM exports them (without the ``vllm:`` prefix).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        # Inter-token gaps: ``itl_values``, ``itl_weights`` (twin.models.engine_gaps; written to ``_gap_*``).
        self._gaps_init()
        self.itl_groups: GroupColumn | None = GroupColumn() if track_groups else None  # parallel to itl_values
        # The decode group (FCFS only: a priority preemption may take back any running request's step).
        self.grp = DecodeGroup(config.block_size, config.max_model_len)
        self.use_group = config.policy == "fcfs"
        self._adm = 0
        self.step_kv_usage = True  # record the KV usage at each step's scheduling (for the iteration log)

    # ---- arrivals and cancellation -------------------------------------------------------------
    def add(self, r: EngineRequest, *, held: bool = False) -> None:
        """Queue ``r``. ``held``: it arrived while a step ran under async scheduling, when vLLM had already formed
        the next step, so it stays out of the next ``schedule`` until ``release_held``."""
        if r.prompt_tokens >= self.cfg.max_model_len:
            raise ValueError(f"prompt of {r.prompt_tokens} tokens does not fit max_model_len {self.cfg.max_model_len}")
        r.status = Status.WAITING
        if held:
            self.held.append(r)
        else:
            self.waiting.push(r)

    def release_held(self) -> int:
        """Queue the held requests for the next ``schedule``, in arrival order; how many there were."""
        held = self.held
        for r in held:
            self.waiting.push(r)
        n = len(held)
        held.clear()
        return n

    def abort(self, r: EngineRequest, now_s: float, reason: str = "abort") -> bool:
        """Cancel a waiting or running request; frees its KV at once. False if already gone."""
        if r.status == Status.FINISHED:
            return False
        if r in self.running:
            if r._grp is not None:
                if self.grp.infl:  # its step is in flight: that step can no longer complete as a group step
                    self._g_dissolve()
                else:
                    self._g_leave(r)
            self.running.remove(r)
        elif r in self.held:
            self.held.remove(r)
        elif not self.waiting.remove(r):
            return False
        self.kv.release(r)
        self._finish(r, now_s, reason)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.held)

    # ---- one scheduling step -------------------------------------------------------------------
    def schedule(self, now_s: float) -> Step | None:
        grp = self.grp
        if grp.n and grp.n == len(self.running) and not self.waiting._n:
            # Only the group's members, nothing waiting: the step is theirs (the usual step between an arrival
            # and a finish). The general path below does the same with more to set up.
            step = Step()
            n = self._g_schedule(step, self.cfg.max_num_batched_tokens)
            if n:
                step.d_req = step.gen_requests = step.gen_tokens = n
                step.d_ctx = grp.csum
                step.p_req = step.p_tok = step.p_pairs = step.ctx_requests = step.ctx_tokens = 0
                step.uniform_decode = True
                if self.step_kv_usage:
                    step.kv_usage = self.kv.usage()
                return step
            # (the group was dissolved: the general path, on the per-request state)
        cfg, kv = self.cfg, self.kv
        budget = cfg.max_num_batched_tokens
        n_total = len(self.running) + len(self.waiting)
        t_long = cfg.long_prefill_token_threshold if n_total > 1 else 0
        if cfg.long_prefill_token_threshold_adaptive and n_total > 1:
            t_long = max(t_long, cfg.max_num_batched_tokens // n_total)
        step = Step()
        reqs, ns = step.reqs, step.ns
        running = self.running
        mml = cfg.max_model_len
        preempted_any = False
        fcfs = cfg.policy == "fcfs"

        # Phase A: running requests in admission order.
        i = 0
        bs = cfg.block_size
        caching = cfg.enable_prefix_caching
        n_running = len(running)
        n_fast = 0  # decode items scheduled by the fast path (shape counted inline: d_req, d_ctx)
        slow: list[int] = []  # positions in reqs of every other item (shape counted in _shape)
        d_ctx = 0
        mml1, bs1 = mml - 1, bs - 1
        if grp.n:
            i = n_fast = self._g_schedule(step, budget)
            if i:
                reqs, ns = step.reqs, step.ns
                budget -= i
                d_ctx = grp.csum  # after _g_schedule: the members' computed tokens including this step's
        add_req, add_n = reqs.append, ns.append
        while i < n_running and budget > 0:
            r = running[i]
            c = r.num_computed
            n = r.seq.num_tokens - c
            if n == 1 and c < mml1 and r._nout > 0:
                # Decode fast path: a new block only when the previous ones are full; a block to hash
                # only when this token fills one. Same result as kv.allocate, without the general case.
                c1 = c + 1
                q = c % bs
                if q == 0 or len(r.blocks) * bs < c1:
                    # kv.allocate(r, 1) for a known token; False: fall through to the general path, which preempts
                    ok = kv.allocate_decode(r, c1)
                else:
                    ok = True
                    if q == bs1 and caching and c1 // bs > r.num_cached_blocks:  # q == bs1: c1 % bs == 0
                        kv._cache_upto(r, c1 // bs)
                if ok:
                    add_req(r)
                    add_n(1)
                    r.num_computed = c1
                    budget -= 1
                    i += 1
                    n_fast += 1
                    d_ctx += c1
                    continue
            if t_long > 0 and n > t_long:
                n = t_long
            if n > budget:
                n = budget
            cap = mml - r.num_computed - 1
            if n > cap:
                n = cap
            if n <= 0:
                i += 1
                continue
            self_preempted = False
            while not kv.allocate(r, n):
                if fcfs:
                    victim = running.pop()
                else:
                    victim = max(running, key=lambda q: (q.priority, q.arrival_s))
                    vi = running.index(victim)
                    del running[vi]
                    if vi < i:
                        i -= 1
                    if victim in reqs:  # already scheduled this step: give its tokens back
                        j = reqs.index(victim)
                        budget += ns[j]
                        del reqs[j], ns[j]
                self._preempt(victim, step)
                preempted_any = True
                if victim is r:
                    self_preempted = True
                    break
            n_running = len(running)
            if self_preempted:
                if fcfs:
                    break
                continue  # running[i] is now the next request
            reqs.append(r)
            ns.append(n)
            slow.append(len(reqs) - 1)
            r.num_computed += n
            budget -= n
            i += 1

        # Phase B: admission, skipped in a step that preempted.
        if not preempted_any:
            waiting = self.waiting
            while budget > 0 and len(waiting) > 0 and len(running) < cfg.max_num_seqs:
                r = waiting.peek()
                pre = r.kv_preloaded if r.num_computed == 0 else 0
                hits = kv.find_hit(r) if r.num_computed == 0 and not pre else []
                h = len(hits) * cfg.block_size
                n = r.seq.num_tokens - h - pre
                if t_long > 0 and n > t_long:
                    n = t_long
                if not cfg.enable_chunked_prefill and n > budget:
                    break
                if n > budget:
                    n = budget
                wm = self.watermark_blocks if running else 0
                # KV that arrived by transfer needs blocks like computed tokens but no compute budget
                if not kv.admit(r, n + pre, hits, full_isl=cfg.scheduler_reserve_full_isl, watermark_blocks=wm):
                    break
                waiting.pop()
                running.append(r)
                self._adm += 1
                r.adm = self._adm  # increases along running (admission order)
                r.status = Status.RUNNING
                if r.num_preemptions == 0 and cfg.enable_prefix_caching and not pre:
                    self.prefix_cache_queries += r.seq.num_tokens
                    self.prefix_cache_hits += h
                if r.first_scheduled_s is None:
                    r.first_scheduled_s = now_s
                    r.num_cached_tokens = h
                r.num_computed = h + n + pre
                reqs.append(r)
                ns.append(n)
                slow.append(len(reqs) - 1)
                step.admitted.append(r)
                budget -= n

        if not reqs:
            return None
        if preempted_any and not step.g_n:  # a preemption may have taken back scheduled items: count from scratch
            # (with a group the policy is FCFS, whose victims are never items already scheduled: no need)
            self._shape(step, range(len(reqs)), 0, 0)
        else:
            self._shape(step, slow, n_fast, d_ctx)
        step.uniform_decode = (
            not step.admitted and not step.preempted and len(reqs) == len(running)
            and step.p_req == 0
        )
        if self.step_kv_usage:
            step.kv_usage = kv.usage()
        return step

    def _shape(self, step: Step, items, n_fast: int, d_ctx: int) -> None:
        """Step shape and iteration-log counts from the items at positions ``items`` plus ``n_fast`` items
        of Phase A's decode fast path (one token each, with output, ``d_ctx`` context tokens in all)."""
        d_req = n_fast
        p_req = p_tok = p_pairs = 0
        ctx_r = ctx_t = 0
        gen_r = gen_t = n_fast
        reqs, ns = step.reqs, step.ns
        for j in items:
            r = reqs[j]
            n = ns[j]
            if n == 1 and r.num_computed == r.seq.num_tokens and r._nout > 0:
                d_req += 1
                d_ctx += r.num_computed
            else:
                p_req += 1
                p_tok += n
                p_pairs += prefill_attention_work(r.num_computed - n, n)
            # vLLM's iteration log: a request with output is "gen", whatever the step computes for it.
            if r._nout > 0:
                gen_r += 1
                gen_t += n
            else:
                ctx_r += 1
                ctx_t += n
        step.d_req, step.d_ctx, step.p_req, step.p_tok, step.p_pairs = d_req, d_ctx, p_req, p_tok, p_pairs
        step.ctx_requests, step.ctx_tokens, step.gen_requests, step.gen_tokens = ctx_r, ctx_t, gen_r, gen_t

    def _preempt(self, victim: EngineRequest, step: Step) -> None:
        self.kv.release(victim)
        victim.num_computed = 0
        victim.kv_preloaded = 0  # transferred KV is gone with the blocks: recompute it
        victim.status = Status.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim, front=True)
        step.preempted.append(victim)

    # ---- step outputs --------------------------------------------------------------------------
    def complete(self, step: Step, end_s: float) -> list[EngineRequest]:
        """Apply one step's outputs at ``end_s``; returns the requests that finished."""
        self.num_steps += 1
        finished: list[EngineRequest] = []
        mml = self.cfg.max_model_len
        RUNNING = Status.RUNNING
        itl_v, itl_w, itl_g = self._gap_v, self._gap_w, self.itl_groups
        emitted = 0
        first = step.first_tokens
        grp = self.grp
        g_n = step.g_n if step.g_epoch == grp.epoch else 0
        broken = False
        if g_n:  # the members: gaps in bulk, then only the members finishing or at a watched count
            emitted = self._g_emit(step, end_s)
            s1 = grp.steps + 1
            for r in (grp.pop_due(grp.cheap, s1) if grp.cheap and grp.cheap[0][0] <= s1 else ()):
                r._grp = None  # its own fields are written below: its callback reads them directly
                grp.materialise(r)
                seq = r.seq
                w = r.watch_output
                if w is not None and r._nout + 1 >= w:  # _emit(r, 1, end_s, end_s), its gap already recorded
                    seq.append_output(1)
                    r._nout += 1
                    r.last_token_s = end_s
                    if r.on_tokens is not None and r._nout >= w:
                        r.on_tokens(r, 1, end_s)
                else:
                    seq._out_len += 1
                    seq.num_tokens += 1
                    r._nout += 1
                    r.last_token_s = end_s
                r.g_base = s1
                r._grp = grp
                if r._nout >= r.target_output_tokens or seq.num_tokens >= mml:
                    finished.append(r)
                elif r.watch_output is not None and r.watch_output <= r._nout:
                    broken = True  # no longer a steady decode: dissolve once the step is applied
                else:
                    grp.push_complete(r)
            grp.steps = s1
            grp.infl = 0
        for r in (step.reqs[g_n:] if g_n else step.reqs):
            seq = r.seq
            if r.status != RUNNING or r.num_computed < seq.num_tokens:
                continue  # a non-final prefill chunk: its sampled token is discarded
            w = r.watch_output
            if r._nout == 0 or (w is not None and r._nout + 1 >= w):
                if r._nout == 0:
                    first.append(r)
                self._emit(r, 1, end_s, end_s)
            else:  # inlined _emit for the common decode case
                itl_v.append(end_s - r.last_token_s)
                itl_w.append(1)
                if itl_g is not None:
                    itl_g.append(r.group)
                seq._out_len += 1
                seq.num_tokens += 1
                r._nout += 1
                r.last_token_s = end_s
                emitted += 1
            if r.token_times is not None:
                r.token_times.append(end_s)
            if r._nout >= r.target_output_tokens or seq.num_tokens >= mml:
                finished.append(r)
        self.generation_tokens += emitted
        if finished:
            self._retire(finished, end_s)
        if broken:
            self._g_dissolve()
        self._g_join(end_s)
        return finished

    def _emit(self, r: EngineRequest, m: int, first_s: float, last_s: float) -> None:
        """Record ``m`` new tokens of ``r``: the first at ``first_s``, the last at ``last_s``."""
        if r._nout == 0:
            r.first_token_s = first_s
            self.prompt_tokens += r.prompt_tokens
        else:
            self._gap_v.append(first_s - r.last_token_s)  # type: ignore[operator]
            self._gap_w.append(1)
            if self.itl_groups is not None:
                self.itl_groups.append(r.group)
        r.seq.append_output(m)
        r._nout += m
        self.generation_tokens += m
        first = r._nout == m
        r.last_token_s = last_s
        if r.on_tokens is not None and (first or (r.watch_output is not None and r._nout >= r.watch_output)):
            r.on_tokens(r, m, last_s)  # only at the first token and at a watched count, not per token

    def _retire(self, finished: list[EngineRequest], end_s: float) -> None:
        if self.grp.n:
            running = self.running
            plain = []
            for r in finished:
                if r._grp is not None:
                    del running[self._g_leave(r)]
                else:
                    plain.append(r)
        else:
            plain = finished
        self._retire_plain(plain)
        for r in finished:
            self.kv.release(r)
            reason = "stop" if r._nout >= r.target_output_tokens and r.target_output_tokens < r.max_tokens else "length"
            self._finish(r, end_s, reason)

    def _retire_plain(self, finished: list[EngineRequest]) -> None:
        if len(finished) <= 8:  # usually one or two: list.remove scans at C speed, order kept
            running = self.running
            for r in finished:
                running.remove(r)
        else:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]

    def _finish(self, r: EngineRequest, end_s: float, reason: str) -> None:
        r.status = Status.FINISHED
        r.finish_s = end_s
        r.finished_reason = reason
        if r.on_finished is not None:
            r.on_finished(r)
