"""The GPU-only parts that can be checked without a GPU: graph batch sizes, the uploader's
packing, and the worst steps the KV cache is sized from. The graphs themselves replay on CPU with
a stand-in in tests/integration/test_model_runner.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_worker.config import EngineConfig
from model_worker.runner.cuda_graphs import graph_batch_sizes
from model_worker.runner.memory_plan import graph_batch_for, kv_budget_bytes, profile_steps
from model_worker.runner.uploader import Uploader

pytestmark = pytest.mark.integration


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_graph_batch_is_bounded_by_every_limit():
    assert graph_batch_for(max_num_seqs=128, max_num_batched_tokens=512, max_graph_batch=256) == 128
    assert graph_batch_for(max_num_seqs=512, max_num_batched_tokens=64, max_graph_batch=256) == 64
    assert graph_batch_for(max_num_seqs=512, max_num_batched_tokens=2048, max_graph_batch=256) == 256


def test_uploader_packs_into_one_buffer_and_reuses_it():
    upload = Uploader(torch.device("cpu"), pin=True)  # the packing path, on CPU
    arrays = [np.arange(5), np.arange(12).reshape(3, 4) * 10, np.array([], dtype=np.int64), np.array([-1, 7])]
    out = upload(arrays)
    for array, tensor in zip(arrays, out):
        assert tensor.dtype == torch.int64 and tensor.shape == array.shape
        assert tensor.tolist() == array.tolist()
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr(), "one device buffer"
    host = upload._host
    again = upload([np.array([3, 2, 1])])
    assert again[0].tolist() == [3, 2, 1] and upload._host is host, "the host buffer is reused"
    assert out[0].tolist() == [0, 1, 2, 3, 4], "an earlier step's device tensors are not overwritten"
    upload([np.arange(1000)])
    assert upload._host.numel() >= 1000


@pytest.mark.parametrize("max_num_seqs, budget, max_model_len, block_size", [
    (128, 512, 8192, 16), (4, 512, 100, 16), (256, 8192, 4096, 32), (1, 16, 64, 5), (8, 4, 64, 16)])
def test_profile_steps_are_steps_the_scheduler_could_run(max_num_seqs, budget, max_model_len, block_size):
    steps, num_blocks = profile_steps(max_num_seqs, budget, max_model_len, block_size, graph_batch=min(3, max_num_seqs))
    assert num_blocks == -(-max_model_len // block_size)
    names = [step.name for step in steps]
    assert {"long_prefill_chunk", "full_decode_batch", "many_prefills", "graph_decode_batch"} <= set(names)
    for step in steps:
        sequences = step.batch.sequences
        assert step.batch.num_scheduled_tokens == sum(len(s.token_ids) for s in sequences)
        if step.name != "graph_decode_batch":
            assert step.batch.num_scheduled_tokens <= budget and len(sequences) <= max_num_seqs
        for s in sequences:
            assert 1 <= s.context_len <= max_model_len
            assert len(s.block_table) * block_size >= s.context_len
            assert max(s.block_table) < num_blocks and s.sample
    by_name = {step.name: step.batch for step in steps}
    decode = by_name["full_decode_batch"].sequences
    assert len(decode) == min(max_num_seqs, budget)
    assert all(s.context_len == max_model_len and len(s.token_ids) == 1 for s in decode), "the longest context"
    chunk = by_name["long_prefill_chunk"].sequences[0]
    assert len(chunk.token_ids) == min(budget, max_model_len) and chunk.context_len == max_model_len
    assert by_name["many_prefills"].num_scheduled_tokens == min(budget, len(decode) * max_model_len)
    assert len(by_name["graph_decode_batch"].sequences) == min(3, max_num_seqs)


def test_kv_budget():
    gib = 2**30
    # 80 GiB at 0.9: 72 less 16 of weights, 3 of peak and 1 of graphs.
    assert kv_budget_bytes(80 * gib, 64 * gib, 0.9, 16 * gib, 3 * gib, 1 * gib) == 52 * gib
    # Another process holds most of the GPU: only what is free now counts.
    assert kv_budget_bytes(80 * gib, 20 * gib, 0.9, 16 * gib, 3 * gib, 1 * gib) == 16 * gib


def test_engine_config_graph_settings_are_checked():
    assert EngineConfig().enforce_eager is False and EngineConfig().cuda_graph_max_batch == 256
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="no")
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=0)
