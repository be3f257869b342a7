"""runtime.gguf_blocks: every supported GGUF type converts exactly (bit for bit against the
`gguf` package's dequantization, which is llama.cpp's), and fused parts widen exactly."""

import numpy as np
import pytest
import torch

from runtime.blockq import BlockQuantLinear
from runtime.gguf_blocks import SUPPORTED, concat, to_canonical, widen


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def raw_tensor(kind: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """A valid GGUF tensor of type `kind`: (N, row bytes) uint8. Legacy types come from the `gguf`
    package's quantizer; K-quants (which it cannot quantize) are random codes and scale codes under
    random finite fp16 super-scales."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(N * K // block_size, block_bytes), dtype=np.uint8)
    scales = _fp16_bytes(rng.uniform(1e-4, 1e-2, size=(blocks.shape[0], 2)).reshape(-1))
    if kind == "Q6_K":
        blocks[:, 208:210] = scales.reshape(-1, 4)[:, :2]
    else:  # Q4_K, Q5_K: d and dmin first
        blocks[:, 0:4] = scales.reshape(-1, 4)
    return blocks.reshape(N, -1)


def _dequantized(raw: np.ndarray, kind: str, N: int, K: int) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32).reshape(N, K))


@pytest.mark.parametrize("kind", SUPPORTED)
def test_each_type_converts_exactly(kind):
    N, K = 48, 512
    raw = raw_tensor(kind, N, K)
    c = to_canonical(raw, kind, (N, K))
    module = BlockQuantLinear.from_canonical(c.q, c.sc, c.mc, c.d, c.dm, c.bits, c.group_size, c.super_block)
    expected = _dequantized(raw, kind, N, K)
    assert torch.equal(module.dequantize(), expected), kind
    rows = torch.tensor([0, 7, 31, 47])
    assert torch.equal(module.rows(rows, torch.float32), expected[rows])


def test_fused_parts_of_different_types_widen_exactly():
    N, K = 32, 512
    raws = {kind: raw_tensor(kind, N, K, seed=i) for i, kind in enumerate(("Q4_K", "Q6_K", "Q8_0"))}
    parts = [to_canonical(raw, kind, (N, K)) for kind, raw in raws.items()]
    fused = concat(parts)
    assert (fused.bits, fused.group_size, fused.super_block) == (8, 16, 32)
    module = BlockQuantLinear.from_canonical(fused.q, fused.sc, fused.mc, fused.d, fused.dm, fused.bits,
                                             fused.group_size, fused.super_block)
    expected = torch.cat([_dequantized(raw, kind, N, K) for kind, raw in raws.items()])
    assert torch.equal(module.dequantize(), expected)
    with pytest.raises(ValueError, match="cannot widen"):
        widen(parts[1], 4, 16, 256)  # fewer bits


def test_row_permutation_moves_whole_rows():
    raw = raw_tensor("Q4_K", 32, 256)
    c = to_canonical(raw, "Q4_K", (32, 256))
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    p = c.rows(perm)
    module = BlockQuantLinear.from_canonical(p.q, p.sc, p.mc, p.d, p.dm, p.bits, p.group_size, p.super_block)
    assert torch.equal(module.dequantize(), _dequantized(raw, "Q4_K", 32, 256)[perm])
