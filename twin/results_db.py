"""A sweep folder as a DuckDB database: views over its runs' Parquet files, and the summary across seeds.

``connect(dir)`` returns an in-memory DuckDB connection with these views over the complete runs in
``<dir>/runs/<hash>/`` that ``<dir>/index.json`` lists (the last sweep's runs; a folder left by an older
spec or schema is not read). A run whose manifest records an exception has no tables and is left out:

- ``runs``: every ``run.parquet`` row (scenario, policy, seed, run_hash, flattened summary metrics);
- ``requests``, ``events``, ``levels``: the runs' tables with a ``run_hash`` column added;
- ``replicas``: every replica of each run (``scope, region, model, pool``), idle ones included;
- ``replica_load``: ``replicas`` with ``routed_requests``, the requests that ended there
  (``requests.scope``; requests rejected before routing have an empty scope), 0 for an idle replica;
- ``run_metrics``: per run, the labels and the metrics the summary and the check gate compare,
  including ``load_spread_cv``: the coefficient of variation (population std / mean) of
  ``routed_requests`` over the replicas of the pools (region, model, pool) that served any request.
  A pool that served nothing (a standby tier, say) is left out; an idle replica in a busy pool counts 0.
  ``replicas`` is the number of replicas it was computed over.

Schemas may differ between runs (a tier seen in one run only); views read with ``union_by_name``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TABLES = ("requests", "events", "levels", "replicas")

# metric column -> (run.parquet expression, True when higher is better)
METRICS: dict[str, tuple[str, bool]] = {
    "ttft_p50_s": ("ttft_s_p50", False),
    "ttft_p99_s": ("ttft_s_p99", False),
    "itl_p99_s": ("itl_s_p99", False),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", True),
    "goodput_rps": ("goodput_rps", True),
    "load_spread_cv": ("load_spread_cv", False),
}


def complete_runs(folder: Path) -> list[Path]:
    """Run folders under ``folder/runs`` whose manifest has no exception, sorted by hash; only those listed
    in ``folder/index.json`` (the spec's current runs, written by every sweep) when it exists."""
    index = folder / "index.json"
    wanted = None
    if index.exists():
        wanted = {r["run_hash"] for r in json.loads(index.read_text(encoding="utf-8"))["runs"]}
    out = []
    for d in sorted((folder / "runs").glob("*")):
        if d.name.startswith(".") or not (d / "run.parquet").exists() or (wanted is not None and d.name not in wanted):
            continue
        try:
            if json.loads((d / "manifest.json").read_text(encoding="utf-8")).get("exception") is None:
                out.append(d)
        except (OSError, ValueError):
            continue
    return out


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def connect(folder: str | Path):
    """An in-memory DuckDB connection with the sweep folder's views (see the module docstring)."""
    import duckdb

    folder = Path(folder)
    runs = complete_runs(folder)
    if not runs:
        raise FileNotFoundError(f"{folder}: no complete runs under {folder / 'runs'}")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW runs AS SELECT * FROM read_parquet({_sql_list([d / 'run.parquet' for d in runs])}, "
                "union_by_name=true)")
    for name in TABLES:
        files = [d / f"{name}.parquet" for d in runs if (d / f"{name}.parquet").exists()]
        if files:
            con.execute(f"CREATE VIEW {name} AS SELECT * EXCLUDE (filename), "
                        "regexp_extract(filename, '([^/\\\\]+)[/\\\\][^/\\\\]+$', 1) AS run_hash "
                        f"FROM read_parquet({_sql_list(files)}, filename=true, union_by_name=true)")
    if not all((d / "replicas.parquet").exists() for d in runs):
        return con  # folders from before replicas.parquet: no replica_load / run_metrics (per_run says so)
    con.execute("""
        CREATE VIEW replica_load AS
        WITH routed AS (SELECT run_hash, scope, count(*) AS n FROM requests
                        WHERE scope IS NOT NULL AND scope <> '' GROUP BY run_hash, scope)
        SELECT p.run_hash, p.scope, p.region, p.model, p.pool, coalesce(routed.n, 0) AS routed_requests
        FROM replicas p LEFT JOIN routed ON p.run_hash = routed.run_hash AND p.scope = routed.scope
    """)
    cols = ", ".join(f"r.{src} AS {name}" for name, (src, _) in METRICS.items() if name != "load_spread_cv")
    con.execute(f"""
        CREATE VIEW run_metrics AS
        WITH busy AS (SELECT l.* FROM replica_load l
                      QUALIFY sum(routed_requests) OVER (PARTITION BY run_hash, region, model, pool) > 0),
             spread AS (SELECT run_hash, count(*) AS replicas,
                               stddev_pop(routed_requests) / avg(routed_requests) AS load_spread_cv
                        FROM busy GROUP BY run_hash)
        SELECT r.scenario, r.policy, r.seed, r.run_hash, {cols}, s.replicas, s.load_spread_cv
        FROM runs r LEFT JOIN spread s ON r.run_hash = s.run_hash
    """)
    return con


# two-sided 95% Student t quantiles t_{0.975, df}
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(df: int) -> float:
    """t_{0.975} for ``df`` degrees of freedom (table to 30, then 1.96 + 2.4/df, within 0.003 of exact)."""
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def mean_ci(values: list[float]) -> tuple[float, float, float, int]:
    """(mean, 95% CI half-width, sample std, n) of the finite values; NaN where undefined."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    m = math.fsum(v) / n
    if n == 1:
        return m, math.nan, math.nan, 1
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in v) / (n - 1))
    return m, t975(n - 1) * sd / math.sqrt(n), sd, n


def per_run(con) -> list[dict[str, Any]]:
    """Every complete run's labels and compared metrics, ordered by scenario, policy, seed."""
    names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "run_metrics" not in names:
        raise FileNotFoundError("a run has no replicas.parquet (twin sweep writes it): rerun the sweep into a "
                                "fresh folder for the load spread")
    cur = con.execute("SELECT * FROM run_metrics ORDER BY scenario, policy, seed")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def summarize_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario x policy: n and (mean, CI half-width, std) of each metric across seeds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["policy"]), []).append(r)
    out = []
    for (scenario, policy), rs in sorted(groups.items()):
        entry: dict[str, Any] = {"scenario": scenario, "policy": policy, "n": len(rs)}
        for name in METRICS:
            m, hw, sd, _ = mean_ci([r[name] for r in rs])
            entry[name] = {"mean": m, "ci95": hw, "std": sd}
        out.append(entry)
    return out


def _fmt(x: float, digits: int) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def format_summary(summary: list[dict[str, Any]]) -> str:
    """A plain-text table: mean ± 95% CI half-width per metric."""
    digits = {"ttft_p50_s": 4, "ttft_p99_s": 4, "itl_p99_s": 5, "prefix_cache_hit_rate": 3, "goodput_rps": 3,
              "load_spread_cv": 3}
    head = ["scenario", "policy", "n", *METRICS]
    body = [[e["scenario"], e["policy"], str(e["n"]),
             *(f"{_fmt(e[k]['mean'], digits[k])} ± {_fmt(e[k]['ci95'], digits[k])}" for k in METRICS)]
            for e in summary]
    return format_table(head, body)


def format_table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])
