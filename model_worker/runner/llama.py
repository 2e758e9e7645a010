"""Our own Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

One forward per engine step runs over the packed tokens of every scheduled sequence: prompt
chunks and decode tokens side by side, shape (num_tokens, hidden). There is no batch dimension
and no padding; attention is the only op that needs to know where one sequence ends, and it
reads that from the backend's metadata. q/k/v and gate/up are fused into one matmul each at
load time. Logits are computed only for the rows the sampler needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from model_worker.runner import linear as packed
from model_worker.runner.attention.base import AttentionBackend
from model_worker.runner.attention.cpu_backend import CpuAttentionMetadata
from model_worker.runner.cpu_kernels import ops as cpu_ops

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# The float32 islands of a decoder below float32 (LlamaDecoder says what each keeps in float32).
ISLANDS = ("fp32_residual", "fp32_rotary", "fp32_logits", "fp32_final_norm")
# These recompute their frequencies from the current sequence length inside the forward pass, so
# one set of cos/sin tables cannot serve every sequence of a packed batch.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(slots=True)
class DecoderSpec:
    """Shapes and constants of a decoder, read once from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    # q/k/v projections carry a bias (Qwen2 always; Llama when attention_bias is set).
    qkv_bias: bool
    # o_proj carries a bias (Llama with attention_bias).
    o_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Attention window in tokens, or None for full attention. The runner caps max_model_len at it,
    # so a sequence never grows past the window and full attention stays exact.
    sliding_window: int | None
    # RoPE inverse frequencies (head_dim // 2,) in float32, and the factor cos/sin are scaled by.
    inv_freq: torch.Tensor
    rope_attention_scaling: float

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DecoderSpec:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only silu (SwiGLU) is implemented")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        inv_freq, attention_scaling = compute_rope_frequencies(hf_config, head_dim)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias is not supported")
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_window=_sliding_window(hf_config, model_type),
            inv_freq=inv_freq,
            rope_attention_scaling=float(attention_scaling),
        )


def _sliding_window(hf_config: Any, model_type: str) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        return None
    return int(window) if window else None


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings as one dict, from transformers 5 `rope_parameters` or older fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def compute_rope_frequencies(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq (head_dim // 2,) float32 and the cos/sin scaling, exactly as transformers does."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} depends on the sequence length at run time and is not supported; "
                         "use a checkpoint with a static RoPE type (default, linear, llama3, yarn, ...)")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq, scaling = 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown RoPE type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    inv_freq = inv_freq.float().cpu()
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    return inv_freq, float(scaling)


@dataclass(slots=True)
class LayerWeights:
    """One layer's tensors. The decoder may hold the four matrices packed for oneDNN instead
    (model_worker/runner/linear.py): opaque tensors that only its linear reads."""

    input_norm: torch.Tensor  # (hidden,)
    qkv_proj: torch.Tensor  # (q_size + 2 * kv_size, hidden): q, k, v stacked
    qkv_bias: torch.Tensor | None  # (q_size + 2 * kv_size,)
    o_proj: torch.Tensor  # (hidden, q_size)
    o_bias: torch.Tensor | None  # (hidden,)
    post_attention_norm: torch.Tensor  # (hidden,)
    gate_up_proj: torch.Tensor  # (2 * intermediate, hidden): gate, then up
    down_proj: torch.Tensor  # (hidden, intermediate)


@dataclass(slots=True)
class PackedLayerWeights:
    """One layer's tensors with its matrices packed for oneDNN (model_worker/runner/linear.py):
    opaque tensors that only its functions read."""

    input_norm: torch.Tensor  # (hidden,)
    qkv_proj: torch.Tensor  # packed (q_size + 2 * kv_size, hidden)
    qkv_bias: torch.Tensor | None  # (q_size + 2 * kv_size,)
    o_proj: torch.Tensor  # packed (hidden, q_size)
    o_bias: torch.Tensor | None  # (hidden,)
    post_attention_norm: torch.Tensor  # (hidden,)
    gate_up_proj: torch.Tensor  # packed (2 * intermediate, hidden): gate, then up
    down_proj: torch.Tensor  # packed (hidden, intermediate)
    # The matrices packed in panels as well, for steps of up to small_rows rows (our panel
    # kernel, cpu_kernels panel_linear), or None: a LayerWeights whose four matrices are panels.
    panels: LayerWeights | None = None

    @classmethod
    def pack(cls, layer: LayerWeights, with_panels: bool = False) -> PackedLayerWeights:
        panels = None
        if with_panels:
            panels = dataclasses.replace(layer, qkv_proj=cpu_ops.pack_panels(layer.qkv_proj),
                                         o_proj=cpu_ops.pack_panels(layer.o_proj),
                                         gate_up_proj=cpu_ops.pack_panels(layer.gate_up_proj),
                                         down_proj=cpu_ops.pack_panels(layer.down_proj))
        return cls(input_norm=layer.input_norm, qkv_proj=packed.pack(layer.qkv_proj), qkv_bias=layer.qkv_bias,
                   o_proj=packed.pack(layer.o_proj), o_bias=layer.o_bias,
                   post_attention_norm=layer.post_attention_norm, gate_up_proj=packed.pack(layer.gate_up_proj),
                   down_proj=packed.pack(layer.down_proj), panels=panels)


@dataclass(slots=True)
class DecoderWeights:
    embed_tokens: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights] | list[PackedLayerWeights]
    norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden); the same tensor as embed_tokens when tied


class LlamaDecoder:
    """Functional decoder: plain tensors and torch ops, no nn.Module bookkeeping in the hot loop.

    Below float32 (bfloat16, float16) the weights, matmuls and KV cache are in the model dtype,
    and the numerically sensitive parts stay in float32, each a switch (each measured alone by
    `python -m loadtest.benchmarks.bench_agreement`: docs/benchmarks.md, 'bfloat16 numerics:
    greedy agreement with transformers'):
    - `fp32_residual`: the residual stream between layers, so rounding does not pile up over 30
      layers of additions; each layer reads a normed copy in the model dtype.
    - `fp32_rotary`: cos/sin tables and the rotation of q and k, rounded once afterwards.
    - `fp32_logits`: the final norm and the LM head on float32 weights (a float32 copy of the head,
      read every step).
    - `fp32_final_norm`: the final norm in float32, rounded once for an LM head in the model dtype,
      the logits upcast (as vLLM computes them). Only read when fp32_logits is off.
    Only fp32_final_norm is on by default, the one that pays for itself (docs/benchmarks.md, 'The
    float32 islands, each priced'); `set_islands` changes them (the ablation does).
    RMSNorm statistics are always float32, and attention's softmax accumulates in float32 inside
    the attention kernels.

    On CPU the matrices of every layer and the LM head are packed once for oneDNN
    (model_worker/runner/linear.py) where it runs the dtype, unless `pack_weights` is False; the
    layers' plain copies are then dropped, the embedding table (the tied head) kept. With
    `small_batch_kernel` the matrices and the head are also packed in panels of 16 output features
    for our own matmul (cpu_kernels `panel_linear`: AVX-512, and AMX tiles for bfloat16 where the CPU
    has them), which reads a weight at 80-90% of the memory's bandwidth where oneDNN's packed matmul
    reaches about 60%, and a step of at most `small_rows` rows (decode steps, the rows a machine's
    A/B measured it faster for) goes through them; larger steps (prefills) through oneDNN's. The
    weights are then held twice (docs/benchmarks.md, 'Speed on the CPU against vLLM, fifth pass').
    With the CPU attention backend such a step, when every row decodes, runs each layer in one call
    of our kernels (cpu_kernels `small_layer`, the calls of `_packed_layer`'s panel path from C++,
    the same bits). A packed layer adds its residuals as post-ops of the o and down matmuls; with the CPU attention backend it
    also takes RMSNorm and SiLU-times-up from our kernels (model_worker/runner/cpu_kernels/) and
    hands the raw q/k/v projection to the backend, which rotates q and k (in float32, rounded once:
    the fp32_rotary island's numerics, at no cost), writes the cache and attends in one call
    (attention/cpu_backend.py): about ten calls a layer where the torch ops make some sixty.
    """

    def __init__(self, spec: DecoderSpec, weights: DecoderWeights, attention: AttentionBackend,
                 max_model_len: int, pack_weights: bool = True, small_batch_kernel: bool = True) -> None:
        self.spec = spec
        self.weights = weights
        self.attention = attention
        self.scale = spec.head_dim ** -0.5
        device, dtype = weights.embed_tokens.device, weights.embed_tokens.dtype
        self.dtype = dtype
        # Layers computed, over every forward: the runner's progress (engine_loop's heartbeat).
        self.layers_run = 0
        # Of the islands only the final norm pays for itself: it costs nothing measurable, and with
        # oneDNN's bfloat16 matmuls the others each bought at most one more of 20 chat prompts
        # equal to transformers float32, for 4 to 8 ms a step (docs/benchmarks.md).
        self.fp32_residual = False
        self.fp32_rotary = False
        self.fp32_logits = False
        self.fp32_final_norm = dtype != torch.float32
        # cos/sin tables (max_model_len, head_dim), computed in float32, kept in float32 for the
        # float32 rotation and cast to the model dtype (as transformers does per forward) otherwise.
        positions = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, spec.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table32 = (emb.cos() * spec.rope_attention_scaling).to(device=device)
        self.sin_table32 = (emb.sin() * spec.rope_attention_scaling).to(device=device)
        self.cos_table = self.cos_table32.to(dtype)
        self.sin_table = self.sin_table32.to(dtype)
        self._norm32 = weights.norm.float()
        # F.rms_norm is one fused op; transformers normalises in float32 and casts back, which only
        # differs from it below float32.
        self._fused_norm = dtype == torch.float32
        self.packed = pack_weights and packed.packs(device.type, dtype)
        # Steps of at most this many rows read the panels through our kernel; 0: never.
        self.small_rows = (cpu_ops.panel_max_rows(dtype)
                           if self.packed and small_batch_kernel and cpu_ops.has_panel_linear(dtype)
                           and all(cpu_ops.can_pack_panels(w) for layer in weights.layers
                                   for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
                           else 0)
        self._head = self._make_head()  # now, so the memory profile sees it
        if self.packed:
            self.weights = dataclasses.replace(weights, layers=[PackedLayerWeights.pack(layer, self.small_rows > 0)
                                                                for layer in weights.layers])
        # With the CPU attention backend, a decode-only step of up to small_rows rows runs each layer
        # in one call of our kernels (cpu_kernels small_layer: _packed_layer's panel calls, from C++).
        self._small_layers = ([cpu_ops.SmallLayer.of(p.input_norm, p.qkv_proj, p.qkv_bias, p.o_proj, p.o_bias,
                                                     p.post_attention_norm, p.gate_up_proj, p.down_proj)
                               for p in (layer.panels for layer in self.weights.layers)]
                              if self.small_rows and self.attention.fuses_rotary else None)

    def set_islands(self, **flags: bool) -> None:
        """Turn float32 islands on or off by name (fp32_residual, fp32_rotary, fp32_logits,
        fp32_final_norm); the LM head the forward reads is remade to match."""
        for name, on in flags.items():
            if name not in ISLANDS:
                raise ValueError(f"unknown float32 island {name!r}; islands: {', '.join(ISLANDS)}")
            setattr(self, name, bool(on))
        self._head = self._make_head()

    def _make_head(self) -> torch.Tensor:
        head = self.weights.lm_head.float() if self.fp32_logits else self.weights.lm_head
        # The head in panels for steps of up to small_rows rows (a copy beside the embedding table).
        self._small_head = (cpu_ops.pack_panels(head) if self.small_rows and head.dtype == self.dtype
                            and cpu_ops.can_pack_panels(head) else None)
        if self.packed and packed.packs(head.device.type, head.dtype):
            return packed.pack(head)
        return head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: Any, logits_indices: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """input_ids, positions: (T,). Returns logits (len(logits_indices), vocab): float32, or with
        upcast False in the LM head's dtype (a greedy sampler's argmax needs no float32 copy)."""
        weights = self.weights
        hidden = F.embedding(input_ids, weights.embed_tokens)  # (T, hidden)
        if self.fp32_residual:
            hidden = hidden.float()
        tables = (self.cos_table32, self.sin_table32) if self.fp32_rotary else (self.cos_table, self.sin_table)
        cos = tables[0][positions].unsqueeze(1)  # (T, 1, head_dim)
        sin = tables[1][positions].unsqueeze(1)
        if self._runs_small_layers(hidden, attn_metadata):
            hidden = cpu_ops.small_layers(hidden, self._small_layers, kv_caches, attn_metadata.tokens,
                                          attn_metadata.decode, self.cos_table32, self.sin_table32,
                                          self.spec.num_heads, self.spec.rms_norm_eps, self.scale,
                                          attn_metadata.prefill, on_layer=self._layer_done)
        else:
            for layer, (k_cache, v_cache) in zip(weights.layers, kv_caches):
                hidden = self._layer(layer, hidden, cos, sin, k_cache, v_cache, attn_metadata)
                self.layers_run += 1
        hidden = hidden[logits_indices]  # the final norm is per row, so only sampled rows need it
        if hidden.shape[0] == 0:  # a prompt chunk that samples nothing: no head (its kernels take >= 1 row)
            dtype = torch.float32 if upcast or self.fp32_logits else self.dtype
            return hidden.new_empty((0, self.spec.vocab_size), dtype=dtype)
        if self.fp32_logits:
            normed = F.rms_norm(hidden.float(), self._norm32.shape, self._norm32, self.spec.rms_norm_eps)
            return self._head_linear(normed)
        if self.fp32_final_norm:
            normed = F.rms_norm(hidden.float(), self._norm32.shape, self._norm32, self.spec.rms_norm_eps)
            logits = self._head_linear(normed.to(self.dtype))
        else:
            logits = self._head_linear(self._rms_norm(hidden, weights.norm))
        return logits.float() if upcast else logits

    def _layer_done(self) -> None:
        self.layers_run += 1

    def _head_linear(self, normed: torch.Tensor) -> torch.Tensor:
        small_head = self._small_head
        if small_head is not None and normed.shape[0] <= self.small_rows and normed.dtype == self.dtype:
            return cpu_ops.panel_linear(normed, small_head)
        head = self._head
        return packed.linear(normed, head) if head.is_mkldnn else F.linear(normed, head)

    def _layer(self, layer: LayerWeights | PackedLayerWeights, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        if isinstance(layer, PackedLayerWeights):
            return self._packed_layer(layer, hidden, cos, sin, k_cache, v_cache, attn_metadata)
        return self._plain_layer(layer, hidden, cos, sin, k_cache, v_cache, attn_metadata)

    def _packed_layer(self, layer: PackedLayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """oneDNN's packed matmuls, or for a step of at most small_rows rows our panel kernel (the
        residuals added inside it as oneDNN's post-ops add them)."""
        spec = self.spec
        num_tokens = hidden.shape[0]
        if layer.panels is not None and num_tokens <= self.small_rows:
            weights, linear, linear_add = layer.panels, cpu_ops.panel_linear, cpu_ops.panel_linear
        else:
            weights, linear, linear_add = layer, packed.linear, packed.linear_add
        qkv = linear(self._packed_norm(hidden, weights.input_norm), weights.qkv_proj, weights.qkv_bias)
        if self.attention.fuses_rotary:
            attn = self.attention.forward_qkv(qkv, k_cache, v_cache, attn_metadata, self.scale, self.cos_table32,
                                              self.sin_table32)
        else:
            q, k, v = self._rotary(qkv, cos, sin)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, attn_metadata, self.scale)
        hidden = self._residual_linear(attn.reshape(num_tokens, spec.q_size), weights.o_proj, weights.o_bias, hidden,
                                       linear, linear_add)
        gate_up = linear(self._packed_norm(hidden, weights.post_attention_norm), weights.gate_up_proj)
        return self._residual_linear(self._silu_and_mul(gate_up), weights.down_proj, None, hidden, linear, linear_add)

    def _runs_small_layers(self, hidden: torch.Tensor, attn_metadata: Any) -> bool:
        """A step of at most small_rows rows, the residual stream in the model dtype, prepared by
        the CPU attention backend (its decode rows, prompt chunks and token slots are what the
        kernel reads; the backend can be swapped after load, as tests swap it). Prompt chunks too
        where prefill_attention runs this head size (else SDPA takes them, from Python)."""
        if not (self._small_layers is not None and hidden.shape[0] <= self.small_rows and hidden.dtype == self.dtype
                and isinstance(attn_metadata, CpuAttentionMetadata)):
            return False
        prefill = attn_metadata.prefill
        if prefill.token_starts.shape[0] == 0:
            return attn_metadata.decode.token_rows.shape[0] == hidden.shape[0]
        return (cpu_ops.prefill_attention_built(self.spec.head_dim)
                and attn_metadata.decode.token_rows.shape[0] + int(prefill.query_lens.sum()) == hidden.shape[0])

    def _kernels(self, dtype: torch.dtype) -> bool:
        """Whether our CPU kernels take this dtype's elementwise work: with the CPU attention backend."""
        return self.attention.fuses_rotary and dtype == self.dtype

    def _packed_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._kernels(hidden.dtype):
            return cpu_ops.rms_norm(hidden, weight, self.spec.rms_norm_eps)
        return self._rms_norm(hidden, weight)

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernels(gate_up.dtype):
            return cpu_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def _residual_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor,
                         linear: Any, linear_add: Any) -> torch.Tensor:
        """hidden + x @ W^T (+ bias), the addition inside the matmul unless the residual stream is
        float32 (the fp32_residual island), which a lower-precision matmul cannot take as an operand."""
        if hidden.dtype == x.dtype:
            return linear_add(x, weight, bias, hidden)
        return hidden + linear(x, weight, bias)

    def _rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated and v, from the q/k/v projection (T, q_size + 2 * kv_size)."""
        spec = self.spec
        num_tokens = qkv.shape[0]
        # q and k are rotated together: (T, num_heads + num_kv_heads, head_dim).
        qk = qkv[:, : spec.q_size + spec.kv_size].view(num_tokens, spec.num_heads + spec.num_kv_heads, spec.head_dim)
        if cos.dtype != qk.dtype:
            qk = qk.float()
        qk = (qk * cos + _rotate_half(qk) * sin).to(self.dtype)
        v = qkv[:, spec.q_size + spec.kv_size:].view(num_tokens, spec.num_kv_heads, spec.head_dim)
        return qk[:, : spec.num_heads], qk[:, spec.num_heads:], v

    def _plain_layer(self, layer: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        spec = self.spec
        num_tokens = hidden.shape[0]
        normed = self._rms_norm(hidden, layer.input_norm)
        qkv = F.linear(normed, layer.qkv_proj, layer.qkv_bias)  # (T, q_size + 2 * kv_size)
        q, k, v = self._rotary(qkv, cos, sin)
        attn = self.attention.forward(q, k, v, k_cache, v_cache, attn_metadata, self.scale)  # (T, num_heads, head_dim)
        hidden = hidden + F.linear(attn.reshape(num_tokens, spec.q_size), layer.o_proj, layer.o_bias)
        normed = self._rms_norm(hidden, layer.post_attention_norm)
        gate, up = F.linear(normed, layer.gate_up_proj).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, layer.down_proj)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm with float32 statistics; the result is in the model dtype, whatever x's dtype
        (a float32 residual stream is read in the model dtype by the next matmul)."""
        if self._fused_norm:
            return F.rms_norm(x, weight.shape, weight, self.spec.rms_norm_eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(weight.dtype)

    def lm_head_read_per_step(self) -> torch.Tensor:
        """The LM head a forward reads: its float32 copy under fp32_logits, else the model's;
        packed for oneDNN where the layers are."""
        return self._head


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
