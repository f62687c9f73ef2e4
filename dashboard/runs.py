"""Scenario runs for the dashboard: override lists for what-ifs, tiny runs, a local seeds × policies sweep.

Everything goes through the public API (``twin.scenario.load_scenario`` with ``a.b=value`` overrides, as
``twin run --set``; ``twin.runner.run_scenario``); results are the run's tables and summary only. No
Streamlit here, so the page code stays layout and this module is tested directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from twin.paths import REPO_ROOT
from twin.scenario import Scenario, ScenarioError, load_scenario

SCENARIO_DIR = REPO_ROOT / "scenarios"
# A what-if runs at this size unless the page says otherwise: a few replicas for tens of simulated
# seconds, so that a run takes seconds of wall time.
DEFAULT_SCALE = 0.002
DEFAULT_DURATION_S = 30.0


@dataclass(frozen=True)
class RunView:
    """What the dashboard keeps of a run: its result tables, summary and manifest."""

    label: str
    overrides: tuple[str, ...]
    seed: int
    tables: dict[str, pa.Table] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.manifest.get("exception") is None


def _flow(value: Any) -> str:
    """A YAML flow value for an ``a.b=value`` override, on one line however long."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2**31 - 1
                          ).strip().removesuffix("...").strip()


def fleet_scenarios(folder: Path = SCENARIO_DIR) -> dict[str, Path]:
    """name -> path of every scenario in ``folder`` that has a fleet section (others cannot be what-if'd)."""
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            sc = load_scenario(path)
        except ScenarioError:
            continue
        if sc.fleet is not None:
            out[path.stem] = path
    return out


def size_overrides(*, scale: float, duration_s: float) -> list[str]:
    """Shrink a fleet scenario: ``fleet.scale`` (nodes and users together) and the session window."""
    return [f"fleet.scale={scale:g}", f"fleet.traffic.duration_s={duration_s:g}"]


def whatif_overrides(scenario: Scenario, *, traffic_multiplier: float = 1.0, router: str | None = None,
                     clear_surges: bool = False, surge: dict[str, float] | None = None,
                     keep_faults: bool = True, region_loss: dict[str, Any] | None = None,
                     dns_failover_s: float | None = None, ladder_enabled: bool | None = None,
                     ladder: dict[str, str] | None = None, engine: dict[str, Any] | None = None) -> list[str]:
    """The overrides of a what-if on ``scenario`` (already sized): offered load × ``traffic_multiplier``
    (daily users; the fleet stays), a router ``kind``, surges cleared and/or one added
    (``{start_s, ramp_s, hold_s, multiplier}``), faults kept or cleared plus an optional region loss
    (``{region, at_s, recover_at_s}``), the DNS failover delay, the degradation ladder (see
    ``ladder_override``), and engine settings for every served model (``engine_overrides``)."""
    fleet = scenario.fleet
    if fleet is None:
        raise ScenarioError(f"{scenario.name}: a what-if needs a fleet scenario")
    out: list[str] = []
    if traffic_multiplier != 1.0:
        out.append(f"fleet.traffic.daily_users={max(1, round(fleet.traffic.daily_users * traffic_multiplier))}")
    if router:
        out.append(f"fleet.policy.router={_flow({'kind': router})}")
    surges = [] if clear_surges else [s.model_dump(mode="json", exclude_none=True) for s in fleet.traffic.surges]
    if surge is not None:
        surges.append(dict(surge))
    if clear_surges or surge is not None:
        out.append(f"fleet.traffic.surges={_flow(surges)}")
    faults = [f.model_dump(mode="json", exclude_none=True) for f in fleet.faults] if keep_faults else []
    if region_loss is not None:
        faults = [f for f in faults if f["kind"] != "region_loss"] + [
            {"kind": "region_loss", **{k: v for k, v in region_loss.items() if v is not None}}]
    if not keep_faults or region_loss is not None:
        out.append(f"fleet.faults={_flow(faults)}")
    if dns_failover_s is not None:
        out.append(f"fleet.failover.dns_failover_s={dns_failover_s:g}")
    out += ladder_override(scenario, enabled=ladder_enabled, flags=ladder)
    out += engine_overrides(scenario, engine or {})
    return out


ENGINE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "async_scheduling")


def engine_overrides(scenario: Scenario, settings: dict[str, Any]) -> list[str]:
    """``fleet.models.<m>.engine.<knob>=<value>`` for every served model ``m`` and every knob in ``settings`` (one of
    ``ENGINE_KNOBS``) whose value differs from that model's; None leaves a knob as the scenario has it. Raises
    ScenarioError on an unknown knob."""
    unknown = sorted(set(settings) - set(ENGINE_KNOBS))
    if unknown:
        raise ScenarioError(f"unknown engine knobs {unknown} (known: {', '.join(ENGINE_KNOBS)})")
    out = []
    for name, model in scenario.fleet.models.items():
        for knob in ENGINE_KNOBS:
            value = settings.get(knob)
            if value is not None and value != getattr(model.engine, knob):
                text = str(value).lower() if isinstance(value, bool) else str(value)
                out.append(f"fleet.models.{name}.engine.{knob}={text}")
    return out


LADDER_MODES = ("auto", "on", "off")


def ladder_rungs() -> tuple[str, ...]:
    """The degradation ladder's rungs in climbing order (``twin.policies.ladder.RUNGS``); () when this
    twin has no ladder (``fleet.ladder`` is not in the scenario schema)."""
    from twin.fleet_config import FleetSection

    if "ladder" not in FleetSection.model_fields:
        return ()
    from twin.policies.ladder import RUNGS

    return tuple(RUNGS)


