"""The per-run report: key tables (Markdown and HTML) and the charts of ``twin.charts`` in one
self-contained HTML file, optionally side by side with a baseline run.

Inputs are a run folder written by ``twin run`` (``summary.json``, ``requests.parquet``,
``levels.parquet``, ``manifest.json``) or a ``RunResult``; every number in a table is read from the run's
summary (docs/metrics.md), never recomputed. The tables need only pyarrow; the HTML needs plotly
(``pip install 'twin[report]'``), imported when the HTML is rendered.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from twin.results import write_text_atomic


class ReportError(Exception):
    """The input is not a usable run (missing folder, a failed run without a summary, unreadable file)."""


@dataclass(frozen=True)
class RunData:
    """What the report reads from one run."""

    label: str
    summary: dict[str, Any]
    requests: pa.Table | None = None
    levels: pa.Table | None = None
    manifest: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportTable:
    """A titled table of raw values (formatted only when rendered)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    note: str = ""


def load_run(source: Any, *, label: str | None = None) -> RunData:
    """A run folder (path), a ``RunResult``-like object (``.tables``, ``.summary``), or a ``RunData``."""
    if isinstance(source, RunData):
        return source if label is None else RunData(label, source.summary, source.requests, source.levels,
                                                    source.manifest)
    if hasattr(source, "tables") and hasattr(source, "summary"):
        manifest = dict(getattr(source, "manifest", {}) or {})
        if not source.summary:
            raise ReportError("the run has no summary (did it fail? see its manifest)")
        return RunData(label or str(manifest.get("scenario") or "run"), dict(source.summary),
                       source.tables.get("requests"), source.tables.get("levels"), manifest)
    run_dir = Path(source)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run folder")
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ReportError(f"{run_dir}: no summary.json (a failed run writes only its manifest)")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        manifest_path = run_dir / "manifest.json"
        manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
        tables = {name: pq.read_table(run_dir / f"{name}.parquet") if (run_dir / f"{name}.parquet").is_file()
                  else None for name in ("requests", "levels")}
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ReportError(f"{run_dir}: unreadable run ({exc})") from exc
    return RunData(label or str(manifest.get("scenario") or run_dir.name), summary, tables["requests"],
                   tables["levels"], manifest)


# --- tables -------------------------------------------------------------------------------------------

def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _dist(d: dict | None, key: str) -> float | None:
    return _num((d or {}).get(key))


TIER_METRICS: tuple[tuple[str, Any], ...] = (
    ("arrived", lambda s: s["requests"]["arrived"]),
    ("completed", lambda s: s["requests"]["completed"]),
    ("TTFT p50 (s)", lambda s: _dist(s.get("ttft_s"), "p50")),
    ("TTFT p99 (s)", lambda s: _dist(s.get("ttft_s"), "p99")),
    ("ITL p99 (s)", lambda s: _dist(s.get("itl_s"), "p99")),
    ("TPOT p99 (s)", lambda s: _dist(s.get("tpot_s"), "p99")),
    ("goodput (req/s)", lambda s: _num(s.get("goodput_rps"))),
    ("SLO attainment", lambda s: _num(s.get("slo_attainment"))),
)

CLASS_METRICS: tuple[tuple[str, Any], ...] = (
    ("arrived", lambda s: s["arrived"]),
    ("completed", lambda s: s["completed"]),
    ("TTFT p50 (s)", lambda s: _dist(s.get("ttft_s"), "p50")),
    ("TTFT p99 (s)", lambda s: _dist(s.get("ttft_s"), "p99")),
)

