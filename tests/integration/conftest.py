from __future__ import annotations

import os

import pytest

from model_worker.default_model import CACHE_DIR_ENV, default_model_path


@pytest.fixture(scope="session")
def default_model_cache_dir(tmp_path_factory) -> str:
    """$ITERSERVE_CACHE_DIR when set (reuses a built model across runs), else a fresh temp dir."""
    return os.environ.get(CACHE_DIR_ENV) or str(tmp_path_factory.mktemp("iterserve-cache"))


@pytest.fixture(scope="session")
def default_model_dir(default_model_cache_dir) -> str:
    return default_model_path(default_model_cache_dir)
