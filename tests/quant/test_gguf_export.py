"""`specdec export gguf` through llama.cpp's real converter: tiny random Llama models with the smollm2
tokenizer (the converter needs a tokenizer it knows), read back by gguf-py and by our own GGUF
loader (transformers' dequantization, which also undoes llama's q/k row order), and the refusals.

The converter is fetched once (the llama-cpp-python sdist, 77 MB), then found offline, like the real model.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

import quant
import runtime
import runtime.loading
from quant.gguf_export import GGUFExportError, _rewrite, export_gguf, written_by_specdec
from quant.llamacpp_convert import converter_dir
from runtime.output_paths import OutputPathError
from runtime.tiny import tiny_hf_config
from specdec.evaluation import llamacpp
from specdec.evaluation.llamacpp import LlamaServer

SMOLLM2 = "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def converter():
    return converter_dir()  # fetched once (the package index), then offline like the real models


@pytest.fixture(scope="module")
def smol_tokenizer(converter):
    return runtime.load_tokenizer(SMOLLM2)


def _dense_dir(path, model_type: str, tokenizer, seed: int = 0):
    """A tiny random model of the tokenizer's vocabulary, saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(model_type, vocab_size=len(tokenizer), num_hidden_layers=4, intermediate_size=128,
                         tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _compressed_dir(path, dense, tokenizer, config):
    model = runtime.load_model(dense, dtype=torch.float32, weights="dense")
    quant.quantize_(model, config)
    quant.save_compressed(model, path, tokenizer=tokenizer)
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None], None).logits[0]  # (T, V)


def _assert_same_model(gguf_file, ckpt):
    """The GGUF, loaded by our loader (transformers' dequantization, stored as bf16, which also undoes
    llama's q/k row order), computes the checkpoint's logits up to bf16 rounding: a tensor under the
    wrong name or in the wrong row order would be off by its whole size."""
    ours = _logits(runtime.load_model(ckpt, dtype=torch.float32, weights="dense"), IDS)
    back = _logits(runtime.load_model(gguf_file, dtype=torch.float32, weights="dense"), IDS)
    assert float((back - ours).norm() / ours.norm()) < 1e-2


IDS = torch.tensor([[1, 200, 3000, 17, 42, 9000, 5, 77]])  # (1, T)


@pytest.fixture(scope="module")
def llama_dense(tmp_path_factory, smol_tokenizer):
    return _dense_dir(tmp_path_factory.mktemp("llama") / "dense", "llama", smol_tokenizer)


@pytest.fixture(scope="module")
def tiny_exports(llama_dense, smol_tokenizer, tmp_path_factory):
    """(checkpoint, GGUFExport) of each kind of model export of the tiny llama: dense, INT4 (groups of 64,
    the LM head too) -> Q4_1, INT8 -> Q8_0 with float32 float tensors (into a folder export_gguf makes)."""
    d = tmp_path_factory.mktemp("tiny_exports")
    int4 = _compressed_dir(d / "int4", llama_dense, smol_tokenizer,
                           quant.Int4WeightOnly(group_size=64, include_lm_head=True))
    int8 = _compressed_dir(d / "int8", llama_dense, smol_tokenizer, quant.Int8WeightOnly())
    return {"dense": (llama_dense, export_gguf(llama_dense, d / "dense.gguf")),
            "q4_1": (int4, export_gguf(int4, d / "q4_1.gguf")),
            "q8_0": (int8, export_gguf(int8, d / "new" / "q8_0.gguf", dense_type="f32"))}


