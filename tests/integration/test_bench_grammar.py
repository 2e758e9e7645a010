"""bench_grammar on the tiny model: each library gets its compile and mask figures (or says why
not), from answers recorded under our own structured output."""

from __future__ import annotations

import pytest

from loadtest.benchmarks import bench_grammar

pytestmark = pytest.mark.integration


def test_each_library_is_measured_on_the_same_answers(tiny_model_dir):
    result = bench_grammar.main(["--model", tiny_model_dir, "--max-tokens", "8", "--batch", "4"])
    assert len(result["answer_tokens"]) == 20 and all(0 < n <= 8 for n in result["answer_tokens"])
    xgrammar = result["libraries"]["xgrammar"]
    assert xgrammar["compile_ms_total"] > 0 and xgrammar["mask_ms_per_step_batch_4"] >= 0
    assert xgrammar["recorded_tokens_masked_out_batch_1"] == 0  # the answers were made under xgrammar
    assert set(result["libraries"]) == set(bench_grammar.LIBRARIES)
