"""Sweeps: scenarios x policies x seeds, run on a ``concurrent.futures`` executor, one folder per run.

A spec (YAML, :class:`SweepSpec`) expands to :class:`RunTask` items. Each task's effective scenario is
the scenario file with the spec's common overrides, then the policy's overrides, then its router config
(as ``fleet.policy.router``) applied, validated like ``twin run --set``. Only the policy differs between
the tasks of one scenario and seed, so they see the same arrivals (common random numbers, STYLE 3).

A run lands in ``<out>/<name>/runs/<hash>/`` where the hash covers (effective config, seed, replication):
its Parquet tables, ``replicas.parquet`` (every replica, idle ones too), ``manifest.json``,
``summary.json`` and a one-row ``run.parquet`` (scenario, policy,
seed, hash and the flattened summary). Workers compute; the calling process writes, so a dask cluster
needs no shared filesystem. A folder whose manifest has no exception is complete and is skipped on the
next sweep; a failed run's folder holds only its manifest (with the exception) and is run again.
``<out>/<name>/index.json`` lists the runs the spec expands to now; the query layer reads only those.
The hash does not cover twin's code: rerun into a fresh folder after changing the model.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from twin.results import dumps, write_outputs
from twin.scenario import ScenarioError, format_validation_error, load_scenario, parse_scenario

RUN_TABLE = "run.parquet"
Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ScenarioEntry(_Model):
    """A scenario file and overrides for it alone (``a.b=value`` strings, as ``--set``)."""

    path: str
    overrides: list[str] = []


class PolicyEntry(BaseModel):
    """A router config ``{kind: ..., ...params}`` (applied as ``fleet.policy.router``), plus optional
    ``overrides`` for this label. Without ``kind`` only the overrides apply (the scenario's router stays)."""

    model_config = ConfigDict(frozen=True, extra="allow")
    overrides: list[str] = []

    def router(self) -> dict[str, Any] | None:
        return dict(self.model_extra) if self.model_extra else None


class SweepSpec(_Model):
    name: Label
    scenarios: list[str | ScenarioEntry] = Field(min_length=1)
    policies: dict[Label, PolicyEntry] = Field(min_length=1)
    seeds: list[Annotated[int, Field(ge=0)]] | Annotated[int, Field(gt=0)] = 3  # a list, or a count (0..n-1)
    replication: Annotated[int, Field(ge=0)] = 0
    overrides: list[str] = []
    out: str = "runs/sweeps"

    @field_validator("policies", mode="before")
    @classmethod
    def _routers_valid(cls, value: Any) -> Any:
        """Each label's router config must parse (unknown kinds and params fail with a did-you-mean)."""
        if isinstance(value, dict):
            from twin.policies import parse_router_config

            for label, entry in value.items():
                cfg = {k: v for k, v in entry.items() if k != "overrides"} if isinstance(entry, dict) else {}
                if not cfg:
                    continue
                try:
                    parse_router_config(cfg)
                except ValidationError as exc:
                    raise ValueError(f"{label}: {exc.errors()[0]['msg']}") from None
        return value

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def scenario_entries(self) -> list[ScenarioEntry]:
        return [ScenarioEntry(path=s) if isinstance(s, str) else s for s in self.scenarios]


class SpecError(ValueError):
    """A sweep spec that cannot be expanded, with a message naming the field."""


def load_spec(path: str | Path, model: type[BaseModel] = SweepSpec) -> Any:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SpecError(f"{p}: cannot read ({exc.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{p}: expected a mapping at the top level")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, str(p))) from None


@dataclass(frozen=True, slots=True)
class RunTask:
    """One run: a validated scenario as JSON (picklable, hashable input), its seed and labels."""

    config: dict[str, Any]
    seed: int
    replication: int
    scenario_path: str
    policy: str
    run_hash: str


