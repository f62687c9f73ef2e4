"""A replica as a SimPy component: one process that runs engine steps back to back.

One SimPy event per engine step at most; while the batch cannot change (no arrival, no completion, no
block shortfall) many decode steps run as one event, and an arrival or cancellation that lands inside
such a run cuts it at the end of the step in flight (as a real engine would see it). Token times and
inter-token gaps are derived from step ends, never from per-token events.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate

import simpy

from twin.engine_profiles.step import StepTimeModel
from twin.models.engine import Engine, Step
from twin.models.recorder import Recorder
from twin.models.request import EngineRequest, Status

_INF = float("inf")


def move_wait(process: simpy.Process, old: simpy.Event, new: simpy.Event) -> None:
    """Make ``process``, suspended on ``old``, resume on ``new`` instead (``old`` may still fire: as a no-op).
    What ``Process.interrupt`` does to detach a process from its target, in SimPy 4.1 (pyproject pins
    simpy below 4.2; tests/test_engine_replica_wait.py checks it)."""
    resume = process._resume
    old.callbacks.remove(resume)  # type: ignore[union-attr]
    new.callbacks.append(resume)  # type: ignore[union-attr]
    process._target = new


class Replica:
    def __init__(
        self,
        env: simpy.Environment,
        *,
        scope: str,
        engine: Engine,
        step_model: StepTimeModel,
        recorder: Recorder,
        max_decode_run_steps: int = 512,
        on_finished: Callable[[EngineRequest], None] | None = None,
        event_prefix: str = "request",
    ) -> None:
        self.env = env
        self.scope = scope
        self.engine = engine
        engine.step_kv_usage = recorder.record_iterations  # (only the iteration log reads it)
        self.step_model = step_model
        self.overhead_s = float(getattr(step_model, "overhead_s", 0.0))
        self.rec = recorder
        self.max_run = max(1, max_decode_run_steps)
        self.on_finished = on_finished
        p = event_prefix
        self._k_queued, self._k_cancelled, self._k_preempted = f"{p}.queued", f"{p}.cancelled", f"{p}.preempted"
        self._k_scheduled, self._k_first, self._k_finished = f"{p}.scheduled", f"{p}.first_token", f"{p}.finished"
        self._k_failed = f"{p}.failed"
        self.speed_factor = 1.0  # step times are multiplied by this (1.0 healthy; 2.0 = half speed)
        self.decode_speedup = None  # callable(batch) -> speed-up of decode-only steps (speculative decoding)
        self.healthy = True  # what a health check sees
        self.down = False  # crashed (its process is gone until restart)
        self._wake: simpy.Event = env.event()  # what the process waits on when idle
        self._idle = False  # waiting on ``_wake``
        self._run_wait: simpy.Event | None = None  # what a decode run waits on (see _wait_run)
        self._run_end_t = _INF  # the time that timeout is due
        self._cut = False  # the waiting run was cut (its wait moved to ``_wake``)
        self._pending_aborts: list[tuple[EngineRequest, str]] = []
        self._step_index = 0
        self._lv_last: list[int | float | None] = [None, None, None]  # running, waiting, kv_usage as last recorded
        self.events = 0  # engine events (a step or a decode run), for benchmarks
        # a step model that wants to hear how long the engine sat idle before a wake (replays' IdleWakeExtra)
        self._woke_after_idle: Callable[[float], None] | None = getattr(step_model, "woke_after_idle", None)
        # a replay's model that times a step by its members (``twin.replay.MatchedStepTimes``), else None
        self._step_time_for: Callable[[Step], float] | None = getattr(step_model, "step_time_for", None)
        # a replay's model that lengthens a step by what happens while it runs (``twin.replay.IntakeExtra``), else None
        self._stretch_step: Callable[[float, float], float] | None = getattr(step_model, "stretch_step", None)
        self.process: simpy.Process | None = None

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError(f"{self.scope} started twice")
        if self.down:
            raise RuntimeError(f"{self.scope} is down")
        self.process = self.env.process(self._run())

    # ---- inputs --------------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        if self.down:  # connection refused: the request fails at once
            self.rec.event(self.env.now, self._k_failed, self.scope, req.request_id, 0.0, "replica_down")
            self.engine._finish(req, self.env.now, "crashed")
            return
        # async scheduling: arriving while the process is busy, the request misses the step vLLM has already formed
        self.engine.add(req, held=self.engine.cfg.async_scheduling and not self._idle)
        self.rec.event(self.env.now, self._k_queued, self.scope, req.request_id, float(req.prompt_tokens))
        self._levels()
        self._poke()

    def cancel(self, req: EngineRequest, reason: str = "cancelled") -> None:
        """Abort at the next step boundary (vLLM processes aborts between steps)."""
        if req.status == Status.FINISHED:
            return
        self._pending_aborts.append((req, reason))
        self._poke()

    def _poke(self) -> None:
        """Wake the process: when idle, or to cut the decode run it waits on. The run's wait is moved from its
        timeout to a fresh ``_wake`` (see ``_decode_run``); while a single step or the step in flight of a cut
        run is waited on, nothing is to be done (the next scheduling sees the change)."""
        if self._idle:
            if not self._wake.triggered:
                self._wake.succeed()
        elif self._run_wait is not None:
            if self._run_end_t == self.env.now:
                return  # the run's end is due at this instant, queued before a wake would be: no cut, as before
            timeout = self._run_wait
            self._run_wait = None
            self._cut = True
            self._wake = wake = self.env.event()
            move_wait(self.process, timeout, wake)
            wake.succeed()

    # ---- faults ---------------------------------------------------------------------------------
    def crash(self, reason: str = "crashed") -> list[EngineRequest]:
        """The replica dies: its process stops mid-step and every live stream drops (KV is gone)."""
        if self.down:
            return []
        self.down = True
        self.healthy = False
        if self.process is not None and self.process.is_alive:
            self.process.interrupt(reason)
        self.process = None
        self._run_wait = None
        self._run_end_t = _INF
        self._idle = self._cut = False
        now = self.env.now
        eng = self.engine
        dropped = [*eng.running, *eng.waiting.items(), *eng.held]
        for r in dropped:
            eng.abort(r, now, "crashed")
            self.rec.event(now, self._k_failed, self.scope, r.request_id, float(r.num_output), reason)
        self._pending_aborts.clear()
        self.rec.event(now, "replica.crashed", self.scope, None, float(len(dropped)), reason)
        self._levels()
        return dropped

    def restart(self, engine: Engine) -> None:
        """Back after recovery and warm-up, with a cold KV cache."""
        self.engine = engine
        engine.step_kv_usage = self.rec.record_iterations
        self.down = False
        self.healthy = True
        self._wake = self.env.event()
        self.rec.event(self.env.now, "replica.recovered", self.scope)
        self.start()

    # ---- the engine loop -----------------------------------------------------------------------
    def _run(self):
        try:
            yield from self._loop()
        except simpy.Interrupt:
            return  # crashed: the step in flight is lost

    def _loop(self):
        env, eng = self.env, self.engine
        waiting = eng.waiting
        while True:
            if self._pending_aborts:
                self._apply_aborts()
            if not eng.running and not waiting._n:  # (not eng.has_work)
                if eng.held:  # (async scheduling) nothing ran on past the last step: vLLM had no step formed
                    eng.release_held()
                    continue
                self._wake = env.event()
                self._idle = True
                idle_from = env.now if self._step_index else -_INF  # before the first step: idle all along
                yield self._wake
                self._idle = False
                if self._woke_after_idle is not None:
                    self._woke_after_idle(env.now - idle_from)
                continue
            step = eng.schedule(env.now)
            # (async scheduling) requests that arrived during the last step join the step after this one, so
            # this one is advanced alone
            released = eng.release_held() if eng.held else 0
            if step is None and released:
                step = eng.schedule(env.now)
            if step is None:
                raise RuntimeError(f"{self.scope}: work is queued but nothing can be scheduled "
                                   f"(KV pool too small for the head request?)")
            if step.admitted or step.preempted:
                self._note_schedule(step)
            self.events += 1
            if step.uniform_decode and self.max_run > 1 and not released:
                k = eng.max_decode_run(step, self.max_run)
            else:
                k = 1
            if k == 1:
                yield from self._one_step(step)
            else:
                yield from self._decode_run(step, k)

    def _one_step(self, step: Step):
        t0 = self.env.now
        by_step = self._step_time_for
        d = (self.step_model.step_time_s(step.shape) if by_step is None else by_step(step)) * self.speed_factor
        if self.decode_speedup is not None and step.p_req == 0:
            d /= self.decode_speedup(step.d_req)
        if self._stretch_step is not None:
            d = self._stretch_step(t0, d)
        yield self.env.timeout(d)
        self._log_iteration(step, t0, d)
        finished = self.engine.complete(step, self.env.now)
        self._note_complete(step, finished)

    def _decode_run(self, step: Step, k: int):
        env = self.env
        t0 = env.now
        d_req, d_ctx = step.d_req, step.d_ctx
        model = self.step_model
        if self.speed_factor == 1.0 and self.decode_speedup is None and hasattr(model, "decode_run_list"):
            durs = model.decode_run_list(d_req, d_ctx, k)  # same floats as a list
        else:
            arr = model.decode_run_s(d_req, d_ctx, k) * self.speed_factor
            if self.decode_speedup is not None:
                arr = arr / self.decode_speedup(d_req)
            durs = arr.tolist()
        # Step ends t0 + (d0 + ... + di): runs are short (a few steps), where numpy's per-call overhead costs
        # more than the loop; accumulate adds left to right as np.cumsum does, so the floats are the same
        # (``map`` with the bound add: the loop in C; the clock may start as int 0, and int + float converts the int
        # first, so float(t0) gives the same sums).
        ends = list(map(float(t0).__add__, accumulate(durs)))
        m = yield from self._wait_run(ends)
        ends_l = ends[:m] if m < k else ends
        if self.rec.record_iterations:
            starts = [t0, *ends_l[:-1]]
            for i in range(m):
                self._log_iteration(step, starts[i], durs[i])
        else:
            self._step_index += m
        finished = self.engine.complete_decode_run(step, m, ends_l)
        self._note_complete(step, finished)

    def _wait_run(self, ends: list[float]):
        """Wait for a decode run whose steps end at ``ends``: until its last step ends or, when an arrival or
        abort cuts it (``_poke``), until the step in flight ends. Returns the steps done.

        ``timeout | wake`` with no event per run besides the timeout: ``_poke`` moves the wait from the timeout
        to a fresh wake event, unless the timeout is due at that very instant (it is queued before the wake
        would be: the run ends whole, as it did). These waits used to go through one more event (``first_of``'s,
        scheduled when the first of the two was processed), so where other events are queued for the same
        instant the process lets them go first (the hop below): the same place in the event order as before,
        ties and same-instant cascades included (tests/test_engine_replica_wait.py runs the former code side by
        side)."""
        env = self.env
        k = len(ends)
        end = ends[-1]
        t0 = env.now
        timeout = env.timeout(end - t0)
        self._run_wait = timeout
        self._run_end_t = t0 + (end - t0)  # (the time the timeout is scheduled at)
        yield timeout
        self._run_wait = None
        self._run_end_t = _INF
        q = env._queue
        if q and q[0][0] <= env.now:
            yield env.timeout(0)  # (the hop)
        if not self._cut:
            return k
        self._cut = False  # finish the step in flight
        now = env.now
        if now >= end:
            return k
        m = min(bisect_right(ends, now) + 1, k)
        if ends[m - 1] > now:
            yield env.timeout(ends[m - 1] - now)
        return m

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        if not self._pending_aborts:
            return
        now = self.env.now
        for req, reason in self._pending_aborts:
            if self.engine.abort(req, now, "abort"):
                self.rec.event(now, self._k_cancelled, self.scope, req.request_id, float(req.num_output), reason)
                if self.on_finished is not None:
                    self.on_finished(req)
        self._pending_aborts.clear()
        self._levels()

    def _note_schedule(self, step: Step) -> None:
        now = self.env.now
        rec = self.rec
        for r in step.preempted:
            rec.event(now, self._k_preempted, self.scope, r.request_id, float(r.num_output))
        for r in step.admitted:
            if r.num_preemptions == 0:
                rec.event(now, self._k_scheduled, self.scope, r.request_id, float(r.num_cached_tokens or 0))

    def _note_complete(self, step: Step, finished: list[EngineRequest]) -> None:
        now = self.env.now
        rec = self.rec
        if step.first_tokens:  # (Engine.complete lists them: no pass over every scheduled request)
            for r in step.first_tokens:
                rec.event(now, self._k_first, self.scope, r.request_id)
        if finished:
            for r in finished:
                rec.event(now, self._k_finished, self.scope, r.request_id, float(r.num_output), r.finished_reason)
                if self.on_finished is not None:
                    self.on_finished(r)
        self._levels()

    def _levels(self) -> None:
        """Record the three gauges. A value equal to the one last recorded is a no-op in the recorder, so
        it is skipped here without the recorder's lookup (this runs once per engine event)."""
        eng, last = self.engine, self._lv_last
        pool = eng.kv
        # pool.usage(), inlined (the same expression: the same float; this runs once per engine event)
        kv = 1.0 - (len(pool.head) + (pool.num_blocks - pool.fresh) + pool.tail_len) / (pool.num_blocks - 1)
        running, waiting = len(eng.running), eng.waiting._n + len(eng.held)  # (held: async scheduling's arrivals)
        if running != last[0]:  # (counts compared as ints, recorded as floats)
            last[0] = running
            self.rec.level(self.env.now, self.scope, "running", float(running))
        if waiting != last[1]:
            last[1] = waiting
            self.rec.level(self.env.now, self.scope, "waiting", float(waiting))
        if kv != last[2]:
            last[2] = kv
            self.rec.level(self.env.now, self.scope, "kv_usage", kv)

    def _log_iteration(self, step: Step, t0: float, d: float) -> None:
        if self.rec.record_iterations:
            self.rec.iteration(self.scope, step=self._step_index, t_start_s=t0, ctx_requests=step.ctx_requests,
                               ctx_tokens=step.ctx_tokens, gen_requests=step.gen_requests,
                               gen_tokens=step.gen_tokens, elapsed_ms=(d - self.overhead_s) * 1000.0,
                               kv_usage_pct=step.kv_usage * 100.0)
        self._step_index += 1
