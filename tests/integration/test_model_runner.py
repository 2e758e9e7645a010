"""TorchModelRunner against transformers: same logits, same greedy tokens, batch-invariant seeds.

Every checkpoint here is built locally (the embedded default model, and tiny seeded Qwen2,
Mistral and llama3-RoPE Llama models saved with save_pretrained), so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import model_worker.checkpoints.tiny_model as tiny_model
from contracts.sampling import SamplingParams
from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.config import EngineConfig
from model_worker.runner import TorchModelRunner
from model_worker.runner.llama import ISLANDS, compute_rope_frequencies

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
ATOL = 1e-4
TEXT = ("The scheduler decides, the runner executes. A runner never changes request state; it only reads "
        "this batch and returns one sampled token per sequence whose sample flag is set.")


def make_runner(model_dir: str, **overrides) -> TorchModelRunner:
    settings = dict(model=model_dir, num_kv_blocks=128, block_size=16, num_threads=2, dtype="float32")
    settings.update(overrides)
    return TorchModelRunner(EngineConfig(**settings))


def seq(request_id: str, token_ids: list[int], start: int, blocks: list[int], sample: bool = True,
        params: SamplingParams = GREEDY, output_index: int = 0) -> ScheduledSequence:
    return ScheduledSequence(request_id=request_id, token_ids=list(token_ids), start_position=start,
                             block_table=list(blocks), sample=sample, sampling_params=params,
                             output_index=output_index)


def step(*sequences: ScheduledSequence) -> SchedulerOutput:
    return SchedulerOutput(sequences=list(sequences), num_scheduled_tokens=sum(len(s.token_ids) for s in sequences))


def hf_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> TorchModelRunner:
    return make_runner(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(runner) -> list[int]:
    token_ids = runner.tokenizer(TEXT)["input_ids"]
    assert len(token_ids) > 20
    return token_ids


# --- (a), (b): logits at every position equal transformers' ---

def test_tiny_model_logits_match_transformers(runner, tiny_model_dir, prompt):
    ours = runner.compute_logits(step(seq("a", prompt, 0, range(0, 4))), all_tokens=True)
    torch.testing.assert_close(ours, hf_logits(tiny_model_dir, prompt), atol=ATOL, rtol=0)


def test_tiny_model_chunked_logits_match_transformers(runner, tiny_model_dir, prompt):
    """Chunks of 7 tokens attend to the earlier chunks through the paged cache."""
    blocks = list(range(4, 8))
    chunks = [runner.compute_logits(step(seq("a", prompt[i:i + 7], i, blocks)), all_tokens=True)
              for i in range(0, len(prompt), 7)]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(tiny_model_dir, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_progress_counts_each_forward_and_each_layer_it_computes(runner, prompt, rows):
    """What the engine loop's heartbeat reads (model_worker/engine/engine_loop.py): a prompt of
    1, 3 or 40 rows, then a decode step (each layer one kernel call where the kernels are built,
    else the calls from Python), each add one plus the number of layers."""
    layers = len(runner.model.weights.layers)
    before = runner.progress
    runner.compute_logits(step(seq("p", prompt[:rows], 0, [9, 10, 11])))
    assert runner.progress - before == 1 + layers
    runner.compute_logits(step(seq("p", prompt[rows:rows + 1], rows, [9, 10, 11])))
    assert runner.progress - before == 2 * (1 + layers)


def _mixed_step_logits(runner: TorchModelRunner, prompt: list[int]) -> torch.Tensor:
    """Every token's logits of a mixed step (a prompt chunk beside two decodes), after a first step."""
    runner.compute_logits(step(seq("a", prompt[:5], 0, [1]), seq("b", prompt[:9], 0, [2]),
                               seq("c", prompt[:20], 0, [3, 4])))
    mixed = step(seq("a", prompt[5:6], 5, [1]), seq("b", prompt[9:10], 9, [2]), seq("d", prompt[:12], 0, [5]))
    return runner.compute_logits(mixed, all_tokens=True)


