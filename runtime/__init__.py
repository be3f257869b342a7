"""runtime: the engine. Llama-family model, weight loading, catalogue, static KV cache, attention."""

from runtime.cache import KVCache
from runtime.catalogue import CATALOGUE, fetch, fetch_gguf
from runtime.compile import compile_decode
from runtime.config import ModelConfig
from runtime.errors import (
    CacheHomeError,
    CacheMemoryError,
    CatalogueError,
    CheckpointError,
    ContextLengthError,
    SpecdecError,
    UnsupportedModelError,
)
from runtime.hf_adapter import HFAdapter
from runtime.loading import load_model, load_tokenizer
from runtime.model import Transformer
from runtime.model_output import ModelOutput

__all__ = ["KVCache", "ModelConfig", "Transformer", "ModelOutput", "compile_decode", "load_model", "load_tokenizer",
           "fetch", "fetch_gguf", "CATALOGUE", "HFAdapter", "SpecdecError", "CheckpointError", "CatalogueError",
           "ContextLengthError", "CacheMemoryError", "CacheHomeError", "UnsupportedModelError"]

