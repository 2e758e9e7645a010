"""Load generation and benchmarks.

At the top, `iterserve bench` (`bench_cli`) and its parts: the load generator (`client`), the
workloads (`workloads`) over the Azure trace (`traces`), per-request results and their summary
(`results`) and reports with plots (`report`); beside them `engine_driver`, which drives an
LLMEngine offline through a workload, and `local_serve`, a local Ray Serve for benchmarks and tests.
`traces` and `workloads` are pure (standard library + numpy). `benchmarks/` holds the benchmark
scripts (`python -m loadtest.benchmarks.NAME`, which import torch and transformers; figures in
docs/benchmarks.md) and `faults/` the fault suite (docs/reliability.md)."""
