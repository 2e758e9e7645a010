"""The CPU kernels as functions of torch tensors (kernels.cpp says what each computes).

`kernels()` is the loaded library, built on first use (build.py), or None where it cannot be built
here; callers keep their torch path then. Each wrapper checks what the C++ side assumes (device,
dtype, contiguity, index ranges) and raises ValueError otherwise, so a bad call is an error, never
a read out of bounds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from model_worker.runner.cpu_kernels.build import KernelBuildError, load_library

logger = logging.getLogger(__name__)

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
# Most positions in one part of a decode row's context; a row is cut into as few parts as that allows,
# of about equal length (kernels.cpp, decode_attention).
SPLIT_LEN = 256
# What an absent index array points at (the kernels read none of it).
_EMPTY_INDEX = torch.zeros(1, dtype=torch.int64)
# Output features per panel of a packed weight (kernels.cpp, panel_linear).
PANEL = 16
# Up to how many rows a step goes through the panel kernel rather than oneDNN's packed matmuls, by
# dtype and whether bfloat16 runs on AMX tiles. SmolLM2's whole decode step on 2 cores of an Intel
# AVX-512/AMX machine, panels against oneDNN (docs/benchmarks.md, 'Speed on the CPU against vLLM,
# fifth pass'): bfloat16 at 16 / 32 / 64 / 96 / 128 rows 14.9 / 20.0 / 26.8 / 36.0 / 44.5 ms against
# 24.4 / 28.6 / 36.5 / 47.7 / 55.2, float32 at 16 / 32 / 64 / 128 34.3 / 49.3 / 82.2 / 138.8 against
# 47.0 / 62.0 / 96.7 / 157.4. Past 128 (prefill chunks) oneDNN's blocking wins: 2,048 rows of a layer
# 6.3 against our 10.3 ms in bfloat16. Without AMX, bfloat16 goes through dpbf16ps, which that CPU
# issues about once in two cycles: the 120 matrices at 4 / 8 rows took 10.6 / 14.3 ms against
# oneDNN's (AMX) 11.8 / 11.8, so 4 (a CPU without AMX has none for oneDNN either: a lower bound).
# That 4 holds where oneDNN has AMX and our panels do not (built without it, or not permitted). On a
# CPU without AMX, oneDNN multiplies bfloat16 with dpbf16ps too: a 2-core AMD EPYC (Zen 4) VM timed
# the two alone within 5% of each other from 16 to 128 rows (a matrix in cache), and the panels'
# whole decode step, which runs each layer in one call, won at every size: 8 / 16 / 32 / 64 rows
# 13.8 / 18.5 / 30.1 / 53.7 ms against oneDNN's 19.8 / 25.5 / 38.5 / 61.3 (docs/benchmarks.md, eighth
# pass). There the bound is 128, as with AMX.
# On an Intel CPU with AMX the bound is 1024 rows in both dtypes, since the matmuls take a prompt
# step's rows in blocks that stay in L2 (kernels.cpp, kPanelRowBlock): SmolLM2's whole step, one
# call a layer against nine from Python around oneDNN, 2 cores, twelfth pass of docs/benchmarks.md:
# bfloat16 at 256 / 512 / 1,024 / 1,280 / 1,536 / 2,048 rows 65-69 / 141 / 230-234 / 273-295 /
# 349-354 / 450-516 ms against 82-86 / 161-167 / 253-271 / 286-315 / 312-323 / 414-444; float32 at
# 256 / 512 / 1,024 rows 199 / 390-421 / 770-779 against 233 / 437-447 / 781-801. CPUs without AMX
# keep 128 rows until measured. On a CPU with AVX2 and no AVX-512 (a 2-core AMD EPYC Zen 3 VM,
# eighteenth pass), float32 panels against oneDNN over SmolLM2's 120 matrices: 1 / 8 / 32 / 128 / 256
# rows 20.6 / 29.2 / 58.2 / 245.7 / 507 ms against 30.3 / 36.5 / 80.8 / 258.7 / 485: 128 there too.
_FASTER_UP_TO = {(torch.bfloat16, True): 1024, (torch.bfloat16, False): 4, (torch.float32, True): 1024,
                 (torch.float32, False): 128}
_WITHOUT_AMX_ANYWHERE = 128


# Libraries that `kernels_from` put in place of this checkout's, innermost last.
_SWAPPED: list[ctypes.CDLL] = []


def kernels() -> ctypes.CDLL | None:
    """The library, or None (logged once, with the reason) where it cannot be built or loaded."""
    return _SWAPPED[-1] if _SWAPPED else _built_here()


@functools.cache
def _built_here() -> ctypes.CDLL | None:
    try:
        return _bind(load_library())
    except KernelBuildError as exc:
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None


@contextlib.contextmanager
def kernels_from(source: bytes) -> Iterator[ctypes.CDLL]:
    """Within the block, every op runs on a library built from `source`, another kernels.cpp (an
    earlier commit's): benchmarks time a change's kernels before and after in one process, on the
    same tensors, interleaved. What is probed once per process (has_panel_linear, panel_amx, ...)
    stays as first probed. KernelBuildError if that source does not build or lacks a function."""
    library = load_library(source=source)
    try:
        _bind(library)
    except AttributeError as exc:
        raise KernelBuildError(f"that kernels.cpp lacks a function these ops call: {exc}") from None
    _SWAPPED.append(library)
    try:
        yield library
    finally:
        _SWAPPED.pop()


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """The library with every function's argument and result types set."""
    signatures = {"decode_attention": [_P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I],
                  "rms_norm": [_P, _I, _P, _P, _I, _I, _F],
                  "rotary_and_cache": [_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
                  "argmax_rows": [_P, _I, _I, _I, _P],
                  "sample_rows": [_P, _I, _I, _I, _P, _P, _P],
                  "silu_and_mul": [_P, _I, _P, _I, _I],
                  "panel_linear": [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _I],
                  "prefill_attention": [_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _F],
                  "small_layer": [_P, _P, _I, _I, _I, _F, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, _P,
                                  _I, _P, _P, _P, _P, _I, _I, _I, _F, _I, _P]}
    for name, argtypes in signatures.items():
        for suffix in _SUFFIX.values():
            function = getattr(library, f"{name}_{suffix}")
            function.restype = ctypes.c_int if name in ("panel_linear", "small_layer", "prefill_attention") else None
            function.argtypes = argtypes
    library.panel_amx.restype = ctypes.c_int
    library.panel_amx.argtypes = []
    # Optional: an earlier kernels.cpp (kernels_from) may lack it; mask_rows() then uses torch.
    mask_rows_f32 = getattr(library, "mask_rows_f32", None)
    if mask_rows_f32 is not None:
        mask_rows_f32.restype = None
        mask_rows_f32.argtypes = [_P, _I, _P, _I, _I, _P, _I]
    library.prefill_attention_built_for.restype = ctypes.c_int
    library.prefill_attention_built_for.argtypes = [_I]
    return library


def supports(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIX


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The decode rows of a step for `decode_attention`, checked once per step (every layer reads
    them): token_rows and context_lens (N,) int64, block_tables (N, max_blocks) int64, contiguous."""

    token_rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    # Bounds every call checks against q's and the cache's shapes: the largest token row and block
    # id (-1 with no rows), and the block size every context was checked to fit its table with.
    max_token_row: int
    max_block_id: int
    block_size: int

    @classmethod
    def of(cls, token_rows: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray,
           block_size: int) -> "DecodeRows":
        """Raises ValueError for a negative index, or a context its block table cannot hold."""
        token_rows, context_lens = (np.ascontiguousarray(a, dtype=np.int64) for a in (token_rows, context_lens))
        block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
        num_rows = len(token_rows)
        _check(block_tables.ndim == 2 and block_tables.shape[0] == num_rows == len(context_lens),
               "index shapes do not match")
        max_token_row = max_block_id = -1
        if num_rows:
            _check(token_rows.min() >= 0 and block_tables.min() >= 0, "negative index")
            _check(context_lens.min() >= 1 and context_lens.max() <= block_tables.shape[1] * block_size,
                   "context length out of range")
            max_token_row, max_block_id = int(token_rows.max()), int(block_tables.max())
        return cls(torch.from_numpy(token_rows), torch.from_numpy(block_tables), torch.from_numpy(context_lens),
                   max_token_row, max_block_id, block_size)


@dataclass(frozen=True, slots=True)
class PrefillRows:
    """The prompt chunks of a step (sequences with more than one query token) for
    `prefill_attention`, checked once per step: token_starts, query_lens and starts (N,) int64,
    block_tables (N, max_blocks) int64, contiguous."""

    token_starts: torch.Tensor
    query_lens: torch.Tensor
    starts: torch.Tensor
    block_tables: torch.Tensor
    # Bounds every call checks against q's and the cache's shapes (-1 with no chunks).
    max_token_end: int
    max_block_id: int
    block_size: int

    @classmethod
    def of(cls, token_starts: np.ndarray, query_lens: np.ndarray, starts: np.ndarray, block_tables: np.ndarray,
           block_size: int) -> "PrefillRows":
        """Raises ValueError for a negative index or length, or a context its block table cannot hold."""
        token_starts, query_lens, starts = (np.ascontiguousarray(a, dtype=np.int64)
                                            for a in (token_starts, query_lens, starts))
        num_rows = len(token_starts)
        _check(block_tables.ndim == 2 and block_tables.shape[0] == num_rows == len(query_lens) == len(starts),
               "index shapes do not match")
        max_token_end = max_block_id = -1
        if num_rows:
            # Only the blocks each context needs: the rest of a padded table is never read.
            context_lens = starts + query_lens
            _check(token_starts.min() >= 0 and starts.min() >= 0 and query_lens.min() >= 1, "negative index")
            _check(context_lens.max() <= block_tables.shape[1] * block_size, "context length out of range")
            width = int(-(-context_lens.max() // block_size))
            block_tables = block_tables[:, :width]
            needed = np.arange(width)[None, :] < -(-context_lens[:, None] // block_size)
            _check(bool((block_tables[needed] >= 0).all()), "negative index")
            max_token_end, max_block_id = int((token_starts + query_lens).max()), int(block_tables[needed].max())
        block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
        return cls(torch.from_numpy(token_starts), torch.from_numpy(query_lens), torch.from_numpy(starts),
                   torch.from_numpy(block_tables), max_token_end, max_block_id, block_size)


@dataclass(frozen=True, slots=True)
class TokenSlots:
    """Each token's position and cache slot for `rotary_and_cache`, checked once per step (every
    layer reads them): positions and slots (T,) int64, contiguous."""

    positions: torch.Tensor
    slots: torch.Tensor
    # Bounds every call checks against the rotary tables' and the cache's sizes (-1 with no tokens).
    max_position: int
    max_slot: int

    @classmethod
    def of(cls, positions: np.ndarray, slots: np.ndarray) -> "TokenSlots":
        """Raises ValueError for a negative position or slot."""
        positions, slots = (np.ascontiguousarray(a, dtype=np.int64) for a in (positions, slots))
        _check(positions.ndim == slots.ndim == 1 and len(positions) == len(slots), "index shapes do not match")
        max_position = max_slot = -1
        if len(positions):
            _check(positions.min() >= 0 and slots.min() >= 0, "negative index")
            max_position, max_slot = int(positions.max()), int(slots.max())
        return cls(torch.from_numpy(positions), torch.from_numpy(slots), max_position, max_slot)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x (rows, width) with weight (width,), as transformers computes it
    (model_worker/runner/llama.py); x's rows contiguous, the result contiguous."""
    rows, width = x.shape
    _check(x.dtype in _SUFFIX and weight.dtype == x.dtype and weight.shape == (width,) and weight.is_contiguous()
           and x.stride(1) == 1 and x.device.type == weight.device.type == "cpu", "bad rms_norm arguments")
    out = torch.empty((rows, width), dtype=x.dtype)
    if rows:
        getattr(_library(), f"rms_norm_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), weight.data_ptr(),
                                                           out.data_ptr(), rows, width, float(eps))
    return out


def rotary_and_cache(qkv: torch.Tensor, tokens: TokenSlots, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
    """Rotate q and k of qkv (T, (num_heads + 2 * num_kv_heads) * head_dim) in place by the rotary
    tables cos, sin (max_len, head_dim) float32 at each token's position, and write each token's k
    and v into its slot of k_cache, v_cache (num_blocks, block_size, num_kv_heads, head_dim)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    _check(qkv.dtype in _SUFFIX and qkv.dtype == k_cache.dtype == v_cache.dtype
           and cos.dtype == sin.dtype == torch.float32, "dtypes differ")
    _check(all(t.device.type == "cpu" for t in (qkv, cos, sin, k_cache, v_cache)), "every tensor must be on the CPU")
    _check(qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1 and head_dim % 2 == 0,
           "qkv does not match the heads")
    _check(cos.shape == sin.shape and cos.shape[1] == head_dim and cos.is_contiguous() and sin.is_contiguous(),
           "bad rotary tables")
    _check(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape, "bad caches")
    _check(tokens.positions.shape[0] == num_tokens and tokens.max_position < cos.shape[0]
           and tokens.max_slot < k_cache.shape[0] * k_cache.shape[1], "a position or slot out of range")
    if num_tokens:
        getattr(_library(), f"rotary_and_cache_{_SUFFIX[qkv.dtype]}")(
            qkv.data_ptr(), qkv.stride(0), tokens.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            tokens.slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_tokens, num_heads, num_kv_heads,
            head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of x (rows, 2 * width), gate the first half of each row: (rows, width)."""
    rows, double_width = x.shape
    _check(x.dtype in _SUFFIX and x.stride(1) == 1 and x.device.type == "cpu" and double_width % 2 == 0,
           "bad silu_and_mul argument")
    out = torch.empty((rows, double_width // 2), dtype=x.dtype)
    if rows:
        getattr(_library(), f"silu_and_mul_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), out.data_ptr(), rows,
                                                               double_width // 2)
    return out


@functools.cache
def has_panel_linear(dtype: torch.dtype) -> bool:
    """Whether this machine's build has `panel_linear` for dtype (AVX-512 with BW; float32 also AVX2 with FMA)."""
    library = kernels()
    if library is None or dtype not in _SUFFIX:
        return False
    x, panels = torch.zeros(1, 2, dtype=dtype), pack_panels(torch.zeros(PANEL, 2, dtype=dtype))
    out = torch.empty(1, PANEL, dtype=dtype)
    return bool(getattr(library, f"panel_linear_{_SUFFIX[dtype]}")(x.data_ptr(), 2, 1, panels.data_ptr(), 2, PANEL,
                                                                    None, None, 0, out.data_ptr(), PANEL))


@functools.cache
def prefill_attention_built(head_dim: int) -> bool:
    """Whether `prefill_attention` has its fast path for this head size here, so that
    `small_layers` takes steps with prompt chunks."""
    library = kernels()
    return library is not None and bool(library.prefill_attention_built_for(head_dim))


@functools.cache
def panel_amx() -> bool:
    """Whether bfloat16 panels go through AMX tiles here (built for them, and the OS lets this process use them)."""
    library = kernels()
    return library is not None and bool(library.panel_amx())


def panel_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows `panel_linear` is the faster matmul for this dtype on this machine."""
    if dtype == torch.float32:
        return _FASTER_UP_TO[(dtype, cpu_has_amx())]
    amx = dtype == torch.bfloat16 and panel_amx()
    if dtype == torch.bfloat16 and not amx and not cpu_has_amx():
        return _WITHOUT_AMX_ANYWHERE
    return _FASTER_UP_TO.get((dtype, amx), 0)


@functools.cache
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has AMX for bfloat16 (so oneDNN may multiply on tiles); True where unknown,
    which keeps the bound that assumes oneDNN the faster."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return True


def _pair(dtype: torch.dtype) -> int:
    """Inputs side by side in a panel row: two in bfloat16 (the pairs dpbf16ps multiplies), else one."""
    return 2 if dtype == torch.bfloat16 else 1


def can_pack_panels(weight: torch.Tensor) -> bool:
    """Whether `pack_panels` takes this weight: a CPU matrix of a kernel dtype, its out_features a
    multiple of PANEL and, in bfloat16, its in_features even."""
    return (weight.dim() == 2 and weight.dtype in _SUFFIX and weight.device.type == "cpu"
            and weight.shape[0] % PANEL == 0 and weight.shape[0] > 0 and weight.shape[1] > 0
            and weight.shape[1] % _pair(weight.dtype) == 0)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (out_features, in_features) laid out in panels of PANEL output features for
    `panel_linear` (kernels.cpp): float32 (out / 16, in, 16), bfloat16 (out / 16, in / 2, 16, 2). A
    new tensor: the weight itself is not kept."""
    _check(can_pack_panels(weight), "a weight panels cannot hold (out_features a multiple of 16, in_features even "
                                    "in bfloat16)")
    out_features, in_features = weight.shape
    pair = _pair(weight.dtype)
    grouped = weight.reshape(out_features // PANEL, PANEL, in_features // pair, pair)
    panels = grouped.permute(0, 2, 1, 3).contiguous()
    return panels if pair == 2 else panels.reshape(out_features // PANEL, in_features, PANEL)


def panel_shape(panels: torch.Tensor) -> tuple[int, int]:
    """(out_features, in_features) of a weight from `pack_panels`; ValueError for a tensor that is not one."""
    _check(is_panels(panels), "not a weight packed in panels")
    return panels.shape[0] * PANEL, panels.shape[1] * _pair(panels.dtype)


def is_panels(t: torch.Tensor) -> bool:
    if t.dtype not in _SUFFIX or t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
        return False
    pair = _pair(t.dtype)
    return t.dim() == 4 and t.shape[2:] == (PANEL, 2) if pair == 2 else t.dim() == 3 and t.shape[2] == PANEL


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) (+ residual) for x (rows, in_features), rows >= 1, and the weight
    (out_features, in_features) from `pack_panels`, bias (out_features,), residual (rows,
    out_features): summed in float32, rounded once to x's dtype. Only where
    `has_panel_linear(x.dtype)`. A decode step makes over a hundred of these calls, so the checks
    are few and cheap: shapes, strides, dtypes and the device."""
    rows, in_features = x.shape
    dtype = x.dtype
    pair = _pair(dtype)
    _check(dtype in _SUFFIX and panels.dtype == dtype and x.is_cpu and panels.is_cpu and rows >= 1
           and x.stride(1) == 1 and panels.is_contiguous() and panels.dim() == 2 + pair
           and panels.shape[2] == PANEL and panels.shape[1] * pair == in_features, "bad panel_linear arguments")
    out_features = panels.shape[0] * PANEL
    if bias is not None:
        _check(bias.dtype == dtype and bias.shape == (out_features,) and bias.is_contiguous(), "bad bias")
    if residual is not None:
        _check(residual.dtype == dtype and residual.shape == (rows, out_features) and residual.stride(1) == 1,
               "bad residual")
    out = torch.empty((rows, out_features), dtype=dtype)
    done = _panel_linear_function(dtype)(
        x.data_ptr(), x.stride(0), rows, panels.data_ptr(), in_features, out_features,
        None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), out.data_ptr(), out_features)
    _check(bool(done), "panel_linear is not built for this CPU")
    return out


@functools.cache
def _panel_linear_function(dtype: torch.dtype) -> ctypes._CFuncPtr:
    return getattr(_library(), f"panel_linear_{_SUFFIX[dtype]}")


@dataclass(frozen=True, slots=True)
class SmallLayer:
    """One decoder layer's tensors for `small_layers`, checked once at load: the pointers the kernel
    reads (input norm, q/k/v, its bias, o, its bias, post-attention norm, gate/up, down), the four
    matrices packed in panels (`pack_panels`)."""

    pointers: ctypes.Array
    tensors: tuple[torch.Tensor | None, ...]  # kept alive with the pointers
    dtype: torch.dtype
    hidden_size: int
    intermediate_size: int
    qkv_width: int
    q_width: int

    @classmethod
    def of(cls, input_norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None, o: torch.Tensor,
           o_bias: torch.Tensor | None, post_norm: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> "SmallLayer":
        """Raises ValueError for shapes that do not make a layer, matrices not in panels, or tensors
        not plain and contiguous."""
        tensors = (input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down)
        dtype = qkv.dtype
        _check(all(t is None or (t.dtype == dtype and t.is_cpu and t.layout == torch.strided and t.is_contiguous())
                   for t in tensors) and dtype in _SUFFIX, "a layer tensor is not plain, contiguous and alike")
        (qkv_width, qkv_in), (hidden, q_width), (gate_up_width, gate_up_in), (down_width, intermediate) = (
            panel_shape(w) for w in (qkv, o, gate_up, down))
        _check(input_norm.shape == post_norm.shape == (hidden,) and qkv_in == hidden
               and (gate_up_width, gate_up_in) == (2 * intermediate, hidden) and down_width == hidden
               and (qkv_bias is None or qkv_bias.shape == (qkv_width,))
               and (o_bias is None or o_bias.shape == (hidden,)), "layer shapes do not match")
        pointers = (ctypes.c_void_p * 8)(*[None if t is None else t.data_ptr() for t in tensors])
        return cls(pointers, tensors, dtype, hidden, intermediate, qkv_width, q_width)


def small_layers(hidden: torch.Tensor, layers: list[SmallLayer], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 tokens: TokenSlots, rows: DecodeRows, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 eps: float, scale: float, chunks: PrefillRows | None = None,
                 on_layer: Callable[[], None] | None = None) -> torch.Tensor:
    """Every layer over hidden (rows, hidden_size) for a step whose tokens are each either a
    decode row of `rows` or a token of a prompt chunk of `chunks` (kernels.cpp, small_layer: what
    LlamaDecoder._packed_layer computes through panels, call for call). Prompt chunks need
    `prefill_attention_built(head_dim)`. `on_layer` is called after each layer. Returns the last
    layer's output."""
    num_rows, hidden_size = hidden.shape
    first = layers[0]
    k_cache = kv_caches[0][0]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check(hidden.dtype == first.dtype and hidden.is_cpu and hidden.is_contiguous() and hidden_size == first.hidden_size
           and num_rows >= 1 and len(layers) == len(kv_caches), "bad small_layers arguments")
    _check(first.q_width == num_heads * head_dim and first.qkv_width == (num_heads + 2 * num_kv_heads) * head_dim
           and num_heads % num_kv_heads == 0, "head shapes do not match the layer")
    num_chunks = 0 if chunks is None else chunks.token_starts.shape[0]
    chunk_tokens = 0 if chunks is None else int(chunks.query_lens.sum())
    _check(rows.token_rows.shape[0] + chunk_tokens == num_rows and rows.max_token_row < num_rows
           and rows.block_size == block_size and rows.max_block_id < num_blocks,
           "every token must be a decode row or a prompt token within the caches")
    if num_chunks:
        _check(chunks.max_token_end <= num_rows and chunks.block_size == block_size and chunks.max_block_id < num_blocks,
               "a prompt chunk out of range")
        _check(prefill_attention_built(head_dim), f"prompt chunks need prefill_attention for head_dim {head_dim}")
    empty = _EMPTY_INDEX
    chunk_args = ((chunks.token_starts.data_ptr(), chunks.query_lens.data_ptr(), chunks.starts.data_ptr(),
                   chunks.block_tables.data_ptr(), chunks.block_tables.stride(0), num_chunks) if num_chunks
                  else (empty.data_ptr(), empty.data_ptr(), empty.data_ptr(), empty.data_ptr(), 0, 0))
    _check(tokens.positions.shape[0] == num_rows and tokens.max_position < cos.shape[0]
           and tokens.max_slot < num_blocks * block_size and cos.dtype == sin.dtype == torch.float32
           and cos.shape == sin.shape and cos.shape[1] == head_dim and cos.is_contiguous() and sin.is_contiguous(),
           "a position or slot out of range")
    for layer, (k, v) in zip(layers, kv_caches):
        _check(layer.dtype == hidden.dtype and k.dtype == v.dtype == hidden.dtype
               and k.shape == v.shape == k_cache.shape and k.is_contiguous() and v.is_contiguous(), "layers or caches differ")
    intermediate = first.intermediate_size
    scratch = torch.empty(num_rows * (2 * hidden_size + first.qkv_width + first.q_width + 3 * intermediate),
                          dtype=hidden.dtype)
    source, target = hidden, torch.empty_like(hidden)
    spare = torch.empty_like(hidden)
    function = getattr(_library(), f"small_layer_{_SUFFIX[hidden.dtype]}")
    for layer, (k, v) in zip(layers, kv_caches):
        done = function(source.data_ptr(), target.data_ptr(), num_rows, hidden_size, layer.intermediate_size,
                        float(eps), layer.pointers, tokens.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                        tokens.slots.data_ptr(), k.data_ptr(), v.data_ptr(), num_heads, num_kv_heads, head_dim,
                        rows.token_rows.data_ptr(), rows.block_tables.data_ptr(), rows.block_tables.stride(0),
                        rows.context_lens.data_ptr(), rows.token_rows.shape[0], *chunk_args, block_size,
                        float(scale), SPLIT_LEN, scratch.data_ptr())
        _check(bool(done), "small_layer is not built for this CPU")
        if on_layer is not None:
            on_layer()
        # The input is never written: the first layer's is the caller's tensor.
        source, target = target, (spare if source is hidden else source)
    return source


def mask_rows(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """x[r, t] = -inf for each r in rows and each token t whose bit in bitmask[r] is clear, in
    place: x (R, width) float32 rows contiguous, bitmask (R, ceil(width / 32)) int32 contiguous.
    False, changing nothing, where the kernel is not built (the caller masks another way)."""
    library = kernels()
    function = getattr(library, "mask_rows_f32", None) if library is not None else None
    if function is None or not rows:
        return function is not None
    num_rows, width = x.shape
    _check(x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu" and bitmask.dtype == torch.int32
           and bitmask.is_contiguous() and bitmask.shape[0] >= num_rows and bitmask.shape[1] * 32 >= width
           and 0 <= min(rows) and max(rows) < num_rows, "bad mask_rows arguments")
    indices = torch.tensor(rows, dtype=torch.int64)
    function(x.data_ptr(), x.stride(0), indices.data_ptr(), len(rows), width, bitmask.data_ptr(), bitmask.stride(0))
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x (rows, width), rows contiguous: (rows,) int64."""
    rows, width = x.shape
    _check(x.dtype in _SUFFIX and x.stride(1) == 1 and x.device.type == "cpu" and width > 0, "bad argmax argument")
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        getattr(_library(), f"argmax_rows_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), rows, width, out.data_ptr())
    return out


def sample(x: torch.Tensor, inv_temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of logits x (rows, width), rows contiguous, drawn from softmax(x[r] *
    inv_temperatures[r]) with noise that depends on seeds[r] and the token index alone (kernels.cpp,
    sample_rows): (rows,) int64. inv_temperatures (rows,) float32 positive and finite, seeds (rows,)
    int64."""
    rows, width = x.shape
    _check(x.dtype in _SUFFIX and x.stride(1) == 1 and x.device.type == "cpu" and 0 < width < 2**31,
           "bad sample argument")
    _check(inv_temperatures.dtype == torch.float32 and inv_temperatures.shape == (rows,)
           and inv_temperatures.is_contiguous() and seeds.dtype == torch.int64 and seeds.shape == (rows,)
           and seeds.is_contiguous(), "bad sample temperatures or seeds")
    _check(bool(torch.isfinite(inv_temperatures).all()) and bool((inv_temperatures > 0).all()),
           "inverse temperatures must be positive and finite")
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        getattr(_library(), f"sample_rows_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), rows, width,
                                                              inv_temperatures.data_ptr(), seeds.data_ptr(),
                                                              out.data_ptr())
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows,
                     out: torch.Tensor, scale: float) -> None:
    """out[token_rows[i]] = attention of q[token_rows[i]] over the first context_lens[i] positions of
    the sequence whose blocks are block_tables[i], for every row i of `rows`.

    q, out: (T, num_heads, head_dim), each token row contiguous (q may be a view with a larger row
    stride); k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim) contiguous, with the
    block_size `rows` was checked with, and every row and block id of `rows` within them.
    """
    library = _library()
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    _check_attention_tensors(q, k_cache, v_cache, out)
    _check(rows.max_token_row < num_tokens and rows.max_block_id < num_blocks and rows.block_size == block_size,
           "a row or block id out of range")
    num_rows = rows.token_rows.shape[0]
    if num_rows == 0:
        return
    getattr(library, f"decode_attention_{_SUFFIX[q.dtype]}")(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), rows.token_rows.data_ptr(),
        rows.block_tables.data_ptr(), rows.block_tables.stride(0), rows.context_lens.data_ptr(), out.data_ptr(),
        out.stride(0), num_rows, num_heads, num_kv_heads, head_dim, block_size, float(scale), SPLIT_LEN)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: PrefillRows,
                      out: torch.Tensor, scale: float) -> bool:
    """out[token_starts[i] + t] = causal attention of q[token_starts[i] + t], at position starts[i] + t,
    over positions [0, starts[i] + t] of the sequence whose blocks are block_tables[i], for every
    chunk i of `rows` and t < query_lens[i]. False, with nothing written, where the kernel is not
    built for this CPU or head_dim (the caller keeps SDPA then).

    q, out: (T, num_heads, head_dim), each token row contiguous; k_cache, v_cache: (num_blocks,
    block_size, num_kv_heads, head_dim) contiguous, holding every position the chunks read.
    """
    library = _library()
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    _check_attention_tensors(q, k_cache, v_cache, out)
    _check(rows.max_token_end <= num_tokens and rows.max_block_id < num_blocks and rows.block_size == block_size,
           "a row or block id out of range")
    num_rows = rows.token_starts.shape[0]
    if num_rows == 0:
        return True
    return bool(getattr(library, f"prefill_attention_{_SUFFIX[q.dtype]}")(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), rows.token_starts.data_ptr(),
        rows.query_lens.data_ptr(), rows.starts.data_ptr(), rows.block_tables.data_ptr(), rows.block_tables.stride(0),
        num_rows, out.data_ptr(), out.stride(0), num_heads, num_kv_heads, head_dim, block_size, float(scale)))


def _check_attention_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             out: torch.Tensor) -> None:
    """What decode_attention and prefill_attention both need of their tensors' dtypes and layouts."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    _check(q.dtype in _SUFFIX and q.dtype == k_cache.dtype == v_cache.dtype == out.dtype, "dtypes differ")
    _check(q.device.type == k_cache.device.type == v_cache.device.type == out.device.type == "cpu",
           "every tensor must be on the CPU")
    _check(q.stride(2) == 1 and q.stride(1) == head_dim, "q's token rows must be contiguous")
    _check(out.shape == q.shape and out.stride(2) == 1 and out.stride(1) == head_dim, "out must match q")
    _check(k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape,
           "caches must be contiguous and alike")
    _check(num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim, "head shapes do not match")


def _library() -> ctypes.CDLL:
    library = kernels()
    if library is None:
        raise KernelBuildError("the CPU kernels are not available")
    return library


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"CPU kernel: {message}")
