"""The iteration-level scheduler through the real engine, over a fake runner that reads its KV."""

from __future__ import annotations

import pytest

from model_worker import RequestRejected, SamplingParams
from tests.unit.conftest import run_to_completion
from tests.unit.fakes import reference_tokens


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 900 for i in range(n)]


def step_log(engine, steps: int, tokens: dict | None = None):
    """Per step: running ids after the step, and ids that finished in it."""
    log = []
    for _ in range(steps):
        outs = engine.step()
        for out in outs:
            if tokens is not None:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        log.append(({r.request_id for r in engine.scheduler.running},
                    {o.request_id for o in outs if o.finished}))
    return log


def test_short_request_leaves_and_waiting_one_joins_next_step(make_engine):
    # The seed's example: A needs 8 tokens, B needs 64, C waits; max_num_seqs=2.
    engine = make_engine(max_num_seqs=2)
    engine.add_request("A", prompt(10, 1), greedy(8))
    engine.add_request("B", prompt(10, 2), greedy(64))
    engine.add_request("C", prompt(10, 3), greedy(8))
    tokens: dict = {}
    log = step_log(engine, 9, tokens)
    assert all(log[i][0] == {"A", "B"} for i in range(7))
    assert "A" in log[7][1], "A finishes at step 8"
    assert "C" in log[8][0], "C is running at step 9"
    for rid, more in run_to_completion(engine)["tokens"].items():
        tokens[rid].extend(more)
    assert tokens["A"] == reference_tokens(prompt(10, 1), 8)
    assert tokens["C"] == reference_tokens(prompt(10, 3), 8)


def test_static_batching_holds_short_result_until_batch_ends(make_engine):
    engine = make_engine(max_num_seqs=2, batching="static")
    engine.add_request("A", prompt(10, 1), greedy(8))
    engine.add_request("B", prompt(10, 2), greedy(64))
    engine.add_request("C", prompt(10, 3), greedy(8))
    tokens: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished_at[out.request_id] = step
        if step <= 64:
            ids = {s.request_id for s in engine.runner.batches[-1].sequences}
            assert ids == {"A", "B"}, "A keeps its batch slot (and a decode per step) until B ends"
    assert finished_at["A"] == finished_at["B"] == 64
    assert finished_at["C"] == 64 + 8, "C joins only after the whole batch"
    for rid, seed, n in (("A", 1, 8), ("B", 2, 64), ("C", 3, 8)):
        assert tokens[rid] == reference_tokens(prompt(10, seed), n), "padding steps add no tokens"


def test_chunked_prefill_never_stalls_running_decodes(make_engine):
    budget = 256
    engine = make_engine(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=budget)
    for i in range(8):
        engine.add_request(f"d{i}", prompt(20, i), greedy(40))
    engine.step()  # the 8 prompts (160 tokens) fit in one step
    engine.add_request("long", prompt(2000, 99), greedy(4))
    runner = engine.runner
    first = len(runner.batches)
    while "long" not in {s.request_id for s in runner.batches[-1].sequences if s.sample}:
        engine.step()
    prefill_steps = runner.batches[first:]
    assert len(prefill_steps) >= 2000 // budget, "the long prompt was chunked"
    for batch in prefill_steps:
        assert batch.num_scheduled_tokens <= budget
        decodes = [s for s in batch.sequences if s.request_id.startswith("d")]
        assert len(decodes) == 8 and all(len(s.token_ids) == 1 for s in decodes)
    result = run_to_completion(engine)
    assert result["tokens"]["long"][-3:] == reference_tokens(prompt(2000, 99), 4)[-3:]


def test_no_step_exceeds_budget_and_all_requests_finish(make_engine):
    engine = make_engine(num_kv_blocks=512, block_size=8, max_num_batched_tokens=64, max_num_seqs=5)
    for i in range(12):
        engine.add_request(f"r{i}", prompt(15 + 13 * i, i), greedy(5 + i))
    result = run_to_completion(engine)
    assert all(b.num_scheduled_tokens <= 64 and len(b.sequences) <= 5 for b in engine.runner.batches)
    for i in range(12):
        assert result["tokens"][f"r{i}"] == reference_tokens(prompt(15 + 13 * i, i), 5 + i)


def test_preemption_under_tiny_cache_completes_every_request_exactly(make_engine):
    engine = make_engine(num_kv_blocks=24, block_size=4, max_num_batched_tokens=64)
    for i in range(6):
        engine.add_request(f"r{i}", prompt(20, i), greedy(40))
    result = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0, "the cache was meant to be too small"
    for i in range(6):
        assert result["tokens"][f"r{i}"] == reference_tokens(prompt(20, i), 40)


def test_preemption_takes_lowest_priority_latest_first(make_engine):
    engine = make_engine(num_kv_blocks=12, block_size=4, max_num_batched_tokens=64)
    engine.add_request("batch_early", prompt(8, 1), greedy(30), priority="batch")
    engine.add_request("inter_early", prompt(8, 2), greedy(30))
    engine.add_request("inter_late", prompt(8, 3), greedy(30))
    preempted = []
    while engine.has_unfinished():
        engine.step()
        preempted.extend(engine.runner.batches[-1].preempted_request_ids)
    assert preempted and preempted[0] == "batch_early"


