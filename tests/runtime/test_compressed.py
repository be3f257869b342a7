"""runtime.compressed: loading a hand-written compressed checkpoint, and its error cases."""

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import runtime
from runtime.compressed import FORMAT_VERSION
from runtime.qlinear import Int8Linear
from runtime.tiny import tiny_model


def _write(tmp_path, version=FORMAT_VERSION, drop=None):
    """A checkpoint whose layers.0.mlp.w2 is INT8 (codes and scales written by hand)."""
    model = tiny_model("llama", seed=0)
    w = model.layers[0].mlp.w2.weight.detach()
    scales = (w.abs().amax(1) / 127).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("layers.0.mlp.w2.")}
    tensors.update({"layers.0.mlp.w2.qweight": q, "layers.0.mlp.w2.scales": scales})
    if drop:
        tensors.pop(drop)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model.config.hf_config.to_json_file(str(tmp_path / "config.json"))
    meta = {"format_version": version, "recipe": [{"type": "Int8WeightOnly"}],
            "modules": {"layers.0.mlp.w2": Int8Linear(q, scales).meta()}}
    (tmp_path / "compression.json").write_text(json.dumps(meta))
    return model, q, scales


def test_loads_packed_tensors_as_stored(tmp_path):
    dense, q, scales = _write(tmp_path)
    model = runtime.load_model(tmp_path, dtype=torch.float32, weights="dense")
    w2 = model.layers[0].mlp.w2
    assert isinstance(w2, Int8Linear) and torch.equal(w2.qweight, q) and torch.equal(w2.scales, scales)
    assert torch.equal(model.layers[1].mlp.w2.weight, dense.layers[1].mlp.w2.weight)
    assert model.compression_recipe == [{"type": "Int8WeightOnly"}]


def test_a_loaded_compressed_model_holds_only_its_packed_weights(tmp_path):
    _write(tmp_path)
    w2 = runtime.load_model(tmp_path, dtype=torch.float32, weights="dense").layers[0].mlp.w2
    assert {name for name, _ in w2.named_buffers()} == set(w2.storage())
    x = torch.randn(1, 300, w2.in_features)  # a long prompt's rows: dequantized tile by tile, not kept
    assert torch.allclose(w2(x), torch.nn.functional.linear(x, w2.dequantize(torch.float32)), rtol=1e-5, atol=1e-5)
    assert {name for name, _ in w2.named_buffers()} == set(w2.storage())


def test_newer_version_missing_tensors_and_bad_meta_are_clear_errors(tmp_path):
    _write(tmp_path, version=FORMAT_VERSION + 1)
    with pytest.raises(runtime.CheckpointError, match="newer than the version"):
        runtime.load_model(tmp_path)
    _write(tmp_path, version="1")
    with pytest.raises(runtime.CheckpointError, match="no valid format_version"):
        runtime.load_model(tmp_path)
    _write(tmp_path, drop="layers.1.mlp.w13.weight")
    with pytest.raises(runtime.CheckpointError, match="lacks 1 tensors"):
        runtime.load_model(tmp_path)
    _write(tmp_path, drop="layers.0.mlp.w2.scales")
    with pytest.raises(runtime.CheckpointError, match="lists 'layers.0.mlp.w2' in format 'int8', which needs "
                                                      "the tensor layers.0.mlp.w2.scales, but .* holds "
                                                      "layers.0.mlp.w2.qweight;"):
        runtime.load_model(tmp_path)


def _edit_entry(tmp_path, name=None, **changes):
    """Rename the INT8 entry of compression.json to `name` and / or change its fields."""
    path = tmp_path / "compression.json"
    meta = json.loads(path.read_text())
    entry = {**meta["modules"].pop("layers.0.mlp.w2"), **changes}
    meta["modules"][name or "layers.0.mlp.w2"] = entry
    path.write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("name, changes, first", [
    ("layers.0.mlp", {}, "META lists compressed module 'layers.0.mlp', which is of type MLP, not a linear layer; "
                         "compressed modules are the model's linear layers (layers.0.attn.wqkv, layers.0.attn.wo, "
                         "layers.0.mlp.w13, layers.0.mlp.w2, lm_head, ...)"),
    ("layers.7.mlp.w2", {}, "META lists compressed module 'layers.7.mlp.w2', which is not a module of this model"),
    ("layers.1.mlp.w2", {}, "WEIGHTS holds layers.0.mlp.w2.qweight, layers.0.mlp.w2.scales, which are not tensors of "
                            "the model, and compression.json lists no compressed module layers.0.mlp.w2"),
    (None, {"format": "int4"}, "META lists 'layers.0.mlp.w2' in format 'int4', which needs the tensor "
                               "layers.0.mlp.w2.zeros, but WEIGHTS holds layers.0.mlp.w2.qweight, "
                               "layers.0.mlp.w2.scales; compression.json does not describe these tensors"),
    (None, {"in_features": 7}, "META says layers.0.mlp.w2 is 64 x 7 (out x in), but its tensors hold 64 x 96"),
    (None, {"format": "int8_mixed"}, "META: compressed module 'layers.0.mlp.w2' ('int8_mixed') lacks 'threshold' "
                                     "in its entry; the file is corrupt"),
    (None, {"format": "nf4"}, "META: compressed module 'layers.0.mlp.w2' in format 'nf4' is malformed (ValueError: "
                              "nf4 weights of a 64 x 96 linear are 3072 uint8 bytes (two codes each), got torch.int8 "
                              "(64, 96))")],
    ids=["not-a-linear", "not-in-the-model", "unlisted-packed-tensors", "wrong-format", "wrong-sizes", "missing-field",
         "nf4-over-int8"])
def test_compression_json_that_does_not_describe_the_tensors_is_named(tmp_path, name, changes, first):
    """A compression.json naming the wrong module, kind or sizes fails as a CheckpointError naming the
    file, the module and what was expected (it used to end in an empty RuntimeError or load silently)."""
    _write(tmp_path)
    meta = _edit_entry(tmp_path, name, **changes)
    with pytest.raises(runtime.CheckpointError) as err:
        runtime.load_model(tmp_path, dtype=torch.float32, weights="dense")
    text = str(err.value)
    assert len(text.splitlines()) == 1
    expected = first.replace("META", str(meta)).replace("WEIGHTS", str(tmp_path / "model.safetensors"))
    assert text.startswith(expected), text


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_a_loaded_compressed_model_does_not_keep_its_file_mapped(tmp_path):
    """Tensors left as views of the safetensors memory map would keep the whole file resident
    beside the modules' own copies (an INT4 module rebuilds its codes in the kernel's layout)."""
    _write(tmp_path)
    model = runtime.load_model(tmp_path, dtype=torch.float32, weights="dense")
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(tmp_path / "model.safetensors") not in maps
    assert model.layers[0].mlp.w2.qweight.is_contiguous()