OVERVIEW_METRICS: tuple[tuple[str, Any], ...] = (
    *((f"requests {k}", (lambda k: lambda s: s["requests"].get(k))(k))
      for k in ("arrived", "completed", "rejected", "cancelled", "abandoned", "failed", "unfinished")),
    ("simulated time (s)", lambda s: _num(s.get("sim_time_s"))),
    ("TTFT p50 (s)", lambda s: _dist(s.get("ttft_s"), "p50")),
    ("TTFT p99 (s)", lambda s: _dist(s.get("ttft_s"), "p99")),
    ("ITL p50 (s)", lambda s: _dist(s.get("itl_s"), "p50")),
    ("ITL p99 (s)", lambda s: _dist(s.get("itl_s"), "p99")),
    ("E2E p99 (s)", lambda s: _dist(s.get("e2e_s"), "p99")),
    ("output tokens/s", lambda s: _num(s.get("output_tokens_per_s"))),
    ("goodput (req/s)", lambda s: _num(s.get("goodput_rps"))),
    ("SLO attainment", lambda s: _num(s.get("slo_attainment"))),
    ("prefix-cache hit rate", lambda s: _num(s.get("prefix_cache_hit_rate"))),
    ("preemptions", lambda s: s.get("preemptions")),
    ("KV usage (time-weighted mean)", lambda s: _num(s.get("kv_usage_mean"))),
)


def tier_summaries(summary: dict) -> dict[str, dict]:
    """Each tier's summary, then ``all`` (the run's own); just ``all`` for a run without tiers."""
    return {**(summary.get("by_tier") or {}), "all": summary}


def change(run: Any, base: Any) -> str:
    """Relative change of ``run`` over ``base`` as a signed percentage ("" when undefined)."""
    if not isinstance(run, (int, float)) or not isinstance(base, (int, float)) or base == 0:
        return ""
    if not (math.isfinite(run) and math.isfinite(base)):
        return ""
    return f"{(run / base - 1) * 100:+.1f}%"


def _grouped(title: str, key: str, groups: dict[str, dict], base_groups: dict[str, dict] | None,
             metrics: tuple[tuple[str, Any], ...], run: RunData, baseline: RunData | None) -> ReportTable:
    """Wide (one row per group) without a baseline; long (group, metric, run, baseline, change) with one."""
    if baseline is None:
        return ReportTable(title, (key, *[m for m, _ in metrics]),
                           tuple((g, *[f(s) for _, f in metrics]) for g, s in groups.items()))
    names = list(groups) + [g for g in (base_groups or {}) if g not in groups]
    rows = []
    for g in names:
        for m, f in metrics:
            a = f(groups[g]) if g in groups else None
            b = f(base_groups[g]) if base_groups and g in base_groups else None
            rows.append((g, m, a, b, change(a, b)))
    return ReportTable(title, (key, "metric", run.label, baseline.label, "change"), tuple(rows))


def _listed(title: str, rows: list[tuple[str, Any]], base_rows: list[tuple[str, Any]] | None,
            run: RunData, baseline: RunData | None, note: str = "") -> ReportTable:
    if baseline is None:
        return ReportTable(title, ("metric", run.label), tuple(rows), note)
    base = dict(base_rows or [])
    labels = [k for k, _ in rows] + [k for k in base if k not in dict(rows)]
    mine = dict(rows)
    return ReportTable(title, ("metric", run.label, baseline.label, "change"),
                       tuple((k, mine.get(k), base.get(k), change(mine.get(k), base.get(k))) for k in labels), note)


def overview_table(run: RunData, baseline: RunData | None = None) -> ReportTable:
    slo = run.summary.get("slo") or {}
    note = f"SLO: TTFT ≤ {slo.get('ttft_s')} s and TPOT ≤ {slo.get('itl_s')} s." if slo else ""
    rows = [(m, f(run.summary)) for m, f in OVERVIEW_METRICS]
    base = [(m, f(baseline.summary)) for m, f in OVERVIEW_METRICS] if baseline else None
    return _listed("Overview", rows, base, run, baseline, note)


def tier_table(run: RunData, baseline: RunData | None = None) -> ReportTable:
    return _grouped("Per tier", "tier", tier_summaries(run.summary),
                    tier_summaries(baseline.summary) if baseline else None, TIER_METRICS, run, baseline)


