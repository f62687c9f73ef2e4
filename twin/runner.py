"""run_scenario(scenario, seed, replication) -> RunResult: build, wire, start, run, tabulate.

The component tree is built and wired first, then every process starts in one place
(elaborate-then-run). A run that raises still returns a manifest with the exception.
"""

from __future__ import annotations

import gc
import platform
import subprocess
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import simpy

from twin import __version__
from twin.engine_profiles.step import StepTimeModel
from twin.models.engine import Engine, EngineConfig
from twin.models.recorder import Recorder
from twin.models.replica import Replica
from twin.models.request import EngineRequest
from twin.models.tokens import TokenSeq, clear_chain_memo
from twin.models.workload import RequestSpec, workload_requests
from twin.paths import REPO_ROOT
from twin.results import events_table, iterations_table, levels_table, requests_table, summarize
from twin.scenario import EngineSettings, ReplicaConfig, Scenario


@dataclass
class RunResult:
    scenario: Scenario
    seed: int
    replication: int
    tables: dict[str, pa.Table] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    world: Any = field(default=None, repr=False)  # the simulated world, for tests and replay; not serialised
    # process CPU seconds of the run's phases ("simulate": build and run the world; "tabulate": tables and
    # summary), for the benchmarks; not serialised, not a result
    cpu_s: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.manifest.get("exception") is None


def build_step_model(rc: ReplicaConfig) -> tuple[StepTimeModel, int]:
    """The replica's step-time model and its KV block count (given, or derived as vLLM derives it)."""
    st, eng = rc.step_time, rc.engine
    if st.kind == "fixed":
        from twin.engine_profiles.simple import FixedStepTime

        model = FixedStepTime(overhead_s=st.overhead_s, step_s=st.step_s, decode_token_s=st.decode_token_s,
                              prefill_token_s=st.prefill_token_s, context_token_s=st.context_token_s)
        assert eng.num_gpu_blocks is not None  # enforced by the schema
        return model, eng.num_gpu_blocks
    from twin.engine_profiles import derive_num_gpu_blocks, load_profile

    profile = load_profile(st.profile)
    blocks = eng.num_gpu_blocks
    if blocks is None:
        blocks = derive_num_gpu_blocks(profile, block_size=eng.block_size,
                                       gpu_memory_utilization=eng.gpu_memory_utilization,
                                       max_num_batched_tokens=eng.max_num_batched_tokens)
    return profile.step_time_model(), int(blocks)


def on_gpu(rc: ReplicaConfig) -> bool:
    """Whether the replica's step time is a GPU profile's (``engine_config``'s ``gpu``); a fixed step time is not."""
    if rc.step_time.kind != "profile":
        return False
    from twin.engine_profiles import load_profile

    return load_profile(rc.step_time.profile).on_gpu


def engine_config(es: EngineSettings, num_gpu_blocks: int, *, gpu: bool = False) -> EngineConfig:
    """The engine's limits from the scenario's settings; ``gpu``: the replica runs a GPU profile, where an unset
    ``async_scheduling`` resolves on (as vLLM resolves it)."""
    return EngineConfig(
        num_gpu_blocks=num_gpu_blocks, block_size=es.block_size, max_num_batched_tokens=es.max_num_batched_tokens,
        max_num_seqs=es.max_num_seqs, max_model_len=es.max_model_len, enable_chunked_prefill=es.enable_chunked_prefill,
        enable_prefix_caching=es.enable_prefix_caching, long_prefill_token_threshold=es.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=es.long_prefill_token_threshold_adaptive, policy=es.policy,
        scheduler_reserve_full_isl=es.scheduler_reserve_full_isl, watermark=es.watermark,
        async_scheduling=gpu if es.async_scheduling is None else es.async_scheduling)


