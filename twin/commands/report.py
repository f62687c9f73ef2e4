"""``twin report RUN_DIR [--baseline RUN_DIR] [--out FILE] [--title TEXT]``.

Writes a self-contained HTML report of a run folder (charts and key tables; docs/report.md) and its tables
as Markdown beside it. Exit codes: 0 written; 2 bad input (no such run folder, a failed run without a
summary, plotly not installed), nothing written.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder written by `twin run`")
    p.add_argument("--baseline", default=None, metavar="RUN_DIR", help="another run to show side by side")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="HTML file to write (default: RUN_DIR/report.html); the Markdown goes beside it (.md)")
    p.add_argument("--title", default=None, help="report title (default: '<run> vs <baseline>' or the run's name)")
    p.add_argument("--label", default=None, help="the run's name in tables (default: its scenario name)")
    p.add_argument("--baseline-label", default=None, help="the baseline's name in tables (default: its scenario "
                                                          "name, or 'baseline' when that is the same)")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("plotly") is None:
        print("twin report: plotly is not installed; install the report extra: pip install 'twin[report]'",
              file=sys.stderr)
        return 2
    from twin.report import ReportError, write_report

    out = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    try:
        html_path, md_path = write_report(args.run_dir, out, title=args.title, baseline=args.baseline,
                                          label=args.label, baseline_label=args.baseline_label)
    except ReportError as exc:
        print(f"twin report: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {html_path}\nwrote {md_path}")
    return 0
