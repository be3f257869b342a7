"""`export_gguf`: a specdec checkpoint or EAGLE-3 head as a GGUF file that llama.cpp runs.

Sources, told apart by their files:

- a dense Hugging Face checkpoint (a distilled draft, `--export-dense` output, a catalogue model):
  llama.cpp's converter writes it as it is (`quant.llamacpp_convert`), float tensors as `dense_type`;
- a compressed checkpoint (`quant.save_compressed`, or compressed-tensors pack-quantized): its
  dequantized weights go through the converter (which names every tensor and writes the tokenizer),
  then each quantized linear's tensor is replaced by GGUF blocks (`quant.gguf_tensors`): exact Q4_1
  / Q8_0 where the layout maps (INT4 in groups of a multiple of 32, per-channel INT8), re-quantized
  (`requant`) otherwise, every replaced tensor's error against the module's own weights measured;
- an EAGLE-3 head directory (`save_eagle`, speculators' layout): the converter's EAGLE3 architecture
  with `--target-model-dir`, after checking that llama.cpp's EAGLE-3 graph computes what the head was
  trained with (it has `norm_before_fc` and `norm_before_residual`, not `fc_norm` or `norm_output`).

Medusa heads (llama.cpp runs none) and .gguf files are refused. Every export carries the metadata key
`specdec.export.source` (the source it was written from): the mark of a GGUF specdec wrote. The file
is written next to `out` and renamed into place; an existing file is replaced only with `overwrite`
and only when it carries that mark (any other GGUF, e.g. one llama.cpp or the catalogue made, is
never replaced), and never in specdec's own caches (`runtime.output_paths`). An export that runs out of disk
space is one DiskFullError naming `out`; its temporary directory goes, and `out` is as it was.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType

from quant.checkpoint import export_dense
from quant.gguf_tensors import REQUANT, block_error, target_type, to_blocks
from quant.llamacpp_convert import convert
from runtime.args import check_path
from runtime.atomic import disk_full_named
from runtime.errors import CheckpointError, SpecdecError
from runtime.hf_state import hf_linear_parts
from runtime.loading import load_model, load_tokenizer, resolve
from runtime.output_paths import OutputPathError, check_output_file
from runtime.qlinear import QuantizedLinear
from runtime.validate import read_json

DENSE_TYPES = ("bf16", "f16", "f32")
TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float32, "f32": torch.float32}  # f16: the converter rounds
FILE_TYPES = {GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
              GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0}
# EAGLE-3 options llama.cpp's graph (src/models/eagle3.cpp) does not compute
EAGLE_UNSUPPORTED = ("fc_norm", "norm_output")
MATCH_TOLERANCE = 1e-2  # relative error between our weights and the converter's float copy of them (dtype rounding)
SOURCE_KEY = "specdec.export.source"  # written into every export: the mark of a GGUF specdec wrote


class GGUFExportError(SpecdecError, ValueError):
    """A source that cannot be written as a GGUF llama.cpp runs, with what to do instead."""


@dataclass(frozen=True)
class TensorReport:
    """One GGUF tensor of a quantized linear: its source format, GGUF type, exactness and error
    (relative Frobenius and max |error| against the module's dequantized weights)."""

    name: str
    source_format: str
    gguf_type: str
    exact: bool
    rel_error: float
    max_error: float


@dataclass
class GGUFExport:
    """What `export_gguf` wrote: the file, the source kind and the quantized tensors' reports."""

    path: Path
    kind: str
    tensors: list[TensorReport] = field(default_factory=list)

    def summary(self) -> str:
        """Lines: the file and its size, then per (format -> type, exact) the tensor count and worst errors."""
        lines = [f"wrote {self.path} ({self.path.stat().st_size / 2**20:.1f} MiB, {self.kind})"]
        groups: dict[tuple[str, str, bool], list[TensorReport]] = {}
        for t in self.tensors:
            groups.setdefault((t.source_format, t.gguf_type, t.exact), []).append(t)
        for (fmt, kind, exact), ts in sorted(groups.items()):
            how = "exact codes" if exact else "re-quantized" if kind in ("Q4_1", "Q8_0") else "float copy"
            lines.append(f"  {len(ts):4d} {fmt} linears -> {kind} ({how}): relative error max "
                         f"{max(t.rel_error for t in ts):.2e}, |error| max {max(t.max_error for t in ts):.2e}")
        return "\n".join(lines)


def written_by_specdec(path: Path) -> bool:
    """Whether `path` is a GGUF file whose metadata holds SOURCE_KEY (an export of `export_gguf`);
    False for any other file, an unreadable or cut-short one included."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        return GGUFReader(path).get_field(SOURCE_KEY) is not None
    except (OSError, ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError):
        return False


def source_kind(path: Path) -> str:
    """"eagle3", "compressed" or "dense" for a checkpoint directory; GGUFExportError for what cannot be exported."""
    if path.is_file() and path.suffix == ".gguf":
        raise GGUFExportError(f"{path} is already a GGUF file; llama.cpp loads it as it is")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    if (path / "medusa_config.json").is_file():
        raise GGUFExportError(f"{path} holds Medusa heads, which llama.cpp does not run; export them for vLLM "
                              "(docs/exports.md), or train an EAGLE-3 head (`specdec eagle`)")
    config = path / "config.json"
    raw = read_json(config) if config.is_file() else {}
    if raw.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if (path / "compression.json").is_file() or "quantization_config" in raw:
        return "compressed"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json: it is not a Hugging Face checkpoint directory")
    if not isinstance(raw.get("model_type"), str):  # llama.cpp's converter fails on it with its own traceback
        raise CheckpointError(f"{config}: model_type is {raw.get('model_type')!r}, not a model type such as 'llama'; "
                              "it is not a Hugging Face checkpoint's config")
    return "dense"


def check_eagle_for_llamacpp(head_dir: Path, target_dir: Path) -> dict:
    """The head's config, after checking that llama.cpp computes what it was trained with and that it fits
    the target (hidden size, vocabulary); GGUFExportError naming the mismatch otherwise."""
    raw = read_json(head_dir / "config.json")
    on = [k for k in EAGLE_UNSUPPORTED if raw.get(k)]
    if on:
        raise GGUFExportError(f"{head_dir} was trained with {', '.join(on)}, which llama.cpp's EAGLE-3 graph does not "
                              "compute (it has norm_before_fc and norm_before_residual only), so its drafts there "
                              "would not be the ones specdec measured; train the head with --no-fc-norm "
                              "--no-norm-output (optionally --norm-before-fc) for llama.cpp")
    target = read_json(target_dir / "config.json")
    text_config = target.get("text_config", {})
    if not isinstance(text_config, dict):
        raise CheckpointError(f"{target_dir / 'config.json'}: text_config is a JSON {type(text_config).__name__}, "
                              "not an object; the file is corrupt")
    target = {**target, **text_config}
    layer = raw.get("transformer_layer_config", {})
    if not isinstance(layer, dict):
        raise CheckpointError(f"{head_dir / 'config.json'}: transformer_layer_config is a JSON "
                              f"{type(layer).__name__}, not an object; the file is corrupt")
    hidden = raw.get("target_hidden_size", layer.get("hidden_size"))
    if hidden != target.get("hidden_size") or layer.get("vocab_size") != target.get("vocab_size"):
        raise GGUFExportError(f"{head_dir} was trained for a target of hidden size {hidden} and vocabulary "
                              f"{layer.get('vocab_size')}, but {target_dir} has {target.get('hidden_size')} and "
                              f"{target.get('vocab_size')}: pass the head's own target as --target")
    return raw


def _llama_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for Llama (its `LlamaModel.permute`), applied to row indices."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2).swapaxes(1, 2).reshape(-1)


def _rows_in_gguf_order(ref: torch.Tensor, converted: np.ndarray, qtype: GGMLQuantizationType, hf_name: str,
                        cfg) -> torch.Tensor:
    """The row order the converter wrote `hf_name` in: as is, or llama's q/k permutation, whichever its float
    copy matches; GGUFExportError when neither does (the export would be wrong)."""
    rows = torch.arange(ref.shape[0])
    candidates = [rows]
    if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_heads if hf_name.endswith("q_proj.weight") else cfg.num_kv_heads
        candidates.append(_llama_permute(rows, heads))
    for order in candidates:
        if block_error(converted, qtype, ref[order])[0] <= MATCH_TOLERANCE:
            return order
    raise GGUFExportError(f"llama.cpp's converter wrote {hf_name} in a row order specdec does not know; the export "
                          "would not hold the model's weights, so nothing was written")


def _quantized_tensors(model: torch.nn.Module, reader: GGUFReader, requant: str
                       ) -> tuple[dict[str, tuple[np.ndarray, GGMLQuantizationType]], list[TensorReport]]:
    """GGUF name -> (blocks, type) replacing the converter's float copy of each quantized linear, and reports."""
    arch = str(reader.get_field(Keys.General.ARCHITECTURE).contents())
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, len(model.layers))
    by_name = {t.name: t for t in reader.tensors}
    replaced, reports = {}, []
    for mod_name, parts in hf_linear_parts(model).items():
        mod = model.get_submodule(mod_name)
        if not isinstance(mod, QuantizedLinear):
            continue
        kind = target_type(mod, requant)
        weight = mod.dequantize(torch.float32)  # (N, K)
        for hf_name, start, stop in parts:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
            if gguf_name is None or gguf_name not in by_name:
                raise GGUFExportError(f"llama.cpp's converter wrote no tensor for {hf_name}; nothing was written")
            tensor = by_name[gguf_name]
            ref = weight[start:stop]
            order = _rows_in_gguf_order(ref, tensor.data, tensor.tensor_type, hf_name, model.config)
            if kind == "dense":
                data, qtype, exact = tensor.data, tensor.tensor_type, mod.FORMAT == "sparse24"
            else:
                blocks = to_blocks(mod, order + start, kind)
                data, qtype, exact = blocks.data, blocks.qtype, blocks.exact
                replaced[gguf_name] = (data, qtype)
            rel, worst = block_error(data, qtype, ref[order])
            reports.append(TensorReport(gguf_name, mod.FORMAT, qtype.name, exact, rel, worst))
    return replaced, reports