def test_interactive_admitted_before_earlier_batch_request(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("running", prompt(5, 0), greedy(3))
    engine.step()
    engine.add_request("batch", prompt(5, 1), greedy(3), priority="batch")
    engine.add_request("interactive", prompt(5, 2), greedy(3))
    order = []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.runner.batches[-1].sequences:
            if seq.request_id not in order:
                order.append(seq.request_id)
    assert order == ["running", "interactive", "batch"]


def test_interactive_takes_the_seat_of_a_running_batch_request(make_engine):
    # Batch work fills every seat; an interactive request arriving later is scheduled at the next
    # step, the latest batch request gives up its seat, and every request still gets its tokens.
    engine = make_engine(max_num_seqs=2)
    engine.add_request("batch_a", prompt(6, 1), greedy(20), priority="batch")
    engine.add_request("batch_b", prompt(6, 2), greedy(20), priority="batch")
    tokens: dict = {}
    step_log(engine, 3, tokens)
    engine.add_request("inter", prompt(6, 3), greedy(5))
    log = step_log(engine, 1, tokens)
    assert log[0][0] == {"batch_a", "inter"}
    assert engine.runner.batches[-1].preempted_request_ids == ["batch_b"]
    while engine.has_unfinished():
        step_log(engine, 1, tokens)
    for rid, seed, n in (("batch_a", 1, 20), ("batch_b", 2, 20), ("inter", 3, 5)):
        assert tokens[rid] == reference_tokens(prompt(6, seed), n)


def test_same_class_never_takes_a_seat(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("first", prompt(6, 1), greedy(6))
    engine.step()
    engine.add_request("second", prompt(6, 2), greedy(6))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["first"]
    assert not engine.runner.batches[-1].preempted_request_ids
    run_to_completion(engine)


def test_prefix_cache_hits_cost_no_compute_and_give_same_tokens(make_engine):
    engine = make_engine(num_kv_blocks=256, block_size=4)
    shared = prompt(40, 5)
    engine.add_request("first", shared + [7, 8, 9], greedy(6))
    run_to_completion(engine)
    engine.add_request("second", shared + [10, 11], greedy(6))
    first_step = len(engine.runner.batches)
    result = run_to_completion(engine)
    computed = sum(len(s.token_ids) for b in engine.runner.batches[first_step:] for s in b.sequences)
    assert computed == 42 - 40 + 6 - 1, "the 40 shared tokens (10 full blocks) were not recomputed"
    assert result["tokens"]["second"] == reference_tokens(shared + [10, 11], 6)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 40


def test_fully_cached_prompt_still_computes_last_token(make_engine):
    engine = make_engine(num_kv_blocks=64, block_size=4)
    engine.add_request("a", prompt(16, 1), greedy(2))
    run_to_completion(engine)
    engine.add_request("b", prompt(16, 1), greedy(2))
    result = run_to_completion(engine)
    assert result["tokens"]["b"] == reference_tokens(prompt(16, 1), 2)


def test_abort_from_every_state_frees_everything(make_engine):
    engine = make_engine(num_kv_blocks=20, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    engine.add_request("chunking", prompt(30, 1), greedy(10))
    engine.add_request("decoding", prompt(4, 2), greedy(30))
    engine.add_request("waiting", prompt(4, 3), greedy(5))
    engine.step()
    engine.step()
    scheduler = engine.scheduler
    assert scheduler.requests["chunking"].num_computed_tokens < 30
    assert engine.abort("waiting") and engine.abort("chunking")
    for _ in range(3):
        engine.step()
    assert engine.abort("decoding")
    assert not engine.abort("decoding"), "a second abort is a no-op"
    # preempted: fill the cache so one is pushed back
    engine.add_request("p1", prompt(20, 4), greedy(50))
    engine.add_request("p2", prompt(20, 5), greedy(50))
    while not scheduler.num_preemptions:
        engine.step()
    victim = next(r for r in scheduler.waiting)
    assert engine.abort(victim.request_id)
    other = "p1" if victim.request_id == "p2" else "p2"
    assert engine.abort(other)
    assert not engine.has_unfinished()


def test_abort_held_static_result(make_engine):
    engine = make_engine(batching="static", max_num_seqs=2)
    engine.add_request("short", prompt(4, 1), greedy(2))
    engine.add_request("long", prompt(4, 2), greedy(10))
    for _ in range(3):
        engine.step()
    assert engine.abort("short"), "a finished-but-held request can be aborted"
    assert "short" not in run_to_completion(engine)["finished_at"]


@pytest.mark.parametrize("prompt_len,max_tokens,code", [(100, 10, "context_length_exceeded"),
                                                        (10, 100, "context_length_exceeded")])
def test_request_over_context_is_refused_at_submission(make_engine, prompt_len, max_tokens, code):
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestRejected, match="maximum context length is 64") as info:
        engine.add_request("big", prompt(prompt_len), greedy(max_tokens))
    assert info.value.code == code
    assert not engine.has_unfinished()


def test_request_larger_than_whole_cache_is_refused(make_engine):
    engine = make_engine(num_kv_blocks=4, block_size=4)
    with pytest.raises(RequestRejected, match="whole cache has 4"):
        engine.add_request("big", prompt(10), greedy(10))


def test_the_scheduler_itself_refuses_a_request_larger_than_the_cache(make_engine):
    """Its own invariant, guarded for a request added to it directly (as the simulator does),
    past the engine's door: such a request would wait forever."""
    from contracts.serving import RequestTimings
    from model_worker.sched.request import Priority, Request

    def request(request_id: str, max_tokens: int) -> Request:
        return Request(request_id=request_id, prompt_token_ids=prompt(10), sampling_params=greedy(max_tokens),
                       priority=Priority.INTERACTIVE, timings=RequestTimings(arrival_s=0.0))

    engine = make_engine(num_kv_blocks=4, block_size=4)
    with pytest.raises(RequestRejected, match="needs 5 KV blocks .* whole cache has 4") as info:
        engine.scheduler.add_request(request("big", 10))
    assert info.value.code == "context_length_exceeded"
    engine.scheduler.add_request(request("fits", 6))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.scheduler.add_request(request("fits", 2))
    run_to_completion(engine)


def test_bad_inputs_are_refused_clearly(make_engine):
    engine = make_engine()
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("e", [], greedy(2))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request("v", [5, 100000], greedy(2))
    with pytest.raises(RequestRejected, match="no tokenizer"):
        engine.add_request("s", "text", greedy(2))
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("p", [5], greedy(2), priority="urgent")
    engine.add_request("dup", [5, 6], greedy(2))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("dup", [5, 6], greedy(2))
    run_to_completion(engine)


def test_eos_and_stop_token_ids_finish_with_reason(make_engine):
    engine = make_engine(eos_token_ids=(1,))
    p = prompt(6)
    expected = reference_tokens(p, 5)
    engine.runner.forced[("eos", 2)] = 1
    engine.add_request("eos", p, SamplingParams(max_tokens=5, temperature=0))
    engine.add_request("stopid", p, SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[expected[1]]))
    engine.add_request("len", p, SamplingParams(max_tokens=5, temperature=0))
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.num_output_tokens, out.stop_reason)
    assert reasons["eos"] == ("stop", 3, None)
    assert reasons["stopid"] == ("stop", 2, expected[1])
    assert reasons["len"] == ("length", 5, None)


