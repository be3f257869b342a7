"""quant.quantize_ / sparsify_ on tiny models: quality (SQNR of logits), module selection, bad input."""

import dataclasses

import pytest
import torch
from torch import nn

import quant
from runtime.qlinear import Int4Linear, Int8Linear, QuantizedLinear, Sparse24Int4Linear, Sparse24Linear
from runtime.tiny import tiny_model
from tests.quant.conftest import sqnr_db


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None).logits


CASES = [
    (quant.Int8WeightOnly(), 35.0, Int8Linear),
    (quant.Int4WeightOnly(group_size=32), 15.0, Int4Linear),
    (quant.Int4WeightOnly(group_size=32, method="gptq"), 15.0, Int4Linear),
    (quant.Int4WeightOnly(group_size=32, method="gptq", act_order=True), 15.0, Int4Linear),
    (quant.NF4(), 15.0, QuantizedLinear),
    (quant.Int8Mixed(), 30.0, QuantizedLinear),
    (quant.SemiStructured24(method="magnitude"), 3.0, Sparse24Linear),
    (quant.SemiStructured24(method="wanda"), 3.0, Sparse24Linear),
    (quant.SemiStructured24(method="sparsegpt"), 3.0, Sparse24Linear),
    (quant.SemiStructured24(method="sparsegpt", int4_group_size=32), 3.0, Sparse24Int4Linear),
]


@pytest.mark.parametrize("cfg,min_db,cls", CASES, ids=lambda c: repr(c)[:60])
def test_every_config_replaces_all_block_linears_and_keeps_logits_close(cfg, min_db, cls, calib, eval_windows):
    dense = tiny_model("qwen2", seed=0)
    model = tiny_model("qwen2", seed=0)
    verb = quant.sparsify_ if isinstance(cfg, quant.SemiStructured24) else quant.quantize_
    verb(model, cfg, calibration=calib, progress=False)
    for i in range(2):
        for name in ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2"):
            assert isinstance(model.get_submodule(f"layers.{i}.{name}"), cls)
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding
    assert model.compression_recipe == [quant.config_to_dict(cfg)]
    assert sqnr_db(_logits(dense, eval_windows), _logits(model, eval_windows)) >= min_db


def test_calibrated_methods_beat_their_baselines(calib):
    ids = calib[:4]
    dense = _logits(tiny_model("llama", seed=3), ids)

    def db(cfg):
        model = tiny_model("llama", seed=3)
        verb = quant.sparsify_ if isinstance(cfg, quant.SemiStructured24) else quant.quantize_
        verb(model, cfg, calibration=calib, progress=False)
        return sqnr_db(dense, _logits(model, ids))

    assert db(quant.Int4WeightOnly(group_size=32, method="gptq")) > db(quant.Int4WeightOnly(group_size=32))
    assert db(quant.SemiStructured24(method="sparsegpt")) > db(quant.SemiStructured24(method="magnitude"))


@pytest.mark.parametrize("grid", ["mse", "minmax"])
def test_int4_config_grid_reaches_round_to_nearest_and_gptq(grid, calib):
    model = tiny_model("llama", seed=4)
    w = model.layers[0].attn.wqkv.weight.detach().clone()
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32, grid=grid, modules=("layers.0.attn.wqkv",)),
                    progress=False)
    assert torch.equal(model.layers[0].attn.wqkv.dequantize(), quant.grids.int4_rtn(w, 32, grid=grid).dequantize())
    other = "minmax" if grid == "mse" else "mse"
    assert not torch.equal(model.layers[0].attn.wqkv.dequantize(), quant.grids.int4_rtn(w, 32, grid=other).dequantize())
    gptq = {g: tiny_model("llama", seed=4) for g in ("mse", "minmax")}
    for g, m in gptq.items():
        quant.quantize_(m, quant.Int4WeightOnly(group_size=32, method="gptq", grid=g, modules=("layers.0.attn.wqkv",)),
                        calibration=calib, progress=False)
    wqkv = {g: m.layers[0].attn.wqkv.dequantize() for g, m in gptq.items()}
    assert not torch.equal(wqkv["mse"], wqkv["minmax"])


def test_wanda_scores_weight_times_input_norm(calib):
    model = tiny_model("llama", seed=4)
    w = model.layers[0].attn.wqkv.weight.detach().clone()
    with torch.no_grad():
        x = model.layers[0].attn_norm(model.embed(calib))  # (N, T, C): the input of layer 0's wqkv
    norms = x.float().reshape(-1, x.shape[-1]).norm(dim=0)
    quant.sparsify_(model, quant.SemiStructured24(method="wanda", modules=("layers.0.attn.wqkv",)),
                    calibration=calib, progress=False)
    expected = w.masked_fill(quant.grids.mask_24(w.abs() * norms[None]), 0.0)
    assert torch.equal(model.layers[0].attn.wqkv.dequantize(), expected)


def test_module_filter_and_lm_head_option_with_tied_embeddings():
    model = tiny_model("llama", seed=5, tie_word_embeddings=True)
    embed = model.embed.weight.detach().clone()
    quant.quantize_(model, quant.Int8WeightOnly(modules=("layers.1.*", "lm_head"), exclude=("*.w2",),
                                                include_lm_head=True), progress=False)
    assert isinstance(model.layers[1].mlp.w13, Int8Linear) and type(model.layers[1].mlp.w2) is nn.Linear
    assert type(model.layers[0].attn.wqkv) is nn.Linear
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.embed.weight, embed)  # the tied embedding stays dense
    head = tiny_model("llama", seed=5, tie_word_embeddings=True)
    quant.quantize_(head, quant.Int8WeightOnly(), progress=False)
    assert head.lm_head.weight is head.embed.weight  # skipped by default


