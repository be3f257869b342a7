"""Attach Medusa heads to a model, choose their candidate tree, save them (safetensors + JSON), load
them back with checks.

A heads directory holds `medusa.safetensors` (the residual blocks, the per-head LM heads when
they are not shared, and `vocab`, the token ids the heads guess among, when restricted) and
`medusa_config.json` (shapes, the shared-LM-head mode, the guess-vocabulary size, the candidate
tree and the per-head accuracy it was built from). Both are written atomically.
The shared LM head is never saved: it is the base model's own `lm_head`.

`save_medusa(heads, path, format="vllm")` (= `export_medusa_vllm`) writes vLLM's Medusa draft-model
layout instead (specdec.medusa_io describes it): config.json (`model_type` "medusa", `num_heads`,
`num_hidden_layers`, `hidden_size`, `vocab_size`, `medusa_fc_bias`, `original_lm_head`,
`truncated_vocab_size`, and our tree under "specdec") and model.safetensors. vLLM's heads always
have an LM head, so a shared one is written as `lm_heads.0.weight` (the base model's weights) with
`original_lm_head: true`; a restricted guess vocabulary is written as `token_map`.
`load_medusa` reads every layout back.

`save_medusa` writes into a new or empty directory, or one that holds heads (or the training
state of `specdec medusa train`); replacing heads needs `overwrite=True` (runtime.outputs' rule:
a file, or a directory specdec did not write, is refused).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.atomic import atomic_write
from runtime.outputs import prepare_output_dir, write_output_dir
from specdec.medusa import MedusaConfig, MedusaHeads
from specdec.medusa_io import CONFIG, WEIGHTS, load_medusa, read_medusa_config
from specdec.tree import Path as TreePath
from specdec.tree import build_tree

__all__ = ["attach_medusa", "choose_tree", "save_medusa", "export_medusa_vllm", "load_medusa", "read_medusa_config",
           "CONFIG", "WEIGHTS", "HEADS_MARKERS", "FORMATS"]

# a directory holding one of these is a Medusa heads directory (or one `specdec medusa train` is filling)
HEADS_MARKERS = (CONFIG, "checkpoint/trainer.json")
FORMATS = ("specdec", "vllm")
VLLM_MARKER = "specdec_export.json"  # marks a vLLM-layout export as specdec's (overwrite rules)


def attach_medusa(model, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = True,
                  tree=None) -> MedusaHeads:
    """New (zero-initialised) Medusa heads for `model`, float32, on the model's device.

    shared_lm_head: use the base model's frozen LM head for every head (default; these models'
    vocabularies make a separate LM head per head larger than the model). False gives each head
    its own trainable copy of it. tree: candidate paths (default: the shipped tree).
    """
    cfg = model.config
    config = MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads=num_heads, num_layers=num_layers,
                          shared_lm_head=shared_lm_head,
                          tree=tuple(tuple(p) for p in tree) if tree is not None else None)
    heads = MedusaHeads(config, model.lm_head)
    return heads.to(device=model.device, dtype=torch.float32)


def choose_tree(heads: MedusaHeads, table: Sequence[Sequence[float]], num_nodes: int) -> tuple[TreePath, ...]:
    """Give `heads` the `num_nodes`-node tree with the longest expected accepted length under the
    per-head, per-rank accuracy `table` (`specdec.tree.build_tree`); the heads' config keeps the
    tree and the table. Returns the tree's paths."""
    paths = build_tree([list(row) for row in table], num_nodes)
    heads.set_tree(paths, head_accuracy=table)
    return heads.config.tree


def save_medusa(heads: MedusaHeads, path: str | Path, overwrite: bool = False, format: str = "specdec") -> Path:
    """Write the heads to directory `path` (created if needed); returns it. Their config, tree and
    accuracy table included, is saved as it is. `path` must be new, empty or a Medusa directory;
    heads already there are replaced only with `overwrite=True` (OutputPathError otherwise).
    format "vllm": vLLM's Medusa layout (`export_medusa_vllm`)."""
    if format not in FORMATS:
        raise ValueError(f"save_medusa format must be one of {FORMATS}, got {format!r}")
    if format == "vllm":
        return export_medusa_vllm(heads, path, overwrite=overwrite)
    path = prepare_output_dir(path, HEADS_MARKERS, overwrite, what="Medusa heads directory")
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    atomic_write(path / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"format": "specdec-medusa", "version": 1, **heads.config.to_dict()}, f, indent=1)

    atomic_write(path / CONFIG, write_json)
    return path


def vllm_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """The heads' tensors in vLLM's Medusa names (see the module doc)."""
    if heads.lm_heads is None and not heads._base:
        raise ValueError("these Medusa heads share the base model's LM head but are not bound to one; call "
                         "heads.bind(model.lm_head) (or load them with distill.load_medusa) before exporting")
    out: dict[str, torch.Tensor] = {}
    for i, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            out[f"blocks.{i}.layers.{j}.weight"] = res.linear.weight
            out[f"blocks.{i}.layers.{j}.bias"] = res.linear.bias
    if heads.lm_heads is None:
        out["lm_heads.0.weight"] = heads._base[0].weight
    else:
        for i, head in enumerate(heads.lm_heads):
            out[f"lm_heads.{i}.weight"] = head.weight
    if heads.vocab is not None:
        out["token_map"] = heads.vocab
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def vllm_config(heads: MedusaHeads) -> dict:
    """config.json of the vLLM Medusa layout (vLLM's MedusaConfig fields, our tree under "specdec")."""
    cfg = heads.config
    dtype = next(heads.parameters()).dtype
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
            "max_paths": 64, "topk": 10, "truncated_vocab_size": cfg.guess_vocab or cfg.vocab_size,
            "medusa_fc_bias": True, "original_lm_head": cfg.shared_lm_head,
            "dtype": str(dtype).removeprefix("torch."),
            "specdec": {"tree": [list(p) for p in cfg.tree] if cfg.tree else None,
                        "head_accuracy": [list(r) for r in cfg.head_accuracy] if cfg.head_accuracy else None}}


def export_medusa_vllm(heads: MedusaHeads, path: str | Path, overwrite: bool = False) -> Path:
    """Write the heads in vLLM's Medusa draft-model layout to directory `path` (new or empty, or a
    previous export with `overwrite=True`), atomically; returns it. vLLM serves it with
    `--speculative-config '{"method": "medusa", "model": PATH, "num_speculative_tokens": K}'`."""
    state, config = vllm_state(heads), vllm_config(heads)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))

    return write_output_dir(path, write, VLLM_MARKER, {"format": "vllm-medusa", "version": 1}, overwrite,
                            what="vLLM Medusa export")
