"""Benchmark: load generation, the side-by-side run, and reports read from saved results."""
