"""Chart functions: result tables in, plotly figures out (the report and the dashboard share them).

Pure functions of a run's tables (``requests``, ``levels``; see docs/metrics.md) or its summary dict; they
never look inside ``twin.models``. Each accepts a ``pyarrow.Table`` or a ``pandas.DataFrame``, works for
fleet runs and single-replica runs (no ``tier``/``klass`` columns, no ``queue`` scope), and returns a
figure with an explanatory annotation and no data traces when there is nothing to draw.

Percentiles per window are the inverse-CDF quantiles of ``twin.metrics`` (the same formula as the
summary). A level series is a step function written on change: its value at time t is its last sample at
or before t, and 0 before its first sample (every replica and queue starts empty).

Needs plotly (``pip install 'twin[report]'``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pyarrow as pa

from twin.metrics import weighted_quantiles

OUTCOMES = ("completed", "rejected", "cancelled", "abandoned", "failed", "unfinished")
OUTCOME_COLORS = {"completed": "#2ca02c", "rejected": "#d62728", "cancelled": "#ff7f0e",
                  "abandoned": "#9467bd", "failed": "#8c564b", "unfinished": "#7f7f7f"}
REPLICA_METRICS = ("running", "waiting", "kv_usage")
NICE_WINDOWS_S = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400)
MAX_LEVEL_POINTS = 4000
METRIC_LABELS = {"ttft_s": "TTFT", "queue_s": "Queue time", "e2e_s": "End-to-end latency", "tpot_s": "TPOT"}


def frame(table: Any) -> pd.DataFrame:
    """A pandas view of a result table (pyarrow Table, DataFrame, or None for an absent table)."""
    if table is None:
        return pd.DataFrame()
    if isinstance(table, pa.Table):
        return table.to_pandas()
    return pd.DataFrame(table)


def auto_window_s(t: np.ndarray, *, target_windows: int = 40) -> float:
    """A round window length giving about ``target_windows`` windows over the span of ``t``."""
    t = t[np.isfinite(t)]
    span = float(t.max() - t.min()) if t.size else 0.0
    want = span / target_windows if span > 0 else 1.0
    for w in NICE_WINDOWS_S:
        if w >= want:
            return float(w)
    return float(NICE_WINDOWS_S[-1])


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False})
    fig.add_annotation(text=why, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def window_percentiles(t: np.ndarray, v: np.ndarray, *, window_s: float,
                       qs: tuple[float, ...] = (0.5, 0.99)) -> tuple[np.ndarray, dict[float, np.ndarray], np.ndarray]:
    """Per window of ``t``: window mid times, quantiles of ``v`` (inverse-CDF), and sample counts.

    Rows where either value is not finite are dropped; windows with no sample are not returned.
    """
    ok = np.isfinite(t) & np.isfinite(v)
    t, v = t[ok], v[ok]
    if t.size == 0:
        return np.empty(0), {q: np.empty(0) for q in qs}, np.empty(0, dtype=np.int64)
    k = np.floor(t / window_s).astype(np.int64)
    keys = np.unique(k)
    out = {q: np.empty(keys.size) for q in qs}
    counts = np.empty(keys.size, dtype=np.int64)
    for i, key in enumerate(keys):
        sample = v[k == key]
        counts[i] = sample.size
        for q, x in zip(qs, weighted_quantiles(sample, None, qs)):
            out[q][i] = x
    return (keys + 0.5) * window_s, out, counts


def fig_traffic(requests: Any, *, window_s: float | None = None) -> go.Figure:
    """Arrivals per second by class (stacked bars; one "all" bar without a ``klass`` column), and
    completions per second by finish time (a line), per time window."""
    df = frame(requests)
    title = "Traffic: arrivals and completions per second"
    if df.empty:
        return _empty(title, "no requests")
    t = df["arrival_s"].to_numpy(dtype=float)
    w = window_s or auto_window_s(np.concatenate([t, df["finish_s"].to_numpy(dtype=float)]))
    fig = go.Figure()
    groups = df["klass"].fillna("(none)") if "klass" in df.columns else pd.Series(["all"] * len(df), index=df.index)
    for name in sorted(groups.unique()):
        tt = t[(groups == name).to_numpy()]
        k = np.floor(tt[np.isfinite(tt)] / w).astype(np.int64)
        keys, n = np.unique(k, return_counts=True)
        fig.add_bar(x=(keys + 0.5) * w, y=n / w, width=w, name=f"arrived: {name}")
    done = df["outcome"].to_numpy() == "completed"
    ft = df["finish_s"].to_numpy(dtype=float)[done]
    k = np.floor(ft[np.isfinite(ft)] / w).astype(np.int64)
    keys, n = np.unique(k, return_counts=True)
    fig.add_scatter(x=(keys + 0.5) * w, y=n / w, mode="lines+markers", name="completed (by finish)",
                    line={"color": "black"})
    fig.update_layout(title=f"{title} ({w:g} s windows)", barmode="stack", xaxis_title="simulated time (s)",
                      yaxis_title="requests / s")
    return fig


def _scope_series(df: pd.DataFrame, metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    sub = df[df["metric"] == metric]
    out = {}
    for scope, g in sub.groupby("scope", sort=True):
        order = np.argsort(g["t_s"].to_numpy(dtype=float), kind="stable")
        out[str(scope)] = (g["t_s"].to_numpy(dtype=float)[order], g["value"].to_numpy(dtype=float)[order])
    return out


def step_matrix(levels: Any, metric: str, *,
                max_points: int = MAX_LEVEL_POINTS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every scope's step function of ``metric`` on one common time grid.

    The grid is the union of sample times, or ``max_points`` evenly spaced instants over the same span
    when the union is larger (each series is then read exactly at those instants). Before a scope's first
    sample its value is 0.
    """
    df = frame(levels)
    series = _scope_series(df, metric) if not df.empty else {}
    if not series:
        return np.empty(0), {}
    grid = np.unique(np.concatenate([ts for ts, _ in series.values()]))
    if grid.size > max_points:
        grid = np.linspace(grid[0], grid[-1], max_points)
    out = {}
    for scope, (ts, vs) in series.items():
        idx = np.searchsorted(ts, grid, side="right") - 1
        out[scope] = np.where(idx >= 0, vs[np.maximum(idx, 0)], 0.0)
    return grid, out