@pytest.mark.real_model
def test_int4_checkpoint_becomes_q4_1_with_its_own_codes(tiny_exports):
    ckpt, result = tiny_exports["q4_1"]
    assert result.kind == "compressed" and len(result.tensors) == 4 * 7 + 1  # q k v o gate up down, lm_head
    assert all(t.exact and t.gguf_type == "Q4_1" and t.rel_error < 1e-3 for t in result.tensors)
    reader = GGUFReader(result.path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_1
    assert types["output.weight"] == GGMLQuantizationType.Q4_1
    assert types["token_embd.weight"] == GGMLQuantizationType.BF16
    assert str(reader.get_field("specdec.export.source").contents()) == str(ckpt)
    _assert_same_model(result.path, ckpt)
    assert "int4 linears -> Q4_1 (exact codes)" in result.summary()


@pytest.mark.real_model
def test_int8_checkpoint_becomes_q8_0(tiny_exports):
    _, result = tiny_exports["q8_0"]  # (export_gguf checks each replaced tensor against the converter's copy)
    assert all(t.exact and t.gguf_type == "Q8_0" for t in result.tensors)
    assert max(t.rel_error for t in result.tensors) < 1e-3  # the float16 rounding of the row scales
    reader = GGUFReader(result.path)
    assert {t.name: t.tensor_type for t in reader.tensors}["token_embd.weight"] == GGMLQuantizationType.F32


@pytest.mark.real_model
def test_dense_checkpoint_goes_through_the_converter_as_it_is(tiny_exports):
    ckpt, result = tiny_exports["dense"]
    assert result.kind == "dense" and not result.tensors
    assert {t.tensor_type for t in GGUFReader(result.path).tensors} == {GGMLQuantizationType.BF16,
                                                                       GGMLQuantizationType.F32}  # norms: F32
    assert written_by_specdec(result.path)  # marked as specdec's, so --overwrite may replace it
    with pytest.raises(OutputPathError, match="--overwrite"):
        export_gguf(ckpt, result.path)
    assert export_gguf(ckpt, result.path, overwrite=True).path == result.path


def _head(tmp_path, target_dir, **norms):
    from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head
    from specdec.drafters.eagle.io import save_eagle

    target = runtime.load_model(target_dir, dtype=torch.float32, weights="dense")
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=256, **norms))
    head.set_draft_vocab(torch.arange(0, 1024, 4))
    return save_eagle(head, tmp_path / f"head{len(norms)}")


@pytest.mark.real_model
def test_eagle3_head_converts_with_its_target(llama_dense, tmp_path):
    head = _head(tmp_path, llama_dense, norm_before_fc=True)
    result = export_gguf(head, tmp_path / "eagle.gguf", target=llama_dense)
    reader = GGUFReader(result.path)
    assert str(reader.get_field("general.architecture").contents()) == "eagle3"
    assert list(reader.get_field("eagle3.target_layers").contents()) == [2, 2, 1]
    assert bool(reader.get_field("eagle3.norm_before_fc").contents())
    assert str(reader.get_field("specdec.export.source").contents()) == str(head)
    d2t = {t.name: t for t in reader.tensors}["d2t"]
    assert np.array_equal(np.asarray(d2t.data), np.arange(0, 1024, 4))  # absolute target ids in llama.cpp
    with pytest.raises(GGUFExportError, match="--target"):
        export_gguf(head, tmp_path / "x.gguf")
    with pytest.raises(GGUFExportError, match="for EAGLE-3 heads"):
        export_gguf(llama_dense, tmp_path / "x.gguf", target=llama_dense)


@pytest.mark.real_model
def test_eagle3_options_llamacpp_lacks_are_refused(llama_dense, tmp_path):
    head = _head(tmp_path, llama_dense, fc_norm=True, norm_output=True)
    with pytest.raises(GGUFExportError, match="fc_norm, norm_output.*--no-fc-norm --no-norm-output"):
        export_gguf(head, tmp_path / "x.gguf", target=llama_dense)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.real_model
def test_a_head_for_another_target_is_refused(llama_dense, smol_tokenizer, tmp_path):
    head = _head(tmp_path, llama_dense)
    other = _dense_dir(tmp_path / "wide", "llama", smol_tokenizer)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(GGUFExportError, match="hidden size 64"):
        export_gguf(head, tmp_path / "x.gguf", target=other)


