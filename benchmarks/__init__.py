"""Speed benchmarks. Run all with ``python -m benchmarks``; each prints a table and one JSON line per case."""
