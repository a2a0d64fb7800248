"""Llama-family decoder, weight loading (Hugging Face safetensors directories, GGUF files), the
default SmolLM2-135M-Instruct model and named random-weight shapes.

    loaded = load_model(None, device="cpu", dtype=None)      # default model
    logits = loaded.model(input_ids, positions, kv_cache, meta)  # float32 [num_seqs, vocab]
"""

from vmkv.model.config import (
    SHAPES,
    SUPPORTED_GGUF_ARCHITECTURES,
    SUPPORTED_HF_MODEL_TYPES,
    ModelConfig,
    UnsupportedModelError,
)
from vmkv.model.llama import LlamaForCausalLM
from vmkv.model.loader import LoadedModel, load_model, random_model, resolve_device, resolve_dtype
from vmkv.model.parallel import TensorParallel

__all__ = [
    "SHAPES", "SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_HF_MODEL_TYPES", "ModelConfig",
    "UnsupportedModelError", "LlamaForCausalLM", "LoadedModel", "load_model", "random_model",
    "resolve_device", "resolve_dtype", "TensorParallel",
]
