"""Run every benchmark: ``python -m benchmarks`` (single replica, the fleet at three sizes, then a sweep scaled out).

    python -m benchmarks                                        # fleet at 0.005x/0.02x/0.08x for 120 sim-s, ~3 CPU-min
    python -m benchmarks --fleet-scale 0.25 --multiples 1,4,16 --sim-s 30   # the issue's 0.25x/1x/4x fleets
    python -m benchmarks --fleet-scale 0.25 --multiples 1,4,16 --sim-s 30 --repeats 3   # each fleet case's median of 3

The second form is the issue's three fleet sizes (0.25, 1.0 and 4.0 times the 10M-user note's ~540 replicas) for a
shorter window than its 10 simulated minutes: ~2.5 CPU-minutes a round and 3.4 GB at 30 simulated s
(docs/performance.md, round 27); 600 s takes ~25 CPU-minutes and ~14 GB at 1x alone (`python -m benchmarks.fleet
--scale 1 --sim-s 600 --multiples 1`), and more memory than a 24 GB machine has at 4x.
"""

import argparse

from benchmarks import fleet, single_replica, sweep

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--fleet-scale", default="0.02", help="fleet.scale of the fleet's 1x multiple")
ap.add_argument("--multiples", default="0.25,1,4")
ap.add_argument("--sim-s", default="120")
ap.add_argument("--repeats", default="1", help="rounds of the fleet cases, alternated; each case's median run reported")
ap.add_argument("--no-sweep", action="store_true", help="skip the sweep benchmark (~1.5 minutes on 2 cores)")
args = ap.parse_args()
single_replica.main([])
fleet.main(["--scale", args.fleet_scale, "--sim-s", args.sim_s, "--multiples", args.multiples, "--repeats", args.repeats])
if not args.no_sweep:
    sweep.main([])
