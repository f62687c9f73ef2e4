"""``twin check [--update] [--suite FILE] [--baselines DIR] [--out FILE.md]``: the CI policy gate."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from twin.paths import REPO_ROOT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default=None,
                   help="check suite YAML (default: experiments/check_suite.yaml in the repository)")
    p.add_argument("--baselines", default=None, help="baseline folder (default: experiments/baselines)")
    p.add_argument("--update", action="store_true", help="rewrite the baselines from this run (deliberately)")
    p.add_argument("--out", default=None, metavar="FILE.md", help="write a markdown summary (for a PR comment)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count; 0 inline)")
    p.add_argument("--work-dir", default=None, help="keep the suite's run folders here (default: a temp folder)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        import duckdb  # noqa: F401
    except ImportError:
        print("twin check: needs DuckDB: pip install 'twin[sweeps]'", file=sys.stderr)
        return 2
    from twin.check import CheckSuite, compare, format_markdown, format_text, measure, write_baselines
    from twin.sweep import SpecError, load_spec

    suite_path = Path(args.suite) if args.suite else REPO_ROOT / "experiments" / "check_suite.yaml"
    baselines = Path(args.baselines) if args.baselines else REPO_ROOT / "experiments" / "baselines"
    try:
        suite = load_spec(suite_path, CheckSuite)
        workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
        t0 = time.perf_counter()
        summary = measure(suite, base=suite_path.resolve().parent, workers=workers,
                          work_dir=Path(args.work_dir) if args.work_dir else None, progress=not args.quiet)
    except SpecError as exc:
        print(f"twin check: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"twin check: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    if args.update:
        written = write_baselines(baselines, summary, suite)
        print(f"twin check: wrote {len(written)} baselines to {baselines}/ ({wall:.0f} s)")
        return 0
    results, notes = compare(summary, baselines, suite.tolerance)
    print(format_text(results, notes))
    regressed = [c for c in results if c.status == "regressed"]
    print(f"\ntwin check: {'FAILED' if regressed else 'passed'} ({len(results)} metric comparisons, {wall:.0f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(format_markdown(results, notes, suite.tolerance), encoding="utf-8")
        print(f"wrote {args.out}")
    print(f"check: {len(results) - len(regressed)} passed, {len(regressed)} failed")
    return 1 if regressed else 0