def test_quantize_then_sparsify_only_touches_dense_linears(calib):
    model = tiny_model("llama", seed=6)
    quant.quantize_(model, quant.Int8WeightOnly(modules=("*.attn.*",)), progress=False)
    quant.sparsify_(model, quant.SemiStructured24(method="magnitude"), progress=False)
    assert isinstance(model.layers[0].attn.wo, Int8Linear) and isinstance(model.layers[0].mlp.w2, Sparse24Linear)
    assert len(model.compression_recipe) == 2


def test_group_size_must_divide_input_width():
    model = tiny_model("llama", seed=0)  # intermediate 96: w2 has 96 inputs
    with pytest.raises(ValueError, match="group_size 64 does not divide the input width 96 of layers.0.mlp.w2"):
        quant.quantize_(model, quant.Int4WeightOnly(group_size=64), progress=False)


def test_nan_or_inf_weights_are_rejected():
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.layers[1].mlp.w13.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="layers.1.mlp.w13.weight holds NaN or inf"):
        quant.quantize_(model, quant.Int8WeightOnly(), progress=False)
    with torch.no_grad():
        model.layers[1].mlp.w13.weight[3, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        quant.sparsify_(model, quant.SemiStructured24(method="magnitude"), progress=False)


def test_calibrated_methods_need_calibration():
    with pytest.raises(ValueError, match="needs calibration"):
        quant.quantize_(tiny_model(), quant.Int4WeightOnly(group_size=32, method="gptq"), progress=False)
    with pytest.raises(ValueError, match="needs calibration"):
        quant.sparsify_(tiny_model(), quant.SemiStructured24(method="wanda"), progress=False)


def test_wrong_verb_and_empty_selection():
    with pytest.raises(ValueError, match="sparsify_"):
        quant.quantize_(tiny_model(), quant.SemiStructured24())
    with pytest.raises(ValueError, match="matches no"):
        quant.quantize_(tiny_model(), quant.Int8WeightOnly(modules=("nothing.*",)))


def test_bitsandbytes_config_that_cannot_run_on_the_device_is_a_clear_error():
    model = tiny_model("llama", seed=0).to("meta")  # bitsandbytes has no LLM.int8 kernel for this device
    with pytest.raises(RuntimeError, match="bitsandbytes cannot run Int8Mixed.*on meta"):
        quant.quantize_(model, quant.Int8Mixed(), progress=False)


def test_quantize_refuses_a_config_without_a_handler_naming_the_ones_it_takes():
    @dataclasses.dataclass(frozen=True)
    class Int3(quant.Int8WeightOnly):  # a subclass is a new format: it needs its own handler
        pass

    model = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="quantize_ takes Int8WeightOnly, .*Int4WeightOnly, got .*Int3"):
        quant.quantize_(model, Int3(), progress=False)
    with pytest.raises(ValueError, match="sparsity config: use quant.sparsify_"):
        quant.quantize_(model, quant.SemiStructured24(), progress=False)
    with pytest.raises(ValueError, match="sparsify_ takes a SemiStructured24"):
        quant.sparsify_(model, quant.Int8WeightOnly(), progress=False)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # refused before any change


@pytest.mark.parametrize("verb, cfg", [(quant.quantize_, quant.Int8WeightOnly()),
                                       (quant.sparsify_, quant.SemiStructured24(method="magnitude"))])
@pytest.mark.parametrize("bad, want", [(None, r"got None \(NoneType\)"), ("model-dir", r"got the path or name"),
                                       ({}, r"got \{\} \(dict\)")])
def test_a_model_argument_that_is_no_module_is_named(verb, cfg, bad, want):
    with pytest.raises(TypeError, match=rf"^model must be a model to compress \(runtime.load_model\), {want}"):
        verb(bad, cfg, progress=False)


GPTQ = quant.Int4WeightOnly(group_size=32, method="gptq")


@pytest.mark.parametrize("cfg", [GPTQ, quant.SemiStructured24(method="wanda")], ids=["gptq", "wanda"])
@pytest.mark.parametrize("bad, error, want", [
    ("code", TypeError, r"^calibration must be a LongTensor \(N, T\) of token ids, got 'code' \(str\)"),
    ([], TypeError, r"^calibration must be a LongTensor \(N, T\) of token ids, got \[\] \(list\)"),
    ([torch.zeros(1, 16, dtype=torch.long)], TypeError, r"got \[tensor.*\(list\)"),
    (torch.rand(1, 16), ValueError, r"with N, T >= 1, got a torch.float32 tensor of shape \(1, 16\)"),
    (torch.zeros(0, 16, dtype=torch.long), ValueError, r"got a torch.int64 tensor of shape \(0, 16\)"),
    (torch.zeros(16, dtype=torch.long), ValueError, r"got a torch.int64 tensor of shape \(16,\)"),
    (torch.full((1, 16), 999), ValueError, r"^calibration holds token id 999, outside the model's vocabulary "
                                           r"\(0..127\); build it with the model's own tokenizer"),
    (torch.full((1, 16), -1), ValueError, r"^calibration holds token id -1, outside"),
], ids=["str", "empty-list", "list", "float", "no-rows", "1d", "oov", "negative"])
def test_bad_calibration_is_named_before_the_model_changes(cfg, bad, error, want):
    model = tiny_model("llama", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    verb = quant.sparsify_ if isinstance(cfg, quant.SemiStructured24) else quant.quantize_
    with pytest.raises(error, match=want):
        verb(model, cfg, calibration=bad, progress=False)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
