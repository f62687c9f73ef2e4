"""``twin drill region-loss --region R --at T [--scenario FILE] [--recover-at T] [--out DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twin.paths import REPO_ROOT
from twin.results import dumps, write_outputs

DEFAULT = REPO_ROOT / "scenarios" / "region-loss-drill.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drill", choices=["region-loss"], help="the drill to run")
    p.add_argument("--region", required=True, help="the region to lose")
    p.add_argument("--at", type=float, required=True, help="simulated second at which it is lost")
    p.add_argument("--recover-at", type=float, default=None, help="simulated second at which it comes back")
    p.add_argument("--scenario", default=str(DEFAULT), help="fleet scenario to drill on")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the run's tables and drill.json here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print the drill report as JSON")


def run(args: argparse.Namespace) -> int:
    from twin.drill import drill_report, format_drill
    from twin.runner import run_scenario
    from twin.scenario import ScenarioError, load_scenario

    fault = {"kind": "region_loss", "at_s": args.at, "region": args.region}
    if args.recover_at is not None:
        fault["recover_at_s"] = args.recover_at
    try:
        base = load_scenario(args.scenario, overrides=args.overrides)
        if base.fleet is None:
            raise ScenarioError(f"{args.scenario}: a drill needs a fleet scenario")
        faults = [f.model_dump(mode="json") for f in base.fleet.faults if f.kind != "region_loss"] + [fault]
        import yaml

        sc = load_scenario(args.scenario, overrides=[*args.overrides, f"fleet.faults={yaml.safe_dump(faults, default_flow_style=True).strip()}"])
    except ScenarioError as exc:
        print(f"twin drill: {exc}", file=sys.stderr)
        return 2
    res = run_scenario(sc, seed=args.seed)
    if not res.ok:
        print(f"twin drill: the run failed: {res.manifest['exception']}", file=sys.stderr)
        if args.out:
            write_outputs(Path(args.out), tables={}, files={"manifest.json": dumps(res.manifest)})
        return 1
    rep = drill_report(res.tables["events"], res.tables["requests"], region=args.region, at_s=args.at,
                       end_s=res.summary["sim_time_s"])
    if args.out:
        write_outputs(Path(args.out), tables=res.tables, files={"manifest.json": dumps(res.manifest),
                                                                "summary.json": dumps(res.summary),
                                                                "drill.json": dumps(rep)})
    print(dumps(rep) if args.json else format_drill(rep))
    return 0
