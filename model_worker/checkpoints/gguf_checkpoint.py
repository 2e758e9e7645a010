"""GGUF checkpoints: a Llama-family .gguf file converted once into an ordinary Hugging Face one.

transformers reads a GGUF file (with the `gguf` package) and dequantizes it, but refuses to
`save_pretrained` such a model, and reading the file again at every start costs tens of seconds
(rebuilding the tokenizer from GGUF metadata alone takes ~14 s here). So the first use writes
what the normal loader reads, under the model cache, in a directory named by the file's content
hash: config.json (with `architectures`), model.safetensors (float32, as dequantized: Q4_1 and
its kin hold values that bfloat16 would round), the tokenizer files with the chat template, and
generation_config.json with the chat EOS. Every later start loads that directory, and a file
with other contents (a re-quantized model under the same name) gets a directory of its own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from model_worker.checkpoints.model_cache import build_key, build_once, cache_root

# Bump when the conversion writes anything differently.
CONVERTER_VERSION = 1
# Tokens that end a turn or a document, by the names Llama-family chat templates give them; the
# ones a tokenizer has become EOS ids of the checkpoint (chat replies end with the first kind).
_EOS_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")


def gguf_checkpoint_path(gguf_file: str | Path, cache_dir: str | None = None) -> str:
    """The Hugging Face checkpoint converted from `gguf_file`, converting it first if needed.
    The directory is named by the file's stem and contents (and the converting libraries'
    versions), so the same file reached by any path (the embedded default, or its path given as
    --model) is converted once."""
    source = Path(gguf_file)
    if not source.is_file():
        raise ValueError(f"GGUF file {source} does not exist")
    digest = _file_digest(source)
    target = cache_root(cache_dir) / f"{source.stem}-v{CONVERTER_VERSION}-{build_key(digest)[:16]}"
    return str(build_once(target, lambda out: convert_gguf(source, out, digest)))


def convert_gguf(source: Path, out_dir: Path, digest: str | None = None) -> None:
    """Write config, weights, tokenizer and generation config of `source` into out_dir."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it; say so before it fails)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as exc:
        raise ValueError(f"converting a GGUF checkpoint needs the gguf and transformers packages: {exc}") from None
    directory, file_name = str(source.parent), source.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file_name, dtype=torch.float32)
    except Exception as exc:  # transformers raises anything from ValueError to struct errors on bad files
        raise ValueError(f"{source} is not a GGUF checkpoint transformers can read "
                         f"({type(exc).__name__}: {exc})") from exc
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    _write_weights(model, config, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out_dir)
    eos_ids = _eos_token_ids(tokenizer, config)
    GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=eos_ids,
                     pad_token_id=config.get("pad_token_id", eos_ids[0])).save_pretrained(out_dir)
    (out_dir / "iterserve_gguf.json").write_text(json.dumps(
        {"converter_version": CONVERTER_VERSION, "source": str(source), "sha256": digest}, indent=2) + "\n")


def _write_weights(model: Any, config: dict[str, Any], out_dir: Path) -> None:
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the embedding matrix, a second time
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _eos_token_ids(tokenizer: Any, config: dict[str, Any]) -> list[int]:
    """The chat EOS first (the template ends each turn with it), then other end tokens."""
    ids: list[int] = []
    vocab = tokenizer.get_vocab()
    for token in _EOS_TOKENS:
        if token in vocab and vocab[token] not in ids:
            ids.append(vocab[token])
    configured = config.get("eos_token_id")
    for token_id in configured if isinstance(configured, list) else [configured]:
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    if not ids:
        raise ValueError("the GGUF file names no end-of-sequence token")
    return ids


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return sha.hexdigest()
