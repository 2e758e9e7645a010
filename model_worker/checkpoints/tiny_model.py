"""The tiny model: a random-weight Llama with a BPE tokenizer, built on demand (`--model tiny`).

It lets the engine, its tests and its multi-replica benchmarks run fast with no model at all: the
first call trains a byte-level BPE tokenizer on seeded pseudo-English generated at build time
(model_worker/checkpoints/tiny_corpus.py says why generated), initialises a small
LlamaForCausalLM from a fixed seed, and saves both as an ordinary Hugging Face checkpoint. Every
later call finds it in the cache. It loads through the same loader as any real checkpoint. Its
weights are random, so its text is gibberish: the embedded default model, the one that answers,
is SmolLM2 (model_worker/checkpoints/models.py).

The cache subdirectory is named by BUILDER_VERSION and a hash of the generated corpus and the
libraries' versions, so changing any of them (the generator, its seed, its word lists, an upgraded
transformers) builds a fresh checkpoint instead of reusing a stale one (model_worker/checkpoints/model_cache.py builds it atomically, under a lock).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from model_worker.checkpoints.model_cache import build_key, build_once, cache_root
from model_worker.checkpoints.tiny_corpus import tiny_corpus

# Bump when anything below changes the built checkpoint (tokenizer, shapes, init, files).
BUILDER_VERSION = 2

VOCAB_SIZE = 4096
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Small enough that a CPU decode step takes a few milliseconds, large enough to have the shape of
# a real model: grouped-query attention (4 query heads share 2 kv heads), head_dim 64.
# initializer_range 0.1 instead of transformers' 0.02: at 0.02 the random model repeats one token
# forever, which hides decode bugs; at 0.1 greedy outputs vary token to token.
MODEL_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=704, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                   initializer_range=0.1)
INIT_SEED = 0


def tiny_model_path(cache_dir: str | None = None) -> str:
    """Directory of the tiny checkpoint, building it first if it is not in the cache.

    cache_dir: argument, else $ITERSERVE_CACHE_DIR, else ~/.cache/iterserve.
    """
    # Generating the corpus takes well under a second, and keys the cache by content.
    return str(build_once(cache_root(cache_dir) / cache_dir_name(tiny_corpus()), build_checkpoint))


def cache_dir_name(corpus: str) -> str:
    """The checkpoint's directory in the cache: a new one for every builder version, corpus and
    version of the libraries that write it."""
    return f"tiny-llama-v{BUILDER_VERSION}-{build_key(_corpus_digest(corpus))[:12]}"


def _corpus_digest(corpus: str) -> str:
    return hashlib.sha256(corpus.encode("utf-8")).hexdigest()


def build_checkpoint(out_dir: Path) -> None:
    """Write tokenizer + config + weights + generation config into out_dir."""
    corpus = tiny_corpus()
    tokenizer = _train_tokenizer(corpus)
    # The embedding has a row per token: a corpus too poor to fill the vocabulary would silently
    # give the model another shape.
    if len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer trained to {len(tokenizer)} tokens, not {VOCAB_SIZE}: "
                           "the corpus has too few distinct pieces")
    tokenizer.save_pretrained(out_dir)
    _build_model(tokenizer, out_dir, _corpus_digest(corpus))


def _train_tokenizer(corpus: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                        pad_token=EOS_TOKEN, additional_special_tokens=[IM_START, IM_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(tokenizer, out_dir: Path, corpus_sha256: str) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(IM_END)]
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=bos_id,
                         eos_token_id=eos_ids[0], pad_token_id=eos_ids[0], **MODEL_SHAPE)
    torch.manual_seed(INIT_SEED)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    # Chat replies end with <|im_end|>, plain completions with <|end_of_text|>: both stop.
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=eos_ids[0]).save_pretrained(out_dir)
    (out_dir / "iterserve_builder.json").write_text(
        json.dumps({"builder_version": BUILDER_VERSION, "corpus_sha256": corpus_sha256}, indent=2) + "\n")