def test_what_cannot_be_exported_is_refused_before_any_work(tmp_path, snapshot):
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(GGUFExportError, match="already a GGUF"):
        export_gguf(tmp_path / "model.gguf", tmp_path / "out.gguf")
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "medusa_config.json").write_text("{}")
    with pytest.raises(GGUFExportError, match="Medusa heads, which llama.cpp does not run"):
        export_gguf(medusa, tmp_path / "out.gguf")
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match="not a GGUF file written by specdec"):
        export_gguf(medusa, tmp_path / "notes.txt", overwrite=True)
    with pytest.raises(OutputPathError, match=r"\*\.gguf"):
        export_gguf(medusa, tmp_path / "out.bin")
    with pytest.raises(ValueError, match="dense_type"):
        export_gguf(medusa, tmp_path / "out.gguf", dense_type="q4_0")
    assert snapshot(tmp_path) == before


def test_only_a_gguf_specdec_marked_as_its_export_is_replaced(tmp_path, tiny_llama, gguf_writer, snapshot):
    """Ownership is the metadata mark specdec writes, not the GGUF magic: any other GGUF (one llama.cpp
    wrote, a catalogue file), a marked one cut short, or a file that only starts like a GGUF stays."""
    foreign = tmp_path / "foreign.gguf"
    gguf_writer(tiny_llama, foreign)
    ours = tmp_path / "ours.gguf"
    _rewrite(GGUFReader(foreign), ours, {}, "some/checkpoint")
    assert written_by_specdec(ours) and not written_by_specdec(foreign)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ours.read_bytes()[:200])
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGUF" + bytes(100))
    medusa = tmp_path / "medusa"  # a source refused later: the output path is checked first
    medusa.mkdir()
    (medusa / "medusa_config.json").write_text("{}")
    before = snapshot(tmp_path)
    for path in (foreign, cut, magic):
        assert not written_by_specdec(path)
        with pytest.raises(OutputPathError, match="not a GGUF file written by specdec"):
            export_gguf(medusa, path, overwrite=True)
    with pytest.raises(GGUFExportError, match="Medusa"):  # ours: past the output check
        export_gguf(medusa, ours, overwrite=True)
    assert snapshot(tmp_path) == before


