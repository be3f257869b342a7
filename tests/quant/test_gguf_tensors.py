"""GGUF blocks of quantized linears, checked with gguf-py's own dequantizer: INT4 -> Q4_1 and INT8 -> Q8_0
hold the same codes, other layouts are re-quantized with a measured error."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from quant.gguf_tensors import block_error, exact_type, target_type, to_blocks
from runtime.qlinear import Int4Linear, Int8Linear, Sparse24Linear, pack_int4


def _int4(out_features: int, in_features: int, group: int, seed: int = 0) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)  # (N, K)
    groups = (out_features, in_features // group)
    scales = (torch.rand(groups, generator=g) * 0.02 + 0.001).to(torch.bfloat16)  # (N, K/G)
    zeros = (torch.randn(groups, generator=g) * 0.05).to(torch.bfloat16)  # (N, K/G)
    return Int4Linear(pack_int4(codes), scales, zeros, group)


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_map_onto_q4_1_with_the_same_codes(group):
    mod = _int4(48, 256, group)
    rows = torch.arange(48)
    blocks = to_blocks(mod, rows, "q4_1")
    assert blocks.exact and blocks.qtype == GGMLQuantizationType.Q4_1
    assert blocks.data.shape == (48, 256 // 32 * 20)  # 2 + 2 bytes of scale and minimum, 16 of codes per block
    got = torch.from_numpy(dequantize(blocks.data, blocks.qtype))
    # Q4_1: w = d * q + m with d = s and m = z - 8 s, both stored as float16
    q = mod.codes().float().view(48, -1, group)  # (N, K/G, G)
    s, z = mod.scales.float()[..., None], mod.zeros.float()[..., None]
    expected = (_half(s) * q + _half(z - 8 * s)).view(48, 256)
    assert torch.equal(got, expected)
    rel, _ = block_error(blocks.data, blocks.qtype, mod.dequantize())
    assert rel < 1e-3  # only the float16 rounding of the block minimum


def test_rows_come_out_in_the_order_asked():
    mod = _int4(16, 64, 32)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    got = dequantize(to_blocks(mod, order, "q4_1").data, GGMLQuantizationType.Q4_1)
    full = dequantize(to_blocks(mod, torch.arange(16), "q4_1").data, GGMLQuantizationType.Q4_1)
    assert np.array_equal(got, full[order.numpy()])


def test_int8_channels_map_onto_q8_0_exactly():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (24, 96), generator=g, dtype=torch.int8)  # (N, K)
    scales = _half(torch.rand(24, generator=g) * 0.01 + 1e-3)  # float16-representable: the map is exact
    mod = Int8Linear(q, scales)
    blocks = to_blocks(mod, torch.arange(24), "q8_0")
    assert blocks.exact and blocks.qtype == GGMLQuantizationType.Q8_0
    assert torch.equal(torch.from_numpy(dequantize(blocks.data, blocks.qtype)), mod.dequantize())


def test_layouts_without_an_exact_type_are_requantized_with_their_error_measured():
    mod = _int4(32, 128, 16)  # groups of 16: two scales per GGUF block
    assert exact_type(mod) is None and target_type(mod) == "q4_1"
    blocks = to_blocks(mod, torch.arange(32), "q4_1")
    assert not blocks.exact
    rel, worst = block_error(blocks.data, blocks.qtype, mod.dequantize())
    assert 0 < rel < 0.2 and worst > 0
    eight = to_blocks(mod, torch.arange(32), "q8_0")  # a finer grid loses far less
    assert block_error(eight.data, eight.qtype, mod.dequantize())[0] < rel / 4
    assert target_type(mod, "q8_0") == "q8_0" and target_type(mod, "dense") == "dense"
    assert target_type(_int4(8, 64, 32), "dense") == "q4_1"  # an exact map is always taken


def test_formats_without_a_gguf_type_stay_float():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    w.view(8, 16, 4)[..., :2] = 0  # 2:4: two of every four weights are zero
    assert target_type(Sparse24Linear.from_dense(w)) == "dense"
    odd = Int4Linear(pack_int4(torch.zeros(4, 40, dtype=torch.uint8)), torch.ones(4, 5), torch.zeros(4, 5), 8)
    assert target_type(odd, "q4_1") == "dense"  # rows of 40 weights: no 32-weight blocks
    with pytest.raises(ValueError, match="requant must be one of"):
        target_type(odd, "q4_k")
