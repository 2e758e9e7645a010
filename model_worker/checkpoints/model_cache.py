"""The model cache: checkpoints iterserve builds or converts itself, each built once.

A checkpoint directory only ever appears by the rename of a finished build, made under a file
lock, so concurrent replicas never see or produce a half-written one, and a crashed build leaves
at most a staging directory that the next build replaces. A directory's name carries `build_key`:
its inputs and the versions of the libraries that wrote it, so an upgraded library builds afresh
instead of serving files another version wrote.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

CACHE_DIR_ENV = "ITERSERVE_CACHE_DIR"
# What a build writes depends on these: transformers writes its version into config.json and
# reads GGUF, tokenizers trains the tiny model's vocabulary, torch draws its seeded weights,
# safetensors lays out the weight file, gguf dequantises.
BUILD_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "gguf")


def cache_root(cache_dir: str | None = None) -> Path:
    """The argument, else $ITERSERVE_CACHE_DIR, else ~/.cache/iterserve."""
    return Path(cache_dir or os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "iterserve")


def build_key(*inputs: str) -> str:
    """Hex digest of a build's inputs and the installed versions of BUILD_LIBRARIES."""
    sha = hashlib.sha256()
    for part in (*inputs, *(f"{name}=={library_version(name)}" for name in BUILD_LIBRARIES)):
        sha.update(part.encode("utf-8") + b"\0")
    return sha.hexdigest()


def library_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def is_complete(path: Path) -> bool:
    # A directory only appears by rename of a finished build, so these markers are enough.
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(staging_dir)` unless it already exists."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_complete(target):  # another process may have built it while we waited
                _build_atomically(target, build)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        if target.exists():  # a leftover partial directory from a crashed build
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