def test_weights_packed_for_onednn_give_the_logits_of_plain_weights(tiny_model_dir, prompt, monkeypatch):
    """In float32 the CPU decoder with its matrices packed for oneDNN (post-op residuals and SiLU,
    our norm, rotary and attention kernels) gives the logits of the same decoder over plain
    weights, F.linear and torch's ops."""
    from model_worker.runner import linear

    packed_runner = make_runner(tiny_model_dir, dtype="float32")
    if not packed_runner.model.packed:
        pytest.skip("oneDNN does not run float32 on this CPU")
    monkeypatch.setattr(linear, "packs", lambda device_type, dtype: False)
    plain_runner = make_runner(tiny_model_dir, dtype="float32", attention_backend="torch")
    assert not plain_runner.model.packed
    torch.testing.assert_close(_mixed_step_logits(packed_runner, prompt), _mixed_step_logits(plain_runner, prompt),
                               atol=ATOL, rtol=0)


def test_the_packed_bfloat16_decoder_is_as_close_to_float32_as_the_plain_one(tiny_model_dir, prompt, monkeypatch):
    """In bfloat16 the packed decoder rounds differently from torch's op-by-op path (a residual
    added inside the matmul, the rotation in float32, each rounded once): its logits must be no
    farther from the float32 decoder's than the plain bfloat16 decoder's are."""
    from model_worker.runner import linear

    packed_runner = make_runner(tiny_model_dir, dtype="bfloat16")
    if not packed_runner.model.packed:
        pytest.skip("oneDNN does not run bfloat16 on this CPU")
    reference = _mixed_step_logits(make_runner(tiny_model_dir, dtype="float32"), prompt)
    monkeypatch.setattr(linear, "packs", lambda device_type, dtype: False)
    plain_runner = make_runner(tiny_model_dir, dtype="bfloat16", attention_backend="torch")
    packed_error = (_mixed_step_logits(packed_runner, prompt) - reference).abs()
    plain_error = (_mixed_step_logits(plain_runner, prompt) - reference).abs()
    assert packed_error.mean() <= 1.1 * plain_error.mean(), (packed_error.mean(), plain_error.mean())
    assert packed_error.max() <= 1.5 * plain_error.max(), (packed_error.max(), plain_error.max())


def _save_tiny(tmp_path, config, tokenizer_dir: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    out = str(tmp_path / config.model_type)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def _tiny_configs(vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    shape = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256, max_position_embeddings=512, initializer_range=0.05)
    return {
        "qwen2": Qwen2Config(tie_word_embeddings=False, **shape),
        # head_dim 48 differs from hidden_size / num_heads = 32: it must come from the config.
        "mistral": MistralConfig(head_dim=48, tie_word_embeddings=False, **shape),
        "llama3_rope": LlamaConfig(attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **shape),
    }


@pytest.mark.parametrize("name", ["qwen2", "mistral", "llama3_rope"])
def test_tiny_checkpoints_match_transformers(name, tmp_path, tiny_model_dir, runner):
    config = _tiny_configs(runner.vocab_size)[name]
    model_dir = _save_tiny(tmp_path, config, tiny_model_dir)
    tiny = make_runner(model_dir, num_kv_blocks=32)
    # Long enough to pass original_max_position_embeddings (64) of the llama3 RoPE.
    token_ids = [(i * 37) % runner.vocab_size for i in range(100)]
    ours = tiny.compute_logits(step(seq("a", token_ids, 0, range(7))), all_tokens=True)
    torch.testing.assert_close(ours, hf_logits(model_dir, token_ids), atol=ATOL, rtol=0)
    if name == "qwen2":
        assert tiny.model.weights.layers[0].qkv_bias is not None


def test_legacy_rope_fields_and_dynamic_rope_refused():
    legacy = SimpleNamespace(rope_theta=500.0, rope_scaling=None)
    inv_freq, scaling = compute_rope_frequencies(legacy, head_dim=8)
    torch.testing.assert_close(inv_freq, 1.0 / 500.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert scaling == 1.0
    dynamic = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="dynamic"):
        compute_rope_frequencies(dynamic, head_dim=8)


def test_bad_checkpoints_and_lengths_are_refused(tmp_path, tiny_model_dir, runner):
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="max_model_len"):
        make_runner(tiny_model_dir, max_model_len=4096)
    gpt2_dir = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2_dir)
    with pytest.raises(ValueError, match="unsupported model_type"):
        make_runner(str(gpt2_dir))
    with pytest.raises(ValueError, match="not a local directory"):
        make_runner(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="block table"):
        runner.execute(step(seq("a", list(range(20)), 0, [0])))


# --- (c): chunked prefill mixed with decodes gives the full-prefill token ---

