"""A policy sweep run serially, on local worker processes and on a local dask cluster: how a sweep scales out.

Workload: `scenarios/baseline-day.yaml` at the peak hour (the fleet benchmark's overrides) at ``--scale`` for
``--sim-s`` simulated seconds, two routers (llm-d-style scorer, power of two) x ``--seeds`` seeds, each run in a
fresh output folder. Cases: ``--workers 0`` (every run in this process, one after another: the baseline),
``--workers N`` processes (`twin sweep --workers N`), and a dask ``LocalCluster`` of N single-threaded worker
processes on loopback, given to the sweep by its address as `twin sweep --scheduler ADDRESS` gives a real
cluster's (the cluster starts before the clock does; skipped without the `distributed` extra). Compared against:
the serial case's wall time (the speed-up, at most N on N free cores) and its results: every run's summary must
be the same on every executor.

    python -m benchmarks.sweep [--workers 2] [--seeds 4] [--scale 0.02] [--sim-s 60]

``cpu_s`` is this process's CPU time only: in the parallel cases the simulation runs in the workers, so the
rates to read there are the wall-time ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import emit, log, measure, table
from benchmarks.fleet import OVERRIDES
from benchmarks.identical import strip_wall
from twin.sweep import SweepSpec, run_sweep


def spec(*, scale: float, sim_s: float, seeds: int) -> SweepSpec:
    return SweepSpec.model_validate({
        "name": "bench-sweep", "scenarios": ["scenarios/baseline-day.yaml"],
        "policies": {"llm_d": {"kind": "llm_d_scorer"}, "p2c": {"kind": "power_of_two"}}, "seeds": seeds,
        "overrides": [o for o in OVERRIDES if not o.startswith("fleet.policy.router")]
        + [f"fleet.scale={scale}", f"fleet.traffic.duration_s={sim_s}", f"horizon_s={sim_s}"]})


def _summaries(folder: Path) -> dict[str, dict]:
    out = {}
    for d in sorted((folder / "runs").iterdir()):
        out[d.name] = strip_wall(json.loads((d / "summary.json").read_text()))
    return out


def run_case(sp: SweepSpec, out: Path, **how) -> tuple[float, int, dict[str, dict]]:
    """One sweep into a fresh folder: wall seconds, runs, and every run's summary (by run hash)."""
    report, wall = measure(lambda: run_sweep(sp, out=out, progress=False, **how))
    assert not report.failed, report.failed
    assert report.ran == report.total, "a fresh folder runs every task"
    return wall, report.total, _summaries(report.folder)


# CPU time of the simulations is spent in the workers in the parallel cases; this process's is not the figure
_NOT_MEASURED = {"cpu_s": None, "sim_requests_per_cpu_s": None, "sim_s_per_cpu_s": None, "cpu_ms_per_sim_request": None}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the parallel cases")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.02)
    ap.add_argument("--sim-s", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the cases, alternated; medians compared")
    args = ap.parse_args(argv)
    sp = spec(scale=args.scale, sim_s=args.sim_s, seeds=args.seeds)
    try:
        from distributed import LocalCluster
    except ImportError:
        LocalCluster = None  # noqa: N806
        log("dask's distributed is not installed (pip install -e '.[distributed]'): the dask case is skipped")
    cases = [("sweep_serial", {"workers": 0}), (f"sweep_processes_{args.workers}", {"workers": args.workers})]
    walls: dict[str, list[float]] = {}
    first: dict[str, dict] | None = None
    n_runs = 0
    with tempfile.TemporaryDirectory(prefix="twin-bench-sweep-") as tmp:
        def record(case: str, how: dict, rep: int) -> None:
            nonlocal first, n_runs
            wall, n_runs, runs = run_case(sp, Path(tmp) / f"{case}-{rep}", **how)
            first = first or runs
            assert runs == first, f"{case}: a run's summary differs from the serial sweep's"
            walls.setdefault(case, []).append(wall)

        for rep in range(args.repeats):
            log(f"round {rep + 1} of {args.repeats}: {2 * args.seeds} runs serially, on {args.workers} processes"
                f"{'' if LocalCluster is None else f', on a local dask cluster of {args.workers}'} ...")
            for case, how in cases:
                record(case, how, rep)
            if LocalCluster is not None:  # started for its case only: idle workers would share the cores
                with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster:
                    record(f"sweep_dask_{args.workers}", {"scheduler": cluster.scheduler_address}, rep)
    assert first is not None
    turns = sum(s["requests"]["arrived"] for s in first.values())
    sim_s = sum(s["sim_time_s"] for s in first.values())
    out = []
    for case, ws in walls.items():  # one JSON line per case, at its median wall time
        wall = statistics.median(ws)
        out.append(emit(case, sim_requests=turns, sim_s=sim_s, events=None, wall_s=wall,
                        extra={**_NOT_MEASURED, "runs": n_runs, "runs_per_wall_s": n_runs / wall,
                               "walls": [round(w, 3) for w in ws]}))
    print(table(out, ["case", "runs", "wall_s", "runs_per_wall_s", "sim_requests_per_wall_s", "sim_s_per_wall_s"]))
    base = out[0]["wall_s"]
    for r in out[1:]:
        print(f"{r['case']}: {base / r['wall_s']:.2f}x the serial sweep's speed by median wall time (at most "
              f"{args.workers}x on {args.workers} free cores); every run's summary the same on every executor")
    return out


if __name__ == "__main__":
    main()
