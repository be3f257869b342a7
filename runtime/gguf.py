"""GGUF files -> Hugging Face checkpoint directories (bf16 safetensors + tokenizer), converted once.

`transformers` + `gguf` dequantize the file (`from_pretrained(dir, gguf_file=name)`); the model
that loader returns carries a GGUF quantizer and refuses to serialize, so the weights move into a
plain model rebuilt from the same config, which is saved with `save_pretrained`. The tokenizer
comes from the GGUF metadata. Tensor types are checked with `gguf.GGUFReader` before any work.
transformers is always called with trust_remote_code=False: no code beside the GGUF is run.

`convert_gguf(path, out_dir)` writes one directory; `runtime.catalogue.gguf_to_checkpoint(path)`
caches the result under `$SPECDEC_HOME/gguf/<stem>-<key>` (key: hash of path, size and mtime), built
atomically.
"""

from __future__ import annotations

import functools
import gc
import json
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from runtime.config import MAX_POSITIONS
from runtime.errors import CheckpointError
from runtime.progress import keep_alive
from runtime.progress import progress as progress_bar
from runtime.validate import layer_span

if TYPE_CHECKING:
    from tqdm.auto import tqdm

# Written last into every converted directory: its presence marks the directory as complete.
SOURCE_FILE = "specdec_source.json"
CONVERT_STEPS = 3  # progress-bar steps of one conversion: dequantize, save weights, tokenizer


@functools.cache
def supported_tensor_types() -> tuple[str, ...]:
    """Names of the ggml tensor types the installed `gguf` package can dequantize."""
    names = []
    for qtype in gguf.GGMLQuantizationType:
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)  # one all-zero block
        except NotImplementedError:
            continue
        names.append(qtype.name)
    return tuple(names)


def inspect_gguf(gguf_path: Path) -> tuple[Counter, bool]:
    """Count a GGUF file's tensor types and say whether it holds a tokenizer.

    Raises CheckpointError for a file `gguf.GGUFReader` cannot parse, or for a tensor type the
    installed `gguf` cannot dequantize (naming the tensor, its type and the supported types).
    """
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise CheckpointError(f"{gguf_path} is not a readable GGUF file ({type(err).__name__}: {err}); "
                              "it may be truncated or corrupt: download it again") from err
    check_gguf_sizes(reader, gguf_path)
    check_gguf_tensor_names(reader, gguf_path)
    supported = supported_tensor_types()
    counts: Counter = Counter()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in supported:
            raise CheckpointError(
                f"{gguf_path}: tensor {tensor.name!r} is stored as ggml type {kind}, which the installed "
                f"gguf {version('gguf')} cannot dequantize. Supported types: {', '.join(supported)}. "
                "Re-quantize the model to one of these (e.g. Q8_0 or Q4_K with llama.cpp's "
                "llama-quantize) or pass a safetensors checkpoint.")
        counts[kind] += 1
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None and (tokens.types[0] != gguf.GGUFValueType.ARRAY
                               or tokens.types[-1] != gguf.GGUFValueType.STRING):
        raise CheckpointError(f"{gguf_path}: its metadata tokenizer.ggml.tokens is a "
                              f"{'/'.join(t.name.lower() for t in tokens.types)}, not an array of strings (the "
                              "vocabulary); the file is corrupt")
    return counts, "tokenizer.ggml.model" in reader.fields


