"""Engine configuration: explicit, validated once, no torch import."""

from __future__ import annotations

from dataclasses import dataclass

from contracts.checks import is_int, is_number

BATCHING_MODES = ("continuous", "static")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


@dataclass(slots=True)
class EngineConfig:
    # None (the embedded default, SmolLM2-135M-Instruct), "tiny" (the tiny random model), a .gguf
    # file, a checkpoint directory (config.json + *.safetensors + tokenizer files) or a hub id.
    model: str | None = None
    # Tokenizer directory or hub id; None uses the model's.
    tokenizer: str | None = None
    # Tokens per KV block. 16 is vLLM's default: small enough that prefix sharing is fine-grained,
    # large enough that block tables stay short.
    block_size: int = 16
    # KV blocks in the cache. None sizes the cache from kv_cache_memory_gib (CPU) or from
    # gpu_memory_utilization (CUDA).
    num_kv_blocks: int | None = None
    # KV cache size on CPU when num_kv_blocks is None.
    kv_cache_memory_gib: float = 1.0
    # Share of total GPU memory the engine may use (weights + KV cache + activations) on CUDA.
    gpu_memory_utilization: float = 0.85
    # Most requests running at once (decoding or prefilling). A decode step's fixed costs (weights,
    # kernel launches, Python) are shared by every running request, so more is better until the
    # KV cache or the step latency runs out; on CPU, continuous batching's throughput is flat from
    # 64 to 256 (docs/benchmarks.md, 'Engine: continuous vs static batching vs transformers').
    max_num_seqs: int = 128
    # Token budget of one step: decodes (1 each) plus prompt chunks. Bounds step latency, so a
    # long prompt is prefilled over several steps while running requests keep decoding. 2048, vLLM's
    # default for its CPU server: a step's fixed cost (every weight read, a few hundred calls) is
    # large on a CPU, and 16 SmolLM2 prompts of 256 tokens at once were served at 234 tok/s with it
    # against 191 with 512, a lone request's TTFT and TPOT unchanged (docs/benchmarks.md, 'Speed
    # on the CPU against vLLM').
    max_num_batched_tokens: int = 2048
    # Stall-free batching (model_worker/sched/step_budget.py): while requests decode, a step carries
    # only the prompt tokens that keep it under this many times a pure decode step per prompt in
    # flight, from the step times measured; an idle engine still prefills at the full budget.
    # None (the default): prompts fill max_num_batched_tokens whatever runs beside them. On 2 CPU
    # cores, where a step's fixed cost is large, 2 made SmolLM2's served TTFT p50 2.5x longer and
    # its TPOT no shorter (docs/benchmarks.md, 'Stall-free batching'); 2 is the setting that caps
    # a decode step at about twice a pure one.
    max_decode_slowdown: float | None = None
    # Longest prompt + output; None takes the model's max_position_embeddings.
    max_model_len: int | None = None
    # Reuse KV blocks of identical prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # "continuous": the batch is decided again every step. "static": request-level batching, no
    # request joins until the whole batch has finished (a baseline for benchmarks only).
    batching: str = "continuous"
    device: str = "auto"
    # "auto": bfloat16 on CUDA and on a CPU with native bf16 (avx512_bf16, AMX, Arm BF16), float32 on
    # other CPUs, where bf16 is emulated and slower (model_worker/runner/cpu_features.py).
    dtype: str = "auto"
    # "auto": on CUDA, flash-attn where it reads the paged cache in place (block_size a multiple of
    # 256), else our Triton kernels; torch on CPU.
    attention_backend: str = "auto"
    # CUDA only: run every step eagerly. Otherwise decode-only steps of up to cuda_graph_max_batch
    # sequences replay CUDA graphs captured at load (with the Triton attention backend).
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # Seed for requests without their own seed.
    seed: int = 0
    # CPU, where the weights are packed for oneDNN: the matrices and the LM head are also packed in
    # panels for our own matmul (AVX-512, AMX tiles for bfloat16 where the CPU has them), and steps
    # of up to 128 rows (4 in bfloat16 on a CPU without AMX) read them, a decode-only step each layer
    # in one call of our kernels (SmolLM2's step at 1 / 8 / 64 rows about 12.4 / 20.3 / 34.8 -> 10.5 /
    # 11.9 / 25.1 ms in bfloat16 on 2 cores: docs/benchmarks.md, 'Speed on the CPU against vLLM,
    # fifth pass'). The weights are then held twice; False keeps only oneDNN's.
    small_batch_kernel: bool = True
    # Torch intra-op threads on CPU; None uses every core (Ray sets OMP_NUM_THREADS=1 in actors).
    num_threads: int | None = None
    # How many recent TTFT samples stats() keeps for its percentiles.
    stats_window: int = 1000
    # Benchmarks only: pad every non-empty step to at least this many seconds, sleeping (not
    # computing) for the rest, as a GPU step would keep the device, not the host, busy. With it a
    # replica's capacity is set by its steps, not by the host's cores, so a 2-core machine can show
    # how 4 replicas scale. The model still runs for real; 0 (the default) is off. The engine wraps
    # its runner in model_worker.engine.step_padding.PaddedRunner for it; its step has no padding code.
    emulated_step_time_s: float = 0.0
    # AsyncLLMEngine runs the step loop in a process of its own (EngineProcess,
    # model_worker/engine/engine_handles.py), so that the serving work of its process (the event
    # loop, Ray's messages, detokenizing) never holds the GIL the step needs. False: a thread of the caller's process (debugging, and the
    # benchmark that measures what the process is worth).
    engine_process: bool = True

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_decode_slowdown(self.max_decode_slowdown)
        _positive_int("stats_window", self.stats_window)
        _positive_int("cuda_graph_max_batch", self.cuda_graph_max_batch)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if not (isinstance(self.kv_cache_memory_gib, (int, float)) and self.kv_cache_memory_gib > 0):
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not (is_number(self.emulated_step_time_s) and 0 <= self.emulated_step_time_s <= 10):
            raise ValueError(f"emulated_step_time_s must be in [0, 10], got {self.emulated_step_time_s!r}")
        _choice("batching", self.batching, BATCHING_MODES)
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be a bool, got {self.engine_process!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")


@dataclass(slots=True)
class SchedulerConfig:
    """What the pure scheduler needs; built from EngineConfig and the runner's numbers."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    batching: str = "continuous"
    max_decode_slowdown: float | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive_int(name, getattr(self, name))
        _choice("batching", self.batching, BATCHING_MODES)
        check_decode_slowdown(self.max_decode_slowdown)


def check_decode_slowdown(value: object) -> None:
    if value is not None and not (is_number(value) and 1 <= value <= 1000):
        raise ValueError(f"max_decode_slowdown must be None or a number in [1, 1000], got {value!r}")


def _positive_int(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
