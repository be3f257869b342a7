"""save_compressed -> runtime.load_model: bit-exact round trips; export_dense -> transformers; sizes."""

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quant
import runtime
from quant.checkpoint import FORMATS, compressed_modules
from runtime.output_paths import OutputPathError
from runtime.tiny import tiny_model

CONFIGS = [quant.Int8WeightOnly(), quant.Int4WeightOnly(group_size=32, method="gptq"), quant.NF4(), quant.Int8Mixed(),
           quant.SemiStructured24(method="sparsegpt"), quant.SemiStructured24(method="sparsegpt", int4_group_size=32)]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None).logits


def _compress(model, cfg, calib):
    verb = quant.sparsify_ if isinstance(cfg, quant.SemiStructured24) else quant.quantize_
    return verb(model, cfg, calibration=calib, progress=False)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: type(c).__name__ + getattr(c, "method", ""))
def test_round_trip_is_bit_exact(cfg, calib, eval_windows, tokenizer, tmp_path):
    model = _compress(tiny_model("qwen2", seed=1), cfg, calib)
    out = quant.save_compressed(model, tmp_path / "ckpt", tokenizer=tokenizer)
    meta = json.loads((out / "compression.json").read_text())
    assert meta["format_version"] == 1 and meta["recipe"] == [quant.config_to_dict(cfg)]
    assert set(meta["modules"]) == set(compressed_modules(model))
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    assert back.compression_recipe == meta["recipe"]
    for name, mod in compressed_modules(model).items():
        other = back.get_submodule(name)
        a, b = mod.to_tensors(), other.to_tensors()
        assert type(other) is type(mod) and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert torch.equal(_logits(model, eval_windows), _logits(back, eval_windows))
    assert runtime.load_tokenizer(out)("def f").input_ids == tokenizer("def f").input_ids


def test_packed_storage_on_disk_and_sizes(calib, tmp_path):
    dense = tiny_model("llama", seed=2)
    model = _compress(tiny_model("llama", seed=2), quant.Int4WeightOnly(group_size=32), calib)
    out = quant.save_compressed(model, tmp_path / "int4")
    stored = load_file(out / "model.safetensors")
    w = stored["layers.0.mlp.w13.qweight"]
    assert w.dtype == torch.uint8 and w.shape == (192, 32)  # two codes per byte
    sparse = quant.save_compressed(_compress(tiny_model("llama", seed=2), quant.SemiStructured24(method="magnitude"),
                                             calib), tmp_path / "s24")
    stored = load_file(sparse / "model.safetensors")
    assert stored["layers.0.mlp.w2.values"].shape == (64, 48) and stored["layers.0.mlp.w2.indices"].shape == (64, 12)
    linear_bytes = sum(m.weight.numel() * 4 for n, m in dense.named_modules() if n.startswith("layers.")
                       and isinstance(m, torch.nn.Linear))
    qbytes = sum(m.nbytes() for m in compressed_modules(model).values())
    assert qbytes < 0.2 * linear_bytes
    assert quant.model_nbytes(model) < quant.model_nbytes(dense)
    assert quant.dir_nbytes(out) < quant.model_nbytes(dense)


def test_tied_lm_head_quantized_round_trip_and_dense_export(calib, eval_windows, tmp_path):
    model = _compress(tiny_model("llama", seed=3, tie_word_embeddings=True),
                      quant.Int8WeightOnly(include_lm_head=True), calib)
    back = runtime.load_model(quant.save_compressed(model, tmp_path / "c"), dtype=torch.float32, weights="dense")
    assert back.lm_head.__class__.__name__ == "Int8Linear" and back.embed.weight.shape == (128, 64)
    assert torch.equal(_logits(model, eval_windows), _logits(back, eval_windows))
    hf = AutoModelForCausalLM.from_pretrained(quant.export_dense(model, tmp_path / "d")).eval()
    assert not hf.config.tie_word_embeddings
    with torch.no_grad():
        ref = hf(eval_windows).logits
    got = _logits(model, eval_windows)
    assert ((ref - got).abs().max() / got.abs().max()).item() < 1e-4


