"""Medusa heads directories: write them (`save_medusa`, `export_medusa_vllm`) and read them back with
checks against the model (`load_medusa`).

Three layouts, told apart by the keys of their config (never by file names):

- ours (`medusa_config.json` with "format": "specdec-medusa", weights `medusa.safetensors`);
- vLLM's Medusa draft model (`config.json` with `num_heads`, `num_hidden_layers`; tensors
  `blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight` (only `lm_heads.0.weight` when
  `original_lm_head`), `token_map` when `truncated_vocab_size` < `vocab_size`), which
  `distill.save_medusa(..., format="vllm")` writes;
- the original Medusa code's (FasterDecoding/Medusa: `config.json` with `medusa_num_heads`,
  `medusa_num_layers`; tensors `[medusa_head.]{i}.{j}.linear.weight/bias` for the residual blocks and
  `[medusa_head.]{i}.{num_layers}.weight` for each head's LM head, in a safetensors file or a
  weights-only PyTorch file).

Ours holds `medusa.safetensors` (the residual blocks, the per-head LM heads when they are not
shared, and `vocab`, the token ids the heads guess among, when restricted) and `medusa_config.json`
(shapes, the shared-LM-head mode, the guess-vocabulary size, the candidate tree and the per-head
accuracy it was built from), both written atomically. The shared LM head is never saved: it is
the base model's own `lm_head`. vLLM's heads always have an LM head, so `export_medusa_vllm` writes
a shared one as `lm_heads.0.weight` (the base model's weights) with `original_lm_head: true`, and a
restricted guess vocabulary as `token_map`; our tree goes under "specdec" in its config.json.

`save_medusa` writes into a new or empty directory, or one that holds heads (or the training
state of `specdec medusa train`); replacing heads needs `overwrite=True` (runtime.output_paths' rule:
a file, or a directory specdec did not write, is refused). `distill` re-exports the verbs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.args import check_model, check_path, describe
from runtime.atomic import atomic_write
from runtime.errors import CheckpointError
from runtime.output_paths import make_dirs, prepare_output_dir, remove_dirs, write_output_dir
from runtime.validate import TensorInfo, check_finite, read_headers, read_json
from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads

WEIGHTS = "medusa.safetensors"
CONFIG = "medusa_config.json"
HF_CONFIG = "config.json"  # the config file of the vLLM and the original Medusa layouts
VLLM_KEYS = ("num_heads", "num_hidden_layers")
ORIGINAL_KEYS = ("medusa_num_heads", "medusa_num_layers")


def read_medusa_config(path: str | Path) -> MedusaConfig:
    """The MedusaConfig stored in a heads directory (CheckpointError when it is not one)."""
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise CheckpointError(f"{path} is not a Medusa heads directory: it needs {CONFIG} and "
                              f"{WEIGHTS} (written by distill.save_medusa / specdec medusa train)")
    raw = read_json(cfg_file)
    if raw.get("format") != "specdec-medusa":
        raise CheckpointError(f"{cfg_file} is not a specdec Medusa config (format "
                              f"{raw.get('format')!r}); re-save the heads with distill.save_medusa")
    try:
        return MedusaConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as e:
        raise CheckpointError(f"{cfg_file} is malformed ({type(e).__name__}: {e}); re-save the heads") from e


def _indices(names: Iterable[str], pattern: str) -> list[int]:
    return sorted({int(m.group(1)) for n in names if (m := re.match(pattern, n))})


def _count(indices: list[int], what: str) -> str:
    if indices == list(range(len(indices))):
        return f"{len(indices)} {what}"
    return f"{what} {', '.join(map(str, indices[:8]))}{', ...' if len(indices) > 8 else ''}"


def check_medusa_tensors(config: MedusaConfig, tensors: Mapping[str, TensorInfo], path: str | Path) -> None:
    """CheckpointError unless the tensors (from the safetensors header of heads directory `path`)
    are exactly those `MedusaHeads(config)` holds, with its shapes and dtypes: the heads and
    layers counted first, so a config that claims 20000 heads fails before any is built."""
    weights = Path(path) / WEIGHTS
    for key, pattern, what, want in (("num_heads", r"blocks\.(\d+)\.", "heads", config.num_heads),
                                     ("num_layers", r"blocks\.\d+\.(\d+)\.", "layers per head",
                                      config.num_layers)):
        present = _indices(tensors, pattern)
        if present != list(range(want)):
            raise CheckpointError(f"{Path(path) / CONFIG} says {key}={want}, but {weights} holds "
                                  f"{_count(present, what)}; the files are from different saves")
    C, V = config.hidden_size, config.vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            expected[f"blocks.{i}.{j}.linear.weight"] = (C, C)
            expected[f"blocks.{i}.{j}.linear.bias"] = (C,)
        if not config.shared_lm_head:
            expected[f"lm_heads.{i}.weight"] = (V, C)
    if config.guess_vocab:
        expected["vocab"] = (config.guess_vocab,)
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise CheckpointError(f"{weights} does not match its config (missing {missing[:3]}, unexpected "
                              f"{extra[:3]}); the files are from different saves")
    for name, shape in expected.items():
        info = tensors[name]
        if info.shape != shape:
            raise CheckpointError(f"{name} in {weights} has shape {info.shape}, the config says {shape}; the "
                                  "files are from different saves")
        if info.floating == (name == "vocab"):  # token ids are integers, weights floating point
            raise CheckpointError(f"{name} in {weights} is stored as {info.dtype}; re-save the heads")


def medusa_layout(path: str | Path) -> str:
    """"specdec", "vllm" or "original": the layout of heads directory `path`, from its config's keys."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return "specdec"
    if not (path / HF_CONFIG).is_file():
        raise CheckpointError(f"{path} is not a Medusa heads directory: it has neither {CONFIG} (specdec) nor "
                              f"{HF_CONFIG} (vLLM or original Medusa layout)")
    raw = read_json(path / HF_CONFIG)
    if all(k in raw for k in VLLM_KEYS):
        return "vllm"
    if all(k in raw for k in ORIGINAL_KEYS):
        return "original"
    raise CheckpointError(f"{path / HF_CONFIG} describes no Medusa heads: it needs {' and '.join(VLLM_KEYS)} (vLLM "
                          f"layout) or {' and '.join(ORIGINAL_KEYS)} (original Medusa layout)")


