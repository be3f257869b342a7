"""load_model / load_tokenizer: catalogue names, local HF checkpoint dirs, .gguf files and hub ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import StrictDataclassError

from runtime import catalogue
from runtime.args import check_bool, check_dtype, check_path, check_path_length
from runtime.compressed import load_compressed
from runtime.compressed_tensors import is_compressed_tensors, load_compressed_tensors
from runtime.config import HF_SIZE_KEYS, check_model_type, is_size
from runtime.errors import CheckpointError
from runtime.hardware import DTYPES, check_device
from runtime.heap import release_freed_memory
from runtime.hf_state import check_unused, checkpoint_name, read_state_dict, to_runtime_state
from runtime.model import Transformer
from runtime.validate import (
    HF_LAYOUT,
    check_tensors,
    model_config,
    read_headers,
    read_json,
    refuse_remote_code,
    safetensors_files,
    tensor_infos,
)

SOURCES = "a catalogue name, a checkpoint directory, a .gguf file or a hub id"  # what name_or_path may name


def resolve(name_or_path: str | Path) -> Path:
    """A local HF checkpoint directory for a catalogue name, a directory, a .gguf file or a hub id."""
    text = str(name_or_path)
    if text in catalogue.CATALOGUE:
        return catalogue.fetch(text)
    check_path_length("name_or_path", text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return catalogue.gguf_to_checkpoint(path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass a checkpoint directory, a .gguf file or a "
                              "catalogue name")
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if looks_like_hub_id:
        return _from_hub(text)
    raise CheckpointError(f"{text!r} does not exist. Pass a local checkpoint directory, a .gguf "
                          f"file, a hub id, or a catalogue name: {', '.join(catalogue.CATALOGUE)}")


def _from_hub(repo_id: str) -> Path:
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                "*.txt", "*.tiktoken"]))
    except Exception as err:  # the hub client raises many unrelated types (network, auth, 404)
        raise CheckpointError(f"{repo_id!r} is not a local path and could not be downloaded from the "
                              f"Hugging Face hub ({type(err).__name__}: {err}); check the name, or "
                              "use a catalogue name (specdec fetch --list)") from err


def read_hf_config(ckpt: Path) -> Any:
    """The `transformers` config of a checkpoint directory of a family the runtime implements.

    Before transformers reads anything: config.json must be a JSON object, a checkpoint that asks
    to run its own code (`auto_map`) is refused, and so is an unsupported `model_type`
    (UnsupportedModelError). transformers then parses it with trust_remote_code=False; what it
    rejects becomes a CheckpointError naming the file.
    """
    from transformers import AutoConfig  # transformers: heavy, loaded when a checkpoint is read

    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no config.json; it is not a Hugging Face checkpoint directory")
    raw = read_json(path)
    refuse_remote_code(ckpt)
    check_model_type(raw.get("model_type"))
    for key in HF_SIZE_KEYS:  # transformers divides by some of them while parsing
        if key in raw and not is_size(raw[key]):
            raise CheckpointError(f"{path}: {key} must be an integer >= 1, got {raw[key]!r}")
    try:
        return AutoConfig.from_pretrained(ckpt, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError,
            StrictDataclassError) as err:  # what transformers' config classes raise on bad values
        raise CheckpointError(f"{path} is not a valid {raw.get('model_type')} config ({type(err).__name__}: "
                              f"{err})") from err


def from_hf_state(hf_state: dict[str, torch.Tensor], hf_config: Any, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", attention: str | None = None,
                  source: str | Path | None = None) -> Transformer:
    """Build a Transformer on `meta` and assign the given Hugging Face tensors to it.

    The tensors are checked against the config first (layer count, shapes, floating dtypes:
    `runtime.validate.check_tensors`), so a config that disagrees with them builds nothing.
    `source`: the checkpoint directory they came from, which a CheckpointError names.
    """
    cfg = model_config(hf_config)
    check_tensors(cfg, tensor_infos(hf_state), HF_LAYOUT, source)
    check_unused(hf_state, cfg, source)
    with torch.device("meta"):
        model = Transformer(cfg, attention=attention)
    state = to_runtime_state(hf_state, cfg, source)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"{checkpoint_name(source)} lacks {len(missing)} tensors the model needs, e.g. "
                              f"{', '.join(missing[:4])}")
    for name, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"tensor {name} holds NaN or inf values; {checkpoint_name(source)} is corrupt")
    # a tensor taken as is from a safetensors file would stay a view of its memory map, which keeps
    # every page of the file resident (RssFile: +3.6 GB for the 1.5B): copy those into the model's own memory
    mapped = {id(t) for t in hf_state.values()}
    for name in list(state):
        tensor = state.pop(name)
        state[name] = tensor.to(device=device, dtype=dtype, copy=id(tensor) in mapped)
    model.load_state_dict(state, assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


WEIGHTS = ("dense", "gguf", "auto")


def gguf_source(name_or_path: str | Path) -> Path | None:
    """The GGUF file behind a catalogue name (fetched) or a .gguf path; None for other sources."""
    text = str(name_or_path)
    if text in catalogue.CATALOGUE:
        return catalogue.fetch_gguf(text)
    path = Path(text).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def resolve_weights(weights: str, name_or_path: str | Path, device: torch.device | str = "cpu") -> str:
    """What `load_model` does with `weights` for this source: "gguf" (keep a GGUF's blocks), "dense",
    or "blocks" for a `quant` checkpoint whose INT4 / INT8 modules move to the same kernels. "auto"
    is "gguf" for a catalogue name or a .gguf file and "blocks" for a compressed checkpoint where the
    CPU kernels run fast here (`runtime.kernels.cpu_blockq.fast()`, and `device` is the CPU: the
    block kernels have no GPU path), else "dense"."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights != "auto":
        return weights
    from runtime.kernels import cpu_blockq  # imports torch._dynamo (about a second): only for weights="auto"

    if torch.device(device).type != "cpu" or not cpu_blockq.fast():
        return "dense"
    text = str(name_or_path)
    if text in catalogue.CATALOGUE or Path(text).expanduser().suffix == ".gguf":
        return "gguf"
    path = Path(text).expanduser()
    return "blocks" if path.is_dir() and (path / "compression.json").is_file() else "dense"


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", attention: str | None = None,
               compile: bool = False, weights: str = "auto", row_invariant: bool = True) -> torch.nn.Module:
    """Load a model for generation.

    name_or_path: a catalogue name (`runtime.CATALOGUE`), a local Hugging Face checkpoint
    directory (single or sharded safetensors, a directory written by `quant.save_compressed`, or a
    compressed-tensors pack-quantized checkpoint: `runtime.compressed_tensors`),
    a .gguf file, or a hub id when the hub is reachable. attention: "sdpa" | "triton" | None
    (None = triton on CUDA when available, sdpa otherwise). compile: `Transformer.compile_decode`
    the model (faster decode steps; the first step of each shape compiles).
    device: "cpu", "cuda" or "cuda:N"; a ValueError before anything is read when this machine lacks
    it (`runtime.hardware.check_device`). weights: for a catalogue name or a .gguf file, "gguf"
    keeps the file's quantized weights (`runtime.gguf_model`: 4-bit blocks run by the CPU kernels of
    `runtime.kernels.cpu_blockq`, about a third of the bf16 bytes), "dense" dequantizes them to
    `dtype` (what training needs), "auto" picks "gguf" where the kernels run fast
    (`runtime.kernels.cpu_blockq.fast`, device "cpu") and "dense" elsewhere; on a checkpoint written by
    `quant.save_compressed`, "auto" also moves its INT4 / INT8 modules to those kernels
    (`runtime.blockq.to_block_quant`), "dense" keeps its modules as saved. row_invariant: False
    turns off the row-invariant kernels (`Transformer.row_invariant`, on where supported: bf16 on
    the CPU, and float32 with 4-bit / block-quantized weights), so a row's logits may depend on the
    rows and tokens sharing its forward.

    Nothing is built or run before the checkpoint is checked (`runtime.validate`): a checkpoint
    that asks to run its own code (`auto_map`) or has an unsupported model_type raises
    UnsupportedModelError; malformed JSON, shard paths outside the directory, unparsable
    safetensors, a config whose layer count, widths, heads, vocabulary or positions disagree with
    the weights' headers, integer or NaN weights raise CheckpointError naming the file. Before
    that, the arguments themselves (`runtime.args`): dtype is one of `runtime.hardware.DTYPES`
    (torch.bfloat16, torch.float32, torch.float16, or their names).
    """
    check_path("name_or_path", name_or_path, SOURCES)
    dtype = check_dtype("dtype", dtype, DTYPES)
    check_bool("compile", compile)
    check_bool("row_invariant", row_invariant)
    if attention is not None and attention not in ("sdpa", "triton"):
        raise ValueError(f"attention must be 'sdpa' or 'triton', got {attention!r}")
    device = check_device(device)
    weights = resolve_weights(weights, name_or_path, device)
    ckpt = resolve(name_or_path)
    hf_config = read_hf_config(ckpt)
    cfg = model_config(hf_config, ckpt)  # fail on a bad config before reading the weights
    if weights == "gguf":
        from runtime.gguf_model import load_gguf_model  # imports the CPU kernels' module (torch._dynamo)

        source = gguf_source(name_or_path)
        if source is None:
            raise ValueError(f"weights='gguf' keeps a GGUF file's quantized weights: pass a catalogue name or a "
                             f".gguf file, not {str(name_or_path)!r} (a Hugging Face checkpoint quantizes with "
                             "`quant.quantize_`, whose INT4 / INT8 modules run the same kernels)")
        model = load_gguf_model(source, hf_config, dtype=dtype, device=device, attention=attention)
    elif (ckpt / "compression.json").is_file():
        model = load_compressed(ckpt, hf_config, dtype=dtype, device=device, attention=attention)
        if weights == "blocks":
            from runtime.blockq import to_block_quant  # imports the CPU kernels' module (torch._dynamo)

            to_block_quant(model)
    elif is_compressed_tensors(hf_config):
        model = load_compressed_tensors(ckpt, hf_config, dtype=dtype, device=device, attention=attention)
    else:
        files = safetensors_files(ckpt)
        if files:  # the headers against the config, before any weight is read
            check_tensors(cfg, read_headers(files), HF_LAYOUT, ckpt)
        model = from_hf_state(read_state_dict(ckpt), hf_config, dtype=dtype, device=device,
                              attention=attention, source=ckpt)
    release_freed_memory()  # the load's temporaries (`runtime.heap`)
    model.source = ckpt  # lets a drafter compare tokenizers with its target
    model.want_row_invariant = bool(row_invariant)
    if compile:
        model.compile_decode()
    return model


