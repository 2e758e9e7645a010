"""TorchModelRunner: the ModelRunner that runs our decoder with torch on CPU or CUDA.

execute() turns a SchedulerOutput into packed tensors with numpy (no Python loop per token, one
per sequence at most), runs one forward over every scheduled token, and samples one token per
sequence whose `sample` flag is set.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import Any

import numpy as np
import torch

from model_worker.sched.batch import ScheduledSequence, SchedulerOutput
from model_worker.config import EngineConfig
from model_worker.runner.cpu_features import has_native_bf16
from model_worker.checkpoints.models import load_tokenizer
from model_worker.runner.attention.base import StepLayout
from model_worker.runner.attention.selector import create_attention_backend
from model_worker.runner.cuda_graphs import DecodeGraphs, cuda_graph_api
from model_worker.runner.llama import LlamaDecoder
from model_worker.runner.loader import Checkpoint, load_checkpoint, load_eos_token_ids
from model_worker.runner.memory_plan import graph_batch_for, kv_budget_bytes, profile_steps
from model_worker.runner.grammar import GrammarCompiler
from model_worker.runner.sampler import Sampler, token_logprobs
from model_worker.runner.uploader import Uploader

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA, and on a CPU with native bf16 instructions; float32 on other CPUs
    (model_worker/runner/cpu_features.py: emulated bf16 is slower than float32)."""
    if name == "auto":
        if device.type == "cuda" or has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


class TorchModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        """`checkpoint`: weights already loaded (loader.checkpoint_from_state_dict) instead of
        config.model's; they must be on the runner's device and in its dtype."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        model = config.model  # None, "tiny", a .gguf file, a directory or a hub id (model_worker/checkpoints/models.py)
        # Seconds each part of loading took: what a new replica waits for before serving.
        self.load_times_s: dict[str, float] = {}
        started_s = time.perf_counter()
        if checkpoint is None:
            checkpoint = load_checkpoint(model, self.device, self.dtype)
        self.load_times_s["weights"] = time.perf_counter() - started_s
        self.model_path = checkpoint.path
        self.spec = checkpoint.spec
        # Rows of the logits; token ids the model accepts are [0, vocab_size).
        self.vocab_size = checkpoint.spec.vocab_size
        started_s = time.perf_counter()
        self.tokenizer = load_tokenizer(config.tokenizer or checkpoint.path)
        self.load_times_s["tokenizer"] = time.perf_counter() - started_s
        self.eos_token_ids = load_eos_token_ids(checkpoint.path, checkpoint.hf_config, self.tokenizer)
        self.max_model_len = self._resolve_max_model_len(config.max_model_len)
        self.block_size = config.block_size
        self.attention = create_attention_backend(config.attention_backend, self.device, self.dtype, config.block_size)
        self.model = LlamaDecoder(self.spec, checkpoint.weights, self.attention, self.max_model_len,
                                  small_batch_kernel=config.small_batch_kernel)
        self.sampler = Sampler(self.device, config.seed, self.eos_token_ids)
        self.sampled_logprobs: dict[str, tuple[float, list[int], list[float]]] = {}
        self.prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[int], list[float]]]]] = {}
        self._grammar_compiler: GrammarCompiler | None = None
        # Step inputs go to the device in one asynchronous copy (model_worker/runner/uploader.py).
        self.uploader = Uploader(self.device)
        # Decode-only steps replay these on CUDA (model_worker/runner/cuda_graphs.py); set at load.
        self.graphs: DecodeGraphs | None = None
        # On CUDA: what sized the KV cache (bytes), from the profile of the worst steps.
        self.memory_plan: dict[str, int] = {}
        # CUDA events around the last forward, read once the step's sync has passed them.
        self._forward_events: tuple[Any, Any] | None = None
        # Cumulative seconds: the model forward (attention included), and all of execute().
        self.forward_time_s = 0.0
        self.execute_time_s = 0.0
        # Forwards begun (`progress` adds the decoder's layers): what the engine loop's heartbeat
        # reads to tell a long step that moves from a stuck one.
        self.num_forwards = 0
        started_s = time.perf_counter()
        self.num_kv_blocks = config.num_kv_blocks or self._auto_num_kv_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks)
        self.load_times_s["kv_cache"] = time.perf_counter() - started_s
        if self._uses_graphs():
            started_s = time.perf_counter()
            self._capture_graphs()
            self.load_times_s["cuda_graphs"] = time.perf_counter() - started_s

    def _resolve_max_model_len(self, requested: int | None) -> int:
        spec = self.spec
        supported = spec.max_position_embeddings
        limit_reason = "max_position_embeddings"
        if spec.sliding_window is not None and spec.sliding_window < supported:
            # Within the window, sliding-window attention equals full attention.
            supported, limit_reason = spec.sliding_window, "sliding_window"
        if requested is None:
            return supported
        if requested > supported:
            raise ValueError(f"max_model_len {requested} exceeds what the model supports "
                             f"({limit_reason} = {supported})")
        return requested

    @property
    def kv_bytes_per_block(self) -> int:
        spec = self.spec
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * element_size

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Zeroed, not empty: padded gathers read unused slots (masked out), and 0 * NaN is NaN.
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in range(self.spec.num_layers)]

    def _auto_num_kv_blocks(self) -> int:
        if self.device.type == "cuda":
            budget_bytes = self._cuda_kv_budget_bytes()
            source = f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
        else:
            budget_bytes = self.config.kv_cache_memory_gib * 2**30
            source = f"kv_cache_memory_gib={self.config.kv_cache_memory_gib}"
        num_blocks = int(budget_bytes // self.kv_bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache with {source}")
        return num_blocks

    def _uses_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and self.attention.name == "triton"

    def _graph_batch(self) -> int:
        config = self.config
        return graph_batch_for(config.max_num_seqs, config.max_num_batched_tokens, config.cuda_graph_max_batch)

    def _cuda_kv_budget_bytes(self) -> float:
        """Total memory * utilization, less the weights, the peak of the worst step and the CUDA
        graphs (model_worker/runner/memory_plan.py); every figure goes in self.memory_plan."""
        torch.cuda.synchronize(self.device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        weights_bytes = torch.cuda.memory_allocated(self.device)
        peaks = self._profile_step_peaks()
        graph_bytes = peaks.pop("graph_decode_batch", 0)
        step_peak = max(peaks.values())
        budget = kv_budget_bytes(total_bytes, free_bytes, self.config.gpu_memory_utilization, weights_bytes,
                                 step_peak, graph_bytes)
        self.memory_plan.update(total_bytes=total_bytes, free_bytes=free_bytes, weights_bytes=weights_bytes,
                                step_peak_bytes=step_peak, graph_bytes_estimate=graph_bytes, kv_budget_bytes=budget,
                                **{f"peak_{name}_bytes": peak for name, peak in peaks.items()})
        return budget

    def _profile_step_peaks(self) -> dict[str, int]:
        """Peak extra memory of each worst step (forward + sampling), over a KV cache of one context."""
        config = self.config
        steps, num_blocks = profile_steps(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                          self.block_size, self._graph_batch() if self._uses_graphs() else None)
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        peaks = {}
        for profile in steps:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            baseline = torch.cuda.memory_allocated(self.device)
            self.execute(profile.batch)
            torch.cuda.synchronize(self.device)
            peaks[profile.name] = torch.cuda.max_memory_allocated(self.device) - baseline
        self.kv_caches = []
        self.forward_time_s = self.execute_time_s = 0.0
        self._forward_events = None
        torch.cuda.empty_cache()
        return peaks

    def _capture_graphs(self) -> None:
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self.graphs = DecodeGraphs(self.model.forward, self.kv_caches, self.device, self._graph_batch(),
                                   -(-self.max_model_len // self.block_size), cuda_graph_api())
        with torch.inference_mode():
            self.graphs.capture_all()
        torch.cuda.synchronize(self.device)
        self.memory_plan["graph_bytes_measured"] = torch.cuda.memory_reserved(self.device) - reserved
        self.forward_time_s = self.execute_time_s = 0.0
        self._forward_events = None

    @property
    def progress(self) -> int:
        """Grows while the runner works: a forward begun, a decoder layer done."""
        return self.num_forwards + self.model.layers_run

    def execute(self, batch: SchedulerOutput) -> list[int]:
        """One forward over every scheduled token; one sampled token per sequence with sample=True."""
        if not batch.sequences:
            return []
        start_s = time.perf_counter()
        with torch.inference_mode():
            logits = self._forward(batch.sequences, all_tokens=False, upcast=False)
            if any(seq.prompt_token_ids is not None for seq in batch.sequences):
                logits = self._take_prompt_logprobs(batch.sequences, logits)
            sampling = [seq for seq in batch.sequences if seq.sample]
            tokens, logprobs = self.sampler.sample_with_logprobs(
                logits, [seq.sampling_params for seq in sampling], [seq.output_index for seq in sampling],
                [seq.history for seq in sampling], self._grammar_mask(sampling))
            for row, row_logprobs in logprobs.items():
                self.sampled_logprobs[sampling[row].request_id] = row_logprobs
        self.execute_time_s += time.perf_counter() - start_s
        return tokens

    def _grammar_mask(self, sampling: list[ScheduledSequence]):
        """The step's grammar masks, filled now, as a function the sampler applies to the sampled
        rows' logits; None when no row has a grammar. A matcher that raises fails its request
        alone (fault isolation bisects the step)."""
        rows = [row for row, seq in enumerate(sampling) if seq.grammar is not None]
        if not rows:
            return None
        compiler = self.grammar_compiler()
        masks = compiler.allocate_masks(len(sampling))
        for row in rows:
            sampling[row].grammar.fill(masks, row)
        return lambda logits: compiler.apply_masks(logits, masks, rows)

    def grammar_compiler(self) -> GrammarCompiler:
        """The model's grammar compiler, built at the first request with a grammar (it reads the
        whole vocabulary once, about 0.1 s)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammar_compiler

    def _take_prompt_logprobs(self, sequences: list[ScheduledSequence], logits: torch.Tensor) -> torch.Tensor:
        """The logits of the sampled rows alone, once the prompt rows' logprobs (the rows before
        each sampled one, _prepare_inputs' order) are in self.prompt_logprobs. A prompt token's
        logprob is the raw log-softmax at the position before it: logit minus logsumexp."""
        sample_rows: list[int] = []
        row = 0
        for seq in sequences:
            num_rows = _num_prompt_rows(seq)
            if num_rows:
                rows = logits[row:row + num_rows].float()
                targets = torch.tensor(seq.prompt_token_ids[seq.start_position + 1:seq.start_position + 1 + num_rows],
                                       dtype=torch.int64, device=rows.device)
                chosen, top_ids, top_values = token_logprobs(rows, targets, seq.sampling_params.prompt_logprobs or 0)
                self.prompt_logprobs[seq.request_id] = (
                    seq.start_position + 1, [(c, i, v) for c, i, v in zip(chosen, top_ids, top_values)])
                row += num_rows
            if seq.sample:
                sample_rows.append(row)
                row += 1
        return logits[sample_rows]

    def compute_logits(self, batch: SchedulerOutput, all_tokens: bool = False) -> torch.Tensor:
        """The forward of execute() without sampling: float32 logits (rows, vocab).

        Rows are the sequences with sample=True, or every scheduled token when all_tokens is set
        (for checks against a reference model). Writes the batch's K/V into the cache like execute.
        """
        with torch.inference_mode():
            return self._forward(batch.sequences, all_tokens)

    def _forward(self, sequences: list[ScheduledSequence], all_tokens: bool, upcast: bool = True) -> torch.Tensor:
        """Logits of the step's sampled rows (every token's with all_tokens): float32, or with
        upcast False in the model's dtype where the forward makes them in it (the sampler upcasts)."""
        self.num_forwards += 1
        token_ids, positions, layout, logits_indices = self._prepare_inputs(sequences)
        if all_tokens:
            logits_indices = np.arange(len(token_ids), dtype=np.int64)
        graphs = self.graphs
        if graphs is not None and not all_tokens and graphs.can_run(layout, len(logits_indices) == len(sequences)):
            with self._timed_forward():
                return graphs.run(token_ids, positions, layout)
        input_ids, positions, logits_indices = self.uploader([token_ids, positions, logits_indices])
        metadata = self.attention.prepare(layout, self.device)
        with self._timed_forward():
            return self.model.forward(input_ids, positions, self.kv_caches, metadata, logits_indices, upcast)

    @contextlib.contextmanager
    def _timed_forward(self):
        """Adds the forward's time to forward_time_s. On CUDA it is timed with events and read one
        forward later, after the step's own sync, so timing adds no sync of its own."""
        if self.device.type != "cuda":
            started_s = time.perf_counter()
            yield
            self.forward_time_s += time.perf_counter() - started_s
            return
        if self._forward_events is not None:
            start, end = self._forward_events
            end.synchronize()  # passed already: the previous step read its tokens back
            self.forward_time_s += start.elapsed_time(end) / 1000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._forward_events = (start, end)

    def _prepare_inputs(self, sequences: list[ScheduledSequence]):
        num_seqs = len(sequences)
        query_lens = np.fromiter((len(seq.token_ids) for seq in sequences), dtype=np.int64, count=num_seqs)
        start_positions = np.fromiter((seq.start_position for seq in sequences), dtype=np.int64, count=num_seqs)
        table_lens = np.fromiter((len(seq.block_table) for seq in sequences), dtype=np.int64, count=num_seqs)
        context_lens = start_positions + query_lens
        self._check_batch(sequences, query_lens, context_lens, table_lens)
        query_starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_starts[1:])
        num_tokens = int(query_starts[-1])
        # Block tables right-padded with block 0 into one (S, max_blocks) array, filled in one go.
        block_tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int64)
        block_tables[np.arange(block_tables.shape[1])[None, :] < table_lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(seq.block_table for seq in sequences), dtype=np.int64,
            count=int(table_lens.sum()))
        # Token t of sequence s sits at position start_positions[s] + (t - query_starts[s]).
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - (query_starts[:-1] - start_positions)[seq_of_token]
        slot_mapping = (block_tables[seq_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)
        token_ids = np.fromiter(itertools.chain.from_iterable(seq.token_ids for seq in sequences),
                                dtype=np.int64, count=num_tokens)
        self._check_ids(token_ids, block_tables)
        sample_rows = np.fromiter((seq.sample for seq in sequences), dtype=bool, count=num_seqs)
        if any(seq.prompt_token_ids is not None for seq in sequences):
            # Each sequence's prompt rows (_num_prompt_rows), then its sampled row: the order
            # _take_prompt_logprobs reads them in.
            logits_indices = np.concatenate([
                np.concatenate([query_starts[s] + np.arange(_num_prompt_rows(seq), dtype=np.int64),
                                query_starts[s + 1:s + 2] - 1 if seq.sample else np.zeros(0, dtype=np.int64)])
                for s, seq in enumerate(sequences)])
        else:
            logits_indices = query_starts[1:][sample_rows] - 1
        layout = StepLayout(query_lens=query_lens, start_positions=start_positions, context_lens=context_lens,
                            query_starts=query_starts, block_tables=block_tables, slot_mapping=slot_mapping,
                            block_size=self.block_size)
        return token_ids, positions, layout, logits_indices

    def _check_ids(self, token_ids: np.ndarray, block_tables: np.ndarray) -> None:
        # Out-of-range ids fail with a device-side assert on CUDA; name the culprit here instead.
        if token_ids.min() < 0 or token_ids.max() >= self.spec.vocab_size:
            raise ValueError(f"token id out of range [0, {self.spec.vocab_size})")
        num_blocks = self.kv_caches[0][0].shape[0]
        if block_tables.min() < 0 or block_tables.max() >= num_blocks:
            raise ValueError(f"block id out of range [0, {num_blocks})")

    def _check_batch(self, sequences: list[ScheduledSequence], query_lens: np.ndarray, context_lens: np.ndarray,
                     table_lens: np.ndarray) -> None:
        if query_lens.min() < 1:
            raise ValueError("every scheduled sequence needs at least one token")
        if context_lens.max() > self.max_model_len:
            row = int(context_lens.argmax())
            raise ValueError(f"request {sequences[row].request_id} reaches {int(context_lens[row])} tokens, "
                             f"above max_model_len {self.max_model_len}")
        short = np.flatnonzero(table_lens * self.block_size < context_lens)
        if len(short):
            row = int(short[0])
            raise ValueError(f"request {sequences[row].request_id}: block table of {int(table_lens[row])} blocks "
                             f"cannot hold {int(context_lens[row])} tokens")


def _num_prompt_rows(seq: ScheduledSequence) -> int:
    """Positions of this chunk whose next token is a prompt token, when the sequence wants its
    prompt's logprobs: their logits give those tokens' logprobs."""
    if seq.prompt_token_ids is None:
        return 0
    return max(0, min(seq.context_len, len(seq.prompt_token_ids) - 1) - seq.start_position)
