"""Attach Medusa heads to a model, choose their candidate tree, save them (safetensors + JSON), load
them back with checks.

A heads directory holds `medusa.safetensors` (the residual blocks, the per-head LM heads when
they are not shared, and `vocab`, the token ids the heads guess among, when restricted) and
`medusa_config.json` (shapes, the shared-LM-head mode, the guess-vocabulary size, the candidate
tree and the per-head accuracy it was built from). Both are written atomically.
The shared LM head is never saved: it is the base model's own `lm_head`.

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
from runtime.outputs import prepare_output_dir
from specdec.medusa import MedusaConfig, MedusaHeads
from specdec.medusa_io import CONFIG, WEIGHTS, load_medusa, read_medusa_config
from specdec.tree import Path as TreePath
from specdec.tree import build_tree

__all__ = ["attach_medusa", "choose_tree", "save_medusa", "load_medusa", "read_medusa_config", "CONFIG", "WEIGHTS",
           "HEADS_MARKERS"]

# a directory holding one of these is a Medusa heads directory (or one `specdec medusa train` is filling)
HEADS_MARKERS = (CONFIG, "checkpoint/trainer.json")


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


def save_medusa(heads: MedusaHeads, path: str | Path, overwrite: bool = False) -> Path:
    """Write the heads to directory `path` (created if needed); returns it. Their config, tree and
    accuracy table included, is saved as it is. `path` must be new, empty or a Medusa directory;
    heads already there are replaced only with `overwrite=True` (OutputPathError otherwise)."""
    path = prepare_output_dir(path, HEADS_MARKERS, overwrite, what="Medusa heads directory")
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    atomic_write(path / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"format": "specdec-medusa", "version": 1, **heads.config.to_dict()}, f, indent=1)

    atomic_write(path / CONFIG, write_json)
    return path