# files a Hugging Face tokenizer is read from (fast, sentencepiece, BPE, WordPiece, its settings)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
_TOKENIZER_FIX = "copy the base model's tokenizer files into it, or load the tokenizer from the base model"


def _check_tokenizer_files(ckpt: Path) -> list[str]:
    """The tokenizer files in `ckpt` (TOKENIZER_FILES, *.tiktoken); CheckpointError when there are none,
    or when tokenizer.json is not a `tokenizers` file (a JSON object with a "model" mapping)."""
    present = [n for n in TOKENIZER_FILES if (ckpt / n).is_file()] + sorted(p.name for p in ckpt.glob("*.tiktoken"))
    if not present:
        raise CheckpointError(f"no usable tokenizer in {ckpt}: it holds none of {', '.join(TOKENIZER_FILES)}; "
                              f"{_TOKENIZER_FIX}")
    file = ckpt / "tokenizer.json"
    if file.is_file():
        raw = read_json(file)
        if not isinstance(raw.get("model"), dict):
            raise CheckpointError(f"{file} is not a tokenizers file: it has no \"model\" mapping (keys: "
                                  f"{', '.join(sorted(raw)[:6]) or 'none'}); the file is corrupt: {_TOKENIZER_FIX}")
    return present


def load_tokenizer(name_or_path: str | Path):
    """The Hugging Face tokenizer stored with a checkpoint (catalogue name, dir, .gguf or hub id).

    A directory without tokenizer files, a tokenizer.json that is not a `tokenizers` file, or files
    transformers cannot read raise CheckpointError naming the directory or file, in one line."""
    from transformers import AutoTokenizer  # transformers: heavy, loaded when a tokenizer is read

    check_path("name_or_path", name_or_path, SOURCES)
    ckpt = resolve(name_or_path)
    refuse_remote_code(ckpt)
    present = _check_tokenizer_files(ckpt)
    try:
        return AutoTokenizer.from_pretrained(ckpt, trust_remote_code=False)
    except Exception as err:  # transformers and the tokenizers library raise many types (KeyError, Exception)
        reason = " ".join(str(err).split())
        raise CheckpointError(f"no usable tokenizer in {ckpt} ({', '.join(present)}): {type(err).__name__}: "
                              f"{reason}; {_TOKENIZER_FIX}") from err