@pytest.mark.parametrize("cfg", [quant.Int4WeightOnly(group_size=32), quant.SemiStructured24(method="magnitude")])
def test_export_dense_loads_in_transformers_with_equal_logits(cfg, calib, eval_windows, tokenizer, tmp_path):
    model = _compress(tiny_model("qwen2", seed=4), cfg, calib)
    out = quant.export_dense(model, tmp_path / "dense", tokenizer=tokenizer)
    assert not (out / "compression.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf(eval_windows).logits
    got = _logits(model, eval_windows)
    assert ((ref - got).abs().max() / got.abs().max()).item() < 1e-4
    reloaded = runtime.load_model(out, dtype=torch.float32, weights="dense")
    assert torch.allclose(_logits(reloaded, eval_windows), got, atol=1e-4)


def test_overwrite_is_explicit_atomic_and_leaves_no_temporaries(calib, tokenizer, tmp_path):
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    quant.save_compressed(model, tmp_path / "c", tokenizer=tokenizer)
    files = json.loads((tmp_path / "c" / "compression.json").read_text())["files"]
    assert files == sorted(p.name for p in (tmp_path / "c").iterdir())
    with pytest.raises(OutputPathError, match=r"c already holds a compressed checkpoint.*--overwrite"):
        quant.save_compressed(model, tmp_path / "c")
    quant.save_compressed(model, tmp_path / "c", overwrite=True)  # without the tokenizer this time
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["compression.json", "config.json",
                                                                  "model.safetensors"]
    runtime.load_model(tmp_path / "c")


def test_save_and_export_never_touch_a_file_or_a_directory_specdec_did_not_write(calib, tmp_path, snapshot):
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    (tmp_path / "file").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    for save in (quant.save_compressed, quant.export_dense):
        for overwrite in (False, True):
            with pytest.raises(OutputPathError, match="file exists and is not a directory"):
                save(model, tmp_path / "file", overwrite=overwrite)
            with pytest.raises(OutputPathError, match="home is a non-empty directory that specdec did not write"):
                save(model, tmp_path / "home", overwrite=overwrite)
    # a user's file inside a previous checkpoint: --overwrite refuses rather than delete it
    quant.save_compressed(model, tmp_path / "c")
    (tmp_path / "c" / "README.md").write_text("my notes")
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match="not part of the compressed checkpoint.*README.md"):
        quant.save_compressed(model, tmp_path / "c", overwrite=True)
    # --overwrite replaces a checkpoint of the same kind only
    with pytest.raises(OutputPathError, match="holds a compressed checkpoint.*not a dense export"):
        quant.export_dense(model, tmp_path / "c", overwrite=True)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "file", "home"]


def test_export_dense_is_marked_and_overwritten_only_on_request(calib, tmp_path):
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    out = quant.export_dense(model, tmp_path / "d")
    meta = json.loads((out / "specdec_export.json").read_text())
    assert meta["format"] == "specdec-dense-export" and meta["recipe"][0]["type"] == "Int8WeightOnly"
    with pytest.raises(OutputPathError, match="already holds a dense export"):
        quant.export_dense(model, out)
    assert quant.export_dense(model, out, overwrite=True) == out


def test_newer_format_version_is_a_clear_error(calib, tmp_path):
    out = quant.save_compressed(_compress(tiny_model("llama", seed=6), quant.Int8WeightOnly(), calib), tmp_path / "c")
    meta = json.loads((out / "compression.json").read_text())
    meta["format_version"] = 99
    (out / "compression.json").write_text(json.dumps(meta))
    with pytest.raises(runtime.CheckpointError, match="format version 99, newer than the version 1"):
        runtime.load_model(out)


def test_saving_a_dense_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no compressed linears"):
        quant.save_compressed(tiny_model(), tmp_path / "c")


@pytest.mark.parametrize("where, reason", [("/dev/null/x", "/dev/null is not a directory"),
                                           ("/proc/x", "/proc is not a writable directory")])
@pytest.mark.parametrize("format", FORMATS)
def test_a_path_that_cannot_be_created_fails_at_the_check(calib, where, reason, format):
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    with pytest.raises(OutputPathError, match=rf"^{where} cannot be created for the .*: {reason}"):
        quant.save_compressed(model, where, format=format)
    with pytest.raises(OutputPathError, match=rf"^{where} cannot be created for the dense export: {reason}"):
        quant.export_dense(model, where)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_checkpoint_is_readable_by_others_as_the_umask_allows(calib, tokenizer, tmp_path, mask):
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    old = os.umask(mask)
    try:
        outs = [quant.save_compressed(model, tmp_path / "c", tokenizer=tokenizer),
                quant.save_compressed(model, tmp_path / "ct", format="compressed-tensors"),
                quant.export_dense(model, tmp_path / "d")]
    finally:
        os.umask(old)
    for out in outs:
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask, out
        assert {stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")} == {0o666 & ~mask}, out


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("path", ["", " "])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(calib, tmp_path, monkeypatch, format, path):
    monkeypatch.chdir(tmp_path)
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    with pytest.raises(OutputPathError, match=r"^an empty path is not an output location for the .*; give a "
                                              r"directory path"):
        quant.save_compressed(model, path, format=format)
    with pytest.raises(OutputPathError, match=r"^an empty path is not an output location for the dense export"):
        quant.export_dense(model, path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("save", [quant.save_compressed, quant.export_dense], ids=["save_compressed", "export_dense"])
@pytest.mark.parametrize("args, want", [
    ({"model": None}, r"^model must be a model compressed by quant.quantize_ / quant.sparsify_, got None"),
    ({"out_dir": 5}, r"^out_dir must be a directory path \(a str or a Path\), got 5 \(int\)"),
    ({"tokenizer": "tok"}, r"^tokenizer must be a tokenizer \(runtime.load_tokenizer\) or None with save_pretrained"
                           r"\(\), got 'tok' \(str\)"),
    ({"overwrite": "yes"}, r"^overwrite must be True or False, got 'yes' \(str\)"),
], ids=["model", "out_dir", "tokenizer", "overwrite"])
def test_a_bad_argument_is_named_before_anything_is_written(calib, tmp_path, save, args, want):
    model = _compress(tiny_model("llama", seed=5), quant.Int8WeightOnly(), calib)
    call = {"model": model, "out_dir": tmp_path / "c", **args}
    with pytest.raises(TypeError, match=want):
        save(call.pop("model"), call.pop("out_dir"), **call)
    assert list(tmp_path.iterdir()) == []