def ladder_override(scenario: Scenario, *, enabled: bool | None = None, flags: dict[str, str] | None = None) -> list[str]:
    """The ``fleet.ladder`` override for a what-if: ``enabled`` False removes the ladder (``null``); True adds
    a default threshold ladder where the scenario has none; ``flags`` (``{rung: on|off}``; ``auto`` entries
    are ignored) force rungs from t=0 through the ladder's on-call overrides (threshold ladder) or its
    ``on`` list (static ladder). Returns [] when nothing changes."""
    fleet = scenario.fleet
    flags = {r: m for r, m in (flags or {}).items() if m != "auto"}
    unknown = {r: m for r, m in flags.items() if r not in ladder_rungs() or m not in LADDER_MODES}
    if unknown:
        raise ScenarioError(f"unknown ladder rungs or modes: {unknown} (rungs {ladder_rungs()}, modes {LADDER_MODES})")
    if enabled is False:
        return ["fleet.ladder=null"] if getattr(fleet, "ladder", None) is not None else []
    current = getattr(fleet, "ladder", None)
    if current is None and not enabled and not flags:
        return []
    section = current.model_dump(mode="json", exclude_none=True) if current is not None else {
        "policy": {"kind": "threshold_ladder"}}
    policy = section["policy"]
    if policy["kind"] == "static":
        on = [r for r in policy.get("on", []) if flags.get(r) != "off"]
        policy["on"] = [r for r in ladder_rungs() if r in on or flags.get(r) == "on"]
    else:
        policy["overrides"] = [*policy.get("overrides", []),
                               *({"rung": r, "at_s": 0.0, "state": m} for r, m in flags.items())]
    if current is not None and not flags:
        return []
    return [f"fleet.ladder={_flow(section)}"]


def run(path: str | Path, overrides: Sequence[str], *, seed: int, label: str = "") -> RunView:
    """Run a scenario file with overrides; a failed run comes back with its manifest (``ok`` False)."""
    from twin.runner import run_scenario

    sc = load_scenario(path, overrides=list(overrides))
    res = run_scenario(sc, seed=seed)
    return RunView(label=label or sc.name, overrides=tuple(overrides), seed=seed, tables=dict(res.tables),
                   summary=dict(res.summary), manifest=dict(res.manifest))


# ------------------------------------------------------------------------------------ policy sweeps

class _ReportingExecutor(Executor):
    """Runs each sweep task in this process as it is submitted and reports it; ``twin.sweep`` writes the
    run folders and the index as usual."""

    def __init__(self, total: int, progress: Callable[[int, int, str], None] | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as an executor does
            fut.set_exception(exc)
        self.done += 1
        if self.progress is not None:
            task = args[0] if args else None
            self.progress(self.done, self.total, f"{getattr(task, 'policy', '?')} seed {getattr(task, 'seed', '?')}")
        return fut


def policy_sweep(path: str | Path, *, routers: Sequence[str], seeds: Sequence[int], overrides: Sequence[str],
                 out: str | Path, name: str, progress: Callable[[int, int, str], None] | None = None) -> Path:
    """``twin sweep`` of one scenario × ``routers`` × ``seeds`` (same overrides otherwise, so every router
    sees the same arrivals for a seed), run in this process; ``progress(done, total, label)`` is called as
    each run finishes. Runs land in ``out/name/runs/<hash>/`` (docs/sweeps.md); runs already complete
    there are not run again (and not counted in ``total``). Returns the sweep folder."""
    from twin.sweep import SweepSpec, expand, is_complete, run_sweep

    spec = SweepSpec(name=name, scenarios=[str(path)], policies={r: {"kind": r} for r in routers},
                     seeds=list(seeds), overrides=list(overrides), out=str(out))
    folder = Path(out) / name
    tasks = expand(spec)
    pending = sum(not is_complete(folder / "runs" / t.run_hash) for t in tasks)
    run_sweep(spec, tasks=tasks, executor=_ReportingExecutor(pending, progress), progress=False)
    return folder


# run.parquet column (a flattened summary, twin.sweep.flatten_summary) -> metric name, besides those of
# twin.results_db's run_metrics view
EXTRA_RUN_COLUMNS = {"slo_attainment": "slo_attainment", "fleet_usd_per_m_output_tokens": "usd_per_m_output_tokens"}


def sweep_rows(folder: str | Path) -> list[dict[str, Any]]:
    """One row per complete run of a ``twin sweep`` folder: labels (scenario, policy, seed, run_hash) and
    the metrics of ``twin.results_db``'s ``run_metrics`` view, plus SLO attainment and $ per M output
    tokens. Needs duckdb; FileNotFoundError when the folder holds no complete run."""
    from twin import results_db

    con = results_db.connect(folder)
    rows = {r["run_hash"]: dict(r) for r in results_db.per_run(con)}
    have = {r[0] for r in con.execute("DESCRIBE runs").fetchall()}
    cols = [c for c in EXTRA_RUN_COLUMNS if c in have]
    if cols:
        for run_hash, *values in con.execute(f"SELECT run_hash, {', '.join(cols)} FROM runs").fetchall():
            if run_hash in rows:
                rows[run_hash].update({EXTRA_RUN_COLUMNS[c]: v for c, v in zip(cols, values)})
    return list(rows.values())
