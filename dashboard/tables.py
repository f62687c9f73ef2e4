"""Small tables the dashboard draws: from capacity results, run summaries, drill reports and sweep rows.

Pure functions (no Streamlit, no clock, no files): the figures in ``dashboard.figures`` take these tables,
and ``tests/test_dashboard_figures.py`` checks both without a browser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from twin.capacity import CapacityInputs, CapacityResult, ProfileLike, compute_capacity

# The five inputs a named engine profile fills (docs/capacity.md): a preset's own numbers for them are
# dropped when the planner picks a profile, so the profile is the single source.
PROFILE_FIELDS = ("kv_bytes_per_token", "weight_bytes", "gpu_memory_bytes", "tp", "gpus_per_node")


def planner_inputs(base: CapacityInputs, *, profile: str | None = None, **changes: Any) -> CapacityInputs:
    """``base`` with the planner's changes; with ``profile``, its memory facts replace the preset's."""
    data = base.model_dump(exclude_unset=True)
    if profile:
        for field in PROFILE_FIELDS:
            data.pop(field, None)
        data["profile"] = profile
    data.update(changes)
    return CapacityInputs.model_validate(data)


def fleet_size_table(result: CapacityResult) -> pd.DataFrame:
    """Replicas at each step of the estimate (rows whose figure the inputs leave undetermined are dropped)."""
    rows = [
        ("at saturation", result.replicas_at_saturation),
        ("at planning utilisation", result.replicas),
        ("by concurrency (cross-check)", result.replicas_by_concurrency),
        ("with prefill time", result.replicas_with_prefill),
        ("with failover reserve", result.replicas_with_reserve),
    ]
    return pd.DataFrame([{"step": s, "replicas": int(v)} for s, v in rows if v is not None],
                        columns=["step", "replicas"])


def streams_table(result: CapacityResult) -> pd.DataFrame:
    """Streams one replica holds: by KV memory, by the latency target, and the smaller of the two."""
    rows = [("by KV memory", "memory", result.streams_per_replica_by_memory),
            ("by latency target", "latency", result.streams_per_replica_by_latency)]
    return pd.DataFrame([{"limit": s, "streams": int(v), "binding": c == result.binding_constraint}
                         for s, c, v in rows if v is not None], columns=["limit", "streams", "binding"])


def prefix_hit_table(inputs: CapacityInputs, *, profile: ProfileLike | None = None,
                     hits: Sequence[float] | None = None) -> pd.DataFrame:
    """The capacity model re-run at each prefix-cache hit fraction (all other inputs unchanged).

    Columns: ``hit``, ``replicas_with_prefill`` (prefill time-shares a replica with decode; null when the
    inputs give no prefill capacity), ``replicas_decode_only`` (the notes' sizing at the planning
    utilisation, flat in the hit rate; neither includes the failover reserve), ``prefill_share`` and
    ``fleet_fraction_saved_per_10pt``.
    """
    grid = [round(float(h), 4) for h in (hits if hits is not None else np.arange(0.0, 0.951, 0.05))]
    data = inputs.model_dump(exclude_unset=True)
    rows = []
    for h in grid:
        r = compute_capacity(CapacityInputs.model_validate({**data, "prefix_cache_hit_fraction": h}), profile=profile)
        rows.append({"hit": h, "replicas_with_prefill": r.replicas_with_prefill,
                     "replicas_decode_only": r.replicas,
                     "prefill_share": r.prefill_share_of_replica_time,
                     "fleet_fraction_saved_per_10pt": r.fleet_fraction_saved_per_10pt_prefix_hit})
    return pd.DataFrame(rows, columns=["hit", "replicas_with_prefill", "replicas_decode_only", "prefill_share",
                                       "fleet_fraction_saved_per_10pt"])


# ---------------------------------------------------------------------------------------- run summaries

# label -> (path into the run summary, True when higher is better)
SUMMARY_METRICS: dict[str, tuple[tuple[str, ...], bool]] = {
    "arrived": (("requests", "arrived"), True),
    "completed": (("requests", "completed"), True),
    "rejected": (("requests", "rejected"), False),
    "abandoned": (("requests", "abandoned"), False),
    "failed": (("requests", "failed"), False),
    "TTFT p50 (s)": (("ttft_s", "p50"), False),
    "TTFT p99 (s)": (("ttft_s", "p99"), False),
    "ITL p50 (s)": (("itl_s", "p50"), False),
    "ITL p99 (s)": (("itl_s", "p99"), False),
    "goodput (req/s)": (("goodput_rps",), True),
    "SLO attainment": (("slo_attainment",), True),
    "prefix-cache hit rate": (("prefix_cache_hit_rate",), True),
    "KV usage (time-weighted mean)": (("kv_usage_mean",), False),
    "GPU-hours": (("fleet", "gpu_hours"), False),
    "$ per M output tokens": (("fleet", "usd_per_m_output_tokens"), False),
}


def summary_value(summary: dict, path: Iterable[str]) -> float | None:
    """A number from a nested summary dict, or None where the run has none (or a NaN)."""
    node: Any = summary
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if node is None or isinstance(node, bool) or not isinstance(node, (int, float)):
        return None
    return None if isinstance(node, float) and math.isnan(node) else float(node)


def summary_comparison(summary: dict, baseline: dict) -> pd.DataFrame:
    """Key summary figures of a run next to its baseline; ``change`` = run / baseline − 1 (null if undefined)."""
    rows = []
    for label, (path, higher_better) in SUMMARY_METRICS.items():
        a, b = summary_value(summary, path), summary_value(baseline, path)
        change = None if a is None or b is None or b == 0 else a / b - 1.0
        rows.append({"metric": label, "baseline": b, "what_if": a, "change": change,
                     "higher_is_better": higher_better})
    return pd.DataFrame(rows, columns=["metric", "baseline", "what_if", "change", "higher_is_better"])


# ---------------------------------------------------------------------------------------- drill reports

def timeline_table(report: dict) -> pd.DataFrame:
    """The drill's timeline (``twin.drill.drill_report``) as rows: time, kind, scope and a readable detail."""
    rows = []
    for it in report.get("timeline", []):
        kind = it["kind"]
        if kind == "replica.crashed":
            detail = f"{it.get('count', 1)} replicas, {int(it.get('value') or 0)} live streams dropped"
        elif kind == "replica.recovered":
            detail = f"{it.get('count', 1)} replicas back"
        else:
            detail = str(it.get("reason") or "")
        rows.append({"t_s": float(it["t_s"]), "kind": kind, "scope": it.get("scope") or "", "detail": detail})
    return pd.DataFrame(rows, columns=["t_s", "kind", "scope", "detail"])


