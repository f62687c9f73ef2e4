"""Run every benchmark: ``python -m benchmarks``."""

from benchmarks import single_replica

single_replica.main([])