def converted_bytes(gguf_path: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """About the bytes `convert_gguf` writes for `gguf_path`: every tensor's elements at `dtype`'s size
    (the tokenizer files are small beside them)."""
    return sum(int(t.n_elements) for t in gguf.GGUFReader(gguf_path).tensors) * dtype.itemsize


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def check_gguf_sizes(reader, gguf_path: Path) -> None:
    """CheckpointError when a GGUF's metadata disagrees with its tensors in a way that would make
    transformers build an oversized model: a block count other than the blocks stored, a context
    length past runtime.config.MAX_POSITIONS, an embedding length other than the embedding's."""
    arch = _field(reader, "general.architecture")
    if arch is not None and not isinstance(arch, str):  # transformers' loader fails on it with a TypeError
        raise CheckpointError(f"{gguf_path}: its metadata general.architecture is {arch!r} "
                              f"({type(arch).__name__}), not an architecture's name such as 'llama'; the file is "
                              "corrupt or not a model GGUF")
    if not isinstance(arch, str):
        return  # transformers rejects a GGUF without an architecture before building anything
    count = _field(reader, f"{arch}.block_count")
    blocks = sorted({int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))})
    if count is not None and (not isinstance(count, int) or blocks != list(range(count))):
        raise CheckpointError(f"{gguf_path}: its metadata says {arch}.block_count={count!r}, but the file holds "
                              f"{layer_span(blocks)}; the file is corrupt")
    context = _field(reader, f"{arch}.context_length")
    if context is not None and (not isinstance(context, int) or not 1 <= context <= MAX_POSITIONS):
        raise CheckpointError(f"{gguf_path}: its metadata says {arch}.context_length={context!r}; the runtime "
                              f"supports 1 to {MAX_POSITIONS} (2**20) positions")
    width = _field(reader, f"{arch}.embedding_length")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if width is not None and embed is not None and int(embed.shape[0]) != width:
        raise CheckpointError(f"{gguf_path}: its metadata says {arch}.embedding_length={width!r}, but "
                              f"token_embd.weight is {int(embed.shape[0])} wide; the file is corrupt")
    check_gguf_heads(reader, gguf_path, arch)


# the tensors of the GGUF architectures the runtime implements: llama (Llama, Mistral, SmolLM2; q/k/v
# biases optional) and qwen2; rope_freqs holds Llama 3's rotary scaling, which the metadata also states
_ARCH_TENSORS = ("llama", "qwen2")
_TENSOR_NAME = re.compile(r"(token_embd|output_norm|output|rope_freqs)\.weight"
                          r"|blk\.\d+\.((attn_norm|ffn_norm|attn_output|ffn_gate|ffn_up|ffn_down)\.weight"
                          r"|(attn_q|attn_k|attn_v)\.(weight|bias))")
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def check_gguf_tensor_names(reader, gguf_path: Path) -> None:
    """CheckpointError naming the tensors of a llama / qwen2 GGUF that neither conversion nor the 4-bit
    load would read (an output bias, an MLP bias, anything unknown), instead of dropping them; and
    naming the layers whose q / k / v biases are partial."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TENSORS:
        return
    names = [t.name for t in reader.tensors]
    unknown = [n for n in names if not _TENSOR_NAME.fullmatch(n)]
    if unknown:
        raise CheckpointError(f"{gguf_path} holds {len(unknown)} tensors a {arch} model does not have, e.g. "
                              f"{', '.join(unknown[:4])}; the runtime would drop them, so the file is refused "
                              "(it is another architecture stored as llama, or corrupt)")
    present = set(names)
    partial = sorted({int(m.group(1)) for n in names if (m := re.fullmatch(r"blk\.(\d+)\.attn_[qkv]\.bias", n))
                      if not all(f"blk.{m.group(1)}.{b}" in present for b in QKV_BIASES)})
    if partial:
        raise CheckpointError(f"{gguf_path}: layer {partial[0]} has some of the q / k / v biases "
                              f"({', '.join(QKV_BIASES)}) but not all; the file is corrupt")
    biased = {int(m.group(1)) for n in names if (m := re.fullmatch(r"blk\.(\d+)\.attn_q\.bias", n))}
    layers = {int(m.group(1)) for n in names if (m := re.match(r"blk\.(\d+)\.", n))}
    if biased and biased != layers:
        raise CheckpointError(f"{gguf_path}: {layer_span(sorted(biased))} have q / k / v biases but "
                              f"{layer_span(sorted(layers - biased))} do not; the file is corrupt")


def _rows(reader, name: str) -> int | None:
    """Output rows of a 2-D GGUF tensor (its second dimension: GGUF lists the input one first)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return int(tensor.shape[1]) if tensor is not None and len(tensor.shape) == 2 else None


