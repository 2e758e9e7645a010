"""Benchmarks of iterserve. `traces` and `metrics` are pure (standard library + numpy); the
runnable benchmarks (`python -m loadtest.benchmarks.bench_engine`) import torch and transformers."""
