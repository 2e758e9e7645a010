"""Benchmark scripts (`python -m loadtest.benchmarks.NAME`): each prints its figures and writes its
results; docs/benchmarks.md has what they measured."""