def test_chunked_prefill_mixed_with_decodes_matches_full_prefill(tiny_model_dir, prompt):
    runner = make_runner(tiny_model_dir, num_kv_blocks=64)
    other = prompt[::-1][:20]
    expected = runner.execute(step(seq("ref", prompt, 0, range(0, 4))))[0]
    expected_other = runner.execute(step(seq("ref-other", other, 0, range(4, 6))))[0]

    long_blocks, other_blocks = list(range(10, 14)), list(range(20, 22))
    cut1, cut2 = 16, 29
    assert runner.execute(step(seq("other", other, 0, other_blocks),
                               seq("long", prompt[:cut1], 0, long_blocks, sample=False))) == [expected_other]
    other_next = runner.execute(step(seq("other", [expected_other], len(other), other_blocks, output_index=1),
                                     seq("long", prompt[cut1:cut2], cut1, long_blocks, sample=False)))[0]
    tokens = runner.execute(step(seq("other", [other_next], len(other) + 1, other_blocks, output_index=2),
                                 seq("long", prompt[cut2:], cut2, long_blocks)))
    assert tokens[1] == expected


def test_prefix_hit_on_block_written_in_the_same_step(tiny_model_dir, prompt):
    """B reuses A's first block while A is still writing it: B must read it after A's write."""
    runner = make_runner(tiny_model_dir, num_kv_blocks=64)
    expected = runner.execute(step(seq("ref", prompt, 0, range(0, 4))))[0]
    writer = seq("A", prompt[:32], 0, [10, 11], sample=False)
    reader = seq("B", prompt[16:], 16, [10, 20, 21, 22])
    assert runner.execute(step(writer, reader)) == [expected]


# --- (d): greedy decoding reproduces transformers' generate ---

