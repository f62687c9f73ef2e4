"""``twin results query "SQL" [--dir DIR] [--csv]`` and ``twin results summary [--dir DIR]`` over a sweep folder."""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

DEFAULT_ROOT = Path("runs/sweeps")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = sub.add_parser("query", help="run SQL over the views runs, requests, events, levels, replica_load, run_metrics")
    q.add_argument("sql")
    q.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    s = sub.add_parser("summary", help="per scenario x policy: mean and 95%% CI across seeds of the key metrics")
    for sp in (q, s):
        sp.add_argument("--dir", default=None,
                        help=f"sweep folder (holding runs/); default: the newest under {DEFAULT_ROOT}/")


def _folder(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    found = [d for d in DEFAULT_ROOT.glob("*") if (d / "runs").is_dir()]
    if not found:
        return None
    newest = max(found, key=lambda d: (d / "runs").stat().st_mtime)
    print(f"(sweep folder: {newest})", file=sys.stderr)
    return newest


def run(args: argparse.Namespace) -> int:
    try:
        import duckdb
    except ImportError:
        print("twin results: needs DuckDB: pip install 'twin[sweeps]'", file=sys.stderr)
        return 2
    from twin import results_db

    folder = _folder(args.dir)
    if folder is None:
        print(f"twin results: no sweep folder under {DEFAULT_ROOT}/; give --dir", file=sys.stderr)
        return 2
    try:
        con = results_db.connect(folder)
    except FileNotFoundError as exc:
        print(f"twin results: {exc}", file=sys.stderr)
        return 2
    if args.action == "summary":
        try:
            rows = results_db.per_run(con)
        except FileNotFoundError as exc:
            print(f"twin results: {folder}: {exc}", file=sys.stderr)
            return 2
        print(results_db.format_summary(results_db.summarize_runs(rows)))
        return 0
    try:
        cur = con.execute(args.sql)
    except duckdb.Error as exc:
        print(f"twin results: {exc}", file=sys.stderr)
        return 2
    if cur.description is None:
        return 0
    head = [d[0] for d in cur.description]
    rows = cur.fetchall()
    if args.csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(head)
        w.writerows(rows)
        print(buf.getvalue(), end="")
    else:
        cell = lambda v: f"{v:.6g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
        print(results_db.format_table(head, [[cell(v) for v in r] for r in rows]))
        print(f"({len(rows)} rows)")
    return 0
