"""quant.config: validation on construction and the recipe dict round trip."""

import pytest

import quant
from quant.config import config_from_dict, config_to_dict


@pytest.mark.parametrize("make,match", [
    (lambda: quant.Int4WeightOnly(group_size=48), "group_size"),
    (lambda: quant.Int4WeightOnly(grid="absmax"), "grid"),
    (lambda: quant.Int4WeightOnly(grid="hmse"), "method='rtn'"),
    (lambda: quant.Int4WeightOnly(method="awq"), "method"),
    (lambda: quant.Int4WeightOnly(act_order=True), "act_order"),
    (lambda: quant.Int4WeightOnly(method="gptq", damp=0.0), "damp"),
    (lambda: quant.Int4WeightOnly(zero_point="int"), "zero_point"),
    (lambda: quant.NF4(blocksize=48), "blocksize"),
    (lambda: quant.Int8Mixed(threshold=0), "threshold"),
    (lambda: quant.SemiStructured24(method="random"), "method"),
    (lambda: quant.SemiStructured24(method="wanda", int4_group_size=128), "sparsegpt"),
    (lambda: quant.Int8WeightOnly(modules=()), "empty"),
])
def test_invalid_configs_raise_on_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make, want", [
    (lambda: quant.Int8WeightOnly(include_lm_head="yes"),
     r"^Int8WeightOnly.include_lm_head must be a boolean \(true or false\), got 'yes' \(str\)$"),
    (lambda: quant.Int8WeightOnly(modules="layers.*"),
     r"^Int8WeightOnly.modules must be a list of fnmatch patterns \(strings\), got 'layers.\*' \(str\)$"),
    (lambda: quant.Int8WeightOnly(exclude=("a", 1)), r"^Int8WeightOnly.exclude must be a list of fnmatch patterns"),
    (lambda: quant.Int4WeightOnly(group_size="64"), r"^Int4WeightOnly.group_size must be an integer, got '64' \(str\)"),
    (lambda: quant.Int4WeightOnly(group_size=64.0), r"group_size must be an integer, got 64.0 \(float\)"),
    (lambda: quant.Int4WeightOnly(method="gptq", act_order=1), r"^Int4WeightOnly.act_order must be a boolean"),
    (lambda: quant.Int4WeightOnly(method=None), r"^Int4WeightOnly.method must be a string, got None"),
    (lambda: quant.Int4WeightOnly(damp="0.1"), r"^Int4WeightOnly.damp must be a number, got '0.1' \(str\)"),
    (lambda: quant.Int4WeightOnly(block_size=True), r"^Int4WeightOnly.block_size must be an integer, got True"),
    (lambda: quant.NF4(double_quant="no"), r"^NF4.double_quant must be a boolean \(true or false\), got 'no'"),
    (lambda: quant.NF4(blocksize="64"), r"^NF4.blocksize must be an integer, got '64' \(str\)"),
    (lambda: quant.Int8Mixed(threshold="6"), r"^Int8Mixed.threshold must be a number, got '6' \(str\)"),
    (lambda: quant.SemiStructured24(int4_group_size=32.0), r"^SemiStructured24.int4_group_size must be an integer"),
])
def test_every_config_field_is_type_checked_naming_the_value_and_its_type(make, want):
    with pytest.raises(TypeError, match=want):
        make()


def test_a_list_of_patterns_becomes_a_tuple_and_an_integer_a_float_for_a_float_field():
    cfg = quant.Int8Mixed(modules=["layers.*"], exclude=[], threshold=4)
    assert cfg.modules == ("layers.*",) and cfg.exclude == () and type(cfg.threshold) is float


def test_int4_grid_default_is_picked_per_method():
    assert quant.Int4WeightOnly().grid == "mse"
    assert quant.Int4WeightOnly(method="gptq").grid == "minmax"
    assert quant.Int4WeightOnly(method="gptq", act_order=True).grid == "mse"
    assert quant.Int4WeightOnly(method="gptq", grid="mse").grid == "mse"
    assert quant.Int4WeightOnly(method="gptq", act_order=True, grid="hmse").grid == "hmse"


def test_configs_are_frozen():
    cfg = quant.Int4WeightOnly()
    with pytest.raises(AttributeError):
        cfg.group_size = 64


@pytest.mark.parametrize("cfg", [quant.Int8WeightOnly(exclude=("layers.0.*",)),
                                 quant.Int4WeightOnly(group_size=64, method="gptq", act_order=True,
                                                      include_lm_head=True, zero_point="integer"),
                                 quant.NF4(double_quant=False), quant.Int8Mixed(threshold=4.0),
                                 quant.SemiStructured24(method="sparsegpt", int4_group_size=32)])
def test_dict_round_trip(cfg):
    data = config_to_dict(cfg)
    assert data["type"] == type(cfg).__name__
    assert config_from_dict(data) == cfg


def test_bad_recipe_entries():
    with pytest.raises(ValueError, match="unknown config type"):
        config_from_dict({"type": "Int2"})
    with pytest.raises(ValueError, match="NF4: unknown key 'bits'; allowed: blocksize, double_quant"):
        config_from_dict({"type": "NF4", "bits": 3})
    with pytest.raises(ValueError, match="'type' key"):
        config_from_dict(["NF4"])