def _rewrite(reader: GGUFReader, out: Path, replaced: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
             source: str) -> None:
    """Copy `reader`'s file to `out` with the tensors in `replaced` swapped for the given blocks (the copy
    of gguf-py's gguf_new_metadata), general.file_type set to the most common new type's, and SOURCE_KEY
    set to `source`."""
    arch = str(reader.get_field(Keys.General.ARCHITECTURE).contents())
    writer = GGUFWriter(out, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    common = Counter(qtype for _, qtype in replaced.values()).most_common(1)
    for f in reader.fields.values():
        if f.name == Keys.General.ARCHITECTURE or f.name.startswith("GGUF.") or f.name == SOURCE_KEY:
            continue
        value = f.contents()
        if f.name == Keys.General.FILE_TYPE and common:
            value = int(FILE_TYPES[common[0][0]])
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub)
    if reader.get_field(Keys.General.QUANTIZATION_VERSION) is None and replaced:
        writer.add_quantization_version(2)
    writer.add_string(SOURCE_KEY, source)
    tensors = [(t.name, *replaced.get(t.name, (t.data, t.tensor_type))) for t in reader.tensors]
    for name, data, qtype in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()


def _check_out(out: str | Path, overwrite: bool) -> Path:
    path = check_output_file(out, what="GGUF file", looks_like=written_by_specdec)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".gguf":
        raise OutputPathError(f"{path}: name the output file *.gguf (llama.cpp's tools expect it)")
    if path.exists() and path.stat().st_size and not overwrite:
        raise OutputPathError(f"{path} exists; pass --overwrite (overwrite=True) to replace it")
    return path


