"""``twin sweep SPEC.yaml [--workers N] [--scheduler ADDRESS] [--out DIR]``: scenarios x policies x seeds."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="sweep spec YAML (see docs/sweeps.md)")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: the CPU count; 0 runs in this process)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run on a dask cluster, e.g. tcp://127.0.0.1:8786 (needs the 'distributed' extra)")
    p.add_argument("--out", default=None, help="output root (default: the spec's 'out'); runs go to OUT/NAME/runs/")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from twin.sweep import SpecError, expand, load_spec, run_sweep

    if args.workers is not None and args.workers < 0:
        print("twin sweep: --workers must be >= 0", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        tasks = expand(spec, base=Path(args.spec).resolve().parent)
    except SpecError as exc:
        print(f"twin sweep: {exc}", file=sys.stderr)
        return 2
    if args.scheduler:
        try:
            import distributed  # noqa: F401
        except ImportError:
            print("twin sweep: --scheduler needs dask: pip install 'twin[distributed]'", file=sys.stderr)
            return 2
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    report = run_sweep(spec, tasks=tasks, out=args.out, workers=workers, scheduler=args.scheduler,
                       progress=not args.quiet)
    print(f"{spec.name}: {report.total} runs ({report.skipped} already complete, {report.ran} run, "
          f"{len(report.failed)} failed) in {report.wall_s:.1f} s -> {report.folder}/runs/")
    for line in report.failed:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if report.failed else 0
