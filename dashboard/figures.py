"""The dashboard's own figures: tables in, plotly figures out (the run charts are ``twin.charts``).

Pure functions of the tables in ``dashboard.tables`` and of a run's ``requests`` table; no Streamlit. With
nothing to draw a figure has no data traces and a note saying why (as ``twin.charts`` does).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from twin.charts import auto_window_s, frame, window_percentiles

# event kind -> (line colour, dash) for the drill chart; kinds not listed are drawn grey and dotted
EVENT_STYLES: dict[str, tuple[str, str]] = {
    "region.lost": ("#d62728", "solid"),
    "dns.failed_over": ("#ff7f0e", "dash"),
    "region.recovering": ("#1f77b4", "dash"),
    "region.recovered": ("#2ca02c", "solid"),
    "replica.recovered": ("#2ca02c", "dot"),
}
DRILL_MARKED_KINDS = ("region.", "dns.", "replica.recovered", "fault.", "ladder.", "alert.")


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False})
    fig.add_annotation(text=why, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


# ----------------------------------------------------------------------------------------- capacity

def fig_fleet_size(fleet: pd.DataFrame) -> go.Figure:
    """Horizontal bars: replicas at each step of the estimate (``tables.fleet_size_table``)."""
    title = "Replicas needed, step by step"
    if fleet.empty:
        return _empty(title, "the inputs give no per-replica decode capacity")
    fig = go.Figure(go.Bar(x=fleet["replicas"], y=fleet["step"], orientation="h", text=fleet["replicas"],
                           textposition="auto", name="replicas"))
    fig.update_layout(title=title, xaxis_title="replicas", yaxis={"autorange": "reversed"}, height=320,
                      margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return fig


def fig_streams_per_replica(streams: pd.DataFrame) -> go.Figure:
    """Bars: streams one replica holds by KV memory and by the latency target; the binding one is red."""
    title = "Streams per replica: memory vs latency"
    if streams.empty:
        return _empty(title, "the inputs give neither a memory nor a latency limit")
    colors = ["#d62728" if b else "#1f77b4" for b in streams["binding"]]
    fig = go.Figure(go.Bar(x=streams["limit"], y=streams["streams"], marker_color=colors, text=streams["streams"],
                           textposition="auto", name="streams"))
    binding = streams.loc[streams["binding"], "limit"].tolist()
    fig.update_layout(title=title + (f" (binds: {binding[0]})" if binding else ""), yaxis_title="streams",
                      height=320, margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return fig


def fig_prefix_hit(curve: pd.DataFrame, *, current_hit: float | None = None) -> go.Figure:
    """Replicas against the prefix-cache hit fraction (``tables.prefix_hit_table``): prefill-inclusive
    replicas (falls with the hit rate) and the notes' decode-only sizing (flat), both at the planning
    utilisation without the failover reserve; the current hit fraction as a vertical line."""
    title = "Fleet size vs prefix-cache hit rate"
    if curve.empty:
        return _empty(title, "no rows")
    fig = go.Figure()
    if curve["replicas_with_prefill"].notna().any():
        fig.add_scatter(x=curve["hit"], y=curve["replicas_with_prefill"], mode="lines+markers",
                        name="replicas incl. prefill time")
    if curve["replicas_decode_only"].notna().any():
        fig.add_scatter(x=curve["hit"], y=curve["replicas_decode_only"], mode="lines", line_dash="dash",
                        name="decode only (the notes' sizing)")
    if not fig.data:
        return _empty(title, "the inputs give no prefill or decode capacity")
    if current_hit is not None:
        fig.add_vline(x=current_hit, line_dash="dot", line_color="grey", annotation_text=f"now {current_hit:.0%}")
    fig.update_layout(title=title, xaxis_title="prefix-cache hit fraction", yaxis_title="replicas (no reserve)",
                      xaxis_tickformat=".0%", height=340, margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return fig


# ------------------------------------------------------------------------------------ what-if runs

def fig_latency_vs_baseline(requests: Any, baseline: Any, *, metric: str = "ttft_s", time_col: str = "arrival_s",
                            window_s: float | None = None, slo_s: float | None = None,
                            labels: tuple[str, str] = ("what-if", "baseline")) -> go.Figure:
    """p50/p99 of a per-request latency column of completed requests per time window, for a run (solid)
    and its baseline (dashed) on one axis; both use the same window length."""
    title = f"{metric} p50/p99 by {time_col.removesuffix('_s')} time: {labels[0]} vs {labels[1]}"
    frames = [frame(requests), frame(baseline)]
    frames = [f[f["outcome"] == "completed"] if not f.empty else f for f in frames]
    ts = [f[time_col].to_numpy(dtype=float) if not f.empty else np.empty(0) for f in frames]
    if all(t.size == 0 for t in ts):
        return _empty(title, "no completed requests")
    w = window_s or auto_window_s(np.concatenate(ts))
    fig = go.Figure()
    for f, t, label, dash in zip(frames, ts, labels, ("solid", "dash")):
        if t.size == 0:
            continue
        mid, qv, counts = window_percentiles(t, f[metric].to_numpy(dtype=float), window_s=w)
        for q, color in ((0.5, "#1f77b4"), (0.99, "#d62728")):
            fig.add_scatter(x=mid, y=qv[q], mode="lines+markers", name=f"{label} p{round(q * 100)}",
                            line={"dash": dash, "color": color}, customdata=counts,
                            hovertemplate="t=%{x:.1f} s  %{y:.4g} s  (n=%{customdata})")
    if slo_s is not None and math.isfinite(slo_s):
        fig.add_hline(y=slo_s, line_dash="dot", line_color="red", annotation_text=f"SLO {slo_s:g} s")
    fig.update_layout(title=f"{title} ({w:g} s windows)", xaxis_title="simulated time (s)", yaxis_title=f"{metric} (s)")
    return fig


def fig_summary_change(comparison: pd.DataFrame) -> go.Figure:
    """Horizontal bars of run / baseline − 1 per summary metric (``tables.summary_comparison``); green
    where the change is an improvement, red where it is worse."""
    title = "What-if vs baseline (relative change)"
    df = comparison.dropna(subset=["change"]) if not comparison.empty else comparison
    if df.empty:
        return _empty(title, "no metric defined in both runs")
    good = [(c > 0) == hb if c != 0 else True for c, hb in zip(df["change"], df["higher_is_better"])]
    fig = go.Figure(go.Bar(x=df["change"], y=df["metric"], orientation="h",
                           marker_color=["#2ca02c" if g else "#d62728" for g in good],
                           text=[f"{c:+.1%}" for c in df["change"]], textposition="auto"))
    fig.update_layout(title=title, xaxis_tickformat="+.0%", yaxis={"autorange": "reversed"},
                      height=60 + 28 * len(df), margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return fig


# ----------------------------------------------------------------------------------------- drills

def fig_drill_timeline(requests: Any, timeline: pd.DataFrame, *, metric: str = "ttft_s",
                       window_s: float | None = None, slo_s: float | None = None) -> go.Figure:
    """p50/p99 of ``metric`` over completed requests by arrival window, and the share of arrivals in each
    window that did not complete (right axis), with the drill's events (``tables.timeline_table``) as
    vertical lines: region lost, DNS failed over, recovering, replicas back, ladder and alert changes."""
    title = f"Drill replay: {metric} and failed turns, with events"
    df = frame(requests)
    if df.empty:
        return _empty(title, "no requests")
    t_all = df["arrival_s"].to_numpy(dtype=float)
    w = window_s or auto_window_s(t_all)
    done = df[df["outcome"] == "completed"]
    mid, qv, counts = window_percentiles(done["arrival_s"].to_numpy(dtype=float), done[metric].to_numpy(dtype=float),
                                         window_s=w)
    fig = go.Figure()
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        fig.add_scatter(x=mid, y=qv[q], mode="lines+markers", name=f"{metric} {name}", customdata=counts,
                        hovertemplate="t=%{x:.1f} s  %{y:.4g} s  (n=%{customdata})")
    ok = np.isfinite(t_all)
    k = np.floor(t_all[ok] / w).astype(np.int64)
    failed = (df["outcome"].to_numpy() != "completed")[ok]
    keys, n = np.unique(k, return_counts=True)
    bad = np.array([failed[k == key].sum() for key in keys], dtype=float)
    fig.add_bar(x=(keys + 0.5) * w, y=bad / n, width=w * 0.9, name="not completed (share of arrivals)", yaxis="y2",
                marker_color="rgba(127,127,127,0.35)")
    marked = timeline[timeline["kind"].str.startswith(DRILL_MARKED_KINDS)] if not timeline.empty else timeline
    for _, ev in marked.drop_duplicates(subset=["t_s", "kind"]).iterrows():
        color, dash = EVENT_STYLES.get(ev["kind"], ("#7f7f7f", "dot"))
        fig.add_vline(x=ev["t_s"], line_color=color, line_dash=dash,
                      annotation_text=ev["kind"], annotation_textangle=-90, annotation_position="top left")
    if slo_s is not None and math.isfinite(slo_s):
        fig.add_hline(y=slo_s, line_dash="dot", line_color="red", annotation_text=f"SLO {slo_s:g} s")
    fig.update_layout(title=f"{title} ({w:g} s windows)", xaxis_title="simulated time (s, by arrival)",
                      yaxis_title=f"{metric} (s)", barmode="overlay",
                      yaxis2={"title": "not completed", "overlaying": "y", "side": "right", "range": [0, 1],
                              "tickformat": ".0%", "dtick": 0.25, "showgrid": False},
                      legend={"orientation": "h", "y": -0.2}, height=460)
    return fig


# ------------------------------------------------------------------------------------------ sweeps

def fig_policy_ci(ci: pd.DataFrame, metric: str) -> go.Figure:
    """Bars of the mean of ``metric`` per policy with 95% CI error bars (``tables.ci_table``); one colour
    per scenario. A policy with a single seed has no interval (no error bar), and n is in the hover."""
    title = f"{metric}: mean and 95% CI across seeds"
    df = ci[ci["metric"] == metric] if not ci.empty else ci
    df = df[np.isfinite(df["mean"].astype(float))] if not df.empty else df
    if df.empty:
        return _empty(title, f"no runs with a value for {metric}")
    fig = go.Figure()
    for scenario, g in df.groupby("scenario", sort=True):
        half = g["ci95"].astype(float).fillna(0.0)
        fig.add_bar(x=g["policy"], y=g["mean"], name=str(scenario), customdata=np.stack([g["ci95"], g["n"]], axis=1),
                    error_y={"type": "data", "array": half.to_numpy(), "visible": True},
                    hovertemplate="%{x}: %{y:.4g} ± %{customdata[0]:.3g} (n=%{customdata[1]})")
    fig.update_layout(title=title, barmode="group", xaxis_title="policy", yaxis_title=metric)
    return fig
