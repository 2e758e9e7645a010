"""Block hashes are computed once, by the caller (the ingress), and the engine's cache uses them as
sent, after a check: a caller hashing with another block size or cache key is refused clearly."""

from __future__ import annotations

import pytest

import model_worker.sched.request as request_module
from model_worker import RequestRejected, SamplingParams
from model_worker.sched.hashing import hash_prompt_blocks
from tests.unit.conftest import run_to_completion

PROMPT = list(range(1, 43))  # 10 full blocks of 4 tokens and 2 more


def test_sent_hashes_are_used_as_sent_and_the_prompt_is_not_hashed_again(make_engine, monkeypatch):
    engine = make_engine(block_size=4)
    hashes = hash_prompt_blocks(PROMPT, 4, "tenant-a")
    calls = []
    original = request_module.hash_block_tokens
    monkeypatch.setattr(request_module, "hash_block_tokens", lambda *a: calls.append(a) or original(*a))
    request = engine.add_request("a", PROMPT, SamplingParams(max_tokens=2), cache_key="tenant-a", block_hashes=hashes)
    assert request.block_hashes == hashes and calls == []  # the prompt's 10 blocks: not hashed again
    run_to_completion(engine)


def test_sent_hashes_hit_the_prefix_cache_like_the_engines_own(make_engine):
    engine = make_engine(block_size=4)
    engine.add_request("own", PROMPT, SamplingParams(max_tokens=1))
    run_to_completion(engine)
    engine.add_request("sent", PROMPT, SamplingParams(max_tokens=1), block_hashes=hash_prompt_blocks(PROMPT, 4))
    run_to_completion(engine)
    assert engine.stats().prefix_cache_hit_tokens == 40


@pytest.mark.parametrize("hashes, cache_key, match", [
    (hash_prompt_blocks(PROMPT, 8), None, "5 block hashes for a prompt of 10 full blocks of 4 tokens"),
    (hash_prompt_blocks(PROMPT, 4, "tenant-b"), "tenant-a", "another block size or cache_key"),
    (hash_prompt_blocks(PROMPT, 4), "tenant-a", "another block size or cache_key"),
    ([str(h) for h in hash_prompt_blocks(PROMPT, 4)], None, "must be a list of ints"),
])
def test_hashes_that_do_not_match_this_cache_are_refused(make_engine, hashes, cache_key, match):
    engine = make_engine(block_size=4)
    with pytest.raises(RequestRejected, match=match) as caught:
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=2), cache_key=cache_key, block_hashes=hashes)
    assert caught.value.param == "block_hashes"
    assert not engine.has_unfinished()


def test_without_prefix_caching_sent_hashes_are_not_needed(make_engine):
    engine = make_engine(block_size=4, enable_prefix_caching=False)
    request = engine.add_request("a", PROMPT, SamplingParams(max_tokens=2), block_hashes=[1, 2, 3])
    assert request.block_hashes == []
    run_to_completion(engine)
