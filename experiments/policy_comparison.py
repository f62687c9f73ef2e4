"""Issue 6's policy comparison: run the sweep in policy_comparison.yaml, then write the table and chart.

    python experiments/policy_comparison.py [--workers N] [--out DIR]

Writes ``<out>/policy-comparison/comparison.md`` (mean ± 95% CI across seeds of TTFT p50/p99, ITL p99,
prefix-cache hit rate, goodput and load spread across replicas) and ``comparison.html`` (the same as
bar charts with error bars), and prints the table. Reruns skip finished runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

LABELS = {"ttft_p50_s": "TTFT p50 (s)", "ttft_p99_s": "TTFT p99 (s)", "itl_p99_s": "ITL p99 (s)",
          "prefix_cache_hit_rate": "prefix-cache hit rate", "goodput_rps": "goodput (req/s)",
          "load_spread_cv": "load spread (CV)"}


def markdown(summary: list[dict]) -> str:
    lines = ["| scenario | policy | n | " + " | ".join(LABELS.values()) + " |",
             "|---|---|---|" + "---|" * len(LABELS)]
    for e in summary:
        cells = []
        for k in LABELS:
            m, h = e[k]["mean"], e[k]["ci95"]
            cells.append("n/a" if m is None or not math.isfinite(m) else
                         f"{m:.4g} ± {h:.2g}" if h is not None and math.isfinite(h) else f"{m:.4g}")
        lines.append(f"| {e['scenario']} | {e['policy']} | {e['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(summary: list[dict], path: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    scenarios = sorted({e["scenario"] for e in summary})
    metrics = ["ttft_p99_s", "itl_p99_s", "prefix_cache_hit_rate", "load_spread_cv"]
    fig = make_subplots(rows=len(metrics), cols=1, subplot_titles=[LABELS[m] for m in metrics], vertical_spacing=0.07)
    for row, m in enumerate(metrics, start=1):
        for sc in scenarios:
            es = [e for e in summary if e["scenario"] == sc]
            fig.add_trace(go.Bar(name=sc, x=[e["policy"] for e in es], y=[e[m]["mean"] for e in es],
                                 error_y={"type": "data", "array": [e[m]["ci95"] or 0 for e in es]},
                                 legendgroup=sc, showlegend=row == 1), row=row, col=1)
    fig.update_layout(barmode="group", height=320 * len(metrics), title="Routing policies: mean ± 95% CI over seeds")
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(fig.to_html(include_plotlyjs="inline"), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    from twin.results_db import connect, format_summary, per_run, summarize_runs
    from twin.sweep import load_spec, run_sweep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    spec = load_spec(HERE / "policy_comparison.yaml")
    report = run_sweep(spec, out=args.out, workers=args.workers)
    folder = Path(args.out or spec.out) / spec.name
    summary = summarize_runs(per_run(connect(folder)))
    md = markdown(summary)
    (folder / "comparison.md").write_text(md + "\n", encoding="utf-8")
    chart(summary, folder / "comparison.html")
    print(format_summary(summary))
    print(f"\nwrote {folder / 'comparison.md'} and {folder / 'comparison.html'} ({report})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
