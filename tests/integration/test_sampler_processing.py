"""The sampler's logit processing (min_tokens, logit_bias, presence, frequency and repetition
penalties) and its logprobs, each against a reference written row by row in plain torch on the
same logits."""

from __future__ import annotations

import math

import pytest
import torch

from contracts.sampling import SamplingParams, SamplingParamsError
from model_worker.runner.sampler import Sampler

VOCAB = 50
EOS = 2


def _logits(rows: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _reference(logits: torch.Tensor, params: SamplingParams, output_index: int,
               history: tuple[list[int], list[int]] | None) -> torch.Tensor:
    """One row processed the slow, obvious way."""
    row = logits.float().clone()
    if output_index < params.min_tokens:
        for token in [*params.stop_token_ids, *([] if params.ignore_eos else [EOS])]:
            row[token] = -math.inf
    for token, bias in params.logit_bias.items():
        row[token] += bias
    if history is not None:
        prompt, output = history
        for token in set(prompt) | set(output):
            if params.repetition_penalty != 1.0:
                row[token] = (row[token] / params.repetition_penalty if row[token] > 0
                              else row[token] * params.repetition_penalty)
        for token in set(output):
            row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


CASES = [
    (SamplingParams(temperature=0.0), 0, None),
    (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, 9]), 1, None),
    (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]), 3, None),  # past min_tokens
    (SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[5]), 0, None),
    (SamplingParams(temperature=0.0, logit_bias={4: 100.0, 11: -100.0, 12: 2.5}), 0, None),
    (SamplingParams(temperature=0.0, presence_penalty=1.5), 3, ([1, 2, 3], [4, 4, 5])),
    (SamplingParams(temperature=0.0, frequency_penalty=-0.7), 3, ([1, 2, 3], [4, 4, 5])),
    (SamplingParams(temperature=0.0, repetition_penalty=1.8), 4, ([1, 6, 6, 8], [4, 4, 5, 1])),
    (SamplingParams(temperature=0.0, repetition_penalty=0.5, presence_penalty=0.3, frequency_penalty=0.2,
                    logit_bias={0: 3.0}), 5, ([10, 11], [12, 12, 12, 13, 10])),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_processed_row_matches_the_reference_in_one_batch(dtype):
    logits = _logits(len(CASES), dtype)
    params = [p for p, _, _ in CASES]
    indices = [i for _, i, _ in CASES]
    histories = [h if p.penalises_history else None for p, _, h in CASES]
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_ids=[EOS])
    processed = sampler._process(logits.clone(), params, indices, histories)
    for row, (p, index, history) in enumerate(CASES):
        torch.testing.assert_close(processed[row], _reference(logits[row], p, index, history), rtol=1e-6, atol=1e-5)
    tokens = sampler.sample_with_logprobs(logits.clone(), params, indices, histories)[0]
    assert tokens == [int(_reference(logits[row], p, i, h).argmax()) for row, (p, i, h) in enumerate(CASES)]


def test_min_tokens_and_bias_steer_greedy_choices():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    params = [SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=1),
              SamplingParams(temperature=0.0, logit_bias={30: 20.0})]
    tokens = Sampler(torch.device("cpu"), seed=0, eos_token_ids=[EOS]).sample(logits, params, [0, 0, 0])
    assert tokens[0] not in (EOS, 7) and tokens[1] == 7 and tokens[2] == 30


def test_a_step_without_processing_leaves_the_logits_alone():
    logits = _logits(4)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.7, top_k=5, seed=2), SamplingParams(temperature=1.0, top_p=0.8, seed=3)]
    tokens, logprobs = Sampler(torch.device("cpu"), seed=0).sample_with_logprobs(logits, params, [0, 0, 0, 0])
    assert torch.equal(logits, before) and logprobs == {} and len(tokens) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_log_softmax_of_the_processed_logits_over_the_temperature(dtype):
    logits = _logits(4, dtype, seed=5)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.6, seed=4, logprobs=5, presence_penalty=1.0),
              SamplingParams(temperature=0.0),  # asks for none
              SamplingParams(temperature=1.3, top_k=4, seed=9, logprobs=0, logit_bias={3: 5.0})]
    histories = [None, ([1], [3, 3, 8]), None, None]
    tokens, logprobs = Sampler(torch.device("cpu"), seed=0, eos_token_ids=[EOS]).sample_with_logprobs(
        logits.clone(), params, [0, 3, 0, 0], histories)
    assert sorted(logprobs) == [0, 1, 3]
    for row in (0, 1, 3):
        p = params[row]
        reference = torch.log_softmax(_reference(logits[row], p, 0, histories[row]) / (p.temperature or 1.0), dim=-1)
        token_logprob, top_ids, top_logprobs = logprobs[row]
        assert token_logprob == pytest.approx(float(reference[tokens[row]]), abs=1e-5)
        expected = reference.topk(p.logprobs)
        assert top_ids == expected.indices.tolist()
        assert top_logprobs == pytest.approx(expected.values.tolist(), abs=1e-5)
        assert top_logprobs == sorted(top_logprobs, reverse=True)
    # Greedy: the drawn token is the most likely one.
    assert logprobs[0][1][0] == tokens[0] and logprobs[0][0] == pytest.approx(logprobs[0][2][0])


