"""``twin validate SCENARIO...``: check files without running them."""

from __future__ import annotations

import argparse
import sys

from twin.scenario import ScenarioError, load_scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenarios", nargs="+", help="scenario YAML files")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.scenarios:
        try:
            sc = load_scenario(path, overrides=args.overrides)
        except ScenarioError as exc:
            print(str(exc), file=sys.stderr)
            bad += 1
            continue
        print(f"{path}: ok ({sc.name})")
    return 2 if bad else 0
