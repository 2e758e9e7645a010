"""Loading a Hugging Face checkpoint: config, safetensors weights (fused), tokenizer, EOS ids.

A checkpoint is a directory with config.json, one or many *.safetensors files (sharded ones come
with model.safetensors.index.json) and tokenizer files. A name that is not a directory is taken
as a hub id and fetched with huggingface_hub, which only works where a hub is reachable.
Tensors are read through safetensors' memory map one at a time, so loading never holds a second
full copy of the weights in host memory.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from model_worker.checkpoints.models import resolve_model_path
from model_worker.runner.llama import DecoderSpec, DecoderWeights, LayerWeights

SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(slots=True)
class Checkpoint:
    path: str
    hf_config: Any
    spec: DecoderSpec
    weights: DecoderWeights


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json; not a Hugging Face checkpoint")
    return AutoConfig.from_pretrained(path)


def load_checkpoint(model: str | None, device: torch.device, dtype: torch.dtype) -> Checkpoint:
    path = resolve_model_path(model)
    hf_config = load_hf_config(path)
    spec = DecoderSpec.from_hf_config(hf_config)
    weights = load_weights(path, spec, device, dtype)
    return Checkpoint(path=path, hf_config=hf_config, spec=spec, weights=weights)


def checkpoint_from_state_dict(path: str, hf_config: Any, state_dict: dict[str, torch.Tensor],
                               device: torch.device, dtype: torch.dtype) -> Checkpoint:
    """A Checkpoint from tensors already in memory (a transformers model's state_dict), named and
    shaped as in a safetensors checkpoint; `path` is where the tokenizer and generation config are
    read from. The GPU check builds a model of a large shape on the GPU this way, without writing
    its weights to disk."""
    spec = DecoderSpec.from_hf_config(hf_config)
    weights = _read_weights(_DictReader(path, state_dict, device, dtype), spec)
    return Checkpoint(path=path, hf_config=hf_config, spec=spec, weights=weights)


def load_eos_token_ids(path: str, hf_config: Any, tokenizer: Any | None) -> list[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    eos: Any = None
    generation_config = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(token_id) for token_id in eos]


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights (only safetensors checkpoints are supported)")
    names: dict[str, str] = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt", device="cpu") as handle:
            names.update(dict.fromkeys(handle.keys(), os.path.join(path, file)))
    return names


class _DictReader:
    """Reads named tensors from a dict, converted to device and dtype, with _TensorReader's checks."""

    def __init__(self, path: str, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        self.path = path
        self.tensors = tensors
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint {self.path} is missing tensor {name!r}")
        return _checked(name, self.tensors[name], shape, self.device, self.dtype)


def _checked(name: str, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device,
             dtype: torch.dtype) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor.to(device=device, dtype=dtype)


class _TensorReader:
    """Reads named tensors from memory-mapped safetensors files, converted to device and dtype."""

    def __init__(self, path: str, stack: ExitStack, device: torch.device, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.path = path
        self.files = _tensor_files(path)
        self.handles = {file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                        for file in set(self.files.values())}
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"checkpoint {self.path} is missing tensor {name!r}")
        return _checked(name, self.handles[self.files[name]].get_tensor(name), shape, self.device, self.dtype)


def load_weights(path: str, spec: DecoderSpec, device: torch.device, dtype: torch.dtype) -> DecoderWeights:
    with ExitStack() as stack:
        return _read_weights(_TensorReader(path, stack, device, dtype), spec)


def _read_weights(reader: _TensorReader | _DictReader, spec: DecoderSpec) -> DecoderWeights:
    embed = reader.get("model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size))
    layers = [_load_layer(reader, spec, i) for i in range(spec.num_layers)]
    norm = reader.get("model.norm.weight", (spec.hidden_size,))
    if spec.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = reader.get("lm_head.weight", (spec.vocab_size, spec.hidden_size))
    return DecoderWeights(embed_tokens=embed, layers=layers, norm=norm, lm_head=lm_head)


def _load_layer(reader: _TensorReader | _DictReader, spec: DecoderSpec, index: int) -> LayerWeights:
    prefix = f"model.layers.{index}."
    hidden, q_size, kv_size = spec.hidden_size, spec.q_size, spec.kv_size
    qkv = torch.cat([reader.get(prefix + "self_attn.q_proj.weight", (q_size, hidden)),
                     reader.get(prefix + "self_attn.k_proj.weight", (kv_size, hidden)),
                     reader.get(prefix + "self_attn.v_proj.weight", (kv_size, hidden))])
    qkv_bias = None
    if spec.qkv_bias:
        qkv_bias = torch.cat([reader.get(prefix + "self_attn.q_proj.bias", (q_size,)),
                              reader.get(prefix + "self_attn.k_proj.bias", (kv_size,)),
                              reader.get(prefix + "self_attn.v_proj.bias", (kv_size,))])
    o_bias = reader.get(prefix + "self_attn.o_proj.bias", (hidden,)) if spec.o_bias else None
    gate_up = torch.cat([reader.get(prefix + "mlp.gate_proj.weight", (spec.intermediate_size, hidden)),
                         reader.get(prefix + "mlp.up_proj.weight", (spec.intermediate_size, hidden))])
    return LayerWeights(
        input_norm=reader.get(prefix + "input_layernorm.weight", (hidden,)),
        qkv_proj=qkv,
        qkv_bias=qkv_bias,
        o_proj=reader.get(prefix + "self_attn.o_proj.weight", (hidden, q_size)),
        o_bias=o_bias,
        post_attention_norm=reader.get(prefix + "post_attention_layernorm.weight", (hidden,)),
        gate_up_proj=gate_up,
        down_proj=reader.get(prefix + "mlp.down_proj.weight", (hidden, spec.intermediate_size)),
    )
