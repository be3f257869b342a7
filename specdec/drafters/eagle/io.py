"""Save and load EAGLE-3 heads in the speculators `eagle3` format, the one vLLM auto-detects.

A head directory holds `config.json` (a speculators Eagle3SpeculatorConfig: speculators_model_type
"eagle3", architectures, transformer_layer_config (a Llama decoder layer), draft_vocab_size,
target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual written explicitly
(vLLM reads a missing one as True), the later options norm_before_fc, fc_norm and norm_output
(speculators' training turns norm_before_fc and norm_output on by default for eagle3; a missing
one reads as False) and speculators_config with the proposal method and the verifier) and
`model.safetensors` with fc.weight, layers.0.*, norm.weight, lm_head.weight, d2t and t2d (and
input_norm.weight with norm_before_fc, fc_norm.{0,1,2}.weight with fc_norm). The embedding is
the target's and is not saved; a head saved by speculators with its own `embed_tokens.weight`
loads too (that copy is ignored). Loading checks everything against the target before a tensor
is read, and fails with a CheckpointError that names the problem.

`save_eagle` follows runtime.output_paths' rule: the directory must be new, empty, or an EAGLE-3 head
directory specdec wrote, recognised by `specdec_eagle.json` (written last; it lists the files), and
`overwrite=True` replaces only such a head. A model checkpoint, or any directory specdec did not
write, is refused untouched. `write_eagle_files` writes the two files into a directory its caller
has checked (a training directory, a checkpoint's temporary directory).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.args import check_model, check_path, describe
from runtime.atomic import atomic_write, atomic_write_text
from runtime.config import is_size
from runtime.errors import CheckpointError
from runtime.output_paths import write_output_dir
from runtime.validate import TensorInfo, check_finite, read_headers, read_json
from specdec.drafters.eagle.head import DEFAULT_ROPE, Eagle3Config, Eagle3Head, default_aux_layers

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MARKER = "specdec_eagle.json"  # marks a head directory as specdec's (runtime.output_paths' rule)
WHAT = "EAGLE-3 head directory"
ARCHITECTURE = "Eagle3Speculator"
IGNORED = ("embed_tokens.weight",)  # a speculators head may carry its own copy of the target's embedding
NORM_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")  # later speculators options; missing = False


def speculators_config(head: Eagle3Head, speculative_tokens: int = 3) -> dict[str, Any]:
    """The config.json dict of `head` (the speculators Eagle3SpeculatorConfig schema)."""
    cfg = head.config
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": cfg.layer_config(),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "dtype": str(head.dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.target or None, "architectures": []},
        },
    }


def write_eagle_files(head: Eagle3Head, directory: str | Path, speculative_tokens: int = 3) -> Path:
    """Write `head`'s config.json and model.safetensors into existing `directory`, each file
    atomically (weights first), whatever else is there: for a directory the caller has checked (a
    training directory, a checkpoint's temporary directory); a user's path goes through save_eagle."""
    directory = Path(directory)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_text(directory / CONFIG, json.dumps(speculators_config(head, speculative_tokens), indent=2) + "\n")
    return directory


def save_eagle(head: Eagle3Head, path: str | Path, speculative_tokens: int = 3, overwrite: bool = False) -> Path:
    """Write `head` to directory `path` in the speculators eagle3 format, atomically (a temporary
    directory renamed into place, `specdec_eagle.json` last); returns the directory.

    `path` must be new, empty, or a head directory save_eagle wrote, which `overwrite=True` replaces
    (OutputPathError otherwise, nothing written: a model checkpoint or another directory is never
    touched). speculative_tokens: the chain length recorded as the default proposal (what vLLM
    drafts when not told otherwise), an int >= 1.
    """
    if not isinstance(head, Eagle3Head):
        hint = "; save Medusa heads with distill.save_medusa" if type(head).__name__ == "MedusaHeads" else ""
        raise TypeError(f"save_eagle head must be an Eagle3Head, got {describe(head)}{hint}")
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"save_eagle speculative_tokens must be an int >= 1, got {speculative_tokens!r}")
    return write_output_dir(path, lambda tmp: write_eagle_files(head, tmp, speculative_tokens), MARKER,
                            {"format": "specdec-eagle3", "version": 1}, overwrite, what=WHAT)


def _field(raw: Mapping[str, Any], key: str, where: Path, kind: type | tuple[type, ...]) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise CheckpointError(f"{where} has {key}={value!r}; an EAGLE-3 config needs it as "
                              f"{getattr(kind, '__name__', kind)}")
    return value


def read_eagle_config(path: str | Path, target) -> Eagle3Config:
    """The Eagle3Config of head directory `path` for runtime model `target` (CheckpointError when the
    directory is not an eagle3 head, or the head does not fit the target)."""
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise CheckpointError(f"{path} is not an EAGLE-3 head directory: it needs {CONFIG} and {WEIGHTS} "
                              "(written by specdec.save_eagle or speculators)")
    raw = read_json(cfg_file)
    if raw.get("speculators_model_type") != "eagle3":
        raise CheckpointError(f"{cfg_file} has speculators_model_type={raw.get('speculators_model_type')!r}, "
                              "not 'eagle3': it is not an EAGLE-3 head")
    layer = _field(raw, "transformer_layer_config", cfg_file, dict)
    if layer.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{cfg_file}: transformer_layer_config.model_type is {layer.get('model_type')!r}; "
                              "only Llama decoder layers (model_type 'llama') are implemented")
    tc = target.config
    hidden = layer.get("hidden_size")
    for key, value in (("transformer_layer_config.hidden_size", hidden),
                       ("target_hidden_size", raw.get("target_hidden_size", hidden))):
        if value != tc.hidden_size:
            raise CheckpointError(f"{cfg_file} has {key}={value!r} but the target's hidden size is "
                                  f"{tc.hidden_size}: the head was trained for another model")
    if layer.get("vocab_size") != tc.vocab_size:
        raise CheckpointError(f"{cfg_file} has transformer_layer_config.vocab_size={layer.get('vocab_size')!r} but "
                              f"the target's vocabulary has {tc.vocab_size} tokens: the head was trained for "
                              "another model (or tokenizer)")
    if layer.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{cfg_file} has {layer.get('num_hidden_layers')!r} decoder layers; only 1 is "
                              "implemented")
    norms = {key: raw.get(key) or False for key in NORM_OPTIONS}
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        aux = list(default_aux_layers(tc.num_layers))
    if not isinstance(aux, list) or len(aux) != 3 or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < tc.num_layers for i in aux):
        raise CheckpointError(f"{cfg_file} has eagle_aux_hidden_state_layer_ids={aux!r}; the head needs 3 "
                              f"layer ids of the target, each in 0..{tc.num_layers - 1}")
    heads = layer.get("num_attention_heads")
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    rope = layer.get("rope_parameters") or {**DEFAULT_ROPE, "rope_theta": layer.get("rope_theta", 10000.0)}
    try:
        return Eagle3Config(
            hidden_size=hidden, num_heads=heads, num_kv_heads=layer.get("num_key_value_heads", heads),
            head_dim=layer.get("head_dim") or (hidden // heads if is_size(heads) and is_size(hidden) else None),
            intermediate_size=layer.get("intermediate_size"), vocab_size=tc.vocab_size,
            draft_vocab_size=raw.get("draft_vocab_size", tc.vocab_size), num_target_layers=tc.num_layers,
            aux_layers=tuple(aux), max_position_embeddings=layer.get("max_position_embeddings", 0),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_parameters=rope,
            norm_before_residual=raw.get("norm_before_residual", True),
            target=str(verifier.get("name_or_path") or ""), **norms)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{cfg_file} is invalid: {e}") from e


def expected_tensors(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an Eagle3Head of `config` (its state dict)."""
    C, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    pre = "layers.0."
    return {"fc.weight": (C, 3 * C), f"{pre}input_layernorm.weight": (C,), f"{pre}hidden_norm.weight": (C,),
            f"{pre}self_attn.q_proj.weight": (q, 2 * C), f"{pre}self_attn.k_proj.weight": (kv, 2 * C),
            f"{pre}self_attn.v_proj.weight": (kv, 2 * C), f"{pre}self_attn.o_proj.weight": (C, q),
            f"{pre}post_attention_layernorm.weight": (C,), f"{pre}mlp.gate_proj.weight": (F, C),
            f"{pre}mlp.up_proj.weight": (F, C), f"{pre}mlp.down_proj.weight": (C, F), "norm.weight": (C,),
            "lm_head.weight": (config.draft_vocab_size, C), "d2t": (config.draft_vocab_size,),
            "t2d": (config.vocab_size,),
            **({"input_norm.weight": (3 * C,)} if config.norm_before_fc else {}),
            **({f"fc_norm.{i}.weight": (C,) for i in range(3)} if config.fc_norm else {})}


def check_eagle_tensors(config: Eagle3Config, tensors: Mapping[str, TensorInfo], weights: Path) -> None:
    """CheckpointError unless `tensors` (a safetensors header) are those of an Eagle3Head of `config`
    (d2t and t2d may be absent when the draft vocabulary is the whole vocabulary)."""
    expected = expected_tensors(config)
    optional = {"d2t", "t2d"} if config.draft_vocab_size == config.vocab_size else set()
    missing = sorted(set(expected) - set(tensors) - optional)
    extra = sorted(set(tensors) - set(expected) - set(IGNORED))
    if missing or extra:
        raise CheckpointError(f"{weights} does not hold an EAGLE-3 head of its config.json (missing {missing[:4]}, "
                              f"unexpected {extra[:4]})")
    for name, shape in expected.items():
        if name not in tensors:
            continue
        info = tensors[name]
        if info.shape != shape:
            raise CheckpointError(f"{name} in {weights} has shape {info.shape}, its config.json says {shape}")
        want = {"d2t": "I64", "t2d": "BOOL"}.get(name)
        if (info.dtype != want) if want else not info.floating:
            raise CheckpointError(f"{name} in {weights} is stored as {info.dtype}; expected "
                                  f"{want or 'a floating-point type'}")


def load_eagle(path: str | Path, target, dtype: torch.dtype | None = None) -> Eagle3Head:
    """Load the EAGLE-3 head in directory `path` (speculators eagle3 format) for runtime model
    `target`, on its device, in `dtype` (default the target's), in eval mode without gradients."""
    check_path("path", path, "an EAGLE-3 head directory")
    check_model("target", target)
    path = Path(path)
    config = read_eagle_config(path, target)
    weights = path / WEIGHTS
    check_eagle_tensors(config, read_headers([weights]), weights)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is corrupt or truncated ({e}); save the head again") from e
    check_finite(state, weights)
    for name in IGNORED:
        state.pop(name, None)
    head = Eagle3Head(config)
    vocab = state.pop("d2t", None), state.pop("t2d", None)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"d2t", "t2d"}:  # check_eagle_tensors rules this out
        raise CheckpointError(f"{weights} does not match its config.json (missing {missing}, unexpected {unexpected})")
    if vocab[0] is not None:
        ids = vocab[0] + torch.arange(config.draft_vocab_size)
        try:
            head.set_draft_vocab(ids)
        except ValueError as e:
            raise CheckpointError(f"d2t in {weights} is invalid ({e})") from e
        if not torch.equal(head.t2d, vocab[1]):
            raise CheckpointError(f"t2d in {weights} does not mark the target ids d2t maps to; the file is corrupt")
    return head.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)
