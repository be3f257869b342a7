"""dense_hf_state: a runtime Transformer's weights as a Hugging Face-named dense state dict.

The inverse of runtime.loading's name map (q/k/v and gate/up split again, compressed linears
dequantized); what quant's exports and distill's saved drafts write as model.safetensors.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.qlinear import QuantizedLinear


def is_tied(model: nn.Module) -> bool:
    """True when the model's LM head shares the token embedding's weight."""
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed", None)
    return isinstance(head, nn.Linear) and embed is not None and head.weight is embed.weight


def hf_linear_parts(model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """Runtime linear name -> the Hugging Face weights it holds, as (name, first row, end row): q/k/v
    share `attn.wqkv`, gate/up share `mlp.w13`; the LM head is listed unless it is tied."""
    cfg = model.config
    q, kv, ff, hidden = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size,
                         cfg.hidden_size)
    parts = {} if is_tied(model) else {"lm_head": [("lm_head.weight", 0, model.lm_head.out_features)]}
    for i in range(len(model.layers)):
        p = f"model.layers.{i}."
        parts[f"layers.{i}.attn.wqkv"] = [(p + "self_attn.q_proj.weight", 0, q),
                                          (p + "self_attn.k_proj.weight", q, q + kv),
                                          (p + "self_attn.v_proj.weight", q + kv, q + 2 * kv)]
        parts[f"layers.{i}.attn.wo"] = [(p + "self_attn.o_proj.weight", 0, hidden)]
        parts[f"layers.{i}.mlp.w13"] = [(p + "mlp.gate_proj.weight", 0, ff), (p + "mlp.up_proj.weight", ff, 2 * ff)]
        parts[f"layers.{i}.mlp.w2"] = [(p + "mlp.down_proj.weight", 0, hidden)]
    return parts


def dense_hf_state(model: nn.Module, dtype: torch.dtype | None = None,
                   skip: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Hugging Face-named dense tensors (q/k/v and gate/up split again; compressed linears dequantized).

    skip: runtime linear names (e.g. "layers.0.attn.wqkv") whose weights are left out (their biases
    stay): an export that stores them in another form."""
    dtype = dtype or model.dtype
    out = {"model.embed_tokens.weight": model.embed.weight.to(dtype).cpu(),
           "model.norm.weight": model.norm.weight.to(dtype).cpu()}
    for name, parts in hf_linear_parts(model).items():
        mod = model.get_submodule(name)
        if name not in skip:
            w = mod.dequantize(dtype) if isinstance(mod, QuantizedLinear) else mod.weight.to(dtype)
            for hf_name, start, stop in parts:
                out[hf_name] = w.detach()[start:stop].cpu()
        if mod.bias is not None:
            for hf_name, start, stop in parts:
                out[hf_name.removesuffix("weight") + "bias"] = mod.bias.detach().to(dtype)[start:stop].cpu()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.attn_norm.weight.to(dtype).cpu()
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm.weight.to(dtype).cpu()
    return {k: v.contiguous().clone() for k, v in out.items()}