def load_medusa(path: str | Path, model, dtype: torch.dtype | None = None,
                shared_lm_head: bool | None = None) -> MedusaHeads:
    """Load heads for `model` (on its device, in `dtype`, default the model's) from a directory in
    any of the three layouts (`medusa_layout`). Fails with CheckpointError when the heads were
    trained for another hidden size or vocabulary, or when `shared_lm_head` is given and differs
    from the saved mode."""
    check_path("path", path, "a Medusa heads directory")
    check_model("model", model)
    layout = medusa_layout(path)
    if layout != "specdec":
        config, state = read_foreign_heads(path, layout, model)
        return _build(config, state, path, model, dtype, shared_lm_head)
    config = read_medusa_config(path)
    _check_model(config, path, model, shared_lm_head)
    weights = Path(path) / WEIGHTS
    check_medusa_tensors(config, read_headers([weights]), path)  # before any head is built
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is corrupt or truncated ({e}); re-save the heads") from e
    check_finite(state, weights)
    return _build(config, state, path, model, dtype, shared_lm_head)


def _check_model(config: MedusaConfig, path: str | Path, model, shared_lm_head: bool | None) -> None:
    cfg = model.config
    if config.hidden_size != cfg.hidden_size:
        raise CheckpointError(f"the Medusa heads in {path} expect hidden size {config.hidden_size}, "
                              f"the model has {cfg.hidden_size}: they were trained for another model")
    if config.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"the Medusa heads in {path} expect a vocabulary of {config.vocab_size} "
                              f"tokens, the model has {cfg.vocab_size}: they were trained for another "
                              "model (or tokenizer)")
    if shared_lm_head is not None and shared_lm_head != config.shared_lm_head:
        raise CheckpointError(f"the Medusa heads in {path} were saved with shared_lm_head="
                              f"{config.shared_lm_head}, but shared_lm_head={shared_lm_head} was asked "
                              "for; drop the argument or load other heads")