def test_greedy_batch_decoding_matches_generate(runner, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    texts = ["def execute(self, batch):", "Block hashes are chained and namespaced", TEXT]
    prompts = [runner.tokenizer(t)["input_ids"] for t in texts]
    num_new = 12
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = [model.generate(torch.tensor([p]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
                [0, len(p):].tolist() for p in prompts]
    tables = [list(range(40 + 8 * i, 48 + 8 * i)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    batch = [seq(f"r{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]
    for index in range(num_new):
        for i, token in enumerate(runner.execute(step(*batch))):
            outputs[i].append(token)
        batch = [seq(s.request_id, [outputs[i][-1]], s.context_len, s.block_table, output_index=index + 1)
                 for i, s in enumerate(batch)]
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == len(outputs)
    assert len(set(outputs[0])) > 1, "the default model should not repeat one token"


# --- (e): seeded sampling does not depend on the batch ---

def _decode(runner: TorchModelRunner, rows: list[tuple[list[int], SamplingParams]], num_new: int,
            first_block: int) -> list[list[int]]:
    batch = [seq(f"s{i}", p, 0, range(first_block + 8 * i, first_block + 8 * i + 8), params=params)
             for i, (p, params) in enumerate(rows)]
    outputs: list[list[int]] = [[] for _ in rows]
    for index in range(num_new):
        for i, token in enumerate(runner.execute(step(*batch))):
            outputs[i].append(token)
        batch = [seq(s.request_id, [outputs[i][-1]], s.context_len, s.block_table, params=s.sampling_params,
                     output_index=index + 1) for i, s in enumerate(batch)]
    return outputs


def test_seeded_sampling_is_batch_invariant_and_survives_recompute(runner, prompt):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234)
    alone = _decode(runner, [(prompt, seeded)], 10, first_block=80)[0]
    others = [(prompt[:9], SamplingParams(temperature=1.0)), (prompt[5:], GREEDY),
              (prompt[3:15], SamplingParams(temperature=0.5, top_k=5, seed=7))]
    batched = _decode(runner, [others[0], (prompt, seeded), *others[1:]], 10, first_block=80)[1]
    assert batched == alone
    # Preempted after 6 tokens and recomputed: the prompt and those tokens prefilled in one go.
    recomputed = runner.execute(step(seq("re", prompt + alone[:6], 0, range(120, 128), params=seeded,
                                         output_index=6)))
    assert recomputed == [alone[6]]
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1235)
    assert _decode(runner, [(prompt, other_seed)], 10, first_block=80)[0] != alone


def test_top_k_one_is_greedy(runner, prompt):
    expected = runner.execute(step(seq("g", prompt, 0, range(0, 4))))
    assert runner.execute(step(seq("k", prompt, 0, range(4, 8), params=SamplingParams(top_k=1)))) == expected


# --- (f): the default model is built once ---

def test_tiny_model_path_is_idempotent(model_cache_dir, tiny_model_dir, monkeypatch):
    def no_rebuild(out_dir):
        raise AssertionError("default model rebuilt although it is cached")

    monkeypatch.setattr(tiny_model, "build_checkpoint", no_rebuild)
    assert tiny_model.tiny_model_path(model_cache_dir) == tiny_model_dir


def test_tiny_model_builds_the_same_files_every_time(tmp_path, tiny_model_dir):
    """Two builds and the cached one agree byte for byte: the cache key (the corpus) fixes the
    checkpoint. Its vocabulary is full, the special tokens first."""
    from transformers import AutoTokenizer

    builds = [tmp_path / "one", tmp_path / "two"]
    for out_dir in builds:
        out_dir.mkdir()
        tiny_model.build_checkpoint(out_dir)
    files = [{path.name: path.read_bytes() for path in sorted(out_dir.iterdir())} for out_dir in builds]
    assert files[0] == files[1]
    cached = {path.name: path.read_bytes() for path in sorted(Path(tiny_model_dir).iterdir())}
    assert cached == files[0]
    tokenizer = AutoTokenizer.from_pretrained(builds[0])
    assert len(tokenizer) == tiny_model.VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(tiny_model.SPECIAL_TOKENS) == [0, 1, 2, 3]


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_top_p_keeps_exactly_the_sorted_nucleus(path):
    """The sort-free top-p of CPU (topk window, then bisection for flat rows) and the sync-free
    full sort of CUDA keep the same tokens as the textbook rule over a full sort."""
    from model_worker.runner.sampler import _apply_top_p, _apply_top_p_sorted

    apply = _apply_top_p if path == "cpu" else _apply_top_p_sorted
    generator = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 3.0, 10.0):  # flat rows need bisection, peaked ones fit the window
        probs = (torch.randn(8, 3000, generator=generator) * scale).softmax(-1)
        top_ps = [0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0]
        kept = apply(probs, torch.tensor(top_ps).unsqueeze(1)) > 0
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
        limit = torch.tensor(top_ps, dtype=torch.float64).unsqueeze(1)
        keep_sorted = mass_before < limit
        expected = torch.zeros_like(kept).scatter_(1, order, keep_sorted)
        # float32 sums in another order may put a token whose mass-before is within rounding of
        # top_p on the other side of the cut: only such tokens may differ.
        on_the_edge = torch.zeros_like(kept).scatter_(1, order, (mass_before - limit).abs() < 1e-5)
        assert not ((kept != expected) & ~on_the_edge).any()


# --- the flash-attn backend's metadata and K/V gathering, with a reference kernel on CPU ---

def _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      block_table=None):
    """flash_attn_varlen_func semantics in plain torch: causal is bottom-right aligned."""
    assert causal
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        query = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]
        query_len, key_len = query.shape[0], int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        if block_table is None:
            keys, values = k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]], v[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]
        else:
            keys = k[block_table[i].long()].flatten(0, 1)[:key_len]
            values = v[block_table[i].long()].flatten(0, 1)[:key_len]
        mask = torch.arange(key_len)[None, :] <= torch.arange(query_len)[:, None] + (key_len - query_len)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
            scale=softmax_scale, enable_gqa=True)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("block_size", [16, 256])  # gathered varlen K/V, and the paged block_table path
def test_flash_attn_backend_logic_matches_torch_backend(tiny_model_dir, prompt, block_size):
    from model_worker.runner.attention.flash_attn_backend import FlashAttentionBackend

    torch_runner = make_runner(tiny_model_dir, num_kv_blocks=16, block_size=block_size)
    flash_runner = make_runner(tiny_model_dir, num_kv_blocks=16, block_size=block_size)
    from model_worker.runner.uploader import Uploader

    fake_flash = FlashAttentionBackend.__new__(FlashAttentionBackend)
    fake_flash._varlen = _reference_varlen
    fake_flash.upload = Uploader(torch.device("cpu"), pin=True)  # the packed copy path, on CPU
    flash_runner.attention = flash_runner.model.attention = fake_flash
    assert_same_logits_over_mixed_steps(flash_runner, torch_runner, prompt, block_size, first_block=0)


