"""Hugging Face-named state dicts and the runtime's names, both ways.

`read_state_dict` reads a checkpoint directory's tensors; `to_runtime_state` renames and fuses them
into the `Transformer`'s parameters (`_LAYER_MAP`, `_TOP_MAP`; `check_unused` refuses tensors it
would drop). `dense_hf_state` is the inverse (q/k/v and gate/up split again, compressed linears
dequantized): what quant's exports and distill's saved drafts write as model.safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from runtime.config import ModelConfig
from runtime.errors import CheckpointError
from runtime.qlinear import QuantizedLinear
from runtime.validate import safetensors_files

# Hugging Face parameter names (per layer) -> ours; fused entries list their parts in order.
_LAYER_MAP = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "attn.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.wqkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "attn.wo.weight": ["self_attn.o_proj.weight"],
    "mlp_norm.weight": ["post_attention_layernorm.weight"],
    "mlp.w13.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.w2.weight": ["mlp.down_proj.weight"],
}
_TOP_MAP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}


def read_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: model.safetensors, a sharded index, or weights-only .bin."""
    files = safetensors_files(ckpt)
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(load_file(f))
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{f} is corrupt or truncated ({err}); delete it and fetch or "
                                      "convert the checkpoint again") from err
        return state
    bins = sorted(ckpt.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            try:
                state.update(torch.load(f, map_location="cpu", weights_only=True))
            except Exception as err:  # torch.load raises RuntimeError/UnpicklingError/EOFError
                raise CheckpointError(f"{f} cannot be read as a weights-only PyTorch file ({err})") from err
        return state
    raise CheckpointError(f"{ckpt} holds no weights (no *.safetensors, no pytorch_model*.bin)")


def checkpoint_name(source: str | Path | None) -> str:
    """How a message names the checkpoint the tensors came from (its directory, when known)."""
    return "the checkpoint" if source is None else f"checkpoint {source}"


def to_runtime_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                     source: str | Path | None = None) -> dict[str, torch.Tensor]:
    """Rename and fuse Hugging Face tensors into the Transformer's parameter names; `source` (the
    checkpoint directory) is what a CheckpointError names."""
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _TOP_MAP.items():
        if theirs in hf_state:
            out[ours] = hf_state[theirs]
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out.get("embed.weight")
    for i in range(cfg.num_layers):
        for ours, parts in _LAYER_MAP.items():
            names = [f"model.layers.{i}.{p}" for p in parts]
            present = [n for n in names if n in hf_state]
            if not present:
                continue
            if len(present) != len(names):
                missing = sorted(set(names) - set(present))
                raise CheckpointError(f"{checkpoint_name(source)} is missing {', '.join(missing)}; fetch or convert "
                                      "it again")
            tensors = [hf_state[n] for n in names]
            out[f"layers.{i}.{ours}"] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
    return out


def check_unused(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, source: str | Path | None = None) -> None:
    """CheckpointError naming the tensors the Transformer would not load (a Llama's o_proj or MLP
    biases, q / k / v biases of a config without qkv_bias, anything unknown): dropping them would
    change the model's outputs without a word. Rotary tables saved by old transformers are skipped."""
    used = set(_TOP_MAP.values())
    for i in range(cfg.num_layers):
        for ours, parts in _LAYER_MAP.items():
            if ours.endswith(".bias") and not cfg.qkv_bias:
                continue
            used.update(f"model.layers.{i}.{p}" for p in parts)
    unused = sorted(n for n in hf_state if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise CheckpointError(f"{checkpoint_name(source)} holds {len(unused)} tensors the {cfg.model_type} runtime "
                              f"model does not use, e.g. {', '.join(unused[:4])}; they would be dropped, changing its "
                              "outputs (a bias the runtime does not implement, or another architecture's weights)")


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
