"""The sampler's row kinds on CPU: greedy rows by argmax, plain temperature rows by the fused
kernel (cpu_kernels ops.sample), rows with top-k or top-p by torch ops, in one batch."""

from __future__ import annotations

import pytest
import torch

from contracts.sampling import SamplingParams
from model_worker.runner.cpu_kernels import ops
from model_worker.runner.sampler import Sampler, row_seed

pytestmark = pytest.mark.skipif(ops.kernels() is None, reason="the CPU kernels do not build here (no C++ compiler)")

VOCAB = 1000


def _logits(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_batch_samples_each_row_by_its_kind(dtype):
    logits = _logits(5, dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.5, seed=3),
              SamplingParams(temperature=1.3, seed=11)]
    tokens = Sampler(torch.device("cpu"), seed=0).sample(logits, params, [0, 4, 0, 0, 9])
    argmax = logits.float().argmax(dim=-1)
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    # Plain rows are the kernel's draw with the (seed, output_index) seed.
    for row, params_row, index in ((1, params[1], 4), (4, params[4], 9)):
        want = ops.sample(logits[row:row + 1], torch.tensor([1 / params_row.temperature]),
                          torch.tensor([row_seed(params_row.seed, index)]))
        assert tokens[row] == int(want[0])
    # The top-p row draws from its nucleus.
    probs = torch.softmax(logits[3].float(), dim=-1)
    ordered = probs.sort(descending=True)
    nucleus = ordered.indices[:int(((ordered.values.cumsum(0) - ordered.values) < 0.5).sum())]
    assert tokens[3] in nucleus.tolist()


def test_a_seeded_row_draws_the_same_token_whatever_the_batch():
    logits = _logits(6)
    params = [SamplingParams(temperature=1.0, seed=5)] + [SamplingParams(temperature=1.0)] * 5
    alone = Sampler(torch.device("cpu"), seed=1).sample(logits[:1], params[:1], [3])
    for seed in (2, 3):
        batch = Sampler(torch.device("cpu"), seed=seed).sample(logits, params, [3] * 6)
        assert batch[0] == alone[0]
    # Moved among top-k rows (the torch path for them), the plain row still draws the same token.
    mixed = Sampler(torch.device("cpu"), seed=4).sample(
        logits[[1, 0]].contiguous(), [SamplingParams(temperature=1.0, top_k=5), params[0]], [0, 3])
    assert mixed[1] == alone[0]


def test_unseeded_rows_draw_fresh_noise_each_step_and_a_fresh_sampler_replays_it():
    logits = torch.zeros(4, VOCAB)  # uniform: a repeated draw would show as identical tokens
    params = [SamplingParams(temperature=1.0)] * 4
    first, second = Sampler(torch.device("cpu"), seed=9), Sampler(torch.device("cpu"), seed=9)
    draws = [first.sample(logits, params, [0] * 4) for _ in range(5)]
    assert len({tuple(d) for d in draws}) == 5
    assert [second.sample(logits, params, [0] * 4) for _ in range(5)] == draws


def test_the_sampler_benchmark_times_every_path_and_refuses_bad_arguments():
    from loadtest.benchmarks import bench_sampler

    report = bench_sampler.main(["--rows", "1,3", "--vocab", "50", "--calls", "1", "--repeats", "1", "--threads", "1"])
    for dtype in ("bfloat16", "float32"):
        for rows in ("1", "3"):
            assert set(report["ms_per_call"][dtype][rows]) == {"torch", "one_pass", "argmax"}
            assert all(ms > 0 for ms in report["ms_per_call"][dtype][rows].values())
    for bad in (["--rows", "0"], ["--vocab", "0"], ["--dtypes", "float16"]):
        with pytest.raises(SystemExit):
            bench_sampler.parse_args(bad)


def test_the_idle_ttft_benchmark_times_each_condition_and_refuses_bad_arguments(tiny_model_dir):
    from loadtest.benchmarks import bench_idle_ttft

    report = bench_idle_ttft.main(["--model", tiny_model_dir, "--rounds", "2", "--idle-s", "0.05",
                                   "--evict-mb", "4", "--prompt-tokens", "20", "--threads", "1"])
    assert set(report["ttft_runs_ms"]) == set(bench_idle_ttft.CONDITIONS)
    assert all(len(runs) == 2 and all(ms > 0 for ms in runs) for runs in report["ttft_runs_ms"].values())
    assert report["idle_over_hot"] > 0 and report["evicted_over_hot"] > 0
    for bad in (["--rounds", "0"], ["--idle-s", "-1"], ["--prompt-tokens", "0"], ["--evict-mb", "0"]):
        with pytest.raises(SystemExit):
            bench_idle_ttft.parse_args(bad)