def assert_same_logits_over_mixed_steps(runner, reference, prompt, block_size, first_block):
    """Three steps mixing fresh prompts, a chunk over a paged context and decodes: every token's
    logits from `runner` equal `reference`'s."""
    per_seq = -(-80 // block_size)
    tables = [list(range((first_block + i) * per_seq, (first_block + i + 1) * per_seq)) for i in range(3)]
    steps = [
        step(seq("a", prompt[:20], 0, tables[0]), seq("b", prompt[5:9], 0, tables[1])),
        step(seq("b", [7], 4, tables[1]), seq("a", prompt[20:], 20, tables[0]), seq("c", prompt[:1], 0, tables[2])),
        step(seq("c", [9], 1, tables[2]), seq("a", [11], len(prompt), tables[0]), seq("b", [3], 5, tables[1])),
    ]
    for batch in steps:
        torch.testing.assert_close(runner.compute_logits(batch, all_tokens=True),
                                   reference.compute_logits(batch, all_tokens=True), atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [16, 5])
def test_triton_backend_matches_transformers_and_torch_backend(tiny_model_dir, prompt, block_size):
    """The whole model through our Triton kernels (interpreted on CPU): transformers' logits at every
    position, chunked prefill over the paged cache, and mixed decode steps as the torch backend."""
    from model_worker.runner.attention import triton_kernels

    if not (triton_kernels.triton_available() and (triton_kernels.interpreting() or torch.cuda.is_available())):
        pytest.skip("needs triton, and a GPU or TRITON_INTERPRET=1")
    triton_runner = make_runner(tiny_model_dir, num_kv_blocks=64, block_size=block_size, attention_backend="triton")
    torch_runner = make_runner(tiny_model_dir, num_kv_blocks=64, block_size=block_size)
    assert triton_runner.attention.name == "triton"
    per_seq = -(-80 // block_size)
    table = list(range(per_seq))
    chunks = [triton_runner.compute_logits(step(seq("a", prompt[i:i + 13], i, table)), all_tokens=True)
              for i in range(0, len(prompt), 13)]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(tiny_model_dir, prompt), atol=ATOL, rtol=0)
    assert_same_logits_over_mixed_steps(triton_runner, torch_runner, prompt, block_size, first_block=1)


class _ReplayByRerun:
    """A stand-in for torch.cuda.CUDAGraph on CPU: replay runs the captured forward again into the
    captured output. Like a real graph it sees only the static buffers it was captured over, so a
    step whose inputs were not copied into them gives wrong tokens here too."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


def _rerun_graph_api():
    from model_worker.runner.cuda_graphs import GraphAPI

    def capture(fn, pool):
        out = fn()
        return _ReplayByRerun(fn, out), out

    return GraphAPI(capture=capture, new_pool=lambda: None)


def test_decode_graph_path_matches_eager(tiny_model_dir, prompt):
    """Decode steps of 1, 3 and 5 sequences (padded to graphs of 1, 4 and 8) through the static
    buffers give the eager runner's tokens, and padded rows write no K/V; prefill and mixed steps
    run eagerly."""
    from model_worker.runner.attention import triton_kernels
    from model_worker.runner.cuda_graphs import DecodeGraphs

    if not (triton_kernels.triton_available() and triton_kernels.interpreting()):
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    graphed = make_runner(tiny_model_dir, num_kv_blocks=64, attention_backend="triton")
    eager = make_runner(tiny_model_dir, num_kv_blocks=64, attention_backend="triton")
    graphed.graphs = DecodeGraphs(graphed.model.forward, graphed.kv_caches, graphed.device, 8,
                                  -(-graphed.max_model_len // graphed.block_size), _rerun_graph_api())
    graphed.graphs.capture_all()
    assert sorted(graphed.graphs.graphs) == [1, 2, 4, 8]
    assert all(torch.count_nonzero(k) == 0 for k, _ in graphed.kv_caches), "padding wrote K/V at capture"
    prompts = [prompt[:9 + 3 * i] for i in range(5)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(5)]
    for runner in (graphed, eager):  # prefill: eager in both
        runner.tokens = runner.execute(step(*[seq(f"r{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]))
    assert graphed.graphs.num_replays == 0 and graphed.tokens == eager.tokens
    outputs = {id(r): [list(r.tokens)] for r in (graphed, eager)}
    for index, rows in enumerate([[0], [0, 1, 2], [0, 1, 2, 3, 4], [2, 4]]):
        for runner in (graphed, eager):
            last = outputs[id(runner)][-1]
            batch = step(*[seq(f"r{i}", [last[i]], len(prompts[i]) + index, tables[i], output_index=index + 1)
                           for i in rows])
            new = list(last)
            for i, token in zip(rows, runner.execute(batch)):
                new[i] = token
            outputs[id(runner)].append(new)
    assert outputs[id(graphed)] == outputs[id(eager)]
    assert graphed.graphs.num_replays == 4
    # Same K/V in the same slots (a padded batch's matmuls may round differently in the last
    # bit), and nothing anywhere else: padded rows wrote nothing.
    for (k_graph, v_graph), (k_eager, v_eager) in zip(graphed.kv_caches, eager.kv_caches):
        torch.testing.assert_close(k_graph, k_eager, atol=ATOL, rtol=0)
        torch.testing.assert_close(v_graph, v_eager, atol=ATOL, rtol=0)
        assert torch.equal(k_graph == 0, k_eager == 0), "padded rows wrote K/V"
    # A decode with a prefill beside it runs eagerly.
    mixed = step(seq("r0", [1], 40, tables[0]), seq("new", prompt[:5], 0, [30]))
    graphed.execute(mixed)
    assert graphed.graphs.num_replays == 4


def test_profile_steps_run_on_the_runner(tiny_model_dir):
    """The worst steps the GPU's KV cache is sized from are steps the runner accepts."""
    from model_worker.runner.memory_plan import profile_steps

    runner = make_runner(tiny_model_dir, num_kv_blocks=8, max_model_len=100)
    steps, num_blocks = profile_steps(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=runner.max_model_len,
                                      block_size=runner.block_size, graph_batch=8)
    runner.kv_caches = runner._allocate_kv_cache(num_blocks)
    for profile in steps:
        tokens = runner.execute(profile.batch)
        assert len(tokens) == len(profile.batch.sequences)


def test_decode_groups_cut_padding_and_keep_every_row():
    from model_worker.runner.attention.torch_backend import split_decode_groups

    blocks = np.array(sorted([1] * 30 + [2] * 10 + [20] * 20 + [48] * 4))
    groups = split_decode_groups(blocks)
    assert groups[0][0] == 0 and groups[-1][1] == len(blocks)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:])), "contiguous, no row lost"
    padded = sum((end - start) * blocks[end - 1] for start, end in groups)
    assert padded < 0.5 * len(blocks) * blocks[-1]
    assert split_decode_groups(np.array([5] * 64)) == [(0, 64)], "equal lengths need no split"


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_top_p_that_rounds_to_zero_keeps_the_top_token(path):
    """A top_p that rounds to 0 in float32 keeps the top token: with no token past the cut, the
    threshold's gather would index -1 (an IndexError in the engine)."""
    from model_worker.runner.sampler import _apply_top_p, _apply_top_p_sorted

    apply = _apply_top_p if path == "cpu" else _apply_top_p_sorted
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    kept = apply(probs, torch.tensor([1e-300, 0.0]).unsqueeze(1)) > 0
    assert kept.tolist() == [[False, True, False], [True, False, False]]


