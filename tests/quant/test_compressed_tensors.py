"""compressed-tensors exports and loading, against the real `compressed-tensors` and `transformers`.

Our export -> transformers (which decompresses with compressed-tensors) and -> runtime.load_model;
checkpoints written with the library's own compressor -> runtime.load_model; bad files.
"""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant
import runtime
from quant.checkpoint import compressed_modules
from quant.compressed_tensors import align_zero_points
from runtime.compressed_tensors import pack_int32, unpack_int32
from runtime.errors import CheckpointError
from runtime.qlinear import Int4Linear, Int8Linear
from runtime.tiny import tiny_pair

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from transformers import AutoModelForCausalLM, CompressedTensorsConfig  # noqa: E402

BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # compressed-tensors dequantizes in the scale dtype (bf16)


def _ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))  # (B, T)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None).logits  # (B, T, V)


def _hf_logits(path, ids, dequantize=False):
    """transformers' logits of a compressed-tensors checkpoint, float32 compute. dequantize=True takes
    transformers' load-time decompression: its default route builds the compressed modules on the meta
    device, where compressed-tensors 0.20 leaves asymmetric zero points unpacked, so their shapes
    disagree with every packed checkpoint (the library's own included)."""
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_matches_the_library(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(-(1 << bits - 1), 1 << bits - 1, (6, 40), generator=g, dtype=torch.int8)  # (R, C)
    ours = pack_int32(codes, bits)
    assert torch.equal(ours, pack_to_int32(codes, bits))
    assert torch.equal(unpack_int32(ours, bits, 40), codes)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size([6, 40])), codes)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_int8_export_loads_in_transformers_and_round_trips(arch, tokenizer, tmp_path):
    model, _ = tiny_pair(arch, seed=3)
    quant.quantize_(model, quant.Int8WeightOnly(), progress=False)
    out = quant.save_compressed(model, tmp_path / "w8a16", tokenizer=tokenizer, format="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["symmetric"]) == (8, "channel", True)
    stored = load_file(out / "model.safetensors")
    packed = stored["model.layers.0.self_attn.k_proj.weight_packed"]
    assert packed.dtype == torch.int32 and packed.shape == (32, 16)  # 4 codes per int32
    assert tuple(stored["model.layers.0.self_attn.k_proj.weight_shape"].tolist()) == (32, 64)
    ids = _ids()
    ours = _logits(model, ids)
    torch.testing.assert_close(_hf_logits(out, ids), ours, **BF16_TOL)
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    for name, mod in compressed_modules(model).items():
        other = back.get_submodule(name)
        assert isinstance(other, Int8Linear) and torch.equal(other.qweight, mod.qweight)
        assert torch.equal(other.scales, mod.scales)
    assert torch.equal(_logits(back, ids), ours)


@pytest.mark.parametrize("cfg", [quant.Int4WeightOnly(group_size=32),
                                 quant.Int4WeightOnly(group_size=32, method="gptq", act_order=True)],
                         ids=["rtn", "gptq-act-order"])
def test_int4_export_is_the_library_layout_and_exact_after_alignment(cfg, calib, tmp_path):
    model, _ = tiny_pair("qwen2", seed=4)
    quant.quantize_(model, cfg, calibration=calib, progress=False)
    before = _logits(model, _ids())
    report = align_zero_points(model)
    assert report["moved"] > 0 and 10 < report["sqnr_db"] < 60
    assert align_zero_points(model)["moved"] == 0  # idempotent: every group is on the lattice now
    out = quant.save_compressed(model, tmp_path / "w4a16", format="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"]) == (4, "group", 32)
    assert weights["symmetric"] is False and weights["actorder"] == ("weight" if cfg.act_order else None)
    # the packed tensors are what the library's compressor writes for the same weights and grid
    stored = load_file(out / "model.safetensors")
    wo = model.layers[1].attn.wo
    zp = torch.round(-wo.zeros.float() / wo.scales.float()).to(torch.int8)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, symmetric=False, strategy="group", group_size=32))
    lib = PackedQuantizationCompressor.compress({"weight": wo.dequantize(torch.float32),
                                                 "weight_scale": wo.scales.float(), "weight_zero_point": zp}, scheme)
    for key in ("weight_packed", "weight_zero_point", "weight_shape"):
        assert torch.equal(stored[f"model.layers.1.self_attn.o_proj.{key}"], lib[key]), key
    ids = _ids()
    ours = _logits(model, ids)
    assert not torch.equal(ours, before)  # alignment moved the weights (the export must follow them)
    torch.testing.assert_close(_hf_logits(out, ids, dequantize=True), ours, **BF16_TOL)
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    for name, mod in compressed_modules(model).items():
        other = back.get_submodule(name)
        assert isinstance(other, Int4Linear) and torch.equal(other.qweight, mod.qweight), name
        assert torch.equal(other.dequantize(), mod.dequantize()), name
    assert torch.equal(_logits(back, ids), ours)


