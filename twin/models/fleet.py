"""The fleet world: regions of nodes of replicas per model tier, a router, the token-aware queue, the
gateway, the conversation service and the user population — built and wired first, then started.
"""

from __future__ import annotations

import collections
import dataclasses

import simpy
from simpy.events import URGENT

from twin.fleet_config import FleetSection
from twin.models.client import Clients
from twin.models.conversation import ConversationService
from twin.models.engine import Engine
from twin.models.gateway import Gateway
from twin.models.waits import schedule_at
from twin.models.population import sessions
from twin.models.recorder import Recorder
from twin.models.replica import Replica
from twin.models.router import ReplicaHandle, Router
from twin.models.token_queue import TokenQueue
from twin.rng import stream


def _seed_for(seed: int, replication: int, name: str) -> int:
    return int(stream(seed, replication, name).integers(0, 2**62))


class _Go:
    """What a process is resumed with when it starts: an event that succeeded with no value."""

    _ok = True
    _value = None


class _StartedProcess(simpy.Process):
    """A process whose generator takes its first step at once, inside the event being processed, instead
    of at an ``Initialize`` event scheduled for later: a session starts inside its start timer, at exactly
    the point where its process used to resume from that timer."""

    def __init__(self, env: simpy.Environment, generator) -> None:
        self.env = env
        self.callbacks = []
        self._generator = generator
        self._resume(_Go)  # type: ignore[arg-type]