class SingleReplicaRun:
    """The single-replica world: a request source feeding one replica."""

    def __init__(self, scenario: Scenario, *, seed: int, replication: int, specs: list[RequestSpec] | None = None,
                 step_model: StepTimeModel | None = None) -> None:
        sc = scenario
        self.env = simpy.Environment()
        self.rec = Recorder(levels_interval_s=sc.output.levels_interval_s,
                            record_iterations=sc.output.record_iterations)
        model, blocks = build_step_model(sc.replica)
        if step_model is not None:
            model = step_model
        self.cfg = engine_config(sc.replica.engine, blocks, gpu=on_gpu(sc.replica))
        self.engine = Engine(self.cfg)
        self.replica = Replica(self.env, scope="replica", engine=self.engine, step_model=model, recorder=self.rec,
                               max_decode_run_steps=sc.replica.max_decode_run_steps, on_finished=self._finished)
        specs = specs if specs is not None else workload_requests(sc.workload, seed=seed, replication=replication)
        # the source sends in list order and waits for each one's time, so a spec listed after a later one would
        # be sent late: in time order (a stable sort; ties keep their order, which is the engine's add order).
        # A recorded server run lists its requests by id, and a burst's concurrent sends can leave in another order.
        self.specs = sorted(specs, key=lambda s: s.arrival_s)
        self.record_token_times = sc.output.record_token_times
        self.token_times: dict[str, list[float]] = {}
        self.outstanding = 0
        self.all_done = self.env.event()

    def start(self) -> None:
        self.replica.start()
        self.env.process(self._source())

    def _source(self):
        env, cfg = self.env, self.cfg
        self.outstanding = len(self.specs)
        for spec in self.specs:
            if spec.arrival_s > env.now:
                yield env.timeout(spec.arrival_s - env.now)
            self.rec.event(env.now, "request.arrived", "client", spec.request_id, float(spec.prompt_tokens))
            if spec.prompt_tokens >= cfg.max_model_len:
                self.rec.event(env.now, "request.rejected", "replica", spec.request_id, 0.0, "prompt_too_long")
                self._done_one()
                continue
            req = EngineRequest(
                request_id=spec.request_id, arrival_s=env.now,
                seq=TokenSeq(spec.pieces, block_size=cfg.block_size, output_segment=spec.output_segment),
                max_tokens=spec.max_tokens, target_output_tokens=spec.output_tokens,
                record_token_times=self.record_token_times)
            self.replica.submit(req)
        if not self.specs:
            self.all_done.succeed()

    def _finished(self, req: EngineRequest) -> None:
        if req.token_times is not None:
            self.token_times[req.request_id] = req.token_times
        self._done_one()

    def _done_one(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0 and not self.all_done.triggered:
            self.all_done.succeed()

    def run(self, horizon_s: float | None) -> None:
        self.start()
        if horizon_s is None:
            self.env.run(until=self.all_done)
        else:
            self.env.run(until=simpy.AnyOf(self.env, [self.all_done, self.env.timeout(horizon_s)]))

    def counters(self) -> dict[str, int]:
        e = self.engine
        return {"prefix_cache_queries": e.prefix_cache_queries, "prefix_cache_hits": e.prefix_cache_hits,
                "num_preemptions": e.num_preemptions, "prompt_tokens": e.prompt_tokens,
                "generation_tokens": e.generation_tokens, "num_steps": e.num_steps,
                "num_gpu_blocks": self.cfg.num_gpu_blocks}


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions() -> dict[str, str]:
    import numpy
    import pyarrow
    import pydantic

    return {"twin": __version__, "python": platform.python_version(), "simpy": simpy.__version__,
            "numpy": numpy.__version__, "pydantic": pydantic.__version__, "pyarrow": pyarrow.__version__}


def make_manifest(scenario: Scenario, *, seed: int, replication: int, wall_s: float, exception: str | None) -> dict:
    return {"scenario": scenario.name, "seed": seed, "replication": replication,
            "config": scenario.model_dump(mode="json"), "versions": versions(), "git_sha": git_sha(),
            "wall_s": wall_s, "exception": exception}


def run_scenario(scenario: Scenario, *, seed: int | None = None, replication: int = 0,
                 specs: list[RequestSpec] | None = None, step_model: StepTimeModel | None = None) -> RunResult:
    """Run one scenario (a single replica or a fleet) and tabulate it. Failures land in the manifest."""
    seed = scenario.seed if seed is None else seed
    result = RunResult(scenario=scenario, seed=seed, replication=replication)
    release_finished_worlds()  # the collector is off from here to the end of this run
    clear_chain_memo()  # a run's cost must not depend on what ran before it in this process
    t0 = time.perf_counter()
    try:
        if scenario.fleet is not None:
            _run_fleet(scenario, seed, replication, result, t0)
        else:
            _run_single(scenario, seed, replication, result, t0, specs, step_model)
        result.manifest = make_manifest(scenario, seed=seed, replication=replication,
                                        wall_s=result.summary["wall_s"], exception=None)
    except Exception as exc:  # noqa: BLE001 - the manifest records any failure
        wall = time.perf_counter() - t0
        result.manifest = make_manifest(scenario, seed=seed, replication=replication, wall_s=wall,
                                        exception="".join(traceback.format_exception_only(exc)).strip())
        result.manifest["traceback"] = traceback.format_exc()
    return result


def release_finished_worlds(*, collect: bool = False) -> None:
    """Make the worlds of earlier runs in this process collectable again (``_sim_collector`` froze each one at its
    end), and collect them now once the worlds released since the last collection are large, or when ``collect``
    asks for it. ``run_scenario`` does it first; a benchmark does it with ``collect`` before it starts its clocks, so
    that freeing one case's world is not counted as the next case's cost."""
    if _frozen_world:
        gc.unfreeze()
        _uncollected[0] += _frozen_world.pop()
    if collect or _uncollected[0] >= _COLLECT_WORLDS_FROM:
        gc.collect()
        _uncollected[0] = 0


# The objects the last run's build and simulation left tracked, while its world is frozen (the young generation's
# count at the freeze: the collector was off, so nothing reset it); empty when nothing is. Kept here because
# ``gc.get_freeze_count`` walks the frozen list (~10 ms in a test process).
_frozen_world: list[int] = []
# The same summed over the worlds released since the last collection. A full collection walks the whole process,
# not just the dropped worlds: ~26 ms in a plain process and more in a test process, which a fidelity table of nine
# noise draws of twelve runs paid 120 times (one per replay) to free worlds of a few thousand objects each. So small
# worlds wait until together they pass the threshold, and their cycles stay in memory until then (the next run's
# freeze takes them out of the collector's reach again, so only this count frees them). Measured: a replay of a
# recorded CPU run leaves a few hundred to ~2,000 objects; the fleet benchmark's scenario for 120 simulated s
# ~53,000 at 0.005x, ~215,000 at 0.02x.
_uncollected = [0]
_COLLECT_WORLDS_FROM = 200_000


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while the tables and summary are built: they allocate many
    short-lived objects and few cycles, and each full collection would walk every object of the finished
    world (millions at fleet scale). Changes no result; reference counting still frees everything."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def _sim_collector() -> Iterator[None]:
    """The cyclic garbage collector is off while a world is built and simulates (a fleet, or one replica).

    A run's objects are in no reference cycle (``Generations._submit``; ``tests/test_gc_cycles.py`` runs fleets
    with cancellations, retries, a crash, autoscaling and disaggregated pools and finds nothing for the collector
    to free), so reference counting frees everything a run drops, and a collection during the run can only walk
    what is alive to free nothing. It is not cheap: a young collection visits every reference of every object
    made since the last one, and in a large heap each visit is a cache miss. Measured with ``gc.callbacks`` at 1x
    (540 replicas, 30 simulated s) under the former thresholds (a young collection per million objects): two
    collections took 0.69 and 1.25 CPU-s and freed 0 objects, 6.7 % of the run; at 2x they grew to ~9 % (each
    costlier than the last). At the end the finished world is frozen out of the collector's reach (the first
    collection after the run would walk all of it to free nothing: ~0.8 CPU-s at scale 0.08 for 120 s), and the
    next ``run_scenario`` in this process unfreezes it, so a sweep or the dashboard still gets a dropped world's
    cycles collected. Changes nothing simulated.

    The build is inside it too: it makes the world's long-lived objects (per replica a KV pool, every session's
    spec), so each young collection then promotes what it visits and the older ones walk a heap that keeps growing.
    Measured with ``gc.callbacks`` on the fleet benchmark's scenario for 30 simulated s: at 1x, 120 collections
    took 0.36 of the build's 1.09 CPU-s; at 4x (2,160 replicas), 470 (three of them full) took 3.97 of 9.62, so
    the build grew 8.8x for 4x the fleet. So an earlier run's world, which those collections used to free during
    the build, is collected explicitly before it (``run_scenario``): left to the end of the next run, it added
    ~2 GB to the peak of the 4x fleet run after a 1x one in one process (``python -m benchmarks``).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _frozen_world[:] = [gc.get_count()[0]]
        gc.freeze()
        if was_enabled:
            gc.enable()


def _run_single(scenario, seed, replication, result, t0, specs, step_model) -> None:
    c0 = time.process_time()
    with _sim_collector():
        world = SingleReplicaRun(scenario, seed=seed, replication=replication, specs=specs, step_model=step_model)
        world.run(scenario.horizon_s)
    c1 = time.process_time()
    end = world.env.now
    with _no_cyclic_gc():
        world.rec.close_levels(end)
        events = events_table(world.rec)
        reqs = requests_table(events, world.token_times if scenario.output.record_token_times else None)
        result.tables = {"events": events, "levels": levels_table(world.rec), "requests": reqs}
        if scenario.output.record_iterations:
            result.tables["iterations"] = iterations_table(world.rec)
        means = world.rec.level_means(end)
        kv_means = [v for (scope, metric), v in means.items() if metric == "kv_usage"]
        result.summary = summarize(
            requests=reqs, itl_values=world.engine.itl_values, itl_weights=world.engine.itl_weights,
            counters=world.counters(), kv_usage_mean=sum(kv_means) / len(kv_means) if kv_means else 0.0,
            sim_time_s=end, wall_s=time.perf_counter() - t0, slo_ttft_s=scenario.slo.ttft_s,
            slo_itl_s=scenario.slo.itl_s)
    result.summary["num_gpu_blocks"] = world.cfg.num_gpu_blocks
    result.world = world
    result.cpu_s = {"simulate": c1 - c0, "tabulate": time.process_time() - c1}


def _run_fleet(scenario, seed, replication, result, t0) -> None:
    from twin.fleet_summary import fleet_summary
    from twin.models.fleet import FleetWorld

    c0 = time.process_time()
    with _sim_collector():
        world = FleetWorld(scenario, seed=seed, replication=replication)
        world.run(scenario.horizon_s)
    c1 = time.process_time()
    end = world.env.now
    with _no_cyclic_gc():
        world.rec.close_levels(end)
        events = events_table(world.rec)
        reqs = requests_table(events, attrs=world.turn_attrs)
        result.tables = {"events": events, "levels": levels_table(world.rec), "requests": reqs}
        if scenario.output.record_iterations:
            result.tables["iterations"] = iterations_table(world.rec)
        result.summary = fleet_summary(world, reqs, end_s=end, wall_s=time.perf_counter() - t0, slo=scenario.slo)
    result.world = world
    result.cpu_s = {"simulate": c1 - c0, "tabulate": time.process_time() - c1}
