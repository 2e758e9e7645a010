"""Steps of up to small_rows rows through our panel kernel (EngineConfig.small_batch_kernel): the
same greedy text as oneDNN's packed matmuls, on the trained model, and the kernel really run; a
layer in one C++ call (cpu_kernels small_layer) gives the bits of its calls from Python."""

from __future__ import annotations

import pytest
import torch

from model_worker import EngineConfig, LLMEngine, SamplingParams
from model_worker.runner import linear as packed
from model_worker.runner.cpu_kernels import ops

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (ops.has_panel_linear(torch.float32) and packed.packs("cpu", torch.float32)),
                                 reason="needs our kernels with AVX-512 BW and oneDNN")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def greedy(engine: LLMEngine, tokenizer, prompts: list[str], max_tokens: int = 24) -> dict[str, list[int]]:
    for i, text in enumerate(prompts):
        engine.add_request(str(i), tokenizer.encode(text), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_few_row_steps_give_the_packed_matmuls_text_and_run_the_kernel(smollm2_dir, monkeypatch):
    off = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", small_batch_kernel=False, num_kv_blocks=64))
    decoder = off.runner.model
    assert decoder.small_rows == 0 and all(layer.panels is None for layer in decoder.weights.layers)
    tokenizer = off.runner.tokenizer
    # Three at once (steps of 3 rows), and one alone (1 row).
    expected = greedy(off, tokenizer, PROMPTS) | {"alone": greedy(off, tokenizer, PROMPTS[:1])["0"]}
    del off, decoder

    calls = []
    real = ops.panel_linear
    monkeypatch.setattr(ops, "panel_linear", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    on = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", num_kv_blocks=64))
    assert on.runner.model.small_rows >= 3
    on.runner.model._small_layers = None  # every matmul a call from Python, so each is counted
    assert all(layer.panels is not None for layer in on.runner.model.weights.layers)
    got = greedy(on, on.runner.tokenizer, PROMPTS) | {"alone": greedy(on, on.runner.tokenizer, PROMPTS[:1])["0"]}
    assert got == expected
    assert {1, 3} <= set(calls)  # 3 rows for the decodes of the batch of three, 1 for the lone request


def greedy_with_a_late_prompt(engine: LLMEngine, tokenizer, max_tokens: int = 12) -> dict[str, list[int]]:
    """Two requests, and a third added after three steps: its prompt joins their decodes in one
    step (a mixed step: decode rows and a prompt chunk)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, text in enumerate(PROMPTS[:2]):
        engine.add_request(f"early-{i}", tokenizer.encode(text), params)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            engine.add_request("late", tokenizer.encode(PROMPTS[2]), params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_layer_in_one_call_gives_the_bits_of_its_calls_from_python(smollm2_dir, monkeypatch, dtype):
    """Greedy tokens, and the logits of every step, of a lone request, of three at once and of a
    prompt that joins two running decodes: decode-only steps, prompt-only steps and mixed ones."""
    if not ops.has_panel_linear(getattr(torch, dtype)):
        pytest.skip(f"panel_linear does not run {dtype} here")
    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype=dtype, num_kv_blocks=64))
    decoder, runner = engine.runner.model, engine.runner
    fused = decoder._small_layers
    assert fused is not None and len(fused) == len(decoder.weights.layers)
    logits: list[torch.Tensor] = []
    real_forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: logits.append(real_forward(*a, **k)) or logits[-1])
    layered = []
    real_layers = ops.small_layers
    monkeypatch.setattr(ops, "small_layers", lambda hidden, *a, **k: layered.append(hidden.shape[0]) or
                        real_layers(hidden, *a, **k))
    results = {}
    for name, layers in (("fused", fused), ("calls", None)):
        decoder._small_layers = layers
        engine.reset_prefix_cache()
        logits.clear()
        results[name] = (greedy(engine, runner.tokenizer, PROMPTS) | {"alone": greedy(engine, runner.tokenizer,
                                                                                      PROMPTS[:1])["0"]}
                         | greedy_with_a_late_prompt(engine, runner.tokenizer),
                         [t.clone() for t in logits])
    prompt_lens = [len(runner.tokenizer.encode(text)) for text in PROMPTS]
    # Decode steps of 1, 2 and 3 rows; where prefill_attention is built (AVX-512), also the three
    # prompts in one step, one alone, two in one step, and the late prompt beside the two decodes.
    # Without it (AVX2) a step with a prompt chunk takes the calls from Python.
    prompt_steps = {sum(prompt_lens), prompt_lens[0], prompt_lens[0] + prompt_lens[1], prompt_lens[2] + 2}
    if ops.prefill_attention_built(decoder.spec.head_dim):
        assert {1, 2, 3} | prompt_steps <= set(layered)
    else:
        assert set(layered) == {1, 2, 3}
    (fused_tokens, fused_logits), (call_tokens, call_logits) = results["fused"], results["calls"]
    assert fused_tokens == call_tokens
    assert len(fused_logits) == len(call_logits) > 0
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, call_logits))


@pytest.mark.parametrize("panels_on_amx, cpu_amx, rows, float32_rows",
                         [(True, True, 1024, 1024), (False, True, 4, 1024), (False, False, 128, 128)])
def test_panels_take_prompt_steps_on_amx_cpus_and_bfloat16_leaves_them_where_only_onednn_has_amx(
        monkeypatch, panels_on_amx, cpu_amx, rows, float32_rows):
    """Where oneDNN multiplies on AMX tiles and our panels cannot, it wins past 4 rows; where no one
    has AMX both use dpbf16ps, and the panels' one-call layers win up to 128. On an AMX CPU the
    panels' one-call layers win up to 1024 rows (a 256-token prompt 1.2x faster) in both dtypes."""
    monkeypatch.setattr(ops, "panel_amx", lambda: panels_on_amx)
    monkeypatch.setattr(ops, "cpu_has_amx", lambda: cpu_amx)
    assert ops.panel_max_rows(torch.bfloat16) == rows
    assert ops.panel_max_rows(torch.float32) == float32_rows


def test_amx_is_read_from_the_cpus_flags_and_assumed_where_unknown(tmp_path):
    zen4, sapphire = tmp_path / "zen4", tmp_path / "spr"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    sapphire.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert ops.cpu_has_amx(str(zen4)) is False
    assert ops.cpu_has_amx(str(sapphire)) is True
    assert ops.cpu_has_amx(str(tmp_path / "absent")) is True
