"""Building kernels.cpp once per machine into the model cache, and loading it.

The library is compiled with the system's C++ compiler (`$CXX`, else g++) for this CPU
(-march=native) into `<model cache>/kernels/<key>/`, where the key covers the source, the compiler
and its flags, and the CPU's feature flags: a cache directory shared by machines of other kinds
never hands one of them a library built for another. A build happens under a file lock and appears
by a rename, so concurrent replicas build it once and never load a half-written file.

Where no compiler is found or the build fails, `load()` returns None with the reason in
`unavailable_reason()`; the runner then keeps the torch path (model_worker/runner/attention/).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from model_worker.checkpoints.model_cache import cache_root
from model_worker.runner.cpu_features import cpu_flags

SOURCE = Path(__file__).with_name("kernels.cpp")
LIBRARY_NAME = "libiterserve_kernels.so"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
COMPILE_TIMEOUT_S = 300


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def build_key(cxx: str, source: bytes) -> str:
    sha = hashlib.sha256()
    for part in (source, cxx.encode(), _compiler_version(cxx).encode(), " ".join(FLAGS).encode(),
                 " ".join(sorted(cpu_flags())).encode()):
        sha.update(part + b"\0")
    return sha.hexdigest()[:24]


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def library_path(cache_dir: str | None = None, source: bytes | None = None) -> Path:
    """The built library, compiling it first if this machine has none yet; KernelBuildError if it cannot.
    `source`: another kernels.cpp to build instead of this one (a benchmark's earlier commit)."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    source = SOURCE.read_bytes() if source is None else source
    target_dir = cache_root(cache_dir) / "kernels" / build_key(cxx, source)
    target = target_dir / LIBRARY_NAME
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():  # another process may have built it while this one waited
            _compile(cxx, target, source)
    return target


def _compile(cxx: str, target: Path, source: bytes) -> None:
    fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    source_path = target.parent / "kernels.cpp"
    try:
        source_path.write_bytes(source)
        result = subprocess.run([cxx, *FLAGS, str(source_path), "-o", staging], capture_output=True, text=True,
                                timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise KernelBuildError(f"{cxx} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(staging, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{cxx} could not run: {exc}") from exc
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


def load_library(cache_dir: str | None = None, source: bytes | None = None) -> ctypes.CDLL:
    """The kernels as a ctypes library (of `source` where given, as library_path). torch must be
    imported first: its OpenMP runtime is then the libgomp.so.1 this library binds to, and the two
    share one thread team."""
    import torch  # noqa: F401  (loads torch's libgomp.so.1 before the library asks for it)

    try:
        return ctypes.CDLL(str(library_path(cache_dir, source)))
    except OSError as exc:
        raise KernelBuildError(f"the built kernels do not load: {exc}") from exc
