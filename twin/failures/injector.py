"""The one fault injector: scheduled and random faults interrupting fleet components.

Faults act through the components' own methods (``Replica.crash``/``restart``, ``speed_factor``, the
world's DNS steering and region state), so each component keeps its own invariants. Every fault leaves
events: ``fault.injected``, ``replica.crashed``, ``replica.recovered``, ``region.lost``,
``dns.failed_over``, ``region.recovered``, ``fault.cleared``.
"""

from __future__ import annotations

import fnmatch

from twin.models.engine import Engine
from twin.rng import stream


class FaultInjector:
    def __init__(self, world, *, seed: int, replication: int) -> None:
        self.w = world
        self.env = world.env
        self.cfg = world.cfg
        self.seed = seed
        self.replication = replication

    def start(self) -> None:
        for i, f in enumerate(self.cfg.faults):
            self.env.process(self._scheduled(f, i))
        rates = self.cfg.fault_rates
        if rates.replica_crash_per_replica_hour > 0:
            self.env.process(self._random_crashes(rates.replica_crash_per_replica_hour))
        if rates.xid_per_node_hour > 0:
            self.env.process(self._random_xid(rates.xid_per_node_hour))

    # ---- selection --------------------------------------------------------------------------------
    def replicas_matching(self, pattern: str, count: int):
        hs = sorted((h for h in self.w.handles if fnmatch.fnmatchcase(h.scope, pattern)), key=lambda h: h.scope)
        return hs[:count]

    def nodes_matching(self, pattern: str, count: int) -> list[str]:
        nodes = sorted({h.node for h in self.w.handles if fnmatch.fnmatchcase(h.node, pattern)})
        return nodes[:count]

    # ---- faults -----------------------------------------------------------------------------------
    def _scheduled(self, f, i: int):
        env, rec = self.env, self.w.rec
        if f.at_s > env.now:
            yield env.timeout(f.at_s - env.now)
        rec.event(env.now, "fault.injected", "failures", None, None, f.kind)
        if f.kind == "replica_crash":
            for h in self.replicas_matching(f.replica, f.count):
                self.crash(h, recover=f.recover)
        elif f.kind == "node_loss":
            for node in self.nodes_matching(f.node, f.count):
                for h in self.w.handles:
                    if h.node == node:
                        self.crash(h, recover=f.recover)
        elif f.kind == "xid_slowdown":
            nodes = self.nodes_matching(f.node, f.count)
            for h in self.w.handles:
                if h.node in nodes:
                    h.replica.speed_factor = f.factor
            rec.event(env.now, "node.degraded", ",".join(nodes), None, f.factor, "xid")
            if f.until_s is not None:
                yield env.timeout(max(f.until_s - env.now, 0.0))
                for h in self.w.handles:
                    if h.node in nodes:
                        h.replica.speed_factor = 1.0
                rec.event(env.now, "fault.cleared", ",".join(nodes), None, None, "xid")
        elif f.kind == "region_loss":
            yield from self._region_loss(f.region, f.recover_at_s)
        elif f.kind == "slow_network":
            self.w.extra_latency_s[f.region] = f.extra_latency_s
            if f.until_s is not None:
                yield env.timeout(max(f.until_s - env.now, 0.0))
                self.w.extra_latency_s.pop(f.region, None)
                rec.event(env.now, "fault.cleared", f.region, None, None, "slow_network")

    def crash(self, h, *, recover: bool) -> None:
        dropped = h.replica.crash()
        self.w.router.mark_unhealthy(h.scope)
        self.w.note_dropped(h, len(dropped))
        if recover:
            self.env.process(self._recover(h, self.cfg.failover.recover_after_s))

    def _recover(self, h, after_s: float):
        yield self.env.timeout(after_s + self.cfg.failover.warmup_s)
        if h.replica.down and self.w.region_up.get(h.region, True):
            h.replica.restart(Engine(h.replica.engine.cfg, track_groups=True))

    def _region_loss(self, region: str, recover_at_s: float | None):
        env, w = self.env, self.w
        w.region_up[region] = False
        w.rec.event(env.now, "region.lost", region)
        for h in w.handles:
            if h.region == region:
                self.crash(h, recover=False)
        yield env.timeout(self.cfg.failover.dns_failover_s)
        w.failed_over[region] = True
        w.rec.event(env.now, "dns.failed_over", region)
        if recover_at_s is None:
            return
        if recover_at_s > env.now:
            yield env.timeout(recover_at_s - env.now)
        w.rec.event(env.now, "region.recovering", region)
        yield env.timeout(self.cfg.failover.warmup_s)
        for h in w.handles:
            if h.region == region and h.replica.down:
                h.replica.restart(Engine(h.replica.engine.cfg, track_groups=True))
        w.region_up[region] = True
        yield env.timeout(self.cfg.failover.dns_failover_s)  # DNS moves users back
        w.failed_over[region] = False
        w.rec.event(env.now, "region.recovered", region)

    def _random_crashes(self, per_replica_hour: float):
        rng = stream(self.seed, self.replication, "failures.replica_crash")
        rate = per_replica_hour * len(self.w.handles) / 3600.0
        while True:
            yield self.env.timeout(rng.exponential(1.0 / rate))
            h = self.w.handles[int(rng.integers(len(self.w.handles)))]
            if not h.replica.down:
                self.w.rec.event(self.env.now, "fault.injected", "failures", None, None, "replica_crash")
                self.crash(h, recover=True)

    def _random_xid(self, per_node_hour: float):
        rng = stream(self.seed, self.replication, "failures.xid")
        nodes = sorted({h.node for h in self.w.handles})
        rate = per_node_hour * len(nodes) / 3600.0
        while True:
            yield self.env.timeout(rng.exponential(1.0 / rate))
            node = nodes[int(rng.integers(len(nodes)))]
            for h in self.w.handles:
                if h.node == node:
                    h.replica.speed_factor = 2.0
            self.w.rec.event(self.env.now, "node.degraded", node, None, 2.0, "xid")
