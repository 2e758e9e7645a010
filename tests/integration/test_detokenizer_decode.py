"""The detokenizer's direct decode through the Rust Tokenizer gives what transformers' decode gives."""

from __future__ import annotations

import random

import pytest

from model_worker.checkpoints.models import load_tokenizer
from model_worker.engine.detokenizer import IncrementalDetokenizer, text_decoder


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tiny_model_dir):
    path = tiny_model_dir if request.param == "tiny" else request.getfixturevalue("smollm2_dir")
    return load_tokenizer(path)


def test_the_direct_decode_is_taken_and_equals_transformers_decode(tokenizer):
    decode = text_decoder(tokenizer)
    assert getattr(decode, "direct", False), "both models' tokenizers are Rust tokenizers without space clean-up"
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(2000):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(12))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert not getattr(text_decoder(tokenizer), "direct", False)


def test_streamed_text_is_the_whole_decode(tokenizer):
    rng = random.Random(1)
    ids = [rng.randrange(len(tokenizer)) for _ in range(200)]
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    streamed = "".join(detok.add_token(t) for t in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
