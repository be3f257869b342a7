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


def dense_hf_state(model: nn.Module, dtype: torch.dtype | None = None,
                   skip: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Hugging Face-named dense tensors (q/k/v and gate/up split again; compressed linears dequantized).

    skip: runtime linear names (e.g. "layers.0.attn.wqkv") whose weights are left out (their biases
    stay): an export that stores them in another form."""
    cfg = model.config
    dtype = dtype or model.dtype

    def weight(mod: nn.Module) -> torch.Tensor | None:
        if any(mod is model.get_submodule(name) for name in skip):
            return None
        w = mod.dequantize(dtype) if isinstance(mod, QuantizedLinear) else mod.weight.to(dtype)
        return w.detach().cpu()

    def split(w: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor | None]:
        return [None] * len(sizes) if w is None else list(w.split(sizes, 0))

    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed.weight.to(dtype).cpu(),
           "model.norm.weight": model.norm.weight.to(dtype).cpu()}
    if not is_tied(model):
        out["lm_head.weight"] = weight(model.lm_head)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.attn_norm.weight.to(dtype).cpu()
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm.weight.to(dtype).cpu()
        for part, t in zip("qkv", split(weight(layer.attn.wqkv), [q_size, kv_size, kv_size])):
            out[p + f"self_attn.{part}_proj.weight"] = t
        if layer.attn.wqkv.bias is not None:
            for part, t in zip("qkv", layer.attn.wqkv.bias.to(dtype).cpu().split([q_size, kv_size, kv_size], 0)):
                out[p + f"self_attn.{part}_proj.bias"] = t
        out[p + "self_attn.o_proj.weight"] = weight(layer.attn.wo)
        gate, up = split(weight(layer.mlp.w13), [cfg.intermediate_size] * 2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = weight(layer.mlp.w2)
    return {k: v.contiguous().clone() for k, v in out.items() if v is not None}