def fig_queue_depth(levels: Any) -> go.Figure:
    """Requests waiting: the fleet queue (``queue`` scope, ``queued_requests``; fleet runs only) and the
    engines' waiting queues summed over replicas (``waiting``), as step lines over time."""
    title = "Queue depth: requests waiting"
    df = frame(levels)
    fig = go.Figure()
    if not df.empty:
        t, q = step_matrix(df, "queued_requests")
        if q:
            fig.add_scatter(x=t, y=np.sum(list(q.values()), axis=0), mode="lines", line_shape="hv",
                            name="fleet queue (queued_requests)")
        t, w = step_matrix(df, "waiting")
        if w:
            n = f"{len(w)} replica{'s' if len(w) != 1 else ''}"
            fig.add_scatter(x=t, y=np.sum(list(w.values()), axis=0), mode="lines", line_shape="hv",
                            name=f"engine waiting (sum over {n})")
    if not fig.data:
        return _empty(title, "no queue or waiting levels")
    fig.update_layout(title=title, xaxis_title="simulated time (s)", yaxis_title="requests")
    return fig


def fig_kv_usage(levels: Any) -> go.Figure:
    """KV-cache usage (blocks held by live requests / usable blocks) across replicas: mean and max at
    each instant, as step lines."""
    title = "KV-cache usage across replicas"
    t, kv = step_matrix(levels, "kv_usage")
    if not kv:
        return _empty(title, "no kv_usage levels")
    m = np.vstack(list(kv.values()))
    fig = go.Figure()
    fig.add_scatter(x=t, y=m.mean(axis=0), mode="lines", line_shape="hv",
                    name=f"mean of {len(kv)} replica{'s' if len(kv) != 1 else ''}")
    fig.add_scatter(x=t, y=m.max(axis=0), mode="lines", line_shape="hv", name="max over replicas")
    fig.update_layout(title=title, xaxis_title="simulated time (s)", yaxis_title="KV usage (fraction)",
                      yaxis_range=[0, max(1.0, float(m.max()))])
    return fig


