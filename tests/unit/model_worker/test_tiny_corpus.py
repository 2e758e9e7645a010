"""The tiny model's tokenizer corpus: the same text every time, plain text, never the project's code."""

from __future__ import annotations

import string
from pathlib import Path

import pytest

from model_worker.checkpoints import model_cache
from model_worker.checkpoints.model_cache import BUILD_LIBRARIES
from model_worker.checkpoints.tiny_corpus import tiny_corpus
from model_worker.checkpoints.tiny_model import BUILDER_VERSION, cache_dir_name

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("contracts", "model_worker", "router", "autoscaler", "deployments", "loadtest", "simulator", "iterserve")


def test_the_corpus_is_the_same_on_every_call_and_set_by_its_seed():
    corpus = tiny_corpus()
    assert corpus == tiny_corpus()
    assert tiny_corpus(seed=1) != corpus
    assert 150_000 < len(corpus) < 300_000


def test_the_corpus_holds_every_printable_ascii_character():
    assert set(string.printable) - set("\t\r\x0b\x0c") <= set(tiny_corpus())


def test_no_line_of_the_projects_source_is_in_the_corpus():
    corpus_lines = {line.strip() for line in tiny_corpus().splitlines()}
    source_lines = {line.strip() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                    for line in path.read_text().splitlines() if len(line.strip()) >= 12}
    assert len(source_lines) > 1000, "the walk found too little source"
    assert not corpus_lines & source_lines


def test_another_corpus_or_builder_version_is_another_cache_directory():
    corpus = tiny_corpus()
    assert cache_dir_name(corpus) == cache_dir_name(tiny_corpus())
    assert cache_dir_name(corpus) != cache_dir_name(corpus + " ")
    assert cache_dir_name(corpus).startswith(f"tiny-llama-v{BUILDER_VERSION}-")


@pytest.mark.parametrize("library", BUILD_LIBRARIES)
def test_another_version_of_a_library_that_writes_the_checkpoint_is_another_cache_directory(library, monkeypatch):
    """transformers writes its version into config.json, torch draws the seeded weights: a cache
    built under other versions would hand back files this install never writes."""
    corpus = tiny_corpus()
    before = cache_dir_name(corpus)
    installed = model_cache.library_version
    monkeypatch.setattr(model_cache, "library_version",
                        lambda name: "0.0.1-other" if name == library else installed(name))
    assert cache_dir_name(corpus) != before
