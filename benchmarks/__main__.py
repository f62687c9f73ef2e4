"""Run every benchmark: ``python -m benchmarks`` (single replica, then the fleet at a reduced scale)."""

from benchmarks import fleet, single_replica

single_replica.main([])
fleet.main(["--scale", "0.02", "--sim-s", "120"])