def _percentile_figure(t: np.ndarray, v: np.ndarray, *, window_s: float | None, title: str, yaxis: str,
                       slo_s: float | None) -> go.Figure:
    w = window_s or auto_window_s(t)
    mid, qv, counts = window_percentiles(t, v, window_s=w)
    if mid.size == 0:
        return _empty(title, "no completed request with a finite value")
    fig = go.Figure()
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        fig.add_scatter(x=mid, y=qv[q], mode="lines+markers", name=name, customdata=counts,
                        hovertemplate="t=%{x:.1f} s  %{y:.4g} s  (n=%{customdata})")
    if slo_s is not None and math.isfinite(slo_s):
        fig.add_hline(y=slo_s, line_dash="dash", line_color="red", annotation_text=f"SLO {slo_s:g} s")
    fig.update_layout(title=f"{title} ({w:g} s windows)", xaxis_title="simulated time (s)", yaxis_title=yaxis)
    return fig


def fig_latency_over_time(requests: Any, metric: str = "ttft_s", *, window_s: float | None = None,
                          time_col: str = "arrival_s", slo_s: float | None = None) -> go.Figure:
    """p50 and p99 of a per-request latency column (``ttft_s``, ``queue_s``, ``e2e_s``, ``tpot_s``) over
    completed requests, per window of ``time_col`` (arrival time by default: what a request arriving then
    experienced). ``slo_s`` draws a dashed line."""
    name = METRIC_LABELS.get(metric, metric)
    title = f"{name} p50/p99 of completed requests by {time_col.removesuffix('_s')} time"
    df = frame(requests)
    if df.empty:
        return _empty(title, "no requests")
    df = df[df["outcome"] == "completed"]
    return _percentile_figure(df[time_col].to_numpy(dtype=float), df[metric].to_numpy(dtype=float),
                              window_s=window_s, title=title, yaxis=f"{metric} (s)", slo_s=slo_s)


def fig_itl_over_time(requests: Any, *, window_s: float | None = None, slo_s: float | None = None) -> go.Figure:
    """Inter-token latency over time, by proxy: p50/p99 of each completed request's TPOT (its mean gap
    between tokens) per window of its finish time. The run's true ITL distribution (every gap) is in the
    summary's ``itl_s``; a per-request mean hides single long gaps such as a preemption."""
    title = "ITL proxy: per-request TPOT p50/p99 by finish time"
    df = frame(requests)
    if df.empty:
        return _empty(title, "no requests")
    df = df[df["outcome"] == "completed"]
    return _percentile_figure(df["finish_s"].to_numpy(dtype=float), df["tpot_s"].to_numpy(dtype=float),
                              window_s=window_s, title=title, yaxis="TPOT (s)", slo_s=slo_s)


def fig_outcomes(requests: Any, by: str = "tier") -> go.Figure:
    """Request counts by outcome (stacked bars, one trace per outcome present) for each value of ``by``
    (``tier``, ``klass``, ``region``...); a single "all" bar when the run has no such column."""
    title = f"Outcomes by {by}"
    df = frame(requests)
    if df.empty:
        return _empty(title, "no requests")
    groups = df[by].fillna("(none)") if by in df.columns else pd.Series(["all"] * len(df), index=df.index)
    if by not in df.columns:
        title += f" (no {by} column: all requests)"
    counts = pd.crosstab(groups, df["outcome"])
    fig = go.Figure()
    for outcome in [o for o in OUTCOMES if o in counts.columns] + sorted(set(counts.columns) - set(OUTCOMES)):
        fig.add_bar(x=list(counts.index), y=counts[outcome].to_numpy(), name=outcome,
                    marker_color=OUTCOME_COLORS.get(outcome))
    fig.update_layout(title=title, barmode="stack", xaxis_title=by, yaxis_title="requests")
    return fig


def fig_cost(summary: dict) -> go.Figure:
    """The run's cost as a small table (GPU-hours, $, $ per million output tokens) from ``summary.fleet``."""
    from twin.report import cost_rows

    rows = cost_rows(summary)
    if not rows:
        return _empty("Cost", "no fleet section in the summary (single-replica run)")
    fmt = [("—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))) for _, v in rows]
    fig = go.Figure(go.Table(header={"values": ["", "value"]},
                             cells={"values": [[r[0] for r in rows], fmt]}))
    fig.update_layout(title=f"Cost over {summary.get('sim_time_s', float('nan')):.4g} simulated s")
    return fig
