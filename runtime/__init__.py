"""runtime: the engine. Llama-family model, weight loading, catalogue, static KV cache, attention."""

from runtime.cache import KVCache
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
from runtime.loading import load_model, load_tokenizer
from runtime.model import Transformer
from runtime.model_output import ModelOutput

__all__ = ["KVCache", "ModelConfig", "Transformer", "ModelOutput", "compile_decode", "load_model", "load_tokenizer",
           "fetch", "fetch_gguf", "CATALOGUE", "HFAdapter", "SpecdecError", "CheckpointError", "CatalogueError",
           "ContextLengthError", "CacheMemoryError", "CacheHomeError", "UnsupportedModelError"]


def __getattr__(name: str):
    # catalogue and adapter import lazily: `import runtime` stays cheap
    if name in ("fetch", "fetch_gguf", "CATALOGUE"):
        from runtime import catalogue

        return getattr(catalogue, name)
    if name == "HFAdapter":
        from runtime.hf_adapter import HFAdapter

        return HFAdapter
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