def export_gguf(source: str | Path, out: str | Path, *, target: str | Path | None = None, dense_type: str = "bf16",
                requant: str = "auto", overwrite: bool = False) -> GGUFExport:
    """Write `source` (a catalogue name, checkpoint directory or EAGLE-3 head directory) to GGUF file `out`.

    dense_type: the type of float tensors ("bf16", "f16", "f32"); requant: what a quantized linear
    whose layout maps onto no GGUF type becomes (gguf_tensors.REQUANT: "auto" is Q4_1 for 4-bit
    formats, Q8_0 for 8-bit, a float copy for 2:4 sparse); target: the target model of an EAGLE-3
    head (catalogue name, directory or .gguf), required for heads and refused otherwise."""
    if dense_type not in DENSE_TYPES:
        raise ValueError(f"dense_type must be one of {DENSE_TYPES}, got {dense_type!r}")
    if requant not in REQUANT:
        raise ValueError(f"requant must be one of {REQUANT}, got {requant!r}")
    check_path("source", source, "a catalogue name, checkpoint directory or EAGLE-3 head directory")
    if target is not None:
        check_path("target", target, "the EAGLE-3 head's target model (catalogue name, directory or .gguf)")
    path = _check_out(out, overwrite)
    text = str(source)
    ckpt = Path(text).expanduser() if Path(text).expanduser().exists() else resolve(text)
    kind = source_kind(ckpt)
    if (kind == "eagle3") != (target is not None):
        raise GGUFExportError(f"{ckpt} is an EAGLE-3 head: pass its target model as --target (target=...)"
                              if kind == "eagle3" else f"--target is for EAGLE-3 heads; {ckpt} is a model")
    remedy = "Free disk space there, or write the export to a disk with room (--out), and run it again."
    with disk_full_named(path, remedy), \
            tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.partial-") as tmp_name:
        tmp = Path(tmp_name)
        staged = tmp / "out.gguf"
        reports: list[TensorReport] = []
        if kind in ("eagle3", "dense"):
            target_dir = resolve(target) if kind == "eagle3" else None
            if target_dir is not None:
                check_eagle_for_llamacpp(ckpt, target_dir)
            convert(ckpt, tmp / "converted.gguf", dense_type, target_dir=target_dir)
            reader = GGUFReader(tmp / "converted.gguf")
            _rewrite(reader, staged, {}, text)  # as converted, plus the mark of specdec's export
            del reader
        else:
            model = load_model(ckpt, dtype=TORCH_DTYPES[dense_type], weights="dense")
            # the converter reads a plain Hugging Face directory: quant's dense export, tokenizer included
            export_dense(model, tmp / "hf", tokenizer=load_tokenizer(ckpt), dtype=TORCH_DTYPES[dense_type])
            convert(tmp / "hf", tmp / "dense.gguf", dense_type)
            reader = GGUFReader(tmp / "dense.gguf")
            replaced, reports = _quantized_tensors(model, reader, requant)
            _rewrite(reader, staged, replaced, text)
            del reader
        os.replace(staged, path)
    return GGUFExport(path, kind, reports)
