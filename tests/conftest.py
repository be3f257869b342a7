"""Shared test fixtures: a tiny random Llama and a writer that stores such a model as a GGUF file.

Without a CUDA GPU the Triton kernels run on the interpreter. TRITON_INTERPRET must be set
before anything imports triton (accelerate and bitsandbytes do, in other test folders), so it
is set here, in the first conftest pytest loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def tree_snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a directory), in sorted order."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(Path(root).rglob("*"))}


@pytest.fixture
def snapshot():
    """`snapshot(root)`: the tree under `root` (tree_snapshot), to check a refused or failed call left
    it as it was."""
    return tree_snapshot


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 and back: such values survive a bf16 checkpoint unchanged."""
    return t.to(torch.bfloat16).to(torch.float32)


def _random_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter from an explicit generator with bf16-representable values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise
            param.copy_(_bf16_exact(value))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random transformers LlamaForCausalLM (fp32, tied embeddings, bf16-exact weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    return _random_weights(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A tiny random transformers Qwen2ForCausalLM (qkv bias, separate output head)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    return _random_weights(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed=1)


# Hugging Face parameter names -> llama.cpp GGUF tensor names (per layer, then global)
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows of llama models for its RoPE layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `_llama_cpp_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer(writer, vocab_size: int) -> None:
    """A small byte-level BPE vocabulary (gpt2 style) with a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    merged = ["ab", "cd", "abcd", "ef"]
    singles = [byte_char[b] for b in [*range(32, 127), *range(161, 256)]][: vocab_size - 3 - len(merged)]
    tokens = ["<unk>", "<s>", "</s>"] + singles + merged
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab_size - 3))
    writer.add_token_merges(["a b", "c d", "ab cd", "e f"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_tiny_gguf(model, path: Path, quantize: dict[str, str] | None = None, skip: tuple[str, ...] = (),
                    tokenizer: bool = True, arch: str | None = None, metadata: dict[str, int] | None = None,
                    extra: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Store a tiny transformers Llama/Qwen2 model as a GGUF file the way llama.cpp lays it out.

    quantize: GGUF tensor name -> ggml type name (e.g. "Q8_0") for tensors to store quantized;
    skip: GGUF tensor names to leave out; arch: the GGUF architecture (default: the model's type;
    "llama" for a Qwen2 model stores its q / k / v biases in a llama file); metadata: integer
    metadata keys ("llama.attention.head_count") written with other values; extra: more tensors
    (GGUF name -> float32 array) written as they are. Returns the Hugging Face state dict (fp32)
    that a bf16 conversion of the file must reproduce: the source weights, with quantized ones
    replaced by their dequantized values rounded to bf16.
    """
    import gguf
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    cfg = model.config
    arch = arch or cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata:
        add_uint32 = writer.add_uint32
        writer.add_uint32 = lambda key, value: add_uint32(key, metadata.get(key, value))
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        _write_tokenizer(writer, cfg.vocab_size)
    expected: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name)
        if name in skip:
            continue
        data = tensor.float().numpy().copy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, data)
            expected[hf_name] = tensor.float().clone()
            continue
        kind = gguf.GGMLQuantizationType[qtype]
        packed = gguf_quantize(data, kind)
        writer.add_tensor(name, packed, raw_dtype=kind)
        restored = dequantize(packed, kind).reshape(data.shape)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            restored = _llama_cpp_unpermute(restored, heads)
        expected[hf_name] = _bf16_exact(torch.from_numpy(restored.copy()))
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="session")
def gguf_writer():
    """`write_tiny_gguf(model, path, quantize=None, skip=(), tokenizer=True) -> expected HF state`."""
    return write_tiny_gguf