def _build(config: MedusaConfig, state: dict[str, torch.Tensor], path: str | Path, model, dtype: torch.dtype | None,
           shared_lm_head: bool | None) -> MedusaHeads:
    """MedusaHeads of `config` bound to `model`'s LM head, holding `state` (our tensor names)."""
    _check_model(config, path, model, shared_lm_head)
    heads = MedusaHeads(config, model.lm_head)
    heads.load_state_dict(state)
    if heads.vocab is not None:
        try:  # the stored guess vocabulary gets the checks restrict_vocab makes
            heads.restrict_vocab(heads.vocab)
        except ValueError as e:
            raise CheckpointError(f"{path}: its guess vocabulary is invalid ({e}); re-save the heads") from e
    return heads.to(device=model.device, dtype=dtype or model.dtype).eval().requires_grad_(False)


# --------------------------------------------------------------------- the vLLM and original layouts
def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files in `path`: *.safetensors, else weights-only *.pt / *.bin."""
    files = sorted(path.glob("*.safetensors"))
    loader = load_file
    if not files:
        files = sorted([*path.glob("*.pt"), *path.glob("*.bin")])
        loader = _load_weights_only
    if not files:
        raise CheckpointError(f"{path} has a Medusa config but no weights (*.safetensors, *.pt or *.bin)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = loader(str(f))
        except Exception as e:  # safetensors and torch.load raise many types on corrupt files
            raise CheckpointError(f"{f} is corrupt or truncated, or not a weights-only file ({type(e).__name__}: "
                                  f"{e})") from e
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise CheckpointError(f"{f} does not hold a flat dictionary of tensors")
        state.update(part)
    check_finite({k: v for k, v in state.items() if v.is_floating_point()}, path)
    return state


def _load_weights_only(f: str) -> dict[str, torch.Tensor]:
    return torch.load(f, map_location="cpu", weights_only=True)


def _int(raw: dict, key: str, where: Path) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def _expect(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: Path) -> None:
    """CheckpointError unless `state` holds exactly the tensors `expected`, with those shapes."""
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise CheckpointError(f"the weights in {where} do not match its config (missing {missing[:3]}, unexpected "
                              f"{extra[:3]}); the files are from different saves")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"{name} in {where} has shape {tuple(state[name].shape)}, the config says {shape}")


def _lm_heads(weights: list[torch.Tensor], model) -> tuple[bool, dict[str, torch.Tensor]]:
    """(shared, our lm_heads tensors): shared when every head's LM head is the model's own."""
    base = model.lm_head.weight.detach().to("cpu", torch.float32)
    if all(torch.equal(w.to(torch.float32), base) for w in weights):
        return True, {}
    return False, {f"lm_heads.{i}.weight": w for i, w in enumerate(weights)}


def read_foreign_heads(path: str | Path, layout: str, model) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """(MedusaConfig, tensors in our names) of a heads directory in the "vllm" or "original" layout.

    LM heads equal to the model's own become the shared LM head; others are kept per head. Residual
    blocks without a bias (vLLM's `medusa_fc_bias: false`) get a zero bias, which computes the same."""
    path = Path(path)
    raw = read_json(path / HF_CONFIG)
    state = _read_tensors(path)
    C, V = model.config.hidden_size, model.config.vocab_size
    extra = raw.get("specdec") if isinstance(raw.get("specdec"), dict) else {}
    if layout == "vllm":
        K, L = _int(raw, "num_heads", path), _int(raw, "num_hidden_layers", path)
        C, V = _int(raw, "hidden_size", path), _int(raw, "vocab_size", path)
        bias = bool(raw.get("medusa_fc_bias", False))
        shared_file = bool(raw.get("original_lm_head", False))
        truncated = raw.get("truncated_vocab_size") or V
        expected = {f"blocks.{i}.layers.{j}.{t}": (C, C) if t == "weight" else (C,)
                    for i in range(K) for j in range(L) for t in (("weight", "bias") if bias else ("weight",))}
        expected.update({f"lm_heads.{i}.weight": (V, C) for i in range(1 if shared_file else K)})
        if truncated < V:
            expected["token_map"] = (truncated,)
        _expect(state, expected, path)
        ours = {}
        for i in range(K):
            for j in range(L):
                w = state[f"blocks.{i}.layers.{j}.weight"]
                ours[f"blocks.{i}.{j}.linear.weight"] = w
                zero = torch.zeros(C, dtype=w.dtype)
                ours[f"blocks.{i}.{j}.linear.bias"] = state.get(f"blocks.{i}.layers.{j}.bias", zero)
        lm = [state[f"lm_heads.{0 if shared_file else i}.weight"] for i in range(K)]
        vocab = state["token_map"].to(torch.long) if truncated < V else None
    else:
        K, L = _int(raw, "medusa_num_heads", path), _int(raw, "medusa_num_layers", path)
        state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
        if "0.0.linear.weight" in state:
            C = state["0.0.linear.weight"].shape[1]
        if f"0.{L}.weight" in state:
            V = state[f"0.{L}.weight"].shape[0]
        expected = {f"{i}.{j}.linear.{t}": (C, C) if t == "weight" else (C,)
                    for i in range(K) for j in range(L) for t in ("weight", "bias")}
        expected.update({f"{i}.{L}.weight": (V, C) for i in range(K)})
        _expect(state, expected, path)
        ours = {f"blocks.{i}.{j}.linear.{t}": state[f"{i}.{j}.linear.{t}"]
                for i in range(K) for j in range(L) for t in ("weight", "bias")}
        lm = [state[f"{i}.{L}.weight"] for i in range(K)]
        vocab = None
    if (C, V) != (model.config.hidden_size, model.config.vocab_size):
        raise CheckpointError(f"the Medusa heads in {path} are for hidden size {C} and {V} tokens, the model has "
                              f"{model.config.hidden_size} and {model.config.vocab_size}: they were trained for "
                              "another model")
    shared, lm_state = _lm_heads(lm, model)
    ours.update(lm_state)
    if vocab is not None:
        ours["vocab"] = vocab
    tree, acc = extra.get("tree"), extra.get("head_accuracy")
    try:
        config = MedusaConfig(C, V, num_heads=K, num_layers=L, shared_lm_head=shared,
                              tree=tuple(tuple(p) for p in tree) if tree else None,
                              head_accuracy=tuple(tuple(r) for r in acc) if acc else None,
                              guess_vocab=0 if vocab is None else vocab.numel())
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / HF_CONFIG} is malformed ({e})") from e
    return config, ours