def test_seeded_rows_with_penalties_repeat_exactly_whatever_the_batch():
    logits = _logits(3, seed=8)
    p = SamplingParams(temperature=0.9, seed=17, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=2)
    history = ([1, 2], [3, 3, 4])
    sampler = Sampler(torch.device("cpu"), seed=0)
    alone = sampler.sample_with_logprobs(logits[1:2].clone(), [p], [3], [history])
    batch = Sampler(torch.device("cpu"), seed=5).sample_with_logprobs(
        logits.clone(), [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.0)], [0, 3, 0],
        [None, history, None])
    assert alone[0][0] == batch[0][1]
    assert alone[1][0][0] == pytest.approx(batch[1][1][0]) and alone[1][0][1] == batch[1][1][1]


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("min_tokens", 17),
    ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("logprobs", True)])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError) as refused:
        SamplingParams(max_tokens=16, **{field: value})
    assert refused.value.param == field


def test_a_bias_outside_the_vocabulary_fails_the_step_not_silently():
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler(torch.device("cpu"), seed=0).sample(_logits(1), [SamplingParams(logit_bias={VOCAB: 1.0})], [0])


# ---- prompt logprobs in the engine: chunked prefill, the prefix cache, preemption ----------------


def _all_token_logprobs(engine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position, from one forward of the whole prompt in
    blocks no request holds."""
    from model_worker.sched.batch import ScheduledSequence, SchedulerOutput

    pool = engine.scheduler.kv.pool
    blocks = pool.allocate(-(-len(prompt) // engine.config.block_size))
    try:
        seq = ScheduledSequence("reference", prompt, 0, [b.block_id for b in blocks], True,
                                SamplingParams(max_tokens=1))
        logits = engine.runner.compute_logits(SchedulerOutput([seq], len(prompt)), all_tokens=True)
    finally:
        pool.free(blocks)
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_over_chunks_skip_the_prefix_cache_and_come_once(tiny_model_dir):
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_threads=1, block_size=4,
                                    max_num_batched_tokens=16, num_kv_blocks=64))
    prompt = list(range(5, 45))  # 40 tokens: three chunks of at most 16
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    hits_before = engine.stats().prefix_cache_hit_tokens
    engine.add_request("asks", prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
    chunks = []
    while engine.has_unfinished():
        chunks += [out for out in engine.step() if out.request_id == "asks"]
    with_prompt = [c for c in chunks if c.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is chunks[0]  # once, on the first output token
    entries = with_prompt[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    reference = _all_token_logprobs(engine, prompt)
    for position in range(1, len(prompt)):
        logprob, top_ids, top_values = entries[position]
        assert logprob == pytest.approx(float(reference[position - 1, prompt[position]]), abs=1e-5)
        expected = reference[position - 1].topk(2)
        assert top_ids == expected.indices.tolist() and top_values == pytest.approx(expected.values.tolist(), abs=1e-5)
    assert engine.stats().prefix_cache_hit_tokens == hits_before  # computed, not read from the cache
    engine.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().prefix_cache_hit_tokens > hits_before  # a plain request still hits


def test_prompt_logprobs_of_a_one_token_answer_ride_its_only_chunk(tiny_model_dir):
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_threads=1))
    engine.add_request("one", [7, 8, 9], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (out,) = outputs
    assert out.finished and len(out.prompt_logprobs) == 3 and out.prompt_logprobs[1][1] == []
    assert len(out.logprobs) == 1


# ---- n choices: one prefill, the prompt's blocks shared through their reference counts ----------


@pytest.mark.parametrize("budget", [16, 512])
def test_choices_share_one_prefill_and_seeded_choices_repeat(tiny_model_dir, budget):
    """n choices as the ingress sends them (one request each, the same prompt, their own seeds,
    queued together): the prompt is computed once. The first choice allocates the prompt's blocks
    and the prefix cache holds them from that step; the others, admitted in that step or (with a
    budget smaller than the prompt) once the first's chunks leave room, hit every full block."""
    from contracts.sampling import choice_seed
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_threads=1, block_size=4,
                                    num_kv_blocks=128, max_num_batched_tokens=budget))
    prompt = list(range(5, 5 + 42))  # 10 full blocks and 2 tokens
    full_blocks = len(prompt) // 4

    def run(seed: int) -> dict[str, list[int]]:
        for choice in range(3):
            engine.add_request(f"s{seed}-{choice}", prompt, SamplingParams(
                max_tokens=6, temperature=0.9, seed=choice_seed(seed, choice), ignore_eos=True))
        tokens: dict[str, list[int]] = {f"s{seed}-{c}": [] for c in range(3)}
        shared_counts = None
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
            running = {r.request_id for r in engine.scheduler.running}
            tables = [engine.scheduler.kv.block_ids(rid) for rid in tokens if rid in running]
            if len(tables) == 3 and shared_counts is None:
                pool = engine.scheduler.kv.pool
                shared_counts = [pool.blocks[b].ref_count for b in tables[0][:full_blocks]]
                assert all(t[:full_blocks] == tables[0][:full_blocks] for t in tables)
        assert shared_counts == [3] * full_blocks  # one prefill's blocks, referenced by each choice
        return tokens

    hits_before = engine.stats().prefix_cache_hit_tokens
    first = run(7)
    assert engine.stats().prefix_cache_hit_tokens - hits_before == 2 * full_blocks * 4  # the other choices' hits
    engine.reset_prefix_cache()
    again = run(7)
    assert list(first.values()) == list(again.values())  # a seed gives the same choices
    assert len({tuple(t) for t in first.values()}) == 3  # each choice its own stream