def test_timings_and_stats(make_engine):
    engine = make_engine()
    clock = engine.clock
    engine.add_request("t", prompt(8), greedy(3))
    clock.advance(0.5)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
        clock.advance(0.1)
    timings = outs[-1].timings
    assert timings.queue_s == pytest.approx(0.5)
    assert timings.ttft_s == pytest.approx(0.5)
    assert len(timings.token_times_s) == 3
    stats = engine.stats(include_block_hashes=True)
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.ttft_p50_s == pytest.approx(0.5)
    assert stats.requests_finished["length"] == 1
    assert len(stats.cached_block_hashes) == stats.num_cached_kv_blocks > 0


def test_reset_prefix_cache_makes_a_replay_start_cold(make_engine):
    engine = make_engine()
    engine.add_request("a", prompt(40, 1), greedy(2))
    engine.add_request("b", prompt(40, 2), greedy(200))
    while "a" in engine.scheduler.requests:
        engine.step()
    assert not engine.reset_prefix_cache(), "refused while a request is live"
    run_to_completion(engine)
    assert engine.reset_prefix_cache()
    engine.add_request("c", prompt(40, 1), greedy(2))
    result = run_to_completion(engine)
    assert engine.stats().prefix_cache_hit_tokens == 0
    assert result["tokens"]["c"] == reference_tokens(prompt(40, 1), 2)


def test_emulated_step_time_pads_each_step_with_a_sleep():
    # Benchmarks pad steps to an accelerator-like duration. Real clock, fake runner: 6 steps of
    # 20 ms each take at least 120 ms and the tokens are unchanged.
    import time

    from model_worker import EngineConfig, LLMEngine
    from tests.unit.fakes import FakeKVRunner

    engine = LLMEngine(EngineConfig(block_size=4, emulated_step_time_s=0.02),
                       model_runner=FakeKVRunner(64, 4, 4096, 1000, ()), clock=time.monotonic)
    engine.add_request("r", prompt(6, 1), greedy(6))
    tokens: list[int] = []
    started = time.monotonic()
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
    assert time.monotonic() - started >= 6 * 0.02
    assert tokens == reference_tokens(prompt(6, 1), 6)


def test_emulated_step_time_is_validated():
    from model_worker import EngineConfig

    with pytest.raises(ValueError, match="emulated_step_time_s"):
        EngineConfig(emulated_step_time_s=-1)