def test_the_catalogue_cache_is_never_an_export_target(tmp_path, tiny_llama, gguf_writer, monkeypatch, snapshot):
    """`--out $SPECDEC_HOME/gguf-files/NAME/model.gguf --overwrite` replaced the sha-checked catalogue file;
    now any path in specdec's caches is refused, a GGUF marked as an export there included."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    target = home / "gguf-files" / SMOLLM2 / "model.gguf"
    target.parent.mkdir(parents=True)
    gguf_writer(tiny_llama, tmp_path / "plain.gguf")
    _rewrite(GGUFReader(tmp_path / "plain.gguf"), target, {}, "x")  # even with specdec's mark
    before = snapshot(home)
    for out in (target, home / "models" / SMOLLM2 / "x.gguf", home / "kernels" / "new.gguf"):
        with pytest.raises(OutputPathError, match=r"inside specdec's cache .* never an output location"):
            export_gguf(tmp_path, out, overwrite=True)
    assert snapshot(home) == before


@pytest.mark.real_model
def test_the_command_line_writes_and_summarises(llama_dense, tmp_path, converter):
    out = tmp_path / "cli.gguf"
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "export", "gguf", str(llama_dense), "--out", str(out)],
                          capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out}" in proc.stdout and out.is_file()


needs_llamacpp = pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp not built here (make llamacpp)")
PROMPT = [1, 504, 3458, 282, 4193, 314]  # token ids of the smollm2 vocabulary


@pytest.fixture(scope="module")
def smol_exports(converter, smol_tokenizer, tmp_path_factory):
    """The real smollm2 as a bf16 GGUF, its RTN INT4 (groups of 32) as Q4_1, and a random EAGLE-3 head for it."""
    d = tmp_path_factory.mktemp("smol_exports")
    dense = runtime.loading.resolve(SMOLLM2)
    int4 = _compressed_dir(d / "int4", dense, smol_tokenizer, quant.Int4WeightOnly(group_size=32))
    head = _head(d, dense, norm_before_fc=True)
    return {"dense": export_gguf(SMOLLM2, d / "dense.gguf").path, "q4_1": export_gguf(int4, d / "q4_1.gguf").path,
            "eagle3": export_gguf(head, d / "eagle3.gguf", target=SMOLLM2).path}


@pytest.mark.real_model
@needs_llamacpp
@pytest.mark.parametrize("kind", ["dense", "q4_1", "q8_0"])
def test_llamacpp_loads_and_runs_every_model_export(tiny_exports, kind):
    with LlamaServer(tiny_exports[kind][1].path, threads=2) as server:
        new, _ = server.complete(PROMPT, 8)
    assert new and all(0 <= t < 49152 for t in new)


@pytest.mark.real_model
@needs_llamacpp
@pytest.mark.parametrize("draft", ["q4_1", "eagle3"])
def test_llamacpp_drafting_with_our_exports_gives_its_plain_output(smol_exports, draft):
    with LlamaServer(smol_exports["dense"], threads=2) as server:
        plain, _ = server.complete(PROMPT, 32)
    with LlamaServer(smol_exports["dense"], smol_exports[draft], draft_max=3, threads=2,
                     eagle3=draft == "eagle3") as server:
        spec, timings = server.complete(PROMPT, 32)
    assert spec == plain and timings["draft_n"] > 0


@pytest.mark.parametrize("text, phrase", [("{not json", "cannot be read as JSON"),
                                          ("[1, 2]", "holds a JSON list, not an object"),
                                          # was llama.cpp's converter failing with its traceback
                                          ('{"model_type": 5}', "model_type is 5, not a model type such as 'llama'"),
                                          ("{}", "model_type is None")])
def test_a_broken_config_in_the_source_names_the_file(tmp_path, text, phrase):
    from runtime.errors import CheckpointError

    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=phrase) as err:
        export_gguf(source, tmp_path / "out.gguf")
    assert str(err.value).startswith(str(source / "config.json")) and not (tmp_path / "out.gguf").exists()
    with pytest.raises(ValueError, match="source is 10000 characters long"):
        export_gguf("x" * 10_000, tmp_path / "out.gguf")


@pytest.mark.parametrize("stage", ["converter", "rewrite"])
def test_a_full_disk_during_an_export_is_one_line_and_leaves_out_as_it_was(tmp_path, tiny_llama, gguf_writer,
                                                                            monkeypatch, snapshot, stage):
    """Out of space in llama.cpp's converter (its output quotes the OSError) or while the export is written:
    one DiskFullError naming --out, and neither the output nor a partial directory is left."""
    import errno

    from quant import gguf_export
    from quant.llamacpp_convert import ConverterError
    from runtime.errors import DiskFullError

    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    out = tmp_path / "out" / "model.gguf"

    def convert(model_dir, out_file, outtype="bf16", target_dir=None):
        if stage == "converter":
            Path(out_file).write_bytes(b"GGUF" + bytes(64))
            raise ConverterError(f"llama.cpp's converter failed on {model_dir} (exit 1):\nTraceback ...\n"
                                 "OSError: [Errno 28] No space left on device")
        gguf_writer(tiny_llama, out_file)
        return Path(out_file)

    def rewrite(reader, path, replaced, text):
        Path(path).write_bytes(b"GGUF" + bytes(64))  # cut short by the full disk
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(gguf_export, "convert", convert)
    monkeypatch.setattr(gguf_export, "_rewrite", rewrite)
    out.parent.mkdir()
    before = snapshot(tmp_path)
    with pytest.raises(DiskFullError, match=r"no space left on the disk while writing .*out.model\.gguf \(.* free "
                                            r"there\); nothing was kept.*--out") as err:
        export_gguf(source, out)
    assert "\n" not in str(err.value)
    assert snapshot(tmp_path) == before