def test_a_grammar_that_fails_mid_generation_fails_its_request_alone(tiny_model_dir):
    """A matcher that raises while filling its mask (a grammar library fault) ends that request with
    an error; the others in its batch go on and finish."""
    from contracts.sampling import StructuredOutput
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_threads=1))
    params = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput("regex", "[a-z ]+"))
    for request_id in ("bystander", "broken", "plain"):
        engine.add_request(request_id, "hello there", params if request_id != "plain" else
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    class FaultyMatcher:
        """The request's matcher, until its third mask."""

        def __init__(self, matcher) -> None:
            self.matcher, self.fills = matcher, 0

        def fill(self, masks, row):
            self.fills += 1
            if self.fills > 2:
                raise RuntimeError("grammar library fault")
            self.matcher.fill(masks, row)

        def accept(self, token):
            return self.matcher.accept(token)

        def is_terminated(self):
            return self.matcher.is_terminated()

    request = engine.scheduler.requests["broken"]
    request.grammar = FaultyMatcher(request.grammar)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = (out.finish_reason, out.error)
    assert finals["broken"][0] == "error" and "grammar library fault" in finals["broken"][1]
    assert finals["bystander"][0] in ("stop", "length") and finals["plain"] == ("length", None)


def test_the_mask_kernel_keeps_exactly_the_allowed_tokens():
    """ops.mask_rows against the bits read one by one in torch: mixed, empty and full words, a
    width that is not a multiple of 32, and only the listed rows touched."""
    from model_worker.runner.cpu_kernels import ops

    if ops.kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    width = 1000  # 31 full words and 8 bits of a last one
    generator = torch.Generator().manual_seed(3)
    masks = torch.randint(-2**31, 2**31 - 1, (5, 32), dtype=torch.int32, generator=generator)
    masks[1] = 0
    masks[2] = -1
    masks[3, :16] = 0
    logits = torch.randn(5, width, generator=generator)
    rows = [0, 1, 2, 3]
    expected = logits.clone()
    for row in rows:
        for token in range(width):
            if not (int(masks[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert ops.mask_rows(logits, masks, rows)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1]).all() and not torch.isinf(logits[2]).any()
