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
    (lambda: quant.Int8WeightOnly(modules="layers.*"), "tuple of fnmatch"),
    (lambda: quant.Int8WeightOnly(modules=()), "empty"),
])
def test_invalid_configs_raise_on_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


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