# a directory holding one of these is a Medusa heads directory (or one `specdec medusa train` is filling)
HEADS_MARKERS = (CONFIG, "checkpoint/trainer.json")
FORMATS = ("specdec", "vllm")
VLLM_MARKER = "specdec_export.json"  # marks a vLLM-layout export as specdec's (overwrite rules)


def save_medusa(heads: MedusaHeads, path: str | Path, overwrite: bool = False, format: str = "specdec") -> Path:
    """Write the heads to directory `path` (created if needed); returns it. Their config, tree and
    accuracy table included, is saved as it is. `path` must be new, empty or a Medusa directory;
    heads already there are replaced only with `overwrite=True` (OutputPathError otherwise).
    format "vllm": vLLM's Medusa layout (`export_medusa_vllm`)."""
    _check_heads(heads, "save_medusa")
    if format not in FORMATS:
        raise ValueError(f"save_medusa format must be one of {FORMATS}, got {format!r}")
    if format == "vllm":
        return export_medusa_vllm(heads, path, overwrite=overwrite)
    path = prepare_output_dir(path, HEADS_MARKERS, overwrite, what="Medusa heads directory")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    config = {"format": "specdec-medusa", "version": 1, **heads.config.to_dict()}

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(config, f, indent=1)

    created = make_dirs(path)
    try:
        atomic_write(path / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write(path / CONFIG, write_json)
    except BaseException:
        if created:  # a directory this call made holds nothing usable without its config
            (path / WEIGHTS).unlink(missing_ok=True)
            remove_dirs(created)
        raise
    return path


def _check_heads(heads: object, verb: str) -> None:
    """TypeError unless `heads` is a MedusaHeads (an EAGLE-3 head is pointed to its own saver)."""
    if not isinstance(heads, MedusaHeads):
        hint = "; save an EAGLE-3 head with specdec.save_eagle" if type(heads).__name__ == "Eagle3Head" else ""
        raise TypeError(f"{verb} heads must be Medusa heads (a MedusaHeads from specdec medusa train or "
                        f"distill.load_medusa), got {describe(heads)}{hint}")


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
    _check_heads(heads, "export_medusa_vllm")
    state, config = vllm_state(heads), vllm_config(heads)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))

    return write_output_dir(path, write, VLLM_MARKER, {"format": "vllm-medusa", "version": 1}, overwrite,
                            what="vLLM Medusa export")