def test_unaligned_int4_export_warns_and_transformers_agrees_with_our_loader(calib, tmp_path, caplog):
    model, _ = tiny_pair("llama", seed=5)
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32), progress=False)
    with caplog.at_level(logging.WARNING, logger="quant.compressed_tensors"):
        out = quant.save_compressed(model, tmp_path / "w4", format="compressed-tensors")
    assert "align_zero_points" in caplog.text
    ids = _ids()
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    torch.testing.assert_close(_hf_logits(out, ids, dequantize=True), _logits(back, ids), **BF16_TOL)
    aligned = align_zero_points(model)
    assert aligned["moved"] > 0
    assert torch.equal(_logits(back, ids), _logits(model, ids))  # the export held the aligned weights


@pytest.mark.parametrize("cfg", [quant.Int4WeightOnly(group_size=32, zero_point="integer"),
                                 quant.Int4WeightOnly(group_size=32, method="gptq", zero_point="integer")],
                         ids=["rtn", "gptq"])
def test_integer_zero_point_int4_export_is_exact_without_alignment(cfg, calib, tmp_path, caplog):
    model, _ = tiny_pair("qwen2", seed=4)
    quant.quantize_(model, cfg, calibration=calib, progress=False)
    ids = _ids()
    ours = _logits(model, ids)
    report = align_zero_points(model)
    assert report["moved"] == 0 and report["groups"] > 0
    assert torch.equal(_logits(model, ids), ours)  # alignment changed nothing
    with caplog.at_level(logging.WARNING, logger="quant.compressed_tensors"):
        out = quant.save_compressed(model, tmp_path / "w4a16", format="compressed-tensors")
    assert "align_zero_points" not in caplog.text
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, False)
    torch.testing.assert_close(_hf_logits(out, ids, dequantize=True), ours, **BF16_TOL)
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    for name, mod in compressed_modules(model).items():
        other = back.get_submodule(name)
        assert isinstance(other, Int4Linear) and other.zero_point == mod.zero_point == "integer", name
        assert torch.equal(other.qweight, mod.qweight) and torch.equal(other.dequantize(), mod.dequantize()), name
    assert torch.equal(_logits(back, ids), ours)


def test_integer_zero_points_survive_the_specdec_format(tmp_path):
    model, _ = tiny_pair("llama", seed=6)
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32, zero_point="integer"), progress=False)
    out = quant.save_compressed(model, tmp_path / "specdec")
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    for name, mod in compressed_modules(model).items():
        other = back.get_submodule(name)
        assert other.zero_point == "integer" and torch.equal(other.zeros, mod.zeros), name
    assert align_zero_points(back)["moved"] == 0