def phases_table(report: dict) -> pd.DataFrame:
    """One row per drill phase: turns, completed, not completed, TTFT and TPOT p50/p99, homed and moved."""
    rows = []
    for p in report.get("phases", []):
        rows.append({"phase": p["phase"], "from_s": p["from_s"], "to_s": p["to_s"], "turns": p["turns"],
                     "completed": p["completed"], "not_completed": sum(p["not_completed"].values()),
                     "ttft_p50_s": p["ttft_s"].get("p50"), "ttft_p99_s": p["ttft_s"].get("p99"),
                     "tpot_p50_s": p["tpot_s"].get("p50"), "tpot_p99_s": p["tpot_s"].get("p99"),
                     "homed_in_region": p["turns_homed_in_region"], "served_elsewhere": p["served_elsewhere"]})
    return pd.DataFrame(rows, columns=["phase", "from_s", "to_s", "turns", "completed", "not_completed", "ttft_p50_s",
                                       "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "homed_in_region",
                                       "served_elsewhere"])


# ------------------------------------------------------------------------------------------- sweeps

# columns of a sweep row that label a run rather than measure it
LABEL_COLUMNS = ("scenario", "policy", "seed", "run_hash", "replication", "router", "replicas")

# two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci95(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, half-width of the 95% Student-t interval, n) of the finite values; NaN where undefined."""
    v = np.array([float(x) for x in values if x is not None and math.isfinite(float(x))], dtype=float)
    n = int(v.size)
    if n == 0:
        return math.nan, math.nan, 0
    if n == 1:
        return float(v[0]), math.nan, 1
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96 + 2.4 / (n - 1)
    return float(v.mean()), float(t * v.std(ddof=1) / math.sqrt(n)), n


def ci_table(rows: Iterable[dict[str, Any]], metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Per scenario × policy × metric: mean, 95% CI half-width and n across the rows (one row per seed)."""
    df = pd.DataFrame(list(rows))
    cols = ["scenario", "policy", "metric", "mean", "ci95", "n"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    names = [m for m in (metrics or [c for c in df.columns if c not in LABEL_COLUMNS]) if m in df.columns]
    out = []
    for (scenario, policy), g in df.groupby(["scenario", "policy"], sort=True):
        for m in names:
            mean, hw, n = mean_ci95(g[m].tolist())
            out.append({"scenario": scenario, "policy": policy, "metric": m, "mean": mean, "ci95": hw, "n": n})
    return pd.DataFrame(out, columns=cols)
