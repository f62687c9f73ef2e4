"""The reference runs that a speed-up must leave unchanged: 18 scenarios on fixed seeds, covering the
single-replica engine (with and without KV pressure and preemptions), the fleet with every router kind,
and the bundled drills (retry storm, region loss, canary, viral prompt, long-context pool, disaggregated
pools, a real trace). Each run is `twin run` in its own process, so nothing carries from one to the next.

    python -m benchmarks.reference_runs runs/before            # on the tree before a change
    python -m benchmarks.reference_runs runs/after             # on the tree after it
    python -m benchmarks.reference_runs --compare runs/before runs/after

``--compare`` prints one line per run (`benchmarks.identical` on its folder) and exits non-zero when any
table or summary differs. ``--only NAME,...`` runs a subset.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.fleet import OVERRIDES
from benchmarks.identical import compare

_FLEET = "scenarios/baseline-day.yaml"
_BENCH = [*OVERRIDES, "fleet.scale=0.02", "fleet.traffic.duration_s=60", "horizon_s=60"]  # the fleet benchmark's
_SHORT = ["fleet.traffic.duration_s=40", "horizon_s=40"]

# name -> (scenario, overrides)
RUNS: dict[str, tuple[str, list[str]]] = {
    "single-replica": ("scenarios/single-replica-demo.yaml", ["workload.num_requests=1500"]),
    # a small pool: preemptions by recompute and prefix hits under pressure
    "single-replica-kv-pressure": ("scenarios/single-replica-demo.yaml", [
        "workload.num_requests=1500", "replica.engine.num_gpu_blocks=2500",
        "workload.arrival={kind: poisson, rate_per_s: 9.0}"]),
    "baseline-day": (_FLEET, _SHORT),
    "fleet-bench": (_FLEET, _BENCH),
    **{f"router-{k}": (_FLEET, [*_SHORT, f"fleet.policy.router={{kind: {k}}}"]) for k in (
        "round_robin", "least_outstanding_tokens", "power_of_two", "session_affinity", "prefix_affinity",
        "dynamo_kv_cost")},
    "launch-day-10x": ("scenarios/launch-day-10x.yaml", []),
    "retry-storm": ("scenarios/retry-storm.yaml", []),
    "region-loss-drill": ("scenarios/region-loss-drill.yaml", []),
    "bad-canary": ("scenarios/bad-canary.yaml", []),
    "viral-system-prompt": ("scenarios/viral-system-prompt.yaml", []),
    "long-context-pooled": ("scenarios/long-context-noisy-neighbour-pooled.yaml", []),
    "disaggregated-vs-colocated": ("scenarios/disaggregated-vs-colocated.yaml", []),
    "trace-mooncake-fleet": ("scenarios/trace-mooncake-fleet.yaml", []),
}


def run_all(out: Path, only: list[str] | None = None) -> int:
    names = only or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"unknown run(s): {', '.join(unknown)}; known: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        scenario, overrides = RUNS[name]
        cmd = [sys.executable, "-m", "twin", "run", scenario, "--quiet", "--out", str(out / name)]
        for o in overrides:
            cmd += ["--set", o]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        print(f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.1f} s", flush=True)
        failed += rc != 0
    return 1 if failed else 0


def compare_all(a: Path, b: Path) -> int:
    differ = items = same = 0
    for d in sorted(p for p in a.iterdir() if p.is_dir()):
        if not (b / d.name / "summary.json").exists():
            print(f"{d.name}: DIFFERENT (no run in {b})")
            differ += 1
            continue
        lines = [ln for ln in compare(d, b / d.name) if not ln.startswith("  ")]  # one line per table + summary
        bad = [ln for ln in lines if "DIFFERENT" in ln]
        print(f"{d.name}: {'identical' if not bad else 'DIFFERENT: ' + '; '.join(bad)}")
        differ += bool(bad)
        items += len(lines)
        same += len(lines) - len(bad)
    print(f"{same} of {items} tables and summaries identical; {differ} run(s) differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?", help="folder for the runs' output folders")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--only", help="comma-separated run names")
    args = ap.parse_args(argv)
    if args.compare:
        return compare_all(*args.compare)
    if args.out is None:
        ap.error("give an output folder, or --compare BEFORE AFTER")
    return run_all(args.out, args.only.split(",") if args.only else None)


if __name__ == "__main__":
    sys.exit(main())