def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it_natively(monkeypatch):
    from model_worker.runner import model_runner

    cpu = torch.device("cpu")
    monkeypatch.setattr(model_runner, "has_native_bf16", lambda: False)
    assert model_runner.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(model_runner, "has_native_bf16", lambda: True)
    assert model_runner.resolve_dtype("auto", cpu) == torch.bfloat16
    assert model_runner.resolve_dtype("float32", cpu) == torch.float32
    assert model_runner.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_the_float32_final_norm_is_on_below_float32_only_and_islands_switch_by_name(tiny_model_dir, prompt):
    decoder = make_runner(tiny_model_dir).model
    assert not any(getattr(decoder, island) for island in ISLANDS)
    runner = make_runner(tiny_model_dir, dtype="bfloat16")
    decoder = runner.model
    assert decoder.fp32_final_norm and not (decoder.fp32_residual or decoder.fp32_rotary or decoder.fp32_logits)
    assert decoder.lm_head_read_per_step().dtype == torch.bfloat16
    batch = step(seq("a", prompt, 0, range(0, 4)))
    default = runner.compute_logits(batch, all_tokens=True)
    decoder.set_islands(**dict.fromkeys(ISLANDS, True))
    assert decoder.lm_head_read_per_step().dtype == torch.float32, "the float32 head, remade"
    every = runner.compute_logits(batch, all_tokens=True)
    assert torch.equal(every.argmax(-1)[:4], default.argmax(-1)[:4]) or (every - default).abs().max() < 0.5
    with pytest.raises(ValueError, match="unknown float32 island"):
        decoder.set_islands(fp32_everything=True)
