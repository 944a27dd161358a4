"""Benchmarks of the broker, run by hand (`python -m bench.leases`), never as timed tests."""
