"""A Transformer whose linears keep a GGUF file's quantized weights (`load_model(..., weights="gguf")`).

Every quantized projection becomes a `runtime.blockq.BlockQuantLinear` holding the file's own
codes and scales (`runtime.gguf_blocks`, exact), the embedding a `QuantizedEmbedding` over the
same storage (rows dequantized per lookup; a tied LM head shares it). Fused projections (q/k/v,
gate/up) whose parts have different GGUF types are stored on the finest grid among them, which
is exact but stores the coarser parts with more bytes. Norms, biases and F32 / F16 / BF16 tensors
stay dense in the model's dtype. Tensor types without a block form here (Q2_K, Q3_K, IQ*) are
dequantized to dense (logged). The config comes from the converted checkpoint directory of the
same file (`runtime.gguf.convert_gguf`), the tokenizer too.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from torch import nn

from runtime.blockq import BlockQuantLinear, QuantizedEmbedding
from runtime.errors import CheckpointError
from runtime.gguf import check_gguf_sizes, check_gguf_tensor_names
from runtime.gguf_blocks import SUPPORTED, Canonical, concat, to_canonical
from runtime.model import Transformer
from runtime.progress import keep_alive
from runtime.progress import progress as progress_bar
from runtime.validate import model_config

log = logging.getLogger(__name__)

_DENSE = ("F32", "F16", "BF16")
# runtime names -> the GGUF tensors they are made of (in order), per layer
_LAYER = {
    "attn_norm.weight": ["attn_norm.weight"],
    "mlp_norm.weight": ["ffn_norm.weight"],
    "attn.wqkv": ["attn_q", "attn_k", "attn_v"],
    "attn.wo": ["attn_output"],
    "mlp.w13": ["ffn_gate", "ffn_up"],
    "mlp.w2": ["ffn_down"],
}


class _Reader:
    """The GGUF's tensors by name: raw data, type and (N, K) shape."""

    def __init__(self, path: Path) -> None:
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError) as err:
            raise CheckpointError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err})") from err
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.get_field("general.architecture")
        self.arch = field.contents() if field is not None else None
        self.types: Counter = Counter()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def kind(self, name: str) -> str:
        return self._get(name).tensor_type.name

    def _get(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"{self.path} lacks tensor {name!r}; the file is incomplete or not a "
                                  "Llama-family model")
        return self.tensors[name]

    def dense(self, name: str) -> torch.Tensor:
        """Any tensor dequantized to float32, in PyTorch's (N, K) / (N,) shape."""
        t = self._get(name)
        shape = tuple(int(s) for s in reversed(t.shape))
        self.types[t.tensor_type.name] += 1
        dense = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).view(shape)  # a copy
        self._check_finite(name, {"values": dense})
        return dense

    def canonical(self, name: str) -> Canonical | None:
        """A quantized 2-D tensor in the block form, None when its type has none (dense ones too)."""
        t = self._get(name)
        kind = t.tensor_type.name
        if kind not in SUPPORTED:
            return None
        N, K = int(t.shape[1]), int(t.shape[0])
        self.types[kind] += 1
        c = to_canonical(t.data, kind, (N, K))
        self._check_finite(name, {"block scales (d)": c.d, "block minimums (dm)": c.dm})
        return c

    def _check_finite(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        """CheckpointError naming the tensor when one of its float `parts` holds NaN or inf: the block
        kernels would turn them into finite outputs, so a corrupt file would generate plausible text."""
        for what, values in parts.items():
            bad = ~torch.isfinite(values)
            if bool(bad.any()):
                raise CheckpointError(f"{self.path}: tensor {name!r} holds {int(bad.sum())} NaN or inf {what}; the "
                                      "file is corrupt: download or convert it again")


def _unpermute(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation of Llama checkpoints (as transformers does)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def _projection(r: _Reader, names: list[str], perms: list[torch.Tensor | None], bias: torch.Tensor | None,
                dtype: torch.dtype) -> nn.Module:
    """One (fused) projection from its GGUF parts: a BlockQuantLinear when every part has a block form,
    else a dense nn.Linear (with a log line naming the types)."""
    parts = [r.canonical(n + ".weight") for n in names]
    if all(p is not None for p in parts):
        parts = [p if perm is None else p.rows(perm) for p, perm in zip(parts, perms)]
        c = parts[0] if len(parts) == 1 else concat(parts)
        return BlockQuantLinear.from_canonical(c.q, c.sc, c.mc, c.d, c.dm, c.bits, c.group_size, c.super_block, bias)
    kinds = sorted({r.kind(n + ".weight") for n in names})
    if not set(kinds) <= set(_DENSE):
        log.info("%s: %s stored as %s, which the block kernels do not take: dequantized to %s", r.path.name,
                 "+".join(names), "/".join(kinds), dtype)
    weights = [r.dense(n + ".weight") for n in names]
    weights = [w if perm is None else w[perm] for w, perm in zip(weights, perms)]
    w = torch.cat(weights).to(dtype)
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return linear


def load_gguf_model(gguf_path: Path, hf_config: Any, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", attention: str | None = None,
                    progress: bool = True) -> Transformer:
    """The Transformer of `gguf_path` with its quantized weights kept (see the module docstring).

    hf_config: the `transformers` config of the same model (from the converted checkpoint directory).
    Only the CPU runs the block kernels; on another device the weights are dequantized per call.
    """
    cfg = model_config(hf_config)
    # one step for the file's metadata (GGUFReader parses the tokenizer's arrays: seconds), then the
    # embedding and head, then one per layer
    bar = progress_bar(total=cfg.num_layers + 2, desc=f"load {Path(gguf_path).name} (4-bit)", unit="step",
                       disable=not progress)
    with bar, keep_alive(bar):
        bar.set_postfix_str("metadata")
        r = _Reader(Path(gguf_path))
        if isinstance(r.arch, str):  # as the conversion checks (cheap: no tensor data is read)
            check_gguf_sizes(r.reader, r.path)  # metadata against tensors
            check_gguf_tensor_names(r.reader, r.path)  # no tensor this loader would drop
        layers = sorted({int(m.group(1)) for n in r.tensors if (m := re.match(r"blk\.(\d+)\.", n))})
        if layers != list(range(cfg.num_layers)):
            raise CheckpointError(f"{gguf_path} holds blocks {layers[:3]}... ({len(layers)}), the config says "
                                  f"{cfg.num_layers} layers; the config does not belong to this file")
        with torch.device("meta"):
            model = Transformer(cfg, attention=attention)
        permute = r.arch == "llama"  # llama.cpp permutes q / k rows of Llama checkpoints only
        qkv_perm = ([_unpermute(cfg.num_heads * cfg.head_dim, cfg.num_heads),
                     _unpermute(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads), None] if permute else [None] * 3)

        def dense(name: str) -> torch.Tensor:
            return r.dense(name).to(dtype)

        bar.update()
        bar.set_postfix_str("weights")
        embed = r.canonical("token_embd.weight")
        if embed is None:
            table: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=dense("token_embd.weight"))
        else:
            table = BlockQuantLinear.from_canonical(embed.q, embed.sc, embed.mc, embed.d, embed.dm, embed.bits,
                                                    embed.group_size, embed.super_block)
        model.embed = QuantizedEmbedding(table, dtype) if isinstance(table, BlockQuantLinear) else table
        if r.has("output.weight"):
            model.lm_head = _projection(r, ["output"], [None], None, dtype)
        elif isinstance(table, BlockQuantLinear):
            model.lm_head = table
        else:
            model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            model.lm_head.weight = model.embed.weight
        model.norm.weight = nn.Parameter(dense("output_norm.weight"), requires_grad=False)
        bar.update()
        for i in range(cfg.num_layers):
            block, p = model.layers[i], f"blk.{i}."
            for ours, theirs in _LAYER.items():
                if ours.endswith(".weight"):
                    block.get_submodule(ours.rsplit(".", 1)[0]).weight = nn.Parameter(dense(p + theirs[0]),
                                                                                     requires_grad=False)
                    continue
                bias_names = [p + t + ".bias" for t in theirs]
                present = [r.has(b) for b in bias_names]
                if any(present) and not all(present):
                    raise CheckpointError(f"{gguf_path}: layer {i} has biases for only some of {theirs}")
                bias = torch.cat([r.dense(b) for b in bias_names]) if all(present) else None
                perms = qkv_perm if ours == "attn.wqkv" else [None] * len(theirs)
                if bias is not None and ours == "attn.wqkv" and permute:
                    bias = torch.cat([b if perm is None else b[perm] for b, perm in
                                      zip(bias.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                                      cfg.num_kv_heads * cfg.head_dim]), qkv_perm)])
                block.set_submodule(ours, _projection(r, [p + t for t in theirs], perms, bias, dtype))
            bar.update()
    model = model.to(device)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise CheckpointError(f"{gguf_path} lacks {len(missing)} tensors the model needs, e.g. "
                              f"{', '.join(missing[:4])}")
    model.gguf_tensor_types = dict(r.types)
    return model.eval().requires_grad_(False)
