"""The control plane: every ``control_interval_s`` it measures the fleet as on-call dashboards do
(token backlog, queue ETA, recent ITL/TTFT p95, error rate; never GPU utilisation for decisions) and
lets the degradation ladder, the autoscaler and the alert rules act.

Rung effects (each a flag the ladder policy flips, or on-call forces in the scenario):
``cap_output`` caps new generations' max tokens; ``free_tier_small_model`` routes the free tier to the
smaller model (capability and residency still checked); ``speculative_decoding`` speeds decode-only
steps by the policy's batch-dependent factor; ``queue_eta`` queues with an honest ETA instead of
rejecting at the deadline (clients leave at once when the ETA exceeds their patience); ``shed`` rejects
new turns of the shed tiers at the gateway.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from twin.metrics import weighted_quantiles
from twin.models.engine import Engine
from twin.models.replica import Replica
from twin.models.router import ReplicaHandle


class ControlPlane:
    def __init__(self, world, *, seed: int) -> None:
        from twin.policies.alerts import AlertEvaluator
        from twin.policies.autoscaling import build_autoscaler
        from twin.policies.ladder import build_ladder

        self.w = world
        self.env = world.env
        fc = world.cfg
        self.cfg = fc
        self.ladder = build_ladder(fc.ladder.policy, seed=seed) if fc.ladder is not None else None
        self.autoscaler = build_autoscaler(fc.autoscaling.policy, seed=seed) if fc.autoscaling is not None else None
        self.alerts = AlertEvaluator(fc.alerts) if fc.alerts else None
        from twin.policies.canary import build_canary

        self.canary = build_canary(fc.canary.policy, seed=seed) if fc.canary is not None else None
        if self.canary is not None:
            world.canary_share = self.canary.canary_share
            world.canary_share_max = self.canary.canary_share
        self._itl: deque[tuple[float, np.ndarray, np.ndarray]] = deque()
        self._cursor: dict[int, int] = {}
        self.on: tuple[str, ...] = ()
        self.provisioning = 0
        self.added_nodes = 0

    @property
    def active(self) -> bool:
        return (self.ladder is not None or self.autoscaler is not None or self.alerts is not None
                or self.canary is not None)

    def start(self) -> None:
        if self.active:
            self.env.process(self._loop())

    # ---- signals ----------------------------------------------------------------------------------
    def _window_itl_p95(self, now: float) -> float | None:
        vals, wts = [], []
        for h in self.w.handles:
            e = h.replica.engine
            key = id(e)
            start = self._cursor.get(key, 0)
            if len(e.itl_values) > start:
                vals.append(np.asarray(e.itl_values[start:], dtype=float))
                wts.append(np.asarray(e.itl_weights[start:], dtype=float))
            self._cursor[key] = len(e.itl_values)
        if vals:
            self._itl.append((now, np.concatenate(vals), np.concatenate(wts)))
        while self._itl and self._itl[0][0] < now - self.cfg.signal_window_s:
            self._itl.popleft()
        if not self._itl:
            return None
        v = np.concatenate([x[1] for x in self._itl])
        w = np.concatenate([x[2] for x in self._itl])
        return float(weighted_quantiles(v, w, (0.95,))[0]) if v.size else None

    def _window(self, log: deque, now: float) -> deque:
        while log and log[0][0] < now - self.cfg.signal_window_s:
            log.popleft()
        return log

    def signals(self) -> dict[str, float | None]:
        now = self.env.now
        q = self.w.queue
        backlog = q.queued_tokens
        drain = q.drain_tokens_per_s()
        eta = 0.0 if backlog <= 0 else (backlog / drain if drain > 0 else math.inf)
        ttfts = [x[1] for x in self._window(self.w.ttft_log, now)]
        outcomes = [x[1] for x in self._window(self.w.outcome_log, now)]
        return {"token_backlog": float(backlog), "queue_eta_s": eta, "itl_p95_s": self._window_itl_p95(now),
                "ttft_p95_s": float(np.quantile(ttfts, 0.95)) if ttfts else None,
                "error_rate": (sum(1 for ok in outcomes if not ok) / len(outcomes)) if outcomes else None,
                "drain_tokens_per_s": drain}

    # ---- the loop ---------------------------------------------------------------------------------
    def _loop(self):
        first = True
        while True:
            if not first:  # evaluate at t=0 too, so static rungs and forced flags hold from the start
                yield self.env.timeout(self.cfg.control_interval_s)
            first = False
            sig = self.signals()
            now = self.env.now
            rec = self.w.rec
            for name in ("queue_eta_s", "itl_p95_s", "ttft_p95_s"):
                v = sig[name]
                if v is not None and math.isfinite(v):
                    rec.level(now, "control", name, v)
            if self.ladder is not None:
                self._ladder_step(sig)
            if self.alerts is not None:
                for tr in self.alerts.evaluate(sig, now):
                    rec.event(now, f"alert.{tr.state}", "alerts", None, tr.value, tr.name)
            if self.autoscaler is not None:
                self._autoscale_step(sig)
            if self.canary is not None:
                self._canary_step()

    def _ladder_step(self, sig) -> None:
        from twin.policies.ladder import LadderSignals

        now = self.env.now
        eta = sig["queue_eta_s"]
        decision = self.ladder.evaluate(LadderSignals(
            now_s=now, token_backlog=int(sig["token_backlog"]), queue_eta_s=eta if math.isfinite(eta) else 1e12,
            itl_p95_s=sig["itl_p95_s"], ttft_p95_s=sig["ttft_p95_s"]))
        for rung, on in decision.changed:
            self.w.rec.event(now, "ladder.rung_on" if on else "ladder.rung_off", "ladder", None, None,
                             f"{rung}: {decision.reason(rung) or ''}".strip())
        self.on = decision.on
        self.apply(decision)

    def apply(self, decision) -> None:
        w, fc = self.w, self.cfg
        w.output_cap = self.ladder.cap_output_tokens if decision.is_on("cap_output") else None
        small = fc.ladder.small_model if fc.ladder is not None else None
        w.free_tier_model = small if (decision.is_on("free_tier_small_model") and small) else fc.free_tier_model
        speed = self.ladder.spec_decode_speedup if decision.is_on("speculative_decoding") else None
        for h in w.handles:
            h.replica.decode_speedup = speed
        w.queue_eta_mode = decision.is_on("queue_eta")
        w.shed_tiers = tuple(decision.shed_tiers)
        self.w.rec.level(self.env.now, "ladder", "rungs_on", float(len(decision.on)))

    # ---- autoscaling ------------------------------------------------------------------------------
    def _autoscale_step(self, sig) -> None:
        from twin.policies.autoscaling import ScalingSignals

        now = self.env.now
        live = [h for h in self.w.handles if not h.replica.down and not h.draining]
        busy = sum(1 for h in live if h.replica.engine.has_work)
        eta = sig["queue_eta_s"]
        d = self.autoscaler.evaluate(ScalingSignals(
            now_s=now, token_backlog=int(sig["token_backlog"]), queue_eta_s=eta if math.isfinite(eta) else 1e12,
            replicas_ready=len(live), replicas_provisioning=self.provisioning,
            gpu_utilization=busy / len(live) if live else 0.0, drain_tokens_per_s=sig["drain_tokens_per_s"]))
        if d.add:
            self.provisioning += d.add
            self.w.rec.event(now, "autoscaler.scaled_up", "autoscaler", None, float(d.add), d.reason)
            self.env.process(self._provision(d.add))
        if d.remove:
            for h in sorted(live, key=lambda h: h.scope, reverse=True)[: d.remove]:
                h.draining = True
                h.removed_s = now
                self.w.router.mark_unhealthy(h.scope)
            self.w.rec.event(now, "autoscaler.scaled_down", "autoscaler", None, float(d.remove), d.reason)
        if d.burst_share != self.w.burst_share:
            self.w.rec.event(now, "autoscaler.burst_changed", "autoscaler", None, d.burst_share, d.reason)
        self.w.burst_share = d.burst_share
        self.w.rec.level(now, "autoscaler", "replicas_ready", float(len(live)))

    def _provision(self, n: int):
        """New replicas arrive after the provisioning delay, on new nodes of the configured model/region."""
        auto = self.cfg.autoscaling
        yield self.env.timeout(auto.provisioning_delay_s)
        w = self.w
        model = auto.model or self.cfg.default_model
        region = auto.region or w.region_order[0]
        info = w.model_info[model]
        for k in range(n):
            node = f"fleet.{region}.{model}-autoscaled-n{self.added_nodes:03d}"
            if k % info["per_node"] == 0 and k:
                self.added_nodes += 1
                node = f"fleet.{region}.{model}-autoscaled-n{self.added_nodes:03d}"
            rep = Replica(self.env, scope=f"{node}.r{k % info['per_node']}", engine=Engine(info["engine"], track_groups=True),
                          step_model=info["step_model"], recorder=w.rec,
                          max_decode_run_steps=w.max_decode_run_steps, event_prefix="generation")
            h = ReplicaHandle(rep, region=region, node=node, model=model, pool="default",
                              max_model_len=info["engine"].max_model_len, index=len(w.handles))
            h.started_s = self.env.now
            w.handles.append(h)
            w.router.add_replica(h)
            w.placements.add((model, region))
            rep.start()
        self.added_nodes += 1
        self.provisioning -= n
        w.rec.event(self.env.now, "autoscaler.capacity_ready", "autoscaler", None, float(n))

    # ---- release canary -----------------------------------------------------------------------------
    def observe_canary(self, *, version: str, task_class: str, ttft_s: float | None, itl_s: float | None,
                       error: bool) -> None:
        """A finished turn of a canaried class: its quality is drawn around its version's mean."""
        from twin.policies.canary import CanaryObservation

        c = self.cfg.canary
        vc = c.canary if version == "canary" else c.stable
        mean = vc.quality.get(task_class, vc.quality_default)
        q = 0.0 if error else float(min(max(self.w.quality_rng.normal(mean, c.quality_noise), 0.0), 1.0))
        self.canary.observe(CanaryObservation(version=version, task_class=task_class, quality=q,
                                              ttft_s=ttft_s if ttft_s and ttft_s > 0 else None,
                                              itl_s=itl_s if itl_s and itl_s > 0 else None, error=error))

    def _canary_step(self) -> None:
        now = self.env.now
        d = self.canary.evaluate(now)
        if d.canary_share != self.w.canary_share or d.action in ("promote", "rollback"):
            kind = {"increase": "canary.increased", "promote": "canary.promoted", "rollback": "canary.rolled_back",
                    "hold": "canary.held"}[d.action]
            if d.action != "hold" and (kind != self.w.canary_last or d.canary_share != self.w.canary_share):
                self.w.rec.event(now, kind, "canary", None, d.canary_share, d.reason)
                self.w.canary_last = kind
            self.w.canary_share = d.canary_share
            if d.action == "increase":
                self.w.canary_share_max = max(self.w.canary_share_max, d.canary_share)
        self.w.rec.level(now, "canary", "share", self.w.canary_share)
