"""One Llama-3-70B FP8 TP4 replica, 10,000 requests of 1,500 prompt / 400 output tokens, Poisson at ~65% load.

Workload: constant lengths, no shared prefixes, vLLM 0.33 H100 server defaults (8192-token budget,
chunked prefill, prefix caching on). Load: the replica's capacity is measured first in the same run by
an offline saturation run (all requests queued at t=0; completed requests per simulated second), and the
Poisson rate is set to 65% of it. Compared against: one event per engine step (decode runs off), in the
same process, so the ratio shows what multi-step decode runs buy.

    python -m benchmarks.single_replica [--requests N] [--profile NAME]
"""

from __future__ import annotations

import argparse

from benchmarks.common import emit, log, measure, table
from twin.runner import run_scenario
from twin.scenario import parse_scenario


def scenario(*, n: int, profile: str, arrival: dict, max_run: int = 512):
    return parse_scenario({
        "name": "bench-single-replica", "seed": 1,
        "workload": {"kind": "synthetic", "num_requests": n, "arrival": arrival,
                     "prompt_tokens": {"kind": "constant", "value": 1500},
                     "output_tokens": {"kind": "constant", "value": 400}},
        "replica": {"step_time": {"kind": "profile", "profile": profile}, "max_decode_run_steps": max_run},
    })


def events_of(res) -> int:
    """SimPy events the replica needed: one per engine event (step or decode run) plus arrivals."""
    w = res.world
    return w.replica.events + len(w.specs)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--profile", default="llama3-70b-fp8-tp4-h100")
    ap.add_argument("--load", type=float, default=0.65)
    args = ap.parse_args(argv)
    sat = run_scenario(scenario(n=2000, profile=args.profile, arrival={"kind": "offline"}))
    capacity_rps = sat.summary["requests"]["completed"] / sat.summary["sim_time_s"]
    rate = args.load * capacity_rps
    log(f"capacity (offline saturation, 2000 requests): {capacity_rps:.2f} req/s; Poisson rate {rate:.2f} req/s")
    rows = []
    for case, max_run in (("single_replica", 512), ("single_replica_one_event_per_step", 1)):
        sc = scenario(n=args.requests, profile=args.profile, arrival={"kind": "poisson", "rate_per_s": rate},
                      max_run=max_run)
        res, wall = measure(lambda sc=sc: run_scenario(sc))
        assert res.ok, res.manifest["exception"]
        s = res.summary
        rows.append(emit(case, sim_requests=args.requests, sim_s=s["sim_time_s"], events=events_of(res), wall_s=wall,
                         extra={"capacity_rps": capacity_rps, "rate_rps": rate, "engine_steps": s["engine_steps"],
                                "tabulate_cpu_s": res.cpu_s["tabulate"],
                                "ttft_p50_s": s["ttft_s"]["p50"], "tpot_p50_s": s["tpot_s"]["p50"]}))
    print(table(rows, ["case", "sim_requests_per_wall_s", "sim_s_per_wall_s", "events_per_wall_s", "wall_s", "cpu_s",
                       "cpu_ms_per_sim_request", "peak_rss_mb"]))
    print(f"decode runs speed-up: {rows[1]['wall_s'] / rows[0]['wall_s']:.2f}x wall time (same results)")
    return rows


if __name__ == "__main__":
    main()