def _foreign_checkpoint(tmp_path, g_idx: bool = False):
    """A W4A16 (MLP, symmetric, group 32) + W8A16 (attention, per channel) checkpoint written with the
    library's own compressor and config classes, as another tool would write it."""
    _, hf = tiny_pair("qwen2", seed=6)
    schemes = {
        "group_0": QuantizationScheme(targets=["re:.*mlp.*"], format="pack-quantized", weights=QuantizationArgs(
            num_bits=4, symmetric=True, strategy="group", group_size=32)),
        "group_1": QuantizationScheme(targets=["re:.*self_attn.*"], format="pack-quantized", weights=QuantizationArgs(
            num_bits=8, symmetric=True, strategy="channel"))}
    state = {}
    for name, tensor in hf.state_dict().items():
        module = name.rsplit(".", 1)[0]
        part = next((p for p in ("mlp", "self_attn") if f".{p}." in name), None)
        scheme = schemes["group_0" if part == "mlp" else "group_1"] if part and name.endswith(".weight") else None
        if scheme is None:
            state[name] = tensor.to(torch.bfloat16)
            continue
        w = tensor.float()
        if scheme.weights.strategy == "group":
            scale = w.view(w.shape[0], -1, 32).abs().amax(-1) / 7  # (N, K/32)
        else:
            scale = w.abs().amax(-1, keepdim=True) / 127  # (N, 1)
        parts = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme)
        state.update({f"{module}.{k}": v for k, v in parts.items()})
    if g_idx:  # act-order "group" layout: input k belongs to group g_idx[k] (older llm-compressor exports)
        perm = torch.randperm(96, generator=torch.Generator().manual_seed(0))
        state["model.layers.0.mlp.down_proj.weight_g_idx"] = (perm // 32).to(torch.int32)
    qc = QuantizationConfig(config_groups=schemes, format="pack-quantized", quantization_status="compressed",
                            ignore=["lm_head"]).model_dump(mode="json")
    hf.config.quantization_config = qc
    out = tmp_path / "foreign"
    out.mkdir()
    hf.config.to_json_file(str(out / "config.json"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out, state


def test_foreign_checkpoint_loads_packed_and_matches_transformers(tmp_path):
    out, _ = _foreign_checkpoint(tmp_path)
    model = runtime.load_model(out, dtype=torch.float32)
    assert isinstance(model.layers[0].mlp.w13, Int4Linear) and isinstance(model.layers[0].attn.wqkv, Int8Linear)
    assert isinstance(model.lm_head, torch.nn.Linear)
    ids = _ids()
    torch.testing.assert_close(_logits(model, ids), _hf_logits(out, ids), **BF16_TOL)


def test_g_idx_checkpoint_loads_dequantized_with_a_note(tmp_path, caplog):
    out, state = _foreign_checkpoint(tmp_path, g_idx=True)
    with caplog.at_level(logging.INFO, logger="runtime.compressed_tensors"):
        model = runtime.load_model(out, dtype=torch.float32)
    assert "act-order g_idx" in caplog.text and "mlp.down_proj" in caplog.text
    w2 = model.layers[0].mlp.w2
    assert type(w2) is torch.nn.Linear and isinstance(model.layers[1].mlp.w2, Int4Linear)
    p = "model.layers.0.mlp.down_proj."
    codes = unpack_int32(state[p + "weight_packed"], 4, 96).float()  # (64, 96)
    g = state[p + "weight_g_idx"].long()
    assert torch.equal(w2.weight, codes * state[p + "weight_scale"].float()[:, g])


def test_truncated_file_and_unknown_schemes_fail_clearly(tmp_path):
    out, _ = _foreign_checkpoint(tmp_path)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        runtime.load_model(out)
    weights.write_bytes(data)
    cfg = json.loads((out / "config.json").read_text())
    for change, named in ((lambda g: g.update(input_activations={"num_bits": 8, "type": "int"}), "input_activations"),
                          (lambda g: g.update(format="float-quantized"), "float-quantized"),
                          (lambda g: g["weights"].update(type="float"), "type 'float'"),
                          (lambda g: g["weights"].update(num_bits=3), "num_bits 3")):
        bad = json.loads(json.dumps(cfg))
        change(bad["quantization_config"]["config_groups"]["group_0"])
        (out / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="specdec cannot load") as err:
            runtime.load_model(out)
        assert named in str(err.value)


def test_inconsistent_packed_shapes_fail(tmp_path):
    out, state = _foreign_checkpoint(tmp_path)
    state["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([96, 32])
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mlp.up_proj.weight_packed .* does not fit weight_shape"):
        runtime.load_model(out)


DOWN = "model.layers.0.mlp.down_proj"  # (64, 96): the first packed linear, 4-bit groups of 32 in the checkpoint


@pytest.mark.parametrize("change, first", [
    ({"num_bits": 2}, f"{DOWN}.weight_packed (64, 12) does not fit weight_shape (64, 96) at num_bits=2, the width "
                      "CONFIG gives it (6 int32 words per row; 12 words fit num_bits=4)"),
    ({"num_bits": 8}, f"{DOWN}.weight_packed (64, 12) does not fit weight_shape (64, 96) at num_bits=8"),
    ({"group_size": 16}, f"CONFIG says group_size=16 for {DOWN} (6 groups of its 96 inputs), but its weight_scale "
                         "is (64, 3) (groups of 32 inputs)"),
    ({"strategy": "channel", "group_size": None}, f"CONFIG says strategy='channel' (one scale per row) for {DOWN}, "
                                                  "but its weight_scale is (64, 3)"),
    ({"symmetric": False}, f"CONFIG says symmetric=false for {DOWN}, but DIR has no {DOWN}.weight_zero_point")],
    ids=["num_bits-2", "num_bits-8", "group_size", "strategy", "symmetric"])
def test_config_that_disagrees_with_the_packed_tensors_is_refused(tmp_path, change, first):
    """A quantization_config whose num_bits, group_size, strategy or symmetric do not describe the
    packed tensors fails naming config.json, the linear and both values (it used to decode garbage)."""
    out, _ = _foreign_checkpoint(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        runtime.load_model(out)
    expected = first.replace("CONFIG", str(out / "config.json")).replace("DIR", str(out))
    assert str(err.value).splitlines()[0].startswith((f"{out}: {expected}", expected)), str(err.value)


def test_symmetric_config_over_asymmetric_zero_points_is_refused(tmp_path):
    model, _ = tiny_pair("llama", seed=4)
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32, zero_point="integer"), progress=False)
    out = quant.save_compressed(model, tmp_path / "w4a16", format="compressed-tensors")
    runtime.load_model(out, dtype=torch.float32)  # as written: loads
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        runtime.load_model(out, dtype=torch.float32)
    assert str(err.value).startswith(f"{out / 'config.json'} says symmetric=true for model.layers.0.mlp.down_proj, "
                                     f"but {out} stores non-zero model.layers.0.mlp.down_proj.weight_zero_point")


def test_sparse_model_exports_dense_with_a_log_line(calib, tmp_path, caplog):
    model, _ = tiny_pair("llama", seed=8)
    quant.sparsify_(model, quant.SemiStructured24(method="magnitude", modules=("layers.*.mlp.*",)), progress=False)
    quant.quantize_(model, quant.Int8WeightOnly(modules=("layers.*.attn.*",)), progress=False)
    with caplog.at_level(logging.WARNING, logger="quant.compressed_tensors"):
        out = quant.save_compressed(model, tmp_path / "s24", format="compressed-tensors")
    assert "dropped the 2:4 sparse format" in caplog.text
    ids = _ids()
    back = runtime.load_model(out, dtype=torch.float32, weights="dense")
    assert torch.equal(_logits(back, ids), _logits(model, ids))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in qc["ignore"] and "lm_head" in qc["ignore"]


def test_bad_format_argument(tmp_path):
    model, _ = tiny_pair("llama", seed=9)
    with pytest.raises(ValueError, match="format must be one of"):
        quant.save_compressed(model, tmp_path / "x", format="gguf")