def run_hash(config: dict[str, Any], seed: int, replication: int) -> str:
    """A stable 16-hex-digit key of (effective scenario config, seed, replication)."""
    text = json.dumps({"config": config, "seed": seed, "replication": replication}, sort_keys=True,
                      separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _resolve(path: str, base: Path | None) -> Path:
    """A scenario path as given (absolute or from the working folder), else beside the spec, else from
    the repository root (so ``scenarios/x.yaml`` works from anywhere)."""
    from twin.paths import REPO_ROOT

    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    for root in (base, REPO_ROOT):
        if root is not None and (root / p).exists():
            return root / p
    return p


def expand(spec: SweepSpec, *, base: Path | None = None) -> list[RunTask]:
    """Every (scenario, policy, seed) task, in spec order. Raises SpecError naming the bad entry."""
    tasks: list[RunTask] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(spec.scenario_entries()):
        path = _resolve(entry.path, base)
        for label, pol in spec.policies.items():
            overrides = [*spec.overrides, *entry.overrides, *pol.overrides]
            router = pol.router()
            if router is not None:
                overrides.append("fleet.policy.router=" + json.dumps(router))
            try:
                scenario = load_scenario(path, overrides=overrides)
            except ScenarioError as exc:
                raise SpecError(f"scenarios[{i}] with policies.{label}: {exc}") from None
            config = scenario.model_dump(mode="json")
            for seed in spec.seed_list():
                h = run_hash(config, seed, spec.replication)
                where = f"{entry.path} / {label} / seed {seed}"
                if h in seen:
                    raise SpecError(f"policies.{label}: {where} is the same run as {seen[h]} (same config and seed)")
                seen[h] = where
                tasks.append(RunTask(config=config, seed=seed, replication=spec.replication,
                                     scenario_path=entry.path, policy=label, run_hash=h))
    return tasks


# ---- one run (in a worker) -------------------------------------------------------------------------
def execute(task: RunTask) -> dict[str, Any]:
    """Run one task; picklable in and out (tables, summary, manifest). Never raises for a model failure."""
    from twin.runner import run_scenario

    scenario = parse_scenario(task.config, source=f"run {task.run_hash}")
    result = run_scenario(scenario, seed=task.seed, replication=task.replication)
    if not result.ok:
        return {"tables": {}, "summary": None, "manifest": result.manifest}
    return {"tables": dict(result.tables, replicas=replicas_table(result.world)), "summary": result.summary,
            "manifest": result.manifest}


def replicas_table(world: Any) -> pa.Table:
    """Every replica of the run (``scope, region, model, pool``), idle ones included: the tables only
    name replicas that did something, and the load spread needs the ones that did nothing too."""
    handles = getattr(world, "handles", None)
    if handles is None:  # the single-replica world
        rows = [{"scope": world.replica.scope, "region": None, "model": None, "pool": None}]
    else:
        rows = [{"scope": h.replica.scope, "region": h.region, "model": h.model, "pool": h.pool} for h in handles]
    schema = pa.schema([(c, pa.string()) for c in ("scope", "region", "model", "pool")])
    return pa.Table.from_pylist(rows, schema=schema)


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = re.sub(r"[^A-Za-z0-9_]+", "_", str(k))
            _flatten(f"{prefix}_{key}" if prefix else key, v, out)
    elif isinstance(obj, bool) or obj is None or isinstance(obj, (int, float, str)):
        out[prefix] = obj
    # lists are not flattened (none in summaries today)


def flatten_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """``{"ttft_s": {"p99": x}, "by_tier": {"free": {...}}}`` -> ``ttft_s_p99``, ``tier_free_ttft_s_p99``."""
    renamed = {{"by_tier": "tier", "by_class": "class", "outcomes_by_reason": "outcomes"}.get(k, k): v
               for k, v in summary.items()}
    out: dict[str, Any] = {}
    _flatten("", renamed, out)
    return {k: (float(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in out.items()}


def run_row(task: RunTask, summary: dict[str, Any]) -> pa.Table:
    """The one-row ``run.parquet``: labels first, then every flattened summary metric."""
    row: dict[str, Any] = {"run_hash": task.run_hash, "scenario": task.config.get("name"),
                           "scenario_path": task.scenario_path, "policy": task.policy,
                           "router": ((task.config.get("fleet") or {}).get("policy") or {}).get("router", {}).get("kind"),
                           "seed": task.seed, "replication": task.replication}
    row.update(flatten_summary(summary))
    return pa.Table.from_pylist([row])


def is_complete(run_dir: Path) -> bool:
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return manifest.get("exception") is None and (run_dir / RUN_TABLE).exists() and (run_dir / "summary.json").exists()


def write_run(run_dir: Path, task: RunTask, outcome: dict[str, Any]) -> bool:
    """Write a finished task's folder atomically; True when the run succeeded."""
    manifest = dict(outcome["manifest"], sweep={"scenario_path": task.scenario_path, "policy": task.policy,
                                                "run_hash": task.run_hash})
    if outcome["summary"] is None:
        write_outputs(run_dir, tables={}, files={"manifest.json": dumps(manifest)})
        return False
    tables = dict(outcome["tables"], run=run_row(task, outcome["summary"]))
    write_outputs(run_dir, tables=tables,
                  files={"manifest.json": dumps(manifest), "summary.json": dumps(outcome["summary"])})
    return True


def _relabel(run_dir: Path, task: RunTask) -> None:
    """A skipped run keeps its results; its row follows the spec's current labels."""
    row = pq.read_table(run_dir / RUN_TABLE).to_pylist()[0]
    if row.get("policy") != task.policy or row.get("scenario_path") != task.scenario_path:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        pq.write_table(run_row(task, summary), run_dir / RUN_TABLE)


# ---- the sweep -------------------------------------------------------------------------------------
INDEX = "index.json"


def _write_index(folder: Path, spec: SweepSpec, tasks: list[RunTask]) -> None:
    """``<folder>/index.json``: the spec and the run hashes it expands to now. The query layer reads only
    these runs, so folders left by an older spec or an older schema (other hashes) drop out of views."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"spec": spec.model_dump(mode="json"),
           "runs": [{"run_hash": t.run_hash, "scenario_path": t.scenario_path, "policy": t.policy, "seed": t.seed}
                    for t in tasks]}
    tmp = folder / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / INDEX)


@dataclass
class SweepReport:
    folder: Path
    total: int
    skipped: int
    ran: int
    failed: list[str]
    wall_s: float


class _InlineExecutor(Executor):
    """Runs each task in this process at submit time (``--workers 0``: debugging, monkeypatched tests)."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            fut.set_exception(exc)
        return fut


class _Progress:
    """tqdm when installed, else one rewritten stderr line."""

    def __init__(self, total: int, *, desc: str, enabled: bool) -> None:
        self.total, self.done, self.desc, self.enabled, self.t0 = total, 0, desc, enabled, time.perf_counter()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="run", file=sys.stderr)
            except ImportError:
                pass

    def update(self, note: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            el = time.perf_counter() - self.t0
            print(f"\r{self.desc}: {self.done}/{self.total} runs, {el:.0f} s {note}", end="", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def make_executor(*, workers: int | None, scheduler: str | None) -> tuple[Executor, Callable[[], None]]:
    """The executor and its closer: dask's ``Client.get_executor()`` for a scheduler address, else local
    processes (``workers`` of them; 0 = inline in this process)."""
    if scheduler:
        from distributed import Client

        client = Client(scheduler)
        ex = client.get_executor()
        return ex, lambda: (ex.shutdown(wait=True), client.close())
    if workers == 0:
        ex = _InlineExecutor()
        return ex, lambda: None
    pool = ProcessPoolExecutor(max_workers=workers)
    return pool, lambda: pool.shutdown(wait=True)


def run_sweep(spec: SweepSpec, *, tasks: Iterable[RunTask] | None = None, out: str | Path | None = None,
              workers: int | None = None, scheduler: str | None = None, executor: Executor | None = None,
              progress: bool = True, base: Path | None = None) -> SweepReport:
    """Run every task whose folder is not complete; return counts and failures."""
    t0 = time.perf_counter()
    folder = Path(out if out is not None else spec.out) / spec.name
    todo = list(tasks) if tasks is not None else expand(spec, base=base)
    runs = folder / "runs"
    pending: list[RunTask] = []
    for task in todo:
        if is_complete(runs / task.run_hash):
            _relabel(runs / task.run_hash, task)
        else:
            pending.append(task)
    _write_index(folder, spec, todo)
    failed: list[str] = []
    close: Callable[[], Any] = lambda: None  # noqa: E731
    if executor is None and pending:
        executor, close = make_executor(workers=workers, scheduler=scheduler)
    bar = _Progress(len(pending), desc=spec.name, enabled=progress and bool(pending))
    try:
        futures = {executor.submit(execute, t): t for t in pending} if pending else {}
        for fut in as_completed(futures):
            task = futures[fut]
            try:
                outcome = fut.result()
            except Exception as exc:  # noqa: BLE001 - a worker that died still leaves a manifest
                outcome = {"tables": {}, "summary": None,
                           "manifest": {"scenario": task.config.get("name"), "seed": task.seed,
                                        "replication": task.replication, "config": task.config,
                                        "exception": f"{type(exc).__name__}: {exc}"}}
            if not write_run(runs / task.run_hash, task, outcome):
                failed.append(f"{task.scenario_path} / {task.policy} / seed {task.seed}: "
                              f"{outcome['manifest'].get('exception')}")
            bar.update("(1 failed)" if failed else "")
    finally:
        bar.close()
        close()
    return SweepReport(folder=folder, total=len(todo), skipped=len(todo) - len(pending), ran=len(pending),
                       failed=failed, wall_s=time.perf_counter() - t0)
