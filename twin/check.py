"""The CI policy gate: a fixed suite of small fleet scenarios x every router x a few seeds, compared with
committed baselines (seed-to-seed mean, std and n per scenario x policy x metric).

Rule, per metric (direction: TTFT, ITL and load spread lower is better; goodput and prefix-cache hit rate
higher is better): with baseline mean m_b and current mean m_c over the same seeds,

    worse = m_c - m_b (or m_b - m_c when higher is better)
    regressed  <=>  worse > max(k * se, floor[metric])

where ``se`` is the paired standard error std_i(c_i - b_i) / sqrt(n) over the seeds i, since baseline and
current runs of one seed share their random numbers (STYLE 3); when the seeds differ it is Welch's
sqrt(s_b^2 / n_b + s_c^2 / n_c). ``k`` and the absolute ``floor`` per metric are in the suite file.
Same code and suite give identical runs, so an unchanged tree shows shifts of exactly zero; a change
that only reshuffles the random numbers breaks the pairing and the paired se grows to about Welch's.
A metric that becomes undefined (NaN) where it was defined, or the reverse, regresses.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from twin.results_db import METRICS, connect, format_table, per_run, summarize_runs
from twin.sweep import Label, PolicyEntry, ScenarioEntry, SweepSpec, _Model, expand, run_sweep


class Tolerance(_Model):
    k: Annotated[float, Field(gt=0)] = 4.0
    floor: dict[str, Annotated[float, Field(ge=0)]] = {}


class CheckSuite(_Model):
    name: Label = "check"
    scenarios: list[str | ScenarioEntry] = Field(min_length=1)
    routers: Literal["all"] | list[str] = "all"  # registry keys, each run with its default params
    exclude: list[str] = []
    policies: dict[Label, PolicyEntry] = {}  # extra labelled router configs (e.g. non-default params)
    seeds: list[Annotated[int, Field(ge=0)]] | Annotated[int, Field(gt=0)] = 3
    overrides: list[str] = []
    tolerance: Tolerance = Tolerance()

    def sweep_spec(self) -> SweepSpec:
        from twin.policies import ROUTERS

        keys = ROUTERS.keys() if self.routers == "all" else list(self.routers)
        policies = {k: {"kind": k} for k in keys if k not in self.exclude}
        policies.update({k: v.model_dump() for k, v in self.policies.items()})
        return SweepSpec.model_validate({"name": self.name, "scenarios": [s if isinstance(s, str) else s.model_dump()
                                                                          for s in self.scenarios],
                                         "policies": policies, "seeds": self.seeds, "overrides": self.overrides})


@dataclass(frozen=True)
class Comparison:
    scenario: str
    policy: str
    metric: str
    base: dict[str, float] | None
    cur: dict[str, float]
    tolerance: float
    worse_by: float
    status: str  # ok | improved | regressed | new


def _f(x: Any) -> float:
    return math.nan if x is None else float(x)


def compare_metric(base: dict[str, Any], cur: dict[str, Any], *, higher_better: bool, k: float,
                   floor: float) -> tuple[str, float, float]:
    """(status, worse_by, tolerance) for one metric; see the module docstring. ``base`` and ``cur`` hold
    mean, std, n and optionally ``seeds`` and ``values`` (per seed): with the same seeds on both sides the
    standard error is the paired one."""
    mb, mc = _f(base["mean"]), _f(cur["mean"])
    if math.isnan(mb) or math.isnan(mc):
        return ("ok" if math.isnan(mb) and math.isnan(mc) else "regressed"), math.nan, math.nan
    se = _paired_se(base, cur)
    if se is None:
        sb, sc = _f(base["std"]), _f(cur["std"])
        se = math.sqrt((0.0 if math.isnan(sb) else sb * sb / base["n"]) +
                       (0.0 if math.isnan(sc) else sc * sc / cur["n"]))
    tol = max(k * se, floor)
    worse = (mb - mc) if higher_better else (mc - mb)
    if worse > tol:
        return "regressed", worse, tol
    return ("improved" if -worse > tol else "ok"), worse, tol


def _paired_se(base: dict[str, Any], cur: dict[str, Any]) -> float | None:
    """std(current - baseline per seed) / sqrt(n) when both sides ran the same seeds, else None."""
    bs, cs = base.get("seeds"), cur.get("seeds")
    bv, cv = base.get("values"), cur.get("values")
    if not bs or bs != cs or bv is None or cv is None or len(bv) != len(bs) or len(cv) != len(cs):
        return None
    d = [_f(c) - _f(b) for b, c in zip(bv, cv)]
    if any(math.isnan(x) for x in d):
        return None
    n = len(d)
    if n < 2:
        return 0.0
    m = math.fsum(d) / n
    return math.sqrt(math.fsum((x - m) ** 2 for x in d) / (n - 1) / n)


def baseline_path(folder: Path, scenario: str, policy: str) -> Path:
    return folder / f"{scenario}__{policy}.json"


def config_sha(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def measure(suite: CheckSuite, *, base: Path | None, workers: int | None, work_dir: Path | None,
            progress: bool) -> list[dict[str, Any]]:
    """Run the suite (into ``work_dir`` or a temporary folder) and summarise it per scenario x policy."""
    spec = suite.sweep_spec()
    tasks = expand(spec, base=base)
    shas = {(t.config["name"], t.policy): config_sha(t.config) for t in tasks}
    tmp = None
    if work_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="twin-check-"))
    try:
        report = run_sweep(spec, tasks=tasks, out=work_dir or tmp, workers=workers, progress=progress)
        if report.failed:
            raise RuntimeError("runs failed:\n" + "\n".join(report.failed))
        con = connect(report.folder)
        rows = per_run(con)
        con.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize_runs(rows)
    for entry in summary:
        entry["seeds"] = sorted(r["seed"] for r in rows if (r["scenario"], r["policy"]) == (entry["scenario"],
                                                                                             entry["policy"]))
        entry["values"] = {m: [r[m] for r in sorted(rows, key=lambda r: r["seed"])
                               if (r["scenario"], r["policy"]) == (entry["scenario"], entry["policy"])]
                           for m in METRICS}
        entry["config_sha"] = shas[(entry["scenario"], entry["policy"])]
    return summary


def write_baselines(folder: Path, summary: list[dict[str, Any]], suite: CheckSuite) -> list[Path]:
    """Rewrite ``folder`` with one JSON per scenario x policy (old files of this suite's form removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*__*.json"):
        old.unlink()
    written = []
    for e in summary:
        doc = {"scenario": e["scenario"], "policy": e["policy"], "seeds": e["seeds"], "config_sha": e["config_sha"],
               "tolerance": suite.tolerance.model_dump(),
               "metrics": {m: {"mean": e[m]["mean"], "std": e[m]["std"], "n": e["n"], "values": e["values"][m]}
                           for m in METRICS}}
        p = baseline_path(folder, e["scenario"], e["policy"])
        p.write_text(json.dumps(_clean(doc), indent=2) + "\n", encoding="utf-8")
        written.append(p)
    return written


def _clean(x: Any) -> Any:
    """JSON-ready: NaN as null; floats to 12 significant digits, so that rewriting unchanged baselines
    leaves the files unchanged (DuckDB's parallel sums may differ in the last bit)."""
    if isinstance(x, float):
        return float(f"{x:.12g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def compare(summary: list[dict[str, Any]], folder: Path, tol: Tolerance) -> tuple[list[Comparison], list[str]]:
    """Every metric of every scenario x policy against its baseline; notes on stale or missing baselines."""
    out: list[Comparison] = []
    notes: list[str] = []
    stale: list[str] = []
    for e in summary:
        path = baseline_path(folder, e["scenario"], e["policy"])
        doc = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        if doc is None:
            notes.append(f"{e['scenario']} / {e['policy']}: no baseline (new policy or scenario; run --update)")
        elif doc.get("config_sha") != e["config_sha"]:
            stale.append(f"{e['scenario']} / {e['policy']}")
        for m, (_, higher_better) in METRICS.items():
            cur = {"mean": e[m]["mean"], "std": e[m]["std"], "n": e["n"]}
            if doc is None:
                out.append(Comparison(e["scenario"], e["policy"], m, None, cur, math.nan, math.nan, "new"))
                continue
            base = dict(doc["metrics"][m], seeds=doc.get("seeds"))
            cur.update(seeds=e["seeds"], values=e["values"][m])
            status, worse, t = compare_metric(base, cur, higher_better=higher_better, k=tol.k,
                                              floor=tol.floor.get(m, 0.0))
            out.append(Comparison(e["scenario"], e["policy"], m, base, cur, t, worse, status))
    if stale:
        notes.append(f"{len(stale)} of {len(summary)} baselines were made from a different effective config (a "
                     f"scenario, suite or schema change since the last --update; new fields with defaults count): "
                     + (", ".join(stale) if len(stale) <= 4 else ", ".join(stale[:4]) + ", ..."))
    return out, notes


def _num(x: Any) -> str:
    x = _f(x)
    return "nan" if math.isnan(x) else f"{x:.4g}"


def _row(c: Comparison) -> list[str]:
    b = f"{_num(c.base['mean'])} ± {_num(c.base['std'])}" if c.base else "-"
    return [c.scenario, c.policy, c.metric, b, f"{_num(c.cur['mean'])} ± {_num(c.cur['std'])}",
            _num(c.worse_by), _num(c.tolerance), c.status]


HEAD = ["scenario", "policy", "metric", "baseline mean ± std", "current mean ± std", "worse by", "tolerance",
        "status"]


def format_text(results: list[Comparison], notes: list[str]) -> str:
    """One line per scenario x policy (its regressed metrics named), then the regressed rows in full."""
    groups: dict[tuple[str, str], list[Comparison]] = {}
    for c in results:
        groups.setdefault((c.scenario, c.policy), []).append(c)
    body = []
    for (s, p), cs in groups.items():
        bad = [c.metric for c in cs if c.status == "regressed"]
        better = [c.metric for c in cs if c.status == "improved"]
        status = "REGRESSED" if bad else ("new" if any(c.status == "new" for c in cs) else "ok")
        body.append([s, p, status, ", ".join(bad) or "-", ", ".join(better) or "-"])
    text = format_table(["scenario", "policy", "status", "regressed", "improved"], body)
    bad_rows = [_row(c) for c in results if c.status == "regressed"]
    if bad_rows:
        text += "\n\nregressed metrics:\n" + format_table(HEAD, bad_rows)
    if notes:
        text += "\n\n" + "\n".join(f"note: {n}" for n in notes)
    return text


def format_markdown(results: list[Comparison], notes: list[str], tol: Tolerance) -> str:
    bad = [c for c in results if c.status == "regressed"]
    pairs = {(c.scenario, c.policy) for c in results}
    title = (f"## twin check: FAILED — {len(bad)} regressed metric{'s' if len(bad) != 1 else ''}" if bad
             else f"## twin check: passed ({len(pairs)} scenario × policy pairs, {len(results)} metrics)")
    md = [title, "",
          f"Rule: regressed when the mean over the seeds moves the wrong way by more than max(k × standard error "
          f"of the per-seed differences, floor); "
          f"k = {tol.k}, floors: " + (", ".join(f"{m} {v}" for m, v in sorted(tol.floor.items())) or "none") + ".",
          ""]

    def table(rows: list[Comparison]) -> list[str]:
        lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        lines += ["| " + " | ".join(f"**{v}**" if v == "regressed" else v for v in _row(c)) + " |" for c in rows]
        return lines

    if bad:
        md += ["### Regressed", "", *table(bad), ""]
    if notes:
        md += ["### Notes", "", *(f"- {n}" for n in notes), ""]
    md += ["<details><summary>All comparisons</summary>", "", *table(results), "", "</details>", ""]
    return "\n".join(md)