def class_table(run: RunData, baseline: RunData | None = None) -> ReportTable | None:
    classes = run.summary.get("by_class") or {}
    base = (baseline.summary.get("by_class") or {}) if baseline else None
    if not classes and not base:
        return None
    return _grouped("Per class", "class", classes, base, CLASS_METRICS, run, baseline)


def reasons_table(run: RunData, baseline: RunData | None = None) -> ReportTable:
    """Requests not completed, by ``<outcome>:<reason>``, per tier and for ``all``."""
    def counts(summary: dict) -> dict[tuple[str, str], int]:
        return {(tier, reason): n for tier, s in tier_summaries(summary).items()
                for reason, n in (s.get("outcomes_by_reason") or {}).items()}

    mine = counts(run.summary)
    base = counts(baseline.summary) if baseline else None
    none = [r.label for r, c in ((run, mine), (baseline, base)) if r is not None and not c]
    note = (", ".join(none) + ": no request was rejected, cancelled, abandoned or failed.") if none else ""
    if baseline is None or base is None:
        return ReportTable("Not completed, by reason", ("tier", "outcome:reason", "requests"),
                           tuple((t, r, n) for (t, r), n in mine.items()), note)
    keys = list(mine) + [k for k in base if k not in mine]
    return ReportTable("Not completed, by reason", ("tier", "outcome:reason", run.label, baseline.label),
                       tuple((t, r, mine.get((t, r), 0), base.get((t, r), 0)) for t, r in keys), note)


COST_ROWS = (("replicas", "replicas"), ("gpus", "GPUs"), ("gpu_hours", "GPU-hours"),
             ("usd_per_gpu_hour", "$ per GPU-hour"), ("usd", "$ total"), ("output_tokens", "output tokens"),
             ("usd_per_m_output_tokens", "$ per M output tokens"))


def cost_rows(summary: dict) -> list[tuple[str, Any]]:
    """(label, value) rows of the summary's ``fleet`` section; empty for a run without one."""
    fleet = summary.get("fleet") or {}
    return [(label, _num(fleet.get(key))) for key, label in COST_ROWS] if fleet else []


def cost_table(run: RunData, baseline: RunData | None = None) -> ReportTable:
    rows = cost_rows(run.summary)
    base = cost_rows(baseline.summary) if baseline else None
    none = [r.label for r, c in ((run, rows), (baseline, base)) if r is not None and not c]
    note = (", ".join(none) + ": no fleet section in the summary (a single-replica run has no GPU count or "
            "price), so no cost.") if none else ""
    if not rows and not base:
        return ReportTable("Cost", (), (), note)
    return _listed("Cost", rows, base, run, baseline, note)


def report_tables(run: RunData, baseline: RunData | None = None) -> list[ReportTable]:
    """The report's tables, in order."""
    tables = [overview_table(run, baseline), tier_table(run, baseline), reasons_table(run, baseline)]
    ct = class_table(run, baseline)
    return tables + ([ct] if ct else []) + [cost_table(run, baseline)]