class FleetWorld:
    def __init__(self, scenario, *, seed: int, replication: int) -> None:
        from twin.engine_profiles import load_profile
        from twin.policies.queueing import build_queue_policy
        from twin.runner import build_step_model, engine_config
        from twin.scenario import ProfileStepTime, ReplicaConfig

        fc: FleetSection = scenario.fleet
        self.cfg = fc
        self.env = env = simpy.Environment()
        self.rec = Recorder(levels_interval_s=scenario.output.levels_interval_s,
                            record_iterations=scenario.output.record_iterations)
        self.turn_attrs: dict[str, tuple[str, str, str, str]] = {}
        self.free_tier_model = fc.free_tier_model
        # ---- elaborate: replicas per model, placed on nodes in regions --------------------------
        self.model_info: dict[str, dict] = {}
        for name, m in fc.models.items():
            profile = load_profile(m.profile)
            step_model, blocks = build_step_model(ReplicaConfig(step_time=ProfileStepTime(profile=m.profile),
                                                                engine=m.engine))
            per_node = max(fc.topology.gpus_per_node // profile.tp, 1)
            self.model_info[name] = {"profile": profile, "step_model": step_model,
                                     "engine": engine_config(m.engine, blocks, gpu=profile.on_gpu),
                                     "per_node": per_node,
                                     "tp": profile.tp, "price": profile.hardware.price_per_gpu_hour_usd}
        handles: list[ReplicaHandle] = []
        self.placements: set[tuple[str, str]] = set()
        for region in fc.topology.regions:
            for p_idx, pool in enumerate(region.pools):
                info = self.model_info[pool.model]
                ecfg = info["engine"]
                if pool.max_model_len is not None:
                    ecfg = dataclasses.replace(ecfg, max_model_len=pool.max_model_len)
                for n in range(max(1, round(pool.nodes * fc.scale))):
                    node = f"fleet.{region.name}.{pool.model}-{pool.pool}-n{p_idx}{n:03d}"
                    for k in range(info["per_node"]):
                        rep = Replica(env, scope=f"{node}.r{k}", engine=Engine(ecfg, track_groups=True),
                                      step_model=info["step_model"], recorder=self.rec,
                                      max_decode_run_steps=scenario.replica.max_decode_run_steps,
                                      event_prefix="generation")
                        handles.append(ReplicaHandle(rep, region=region.name, node=node, model=pool.model,
                                                     pool=pool.pool, max_model_len=ecfg.max_model_len,
                                                     index=len(handles)))
                        self.placements.add((pool.model, region.name))
        self.handles = handles
        self.gpus = sum(self.model_info[h.model]["tp"] for h in handles)
        pools_of: dict[str, set[str]] = {}
        for h in handles:
            pools_of.setdefault(h.model, set()).add(h.pool)
        self.disagg_models = {m for m, ps in pools_of.items() if {"prefill", "decode"} <= ps}
        self.router = Router(env, replicas=handles, policy_config=fc.policy.router,
                             seed=_seed_for(seed, replication, "policy.router"),
                             scrape_interval_s=fc.topology.scrape_interval_s, recorder=self.rec)
        self.queue = TokenQueue(env, policy=build_queue_policy(fc.queue.policy,
                                                               seed=_seed_for(seed, replication, "policy.queue")),
                                router=self.router, max_waiting_per_replica=fc.queue.max_waiting_per_replica)
        self.gateway = Gateway(env, cfg=fc.gateway, seed=_seed_for(seed, replication, "policy.admission"),
                               recorder=self.rec)
        self.conversation = ConversationService(fc.conversation)
        self.clients = Clients(self, seed=seed, replication=replication)
        self.sessions = sessions(fc.traffic, fc.topology, seed=seed, replication=replication, scale=fc.scale)
        self.region_up: dict[str, bool] = {r.name: True for r in fc.topology.regions}
        self.failed_over: dict[str, bool] = {r.name: False for r in fc.topology.regions}
        self.extra_latency_s: dict[str, float] = {}
        self.region_order = [r.name for r in fc.topology.regions]
        from twin.failures.injector import FaultInjector

        self.injector = FaultInjector(self, seed=seed, replication=replication)
        self.dropped_streams = 0
        # what the control plane's rungs and the autoscaler set (read by the clients and gateway)
        self.output_cap: int | None = None
        self.shed_tiers: tuple[str, ...] = ()
        self.queue_eta_mode = False
        self.burst_share = 0.0
        self.provider_turns = 0
        self.provider_tokens = 0
        self._provider_window: list[float] = []
        self.ttft_log: collections.deque = collections.deque()  # (t, ttft) of recent first tokens
        self.outcome_log: collections.deque = collections.deque()  # (t, completed?) of recent outcomes
        self.max_decode_run_steps = scenario.replica.max_decode_run_steps
        self.canary_share = 0.0
        self.canary_share_max = 0.0
        self.canary_last = ""
        self.canary_turns = 0
        self.turn_ttft: dict[str, float] = {}
        self.quality_rng = stream(seed, replication, "canary.quality")
        from twin.models.control import ControlPlane

        self.control = ControlPlane(self, seed=_seed_for(seed, replication, "policy.control"))
        if not self.control.active:
            # only the control plane's signals read these logs (and trim them to their window); without
            # one they would keep an entry per turn for the whole run
            self.ttft_log = collections.deque(maxlen=0)
            self.outcome_log = collections.deque(maxlen=0)
        self.done = env.event()
        self._live = 0

    # ---- run ------------------------------------------------------------------------------------
    def start(self) -> None:
        for h in self.handles:
            h.replica.start()
        self.router.start()
        self.injector.start()
        self.control.start()
        self.env.process(self._scrape_kicks())
        self._live = len(self.sessions)
        # Sessions start from one start timer at a time, not from one process each created now: a process
        # per session waiting for its start time held every session's frame and a timer in SimPy's queue
        # for the whole run. The timers keep the places in the event order the up-front ones had (see
        # _start_sessions), so every table is unchanged.
        kickoff = self.env.event()
        kickoff._ok, kickoff._value = True, None
        kickoff.callbacks.append(self._start_sessions)  # type: ignore[union-attr]
        self.env.schedule(kickoff, URGENT)  # where the sessions' Initialize events were
        if not self.sessions:
            self.done.succeed()

    def _start_sessions(self, _event) -> None:
        """At t=0, where every session's process used to take its first step (in order): a session due
        now starts at once; the others each scheduled a start timer there, so the timers' places in the
        event order were consecutive event ids, after everything scheduled before and before everything
        scheduled after. Those places are kept as keys ``base + i / n`` (one event id taken here, ``i``
        the session's index, distinct floats for any n a run can hold), and only the next session's timer
        is in the queue at any time."""
        env, specs = self.env, self.sessions
        n = len(specs)
        if any(specs[k].start_s > specs[k + 1].start_s for k in range(n - 1)):
            # not in start order (a trace may not be): every timer now, each taking its own event id,
            # just as the session processes did
            for i, spec in enumerate(specs):
                if spec.start_s > env.now:
                    self._schedule_start(i, next(env._eid), chain=False)
                else:
                    self._launch(i)
            return
        i = 0
        while i < n and not specs[i].start_s > env.now:
            self._launch(i)
            i += 1
        self._start_base = next(env._eid)
        if i < n:
            self._schedule_start(i, self._start_base + i / n, chain=True)

    def _schedule_start(self, i: int, place: float, *, chain: bool) -> None:
        timer = self.env.event()
        timer._ok, timer._value = True, (i, chain)
        timer.callbacks.append(self._on_start_timer)  # type: ignore[union-attr]
        schedule_at(self.env, timer, self.sessions[i].start_s, place)  # the up-front timer's time (0 + start_s)

    def _on_start_timer(self, timer) -> None:
        i, chain = timer._value
        if chain and i + 1 < len(self.sessions):
            self._schedule_start(i + 1, self._start_base + (i + 1) / len(self.sessions), chain=True)
        self._launch(i)

    def _launch(self, i: int) -> None:
        # the session's generator is the process itself, not wrapped in one more generator: every resume
        # of a turn (~4 a turn) passes one frame less, and a waiting session holds one frame less
        _StartedProcess(self.env, self.clients.session(self.sessions[i]))

    def session_ended(self) -> None:
        """A session's last step (``Clients.session`` calls it): the run is done when the last one ends."""
        self._live -= 1
        if self._live == 0 and not self.done.triggered:
            self.done.succeed()

    def _scrape_kicks(self):
        """Queued work waits for fresh signals: after every scrape, try to dispatch again."""
        while True:
            yield self.env.timeout(self.cfg.topology.scrape_interval_s)
            self.queue.kick()
            self.rec.level(self.env.now, "queue", "queued_requests", float(self.queue.count))
            self.rec.level(self.env.now, "queue", "queued_tokens", float(self.queue.queued_tokens))

    def run(self, horizon_s: float | None) -> None:
        self.start()
        # The cyclic collector's settings for a run are the runner's (twin.runner._sim_collector).
        if horizon_s is None:
            self.env.run(until=self.done)
        else:
            self.env.run(until=simpy.AnyOf(self.env, [self.done, self.env.timeout(horizon_s)]))

    # ---- regions and DNS ----------------------------------------------------------------------------
    def steer(self, home: str, allowed: list[str] | None) -> str | None:
        """The region a user's requests reach now: home, or after DNS failover the first live region
        inside the tenant's residency; None while DNS still points at a dead region (or none is allowed)."""
        if self.region_up.get(home, True):
            return home
        if not self.failed_over.get(home, False):
            return None  # DNS has not moved yet: connections to the lost region fail
        for r in self.region_order:
            if self.region_up[r] and (allowed is None or r in allowed):
                return r
        return None

    def note_dropped(self, handle, n: int) -> None:
        self.dropped_streams += n

    # ---- aggregates -----------------------------------------------------------------------------
    def engines(self) -> list[Engine]:
        return [h.replica.engine for h in self.handles]

    def counters(self) -> dict[str, int]:
        out = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "prompt_tokens": 0,
               "generation_tokens": 0, "num_steps": 0}
        for e in self.engines():
            out["prefix_cache_queries"] += e.prefix_cache_queries
            out["prefix_cache_hits"] += e.prefix_cache_hits
            out["num_preemptions"] += e.num_preemptions
            out["prompt_tokens"] += e.prompt_tokens
            out["generation_tokens"] += e.generation_tokens
            out["num_steps"] += e.num_steps
        return out
