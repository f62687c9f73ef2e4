"""``twin n-minus-1 [--scenario F] [--shares 0.5,0.6,0.7,0.8] [--region R] [--at T] [--seed N | --seeds 1,2,3]
[--json]``."""

from __future__ import annotations

import argparse
import sys

from twin.paths import REPO_ROOT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default=str(REPO_ROOT / "scenarios" / "n-minus-1.yaml"))
    p.add_argument("--shares", default="0.5,0.6,0.7,0.8", help="shares of peak load to try")
    p.add_argument("--region", default="us-east", help="the region to lose")
    p.add_argument("--at", type=float, default=60.0, help="when it is lost (simulated s)")
    p.add_argument("--target", type=float, default=0.95, help="SLO attainment that counts as holding")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None)
    seeds.add_argument("--seeds", default=None,
                       help="run each share on each of these seeds (e.g. 1,2,3); a share holds when it holds on all")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from twin.nminus1 import check, format_check
    from twin.results import dumps
    from twin.scenario import ScenarioError

    try:
        shares = [float(x) for x in args.shares.split(",") if x.strip()]
    except ValueError:
        print(f"twin n-minus-1: --shares must be numbers, got {args.shares!r}", file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else None
    except ValueError:
        print(f"twin n-minus-1: --seeds must be whole numbers, got {args.seeds!r}", file=sys.stderr)
        return 2
    if args.seeds is not None and not seeds:
        print("twin n-minus-1: --seeds names no seed", file=sys.stderr)
        return 2
    try:
        rep = check(args.scenario, shares=shares, region=args.region, fail_at_s=args.at, target=args.target,
                    seed=args.seed, seeds=seeds, overrides=args.overrides)
    except ScenarioError as exc:
        print(f"twin n-minus-1: {exc}", file=sys.stderr)
        return 2
    print(dumps(rep) if args.json else format_check(rep))
    return 0