def fmt(x: Any) -> str:
    """A table cell: 4 significant digits for floats, integers as they are, "—" for missing."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    return str(x) if isinstance(x, int) else f"{x:.4g}"


def table_markdown(t: ReportTable) -> str:
    lines = [f"## {t.title}", ""]
    if t.rows:
        lines.append("| " + " | ".join(t.columns) + " |")
        lines.append("|" + "|".join("---" for _ in t.columns) + "|")
        lines += ["| " + " | ".join(fmt(c).replace("|", "\\|") for c in row) + " |" for row in t.rows]
    if t.note:
        lines += (["", t.note] if t.rows else [t.note])
    return "\n".join(lines) + "\n"


def table_html(t: ReportTable) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(c))}</td>" for c in row) + "</tr>" for row in t.rows)
    parts = [f"<h2>{html.escape(t.title)}</h2>"]
    if t.rows:
        parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    if t.note:
        parts.append(f"<p class='note'>{html.escape(t.note)}</p>")
    return "\n".join(parts)


def _heading(run: RunData, baseline: RunData | None, title: str | None) -> str:
    return title or (f"{run.label} vs {baseline.label}" if baseline else run.label)


def _provenance(r: RunData) -> str:
    m = r.manifest
    bits = [f"{k} {m[k]}" for k in ("scenario", "seed", "replication", "git_sha") if m.get(k) is not None]
    return f"{r.label}: " + (", ".join(bits) if bits else "no manifest")


def render_markdown(run: RunData, baseline: RunData | None = None, *, title: str | None = None) -> str:
    lines = [f"# {_heading(run, baseline, title)}", ""]
    lines += [f"- {_provenance(r)}" for r in (run, baseline) if r is not None]
    lines.append("")
    return "\n".join(lines) + "\n" + "\n".join(table_markdown(t) for t in report_tables(run, baseline))


# --- charts and HTML ----------------------------------------------------------------------------------

def figures(run: RunData) -> list[tuple[str, Any]]:
    """(section, figure) pairs of the run's charts (needs plotly)."""
    from twin import charts

    slo = run.summary.get("slo") or {}
    return [
        ("traffic", charts.fig_traffic(run.requests)),
        ("queue", charts.fig_queue_depth(run.levels)),
        ("ttft", charts.fig_latency_over_time(run.requests, "ttft_s", slo_s=slo.get("ttft_s"))),
        ("itl", charts.fig_itl_over_time(run.requests, slo_s=slo.get("itl_s"))),
        ("kv", charts.fig_kv_usage(run.levels)),
        ("outcomes-tier", charts.fig_outcomes(run.requests, by="tier")),
        ("outcomes-class", charts.fig_outcomes(run.requests, by="klass")),
    ]


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.note{color:#555}
.row{display:grid;grid-template-columns:repeat(var(--cols),1fr);gap:1em}"""


def render_html(run: RunData, baseline: RunData | None = None, *, title: str | None = None) -> str:
    """One self-contained page: plotly.js is embedded once (the first chart), no network needed."""
    import plotly.io as pio

    heading = html.escape(_heading(run, baseline, title))
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{heading}</title>",
             f"<style>{CSS}</style></head><body><h1>{heading}</h1><ul>"]
    parts += [f"<li>{html.escape(_provenance(r))}</li>" for r in (run, baseline) if r is not None]
    parts.append("</ul>")
    parts += [table_html(t) for t in report_tables(run, baseline)]
    parts.append("<h2>Charts</h2>")
    runs = [run] + ([baseline] if baseline else [])
    cols = [figures(r) for r in runs]
    first = True
    for i, (section, _) in enumerate(cols[0]):
        parts.append(f"<div class='row' style='--cols:{len(runs)}'>")
        for r, figs in zip(runs, cols):
            fig = figs[i][1]
            if baseline is not None:
                fig.update_layout(title=f"{r.label}: {fig.layout.title.text}")
            parts.append("<div>" + pio.to_html(fig, full_html=False, include_plotlyjs=first,
                                               div_id=f"{section}-{runs.index(r)}") + "</div>")
            first = False
        parts.append("</div>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(source: Any, out_path: str | os.PathLike, *, title: str | None = None, baseline: Any = None,
                 label: str | None = None, baseline_label: str | None = None) -> tuple[Path, Path]:
    """Write ``out_path`` (HTML) and the Markdown tables beside it (same name, ``.md``), each atomically;
    returns both paths.

    ``source`` and ``baseline`` are run folders, ``RunResult``s or ``RunData``. Labels default to the
    scenario names; a baseline with the same label as the run is called "baseline".
    """
    run = load_run(source, label=label)
    base = load_run(baseline, label=baseline_label) if baseline is not None else None
    if base is not None and base.label == run.label and baseline_label is None:
        base = load_run(base, label="baseline")
    out = Path(out_path)
    md_path = out.with_suffix(".md")
    if out.suffix == ".md":
        out = out.with_suffix(".html")
    html_text = render_html(run, base, title=title)  # before writing anything: a missing plotly writes nothing
    write_text_atomic(md_path, render_markdown(run, base, title=title))
    write_text_atomic(out, html_text)
    return out, md_path
