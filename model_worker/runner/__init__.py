"""The torch side of a model worker: our Llama-family decoder, paged attention, sampling, loading."""

from model_worker.checkpoints.models import load_tokenizer
from model_worker.runner.model_runner import TorchModelRunner

__all__ = ["TorchModelRunner", "load_tokenizer"]
