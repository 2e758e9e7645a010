"""The simulator's forward: seconds per engine step from the step's shape, fitted to the real engine.

    python -m simulator.step_model --model tiny --out tiny-cpu.json [--quick]   # measure and fit
    python -m simulator.step_model --llama3-8b-h100 --out llama3-8b-h100.json   # first principles

A step's time is linear in seven features of its SchedulerOutput, every coefficient >= 0:

    t = base_s                                  weights streamed once, launches, input prep
      + prefill_token_s     * prefill_tokens    matmul rows of prompt chunks
      + decode_seq_s        * decode_seqs       matmul row + logits + sampling of each decode
      + context_token_s     * context_tokens    cached KV each sequence's attention reads
      + prefill_attention_s * prefill_attention (query, key) pairs of the chunks' causal attention
      + multi_row_s         * (tokens >= 2)     a step of more than one row: on some CPUs a
                                                one-row matmul takes a faster path
                                                (docs/simulator.md, 'Step-time profiles')
      + idle_wake_s         * after_idle        the first step after the engine had nothing to
                                                do: its OpenMP threads asleep, its caches cold
                                                (docs/simulator.md, 'Validation against the real
                                                engine')

Non-negative coefficients make the model monotone: more work never predicts less time. They are
fitted by non-negative least squares on relative error (each row divided by its measured time), so
a 5 ms step weighs as much as a 500 ms one. A profile is the fitted model plus what it rests on
(model, device, dtype, source, fit error, the measured points), as JSON: simulator/profiles/.

Importing this module imports no torch: measure_profile() loads the runner when called.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

COEFFICIENTS = ("base_s", "prefill_token_s", "decode_seq_s", "context_token_s", "prefill_attention_s", "multi_row_s",
                "idle_wake_s")
FORMAT_VERSION = 1


@dataclass(slots=True)
class StepFeatures:
    # Tokens of sequences computing more than one token this step (prompt chunks).
    prefill_tokens: int
    # Sequences computing exactly one token (decodes, and one-token chunks).
    decode_seqs: int
    # Sum of start_position over every scheduled sequence: the cached KV the step's attention reads.
    context_tokens: int
    # Sum over chunks of n * (start + n / 2): the (query, key) pairs of their causal attention.
    prefill_attention: float
    num_seqs: int
    # The engine had nothing to do before this step (it slept until a request came).
    after_idle: bool = False

    def row(self) -> list[float]:
        """The design-matrix row, in COEFFICIENTS order (1 for base_s)."""
        return [1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens, self.prefill_attention,
                1.0 if self.prefill_tokens + self.decode_seqs >= 2 else 0.0, 1.0 if self.after_idle else 0.0]

    def to_dict(self) -> dict[str, float]:
        return {"prefill_tokens": self.prefill_tokens, "decode_seqs": self.decode_seqs,
                "context_tokens": self.context_tokens, "prefill_attention": self.prefill_attention,
                "num_seqs": self.num_seqs, "after_idle": self.after_idle}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepFeatures:
        return cls(int(data["prefill_tokens"]), int(data["decode_seqs"]), int(data["context_tokens"]),
                   float(data["prefill_attention"]), int(data["num_seqs"]), bool(data.get("after_idle", False)))


def features(batch: Any, after_idle: bool = False) -> StepFeatures:
    """The features of a model_worker.sched.batch.SchedulerOutput: one pass over its sequences."""
    prefill_tokens = decode_seqs = context_tokens = 0
    prefill_attention = 0.0
    for seq in batch.sequences:
        start = seq.start_position
        num_tokens = len(seq.token_ids)
        context_tokens += start
        if num_tokens == 1:
            decode_seqs += 1
        else:
            prefill_tokens += num_tokens
            prefill_attention += num_tokens * (start + 0.5 * num_tokens)
    return StepFeatures(prefill_tokens, decode_seqs, context_tokens, prefill_attention, len(batch.sequences), after_idle)


@dataclass(slots=True)
class StepTimeModel:
    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    prefill_attention_s: float
    multi_row_s: float = 0.0
    idle_wake_s: float = 0.0
    # What the coefficients describe: a model name, "cpu" or "cuda" (or a device class such as
    # "h100"), the resolved dtype.
    model: str = ""
    device: str = ""
    dtype: str = ""
    # How the coefficients were obtained: "measured on ..." or the figures a derivation rests on.
    source: str = ""
    # False for a profile not fitted to measurements of our engine (replace it once one is at hand).
    measured: bool = False
    # Relative error |pred - meas| / meas over the fitted points: num_points, median, p90, max.
    fit: dict[str, Any] = field(default_factory=dict)
    # ISO date the profile was made.
    created: str = ""
    # Settings and constants behind the profile (threads, the derivation's figures; "shapes": the
    # measured step shapes, in the order of `points`).
    details: dict[str, Any] = field(default_factory=dict)
    # The measured (features, seconds) pairs, kept so the fit can be re-checked.
    points: list[tuple[StepFeatures, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def predict(self, batch: Any) -> float:
        """Seconds the step of this SchedulerOutput takes, hot; 0 for an empty one (no step runs).
        The first step after an idle spell costs idle_wake_s more (simulator/replica.py adds it)."""
        return self.predict_features(features(batch))

    def predict_features(self, f: StepFeatures) -> float:
        if f.num_seqs == 0:
            return 0.0
        return (self.base_s + self.prefill_token_s * f.prefill_tokens + self.decode_seq_s * f.decode_seqs
                + self.context_token_s * f.context_tokens + self.prefill_attention_s * f.prefill_attention
                + (self.multi_row_s if f.prefill_tokens + f.decode_seqs >= 2 else 0.0)
                + (self.idle_wake_s if f.after_idle else 0.0))

    def fit_error(self, samples: list[tuple[StepFeatures, float]]) -> dict[str, Any]:
        errors = np.array([abs(self.predict_features(f) - s) / s for f, s in samples])
        return {"num_points": len(samples),
                "median_rel_error": round(float(np.median(errors)), 4),
                "p90_rel_error": round(float(np.percentile(errors, 90)), 4),
                "max_rel_error": round(float(errors.max()), 4)}

    def summary(self) -> str:
        lines = [f"step-time model: {self.model} on {self.device} ({self.dtype}), measured={self.measured}"]
        lines += [f"  {name:<20} {getattr(self, name):.4g}" for name in COEFFICIENTS]
        if self.fit:
            lines.append(f"  fit over {self.fit['num_points']} points: relative error median "
                         f"{self.fit['median_rel_error']:.1%}, p90 {self.fit['p90_rel_error']:.1%}, "
                         f"max {self.fit['max_rel_error']:.1%}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "model": self.model, "device": self.device, "dtype": self.dtype,
                "measured": self.measured, "source": self.source, "created": self.created,
                "coefficients": {name: getattr(self, name) for name in COEFFICIENTS},
                "fit": self.fit, "details": self.details,
                "points": [{**f.to_dict(), "seconds": s} for f, s in self.points]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTimeModel:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"step-time profile format {data.get('format')!r} is not {FORMAT_VERSION}")
        coefficients = data["coefficients"]
        # A profile written before a coefficient existed has it at 0: the step it describes never paid it.
        return cls(*(float(coefficients.get(name, 0.0)) for name in COEFFICIENTS), model=data.get("model", ""),
                   device=data.get("device", ""), dtype=data.get("dtype", ""), source=data.get("source", ""),
                   measured=bool(data.get("measured", False)), fit=dict(data.get("fit") or {}),
                   created=data.get("created", ""), details=dict(data.get("details") or {}),
                   points=[(StepFeatures.from_dict(p), float(p["seconds"])) for p in data.get("points", [])])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def fit(samples: list[tuple[StepFeatures, float]], objective: str = "relative", **metadata: Any) -> StepTimeModel:
    """The StepTimeModel of least error over (features, measured seconds), coefficients >= 0;
    metadata are StepTimeModel's other fields. Its `fit` holds the error, `points` the samples.

    objective "relative": each step's relative error counts alike (a grid of shapes, each the
    median of repeats). "absolute": seconds count, so the fit is unbiased in the mean step time,
    which is what queueing adds up (thousands of noisy single steps of a real run)."""
    if objective not in ("relative", "absolute"):
        raise ValueError(f"objective must be 'relative' or 'absolute', got {objective!r}")
    if len(samples) < len(COEFFICIENTS):
        raise ValueError(f"fitting needs at least {len(COEFFICIENTS)} samples, got {len(samples)}")
    rows = np.array([f.row() for f, _ in samples], dtype=np.float64)
    seconds = np.array([s for _, s in samples], dtype=np.float64)
    if not (np.isfinite(seconds).all() and (seconds > 0).all()):
        raise ValueError("every measured step time must be a finite number > 0")
    if objective == "relative":
        # Row i divided by its time: the residual of row i is then its relative error.
        coefficients = nnls(rows / seconds[:, None], np.ones(len(samples)))
    else:
        coefficients = nnls(rows, seconds)
    model = StepTimeModel(*(float(c) for c in coefficients), points=list(samples), **metadata)
    model.fit = dict(model.fit_error(samples), objective=f"non-negative least squares on {objective} error")
    return model


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active set; scipy is not a
    dependency). Columns are scaled to unit norm first: the features span ten orders of magnitude."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    num_cols = a.shape[1]
    x = np.zeros(num_cols)
    passive = np.zeros(num_cols, dtype=bool)
    tolerance = 1e-12 * max(1.0, float(np.abs(a.T @ b).max()))
    for _ in range(3 * num_cols + 10):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tolerance:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(num_cols)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x towards z until the first passive coefficient reaches 0; drop it.
            blocking = passive & (z <= 0)
            alpha = float(np.min(x[blocking] / (x[blocking] - z[blocking])))
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x / norms


# --- measuring the real engine ---

# A step shape: (query tokens, start position) per sequence.
Shape = list[tuple[int, int]]


def measurement_grid(quick: bool) -> list[Shape]:
    """Pure decodes over several contexts, single chunks from 0 and over a cached context, decodes
    beside a chunk, and several chunks at once (new requests admitted together)."""
    if quick:
        batches, contexts = (1, 8, 32, 128), (16, 512)
        chunks, chunk_starts = (32, 128, 512), (0, 512)
        mixed_decodes, mixed_chunks = (8, 32), ((128, 0), (128, 256))
        multi = ((2, 64),)
    else:
        batches, contexts = (1, 2, 4, 8, 16, 32, 64, 128), (16, 128, 512, 1024)
        chunks, chunk_starts = (32, 64, 128, 256, 512), (0, 256, 1024)
        mixed_decodes, mixed_chunks = (4, 16, 64), ((64, 0), (256, 0), (64, 512), (256, 512))
        multi = ((2, 64), (4, 64), (2, 128), (4, 128))
    grid: list[Shape] = [[(1, context)] * batch for context in contexts for batch in batches]
    grid += [[(chunk, start)] for start in chunk_starts for chunk in chunks]
    grid += [[(1, 256)] * decodes + [chunk] for decodes in mixed_decodes for chunk in mixed_chunks]
    grid += [[(chunk, 0)] * count for count, chunk in multi]
    return grid


def shape_label(shape: Shape) -> str:
    """Reads "128 x 1 @1024 + 1 x 256 @0": count x query tokens @start position, per run of equal sequences."""
    runs: list[list[Any]] = []
    for entry in shape:
        if runs and runs[-1][1] == entry:
            runs[-1][0] += 1
        else:
            runs.append([1, entry])
    return " + ".join(f"{count} x {num_tokens} @{start}" for count, (num_tokens, start) in runs)


def _blocks(shape: Shape, block_size: int) -> list[int]:
    return [-(-(start + num_tokens) // block_size) for num_tokens, start in shape]


def _build_step(shape: Shape, vocab_size: int, block_size: int, rng: np.random.Generator) -> Any:
    """A SchedulerOutput of this shape; sequence i owns fresh blocks after those of sequence i - 1."""
    from contracts.sampling import SamplingParams
    from model_worker.sched.batch import ScheduledSequence, SchedulerOutput

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    sequences, next_block = [], 0
    for i, ((num_tokens, start), num_blocks) in enumerate(zip(shape, _blocks(shape, block_size))):
        sequences.append(ScheduledSequence(
            request_id=f"s{i}", token_ids=rng.integers(0, vocab_size, num_tokens).tolist(), start_position=start,
            block_table=list(range(next_block, next_block + num_blocks)), sample=True, sampling_params=greedy))
        next_block += num_blocks
    return SchedulerOutput(sequences=sequences, num_scheduled_tokens=sum(n for n, _ in shape))


def _fill_kv_cache(runner: Any, context_len: int, rng: np.random.Generator) -> None:
    """Prefill one real sequence of context_len tokens into the first blocks, then copy its blocks
    over the rest of the cache: every timed step reads real KV, at the cost of one prefill."""
    import torch

    block_size = runner.block_size
    num_blocks = -(-context_len // block_size)
    token_ids = rng.integers(0, runner.vocab_size, context_len).tolist()
    for start in range(0, context_len, 512):
        chunk = min(512, context_len - start)
        shape: Shape = [(chunk, start)]
        step = _build_step(shape, runner.vocab_size, block_size, rng)
        step.sequences[0].token_ids = token_ids[start:start + chunk]
        runner.execute(step)
    total_blocks = runner.kv_caches[0][0].shape[0]
    if total_blocks > num_blocks:
        sources = torch.arange(num_blocks, total_blocks, device=runner.kv_caches[0][0].device) % num_blocks
        for k_cache, v_cache in runner.kv_caches:
            k_cache[num_blocks:] = k_cache[sources]
            v_cache[num_blocks:] = v_cache[sources]


def _engine_model(model: str | None) -> str | None:
    return None if model in (None, "smollm2") else model


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def measure_profile(model: str | None, *, device: str = "cpu", dtype: str = "auto", num_threads: int | None = None,
                    quick: bool = False, repeats: int | None = None, seed: int = 0, log=print) -> StepTimeModel:
    """Time the real runner's execute() on a grid of step shapes and fit a StepTimeModel.

    model: "tiny", None or "smollm2" (the embedded SmolLM2-135M-Instruct), or a checkpoint path.
    Each point is the median of `repeats` timings, taken in passes over the whole grid after one
    warm-up pass (so a slow patch of the machine spreads over every point, not one)."""
    import torch

    from model_worker.config import EngineConfig
    from model_worker.checkpoints.models import served_name
    from model_worker.runner.model_runner import TorchModelRunner

    started_s = time.perf_counter()
    repeats = repeats or (3 if quick else 5)
    block_size = 16
    grid = measurement_grid(quick)
    max_context = max(num_tokens + start for shape in grid for num_tokens, start in shape)
    num_kv_blocks = max(sum(_blocks(shape, block_size)) for shape in grid)
    config = EngineConfig(model=_engine_model(model), device=device, dtype=dtype, num_threads=num_threads,
                          block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False)
    runner = TorchModelRunner(config)
    if max_context > runner.max_model_len:
        grid = [s for s in grid if max(n + p for n, p in s) <= runner.max_model_len]
        max_context = max(n + p for s in grid for n, p in s)
    log(f"loaded {served_name(_engine_model(model))} on {runner.device} ({str(runner.dtype).removeprefix('torch.')}) in "
        f"{time.perf_counter() - started_s:.1f} s; {num_kv_blocks} KV blocks; {len(grid)} step shapes x {repeats}")
    rng = np.random.default_rng(seed)
    _fill_kv_cache(runner, max_context, rng)
    steps = [_build_step(shape, runner.vocab_size, block_size, rng) for shape in grid]
    timings: list[list[float]] = [[] for _ in steps]
    for repeat in range(repeats + 1):  # pass 0 warms up and is not kept
        for step, times in zip(steps, timings):
            step_started_s = time.perf_counter()
            runner.execute(step)  # returns sampled token ids: on CUDA it has synchronized
            if repeat:
                times.append(time.perf_counter() - step_started_s)
        log(f"  pass {repeat}/{repeats} done at {time.perf_counter() - started_s:.0f} s")
    samples = [(features(step), statistics.median(times)) for step, times in zip(steps, timings)]
    threads = torch.get_num_threads() if runner.device.type == "cpu" else None
    if runner.device.type == "cuda":
        hardware = torch.cuda.get_device_name(runner.device)
    else:
        hardware = f"{_processor_name()}, {threads} torch threads"
    today = datetime.date.today().isoformat()
    dtype_name = str(runner.dtype).removeprefix("torch.")
    source = (f"measured on {hardware}, torch {torch.__version__}, {today}: wall time of iterserve's "
              f"TorchModelRunner.execute() (input prep, forward with the {runner.attention.name} attention "
              f"backend, sampling), median of {repeats} after a warm-up pass; the scheduler's own time is not in it")
    details = {"quick": quick, "repeats": repeats, "block_size": block_size, "num_kv_blocks": num_kv_blocks,
               "threads": threads, "seed": seed, "shapes": [shape_label(shape) for shape in grid], "load_s": round(sum(runner.load_times_s.values()), 2),
               "measure_s": round(time.perf_counter() - started_s, 1)}
    return fit(samples, model=served_name(_engine_model(model)), device=runner.device.type,
                             dtype=dtype_name, source=source, measured=True, created=today, details=details)


# --- a profile from first principles, for a GPU we do not have ---

def llama3_8b_h100_profile() -> StepTimeModel:
    """Llama-3-8B (bf16) on one H100 SXM from datasheet figures, stated fractions of them, and one
    published decode latency; every figure is in `details`. Not measured: replace it with a
    measured profile (measure_profile(..., device="cuda")) when a GPU is at hand."""
    # Llama-3-8B: 8,030,261,248 parameters, of which the embedding and the (untied) LM head are
    # 128256 x 4096 each. Every step streams all but the embedding (only looked-up rows are read).
    params_total, embedding = 8_030_261_248, 128_256 * 4096
    params_matmul = params_total - 2 * embedding          # 6.98e9: the decoder layers' matmuls
    weight_bytes = 2 * (params_matmul + embedding)        # bf16, decoder + LM head: 15.0 GB
    kv_bytes_per_token = 2 * 32 * 8 * 128 * 2             # K and V, 32 layers, 8 kv heads, head_dim 128, bf16
    hbm_bytes_per_s = 0.85 * 3.35e12                      # datasheet 3.35 TB/s, at 85% achievable
    matmul_flops_per_s = 0.60 * 989e12                    # datasheet 989 TFLOP/s dense bf16, at 60%
    attention_flops_per_s = 0.35 * 989e12                 # FlashAttention-2's 35% on H100 (FA3 paper)
    attention_flops_per_pair = 4 * 32 * 32 * 128          # QK^T and PV, 2 FLOP per MAC, 32 layers x 32 heads
    published_tpot_s = 6.48e-3                            # vLLM 0.21, H100-80GB-HBM3, Llama-3.1-8B, concurrency 1
    weights_s = weight_bytes / hbm_bytes_per_s
    decode_seq_s = 2 * (params_matmul + embedding) / matmul_flops_per_s
    context_token_s = kv_bytes_per_token / hbm_bytes_per_s
    # The fixed per-step overhead (launches, input prep, sampling, host scheduling) is what the
    # published batch-1 decode leaves over the streaming and the one sequence's work (~300 cached tokens).
    overhead_s = published_tpot_s - weights_s - decode_seq_s - 300 * context_token_s
    source = (
        "first principles, not measured. base_s = weights (15.0 GB bf16: Llama-3-8B less its embedding, LM head "
        "included) / (85% of the H100 SXM datasheet's 3.35 TB/s HBM3; 85% is an assumption, in line with the "
        "2.8 TB/s (84%) a published Nsight profile of H100 inference shows for coalesced weight loads, "
        "https://mikamirai.com/blog/gpu-memory-bandwidth/) + a fixed overhead of "
        f"{overhead_s * 1e3:.2f} ms, set so that a batch-1 decode predicts the published vLLM TPOT p50 of 6.48 ms "
        "(vLLM 0.21.0, one H100-80GB-HBM3, Llama-3.1-8B-Instruct fp16, concurrency 1: "
        "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/; consistent with vLLM's batch-1 decode at "
        "~77% of the memory roofline on an A100, https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on). "
        "context_token_s = 131072 KV bytes per token / the same 2.85 TB/s. prefill_token_s and decode_seq_s = "
        "2 FLOP per matmul parameter (6.98e9, plus the 0.53e9 LM head for a decode) / 60% of the datasheet's "
        "989 TFLOP/s dense bf16 (an assumption, not a citation: what large bf16 GEMMs commonly reach). "
        "prefill_attention_s = 524288 FLOP per causal (query, key) pair / 35% of 989 TFLOP/s "
        "(FlashAttention-2's utilization on H100 per the FlashAttention-3 paper; FA3 reaches up to 75%). "
        "The model is additive: a step below the ridge point (~295 FLOP/byte) pays decode_seq_s per sequence that "
        "a real GPU partly hides under the weight stream, so mid-size batches are predicted slow by up to "
        "decode_seq_s x batch; the overhead assumes ~300 cached tokens at that TPOT. Paged KV reads may run below "
        "85% of HBM bandwidth (the same Nsight profile shows 42% for its KV reads), which would raise "
        "context_token_s.")
    details = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
               "hbm_bytes_per_s": hbm_bytes_per_s, "hbm_fraction": 0.85, "matmul_flops_per_s": matmul_flops_per_s,
               "matmul_fraction": 0.60, "attention_flops_per_s": attention_flops_per_s, "attention_fraction": 0.35,
               "attention_flops_per_pair": attention_flops_per_pair, "params_matmul": params_matmul,
               "lm_head_params": embedding, "weights_s": weights_s, "overhead_s": overhead_s,
               "published_tpot_s": published_tpot_s}
    return StepTimeModel(base_s=weights_s + overhead_s, prefill_token_s=2 * params_matmul / matmul_flops_per_s,
                         decode_seq_s=decode_seq_s, context_token_s=context_token_s,
                         prefill_attention_s=attention_flops_per_pair / attention_flops_per_s,
                         model="Llama-3-8B", device="h100-sxm", dtype="bfloat16", source=source, measured=False,
                         created=datetime.date.today().isoformat(), details=details)


# A gap between two steps longer than this is the engine idle: busy, the host takes ~0.1 ms between them.
IDLE_GAP_S = 1e-3


def measure_trace_steps(model: str | None, *, num_requests: int = 120, rate: float = 3.0, seed: int = 101,
                        device: str = "cpu", dtype: str = "auto", num_threads: int | None = None,
                        log=print) -> list[tuple[StepFeatures, float]]:
    """(features, seconds) of every step the real engine runs on Azure-trace requests: the mixes
    of chunks, decodes and contexts a grid does not cover (a grid of uniform shapes measured a
    mixed step 23% fast on the tiny model), and the steps that start an idle engine again, which
    a grid timed hot never has. The runner's execute() is timed, as in the grid."""
    from contracts.sampling import SamplingParams
    from loadtest import workloads as wl
    from loadtest.engine_driver import run_engine
    from loadtest.traces import LengthScaler, default_trace_path, load_azure_trace, normal_token_ids
    from model_worker.config import EngineConfig
    from model_worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=_engine_model(model), device=device, dtype=dtype, num_threads=num_threads,
                                    num_kv_blocks=2048), detokenize=False)
    runner = engine.runner
    execute = runner.execute
    samples: list[tuple[StepFeatures, float]] = []
    ended_s = [-math.inf]

    def timed(batch: Any) -> list[int]:
        started_s = time.perf_counter()
        tokens = execute(batch)
        now_s = time.perf_counter()
        samples.append((features(batch, after_idle=started_s - ended_s[0] > IDLE_GAP_S), now_s - started_s))
        ended_s[0] = now_s
        return tokens

    runner.execute = timed
    rows = load_azure_trace(default_trace_path())
    pool = normal_token_ids(engine.vocab_size, runner.eos_token_ids)
    workload = wl.trace_replay(rows, num_requests, pool, seed, speedup=rate / wl.trace_rate(rows, num_requests),
                               scaler=LengthScaler(prompt_divisor=4.0, output_divisor=2.0))
    started_s = time.perf_counter()
    run_engine(engine, workload, lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    log(f"trace steps: {len(samples)} steps of {num_requests} requests in {time.perf_counter() - started_s:.0f} s")
    return samples[len(samples) // 20:]  # the first steps pay warm-up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="iterserve simulate profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help='"tiny", "smollm2" (the default) or a checkpoint path')
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--quick", action="store_true", help="a smaller grid, 3 repeats (seconds on tiny, about a minute on smollm2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: every core)")
    p.add_argument("--repeats", type=int, default=None, help="timings per step shape (default 5, quick 3)")
    p.add_argument("--trace-requests", type=int, default=120,
                   help="also fit the steps of the real engine on this many Azure-trace requests (0: the grid only)")
    p.add_argument("--llama3-8b-h100", action="store_true",
                   help="write the first-principles Llama-3-8B / H100 profile instead of measuring")
    args = p.parse_args(argv)
    if args.llama3_8b_h100:
        model = llama3_8b_h100_profile()
    else:
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        model = measure_profile(args.model, device=args.device, dtype=args.dtype, num_threads=args.threads,
                                quick=args.quick, repeats=args.repeats, log=say)
        if args.trace_requests:
            grid_points = model.points
            trace_points = measure_trace_steps(args.model, num_requests=args.trace_requests, device=args.device,
                                               dtype=args.dtype, num_threads=args.threads, log=say)
            details = dict(model.details, grid_points=len(grid_points), trace_points=len(trace_points),
                           trace_requests=args.trace_requests,
                           grid_only_fit=model.fit, grid_only_error_on_trace=model.fit_error(trace_points))
            model = fit(grid_points + trace_points, objective="absolute", model=model.model, device=model.device, dtype=model.dtype,
                        source=model.source + f"; plus every step of the real engine on {args.trace_requests} "
                        "Azure-trace requests (3 req/s, seed 101)", measured=True, created=model.created,
                        details=details)
            model.details["error_on_trace"] = model.fit_error(trace_points)
            mean_s = float(np.mean([s for _, s in trace_points]))
            model.details["trace_mean_step_s"] = mean_s
            model.details["trace_mean_predicted_s"] = float(np.mean([model.predict_features(f) for f, _ in trace_points]))
    model.save(args.out)
    print(model.summary())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