def check_gguf_heads(reader, gguf_path: Path, arch: str) -> None:
    """CheckpointError naming the file and the metadata key when the attention heads or widths of a
    GGUF cannot describe its tensors: a head count (or key/value head count, head size, feed-forward
    width) that is not an integer >= 1, heads that are not a multiple of the key/value heads, a
    width that the heads do not divide, an odd head size (rotary embeddings pair dimensions), or
    counts whose product differs from the rows of layer 0's q, k and ffn_up tensors. Without this
    check transformers divides by a head count of 0 or fails its own config validation."""
    def size(key: str) -> int | None:
        value = _field(reader, f"{arch}.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{gguf_path}: its metadata says {arch}.{key}={value!r}; it must be an integer "
                                  ">= 1 (the file is corrupt)")
        return value

    heads, kv_heads, width = size("attention.head_count"), size("attention.head_count_kv"), size("embedding_length")
    ffn, rope_dim = size("feed_forward_length"), size("rope.dimension_count")
    size("attention.key_length")
    size("attention.value_length")
    if heads is None:
        return
    if kv_heads is not None and heads % kv_heads:
        raise CheckpointError(f"{gguf_path}: its metadata says {arch}.attention.head_count={heads}, not a multiple of "
                              f"{arch}.attention.head_count_kv={kv_heads} (grouped-query attention shares each "
                              "key/value head among whole groups); the file is corrupt")
    head_dim = rope_dim if arch in ("llama", "mistral") and rope_dim is not None else None
    if head_dim is None and width is not None:
        if width % heads:
            raise CheckpointError(f"{gguf_path}: its metadata says {arch}.attention.head_count={heads}, which does not "
                                  f"divide {arch}.embedding_length={width}; the file is corrupt")
        head_dim = width // heads
    if head_dim is None:
        return
    if head_dim % 2:
        raise CheckpointError(f"{gguf_path}: its metadata gives heads of {head_dim} dimensions ({arch}.attention."
                              "head_count, embedding_length, rope.dimension_count); rotary embeddings need an even "
                              "head size: the file is corrupt")
    expected = {"attn_q": ("attention.head_count", heads * head_dim),
                "attn_k": ("attention.head_count_kv", (kv_heads or heads) * head_dim)}
    if ffn is not None:
        expected["ffn_up"] = ("feed_forward_length", ffn)
    for tensor, (key, rows) in expected.items():
        got = _rows(reader, f"blk.0.{tensor}.weight")
        if got is not None and got != rows:
            why = f"{arch}.{key}" + (f", with heads of {head_dim} dimensions" if tensor != "ffn_up" else "")
            raise CheckpointError(f"{gguf_path}: its metadata ({why}) implies {rows} rows for blk.0.{tensor}.weight, "
                                  f"but it holds {got}; the file is corrupt")


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of the q / k rows (and biases) of a llama GGUF, as transformers does."""
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _llama_qkv_biases(gguf_path: Path, config) -> dict[str, torch.Tensor]:
    """The q / k / v biases of a llama GGUF, by their Hugging Face names and in its row order ({} for
    other architectures and for a llama file without biases: Qwen2-style weights stored as llama).
    `check_gguf_tensor_names` has made sure every layer has all three or none has any."""
    if config.model_type not in ("llama", "mistral"):
        return {}
    reader = gguf.GGUFReader(gguf_path)
    if config.model_type == "mistral" and any(t.name.endswith(QKV_BIASES) for t in reader.tensors):
        raise CheckpointError(f"{gguf_path}: a Mistral model (sliding-window attention) with q / k / v biases "
                              f"({', '.join(QKV_BIASES)}) is not implemented; the biases would be dropped")
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads, "attn_v": None}
    hf = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj"}
    biases = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(attn_[qkv])\.bias", t.name)
        if m is None:
            continue
        values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
        if heads[m.group(2)] is not None:
            values = _unpermute_rows(values, heads[m.group(2)])
        biases[f"model.layers.{m.group(1)}.self_attn.{hf[m.group(2)]}.bias"] = torch.from_numpy(values.copy())
    return biases


def _with_qkv_bias(config):
    """A llama config as the Qwen2 config of the same model: Qwen2 is llama with q / k / v biases (and
    no output bias), so transformers and the runtime both run the biases a llama GGUF may hold."""
    from transformers import Qwen2Config  # transformers: heavy, only for a conversion

    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("attention_bias", "mlp_bias", "pretraining_tp", "model_type", "architectures",
                           "transformers_version")}
    return Qwen2Config(**fields, architectures=["Qwen2ForCausalLM"])


def _load_dense(gguf_path: Path, dtype: torch.dtype):
    """The GGUF's model dequantized by transformers, rebuilt as a plain (serializable) model."""
    from transformers import AutoModelForCausalLM, GgufConfig  # transformers: heavy, only for a conversion

    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype, output_loading_info=True,
            quantization_config=GgufConfig(gguf_file=gguf_path.name, dequantize=True), trust_remote_code=False)
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"transformers could not load {gguf_path} ({type(err).__name__}: {err}); "
                              "check that the file is a complete GGUF of a supported architecture") from err
    config = loaded.config
    missing = [k for k in info["missing_keys"] if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise CheckpointError(f"{gguf_path} lacks {len(missing)} tensors the {config.model_type} model "
                              f"needs, e.g. {', '.join(sorted(missing)[:4])}; the file is incomplete")
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dense now; the rebuilt model is plain
    biases = _llama_qkv_biases(gguf_path, config)  # transformers' llama has no q / k / v biases: it skips them
    if biases:
        config = _with_qkv_bias(config)
    state = {**loaded.state_dict(), **{k: v.to(dtype) for k, v in biases.items()}}
    del loaded
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.load_state_dict(state, assign=True, strict=True)
    del state
    model.tie_weights()
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if config.tie_word_embeddings != (head.data_ptr() == embed.data_ptr()):
        raise CheckpointError(f"{gguf_path}: the output head is {'not ' if config.tie_word_embeddings else ''}"
                              "tied to the embeddings, against tie_word_embeddings="
                              f"{config.tie_word_embeddings}; the conversion would change the model")
    return model.eval()


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> str:
    """Rebuild the tokenizer stored in the GGUF metadata, save it, and return its class name."""
    from transformers import AutoTokenizer  # transformers: heavy, only for a conversion

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  trust_remote_code=False)
    except (ValueError, OSError, KeyError) as err:
        raise CheckpointError(f"the tokenizer in {gguf_path} could not be rebuilt ({type(err).__name__}: "
                              f"{err})") from err
    tokenizer.save_pretrained(out_dir)
    return type(tokenizer).__name__


