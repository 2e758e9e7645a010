"""iterserve's model worker: a continuous-batching engine over a paged KV cache.

Importing this package does not import torch; the torch model runner loads when an engine is
built without an injected runner.
"""

from contracts.sampling import SamplingParams, SamplingParamsError
from contracts.serving import GenerationChunk
from model_worker.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailed, RequestStream
from model_worker.config import EngineConfig
from model_worker.engine.llm_engine import LLMEngine
from model_worker.sched.hashing import hash_block_tokens, hash_prompt_blocks
from model_worker.checkpoints.models import DEFAULT_MODEL, TINY_MODEL, default_model_path, resolve_model
from model_worker.sched.request import Priority, RequestStatus
from model_worker.sched.scheduler import RequestRejected


def tiny_model_path(cache_dir: str | None = None) -> str:
    """Directory of the tiny random-weight model (a normal HF checkpoint), built if missing."""
    from model_worker.checkpoints.tiny_model import tiny_model_path as build

    return build(cache_dir)


__all__ = [
    "DEFAULT_MODEL", "TINY_MODEL", "AsyncLLMEngine", "EngineConfig", "EngineDeadError", "GenerationChunk",
    "LLMEngine", "Priority", "RequestFailed", "RequestRejected", "RequestStream", "RequestStatus", "SamplingParams",
    "SamplingParamsError", "default_model_path", "hash_block_tokens", "hash_prompt_blocks", "resolve_model",
    "tiny_model_path",
]