@contextmanager
def _transformers_bars_off() -> Iterator[None]:
    """transformers' own progress bars (loading weights, writing shards) off for a while; the
    conversion's bar covers those stages. Its GGUF dequantization bar is plain tqdm and stays."""
    from transformers.utils import logging as hf_logging  # transformers: heavy, only for a conversion

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: Path | str, out_dir: Path | str, dtype: torch.dtype = torch.bfloat16,
                 progress: bool = True, source: dict | None = None, bar: tqdm | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face checkpoint directory `out_dir` and return it.

    `out_dir` must be new or empty. It receives config.json, model.safetensors in `dtype`,
    generation_config.json, the tokenizer files (when the GGUF holds a tokenizer) and, written
    last, specdec_source.json (provenance; `source` entries are added to it). Not atomic by
    itself: `runtime.catalogue.gguf_to_checkpoint` and `runtime.fetch` build into a staging directory and rename.
    progress: show a bar of CONVERT_STEPS steps. bar: advance this open bar by CONVERT_STEPS
    steps instead, naming the stage in its postfix (`runtime.fetch` shows one bar per fetch).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise CheckpointError(f"{gguf_path} does not exist or is not a file")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} is not empty; convert into a new directory")
    counts, has_tokenizer = inspect_gguf(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = progress_bar(total=CONVERT_STEPS, desc=f"convert {gguf_path.name}", unit="step",
                         disable=not progress) if bar is None else bar
    # a passed bar stays open (and its owner keeps it alive)
    with steps if bar is None else nullcontext(), keep_alive(steps) if bar is None else nullcontext(), \
            _transformers_bars_off():
        steps.set_postfix_str("convert: dequantize")
        model = _load_dense(gguf_path, dtype)
        steps.update()
        steps.set_postfix_str("convert: save weights")
        model.save_pretrained(out_dir)
        model_type = model.config.model_type
        del model
        gc.collect()
        steps.update()
        steps.set_postfix_str("convert: tokenizer")
        tokenizer = _save_tokenizer(gguf_path, out_dir) if has_tokenizer else None
        steps.update()
    record = {"gguf": gguf_path.name, "tensor_types": dict(counts), "dtype": str(dtype).removeprefix("torch."),
              "model_type": model_type, "tokenizer": tokenizer, **(source or {})}
    (out_dir / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir
