"""runtime.qlinear: every format and kernel path against its dequantized reference (SQNR), packing,
tensor round trips.

Tolerances, as SQNR against float64 x @ dequantize(float64)^T: 80 dB for float32 (every eager
float32 call is exact to the dequantized weight), 35 dB for bf16."""

import pytest
import torch
import torch.nn.functional as F

import runtime.qlinear as qlinear
from runtime.qlinear import (
    Int4Linear,
    Int8Linear,
    Int8MixedLinear,
    NF4Linear,
    Sparse24Int4Linear,
    Sparse24Linear,
    from_tensors,
    pack_24_indices,
    pack_int4,
    unpack_24_indices,
    unpack_int4,
)


def sqnr_db(ref, got):
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp(min=1e-30)))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _int8(N=96, K=128, bias=True):
    g = _gen(1)
    q = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
    s = (torch.rand(N, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    return Int8Linear(q, s, torch.randn(N, generator=g) if bias else None)


def _int4(N=96, K=128, G=32, bias=True):
    g = _gen(2)
    codes = torch.randint(0, 16, (N, K), generator=g)
    s = (torch.rand(N, K // G, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    z = (torch.randn(N, K // G, generator=g) * 0.01).to(torch.bfloat16)
    return Int4Linear(pack_int4(codes), s, z, G, torch.randn(N, generator=g) if bias else None)


def _sparse(N=96, K=128):
    g = _gen(3)
    w = torch.randn(N, K, generator=g)
    drop = torch.rand(N, K // 4, 4, generator=g).argsort(-1)[..., :2]
    w = w.view(N, K // 4, 4).scatter(-1, drop, 0.0).view(N, K)
    return Sparse24Linear.from_dense(w, torch.randn(N, generator=g)), w


def _sparse_int4(N=96, K=128, G=32):
    g = _gen(4)
    idx = torch.sort(torch.rand(N, K // 4, 4, generator=g).argsort(-1)[..., :2], -1).values
    codes = torch.randint(0, 16, (N, K // 2), generator=g)
    s = (torch.rand(N, K // G, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    z = (torch.randn(N, K // G, generator=g) * 0.01).to(torch.bfloat16)
    return Sparse24Int4Linear(pack_int4(codes), pack_24_indices(idx), s, z, G)


def _bnb(kind, N=96, K=128):
    w = torch.randn(N, K, generator=_gen(5)) * 0.05
    if kind == "nf4":
        return NF4Linear.quantize(w, None, 64, True)
    return Int8MixedLinear.quantize(w, None, 6.0)


def _int4_integer(N=96, K=128, G=32):
    """Integer zero points z in [0, 15]: zeros = (8 - z) * s in float32 (not a bf16 value in general)."""
    g = _gen(3)
    codes = torch.randint(0, 16, (N, K), generator=g)
    s = (torch.rand(N, K // G, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    z = torch.randint(0, 16, (N, K // G), generator=g)
    return Int4Linear(pack_int4(codes), s, (8 - z) * s.float(), G, None, zero_point="integer")


# "int4" (96 channels) keeps the `pack_int4` layout beside the kernel's; "int4_blocks" (192: whole
# kernel blocks on the CPU) keeps only the kernel's
MODULES = {"int8": _int8, "int4": _int4, "int4_blocks": lambda: _int4(N=192), "int4_n_not_16": lambda: _int4(N=40),
           "int4_integer": _int4_integer,
           "sparse24": lambda: _sparse()[0], "sparse24_int4": _sparse_int4}


def test_int4_and_24_index_packing_round_trip():
    codes = torch.randint(0, 16, (7, 32), generator=_gen())
    assert pack_int4(codes).shape == (7, 16) and pack_int4(codes).dtype == torch.uint8
    assert torch.equal(unpack_int4(pack_int4(codes)), codes.to(torch.int32))
    idx = torch.sort(torch.rand(5, 8, 4, generator=_gen()).argsort(-1)[..., :2], -1).values
    assert pack_24_indices(idx).shape == (5, 4)
    assert torch.equal(unpack_24_indices(pack_24_indices(idx)), idx)


PACKED = ("int8", "int4", "int4_blocks")  # modules with a packed CPU kernel for few rows


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_forward_matches_dequantized_reference(name, dtype, rows):
    mod = MODULES[name]()
    x = torch.randn(1, rows, mod.in_features, generator=_gen(9)).to(dtype)  # (1, rows, K)
    ref = F.linear(x.double(), mod.dequantize(torch.float64), None if mod.bias is None else mod.bias.double())
    y = mod(x)
    assert y.shape == (1, rows, mod.out_features) and y.dtype == dtype
    assert sqnr_db(ref, y) >= (80.0 if dtype == torch.float32 else 35.0)


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16, torch.float32])
def test_a_dtype_conversion_keeps_the_stored_tensors(name, to):
    """`.to(dtype)` (a whole model's `.to(torch.bfloat16)`) leaves a quantized module's codes, scales and
    bias as they are: its outputs keep their bits, in the input's dtype."""
    mod = MODULES[name]()
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    x = torch.randn(3, mod.in_features, generator=_gen(4)).to(torch.bfloat16)
    y = mod(x)
    assert mod.to(to) is mod
    after = mod.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(mod(x), y)


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_the_packed_and_the_tiled_paths_agree_at_every_row_count(name, dtype, monkeypatch):
    """Rows on both sides of the crossover, tiles smaller than the weight (several per call)."""
    monkeypatch.setattr(qlinear, "TILE_BYTES", 40 * 128 * 4)  # 40 output channels of 96 per float32 tile
    mod = MODULES[name]()
    limit = qlinear.packed_max_rows(mod.FORMAT, dtype)
    for rows in (1, limit, limit + 1, 3 * limit):
        x = torch.randn(rows, 128, generator=_gen(rows)).to(dtype)  # (rows, K)
        dense = F.linear(x.double(), mod.dequantize(torch.float64), mod.bias.double())
        tiled = mod._tiled(x)
        assert sqnr_db(dense, tiled) >= (80.0 if dtype == torch.float32 else 35.0)
        assert sqnr_db(dense, mod(x)) >= 35.0
        assert torch.equal(mod(x), tiled) == (rows > limit)


@pytest.mark.parametrize("name", PACKED)
def test_a_cpu_without_native_bf16_runs_the_tiled_path_in_float32(name, monkeypatch):
    """AVX2-only CPUs widen bf16 products in software: a bf16 call of `_tiled` there is the float32
    product rounded to bf16 (exactly), at least as close to the dense product as a bf16 GEMM's."""
    mod = MODULES[name]()
    x = torch.randn(300, 128, generator=_gen(4)).to(torch.bfloat16)  # (rows, K)
    dense = F.linear(x.double(), mod.dequantize(torch.float64), mod.bias.double())
    monkeypatch.setattr(qlinear, "_widen_bf16", lambda: True)
    widened = mod._tiled(x)
    assert widened.dtype == torch.bfloat16 and torch.equal(widened, mod._tiled(x.float()).to(torch.bfloat16))
    monkeypatch.setattr(qlinear, "_widen_bf16", lambda: False)
    native = mod._tiled(x)
    assert sqnr_db(dense, widened) >= max(35.0, sqnr_db(dense, native) - 0.1)


@pytest.mark.parametrize("name", ["int4", "int4_blocks"])
def test_tiled_path_in_float32_equals_the_dense_product(name, monkeypatch):
    monkeypatch.setattr(qlinear, "TILE_BYTES", 40 * 128 * 4)  # several tiles
    mod = MODULES[name]()
    x = torch.randn(2, 300, 128, generator=_gen(3))  # (B, T, K): many rows, float32
    ref = F.linear(x, mod.dequantize(torch.float32), mod.bias)
    assert torch.allclose(mod(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,dtype,min_db", [("nf4", torch.float32, 80.0), ("nf4", torch.bfloat16, 35.0),
                                               ("int8_mixed", torch.float32, 30.0),
                                               ("int8_mixed", torch.bfloat16, 30.0)])
def test_bitsandbytes_formats_match_dequantized_reference(kind, dtype, min_db):
    w = (torch.randn(96, 128, generator=_gen(5)) * 0.05).to(dtype)  # NF4 computes in the weight's dtype
    mod = NF4Linear.quantize(w, None, 64, True) if kind == "nf4" else Int8MixedLinear.quantize(w, None, 6.0)
    x = torch.randn(3, 128, generator=_gen(8)).to(dtype)
    ref = x.double() @ mod.dequantize(torch.float64).T
    assert sqnr_db(ref, mod(x)) >= min_db


@pytest.mark.parametrize("N", [64, 192])  # one block, several
def test_int4_in_whole_kernel_blocks_keeps_one_copy_of_the_codes(N):
    codes = torch.randint(0, 16, (N, 128), generator=_gen(7))
    mod = Int4Linear(pack_int4(codes), torch.ones(N, 2), torch.zeros(N, 2), 64)
    assert mod.block == qlinear.cpu_int4_block() > 0 and mod.packed.is_contiguous()
    assert torch.equal(mod.codes(), codes.to(torch.int32)) and torch.equal(mod.qweight, pack_int4(codes))
    assert set(mod.state_dict()) == {"packed", "scales", "zeros"}
    mod(torch.randn(1, 128, generator=_gen(8)).to(torch.bfloat16))  # the packed kernel reads `packed` itself
    assert mod._kernel is None
    mod.set_qweight(pack_int4(15 - codes))
    assert torch.equal(mod.codes(), (15 - codes).to(torch.int32))


def test_int4_dequantize_follows_the_kernel_convention():
    codes = torch.tensor([[0, 8, 15, 3]])
    mod = Int4Linear(pack_int4(codes), torch.tensor([[0.5]]), torch.tensor([[1.0]]), 4)
    assert torch.equal(mod.dequantize(), torch.tensor([[-3.0, 1.0, 4.5, -1.5]]))


@pytest.mark.parametrize("name", list(MODULES) + ["nf4", "int8_mixed"])
def test_to_tensors_from_tensors_is_bit_exact(name):
    mod = _bnb(name) if name in ("nf4", "int8_mixed") else MODULES[name]()
    back = from_tensors(mod.meta(), mod.to_tensors())
    assert type(back) is type(mod) and back.meta() == mod.meta()
    a, b = mod.to_tensors(), back.to_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, mod.in_features, generator=_gen())
    assert torch.equal(mod(x), back(x))


def test_sparse24_from_dense_keeps_exact_values_and_pattern():
    mod, w = _sparse()
    assert torch.equal(mod.dequantize(), w)
    assert mod.nbytes() < w.numel() * 4 * 0.6


def test_bad_construction_is_rejected():
    with pytest.raises(ValueError, match="2 nonzeros"):
        Sparse24Linear.from_dense(torch.ones(4, 8))
    with pytest.raises(ValueError, match="divisible by 8"):
        Sparse24Linear.from_dense(torch.zeros(4, 12))
    with pytest.raises(ValueError, match="int8"):
        Int8Linear(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="scales/zeros"):
        Int4Linear(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4, 1), 16)
    with pytest.raises(ValueError, match="unknown quantized-linear format"):
        from_tensors({"format": "int3"}, {})
    with pytest.raises(ValueError, match="zero_point"):
        Int4Linear(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1), 16, zero_point="int")
    with pytest.raises(ValueError, match=r"\(8 - z\) \* scales"):  # 0.25 / 0.5 is not an integer offset from 8
        Int4Linear(torch.zeros(4, 8, dtype=torch.uint8), torch.full((4, 1), 0.5), torch.full((4, 1), 0.25), 16,
                   zero_point="integer")


def test_int4_integer_zero_points_dequantize_as_q_minus_z_and_old_meta_loads_as_float():
    mod = _int4_integer()
    z = 8 - mod.zeros / mod.scales.float()
    q = mod.codes().float().view(96, 4, 32)
    ref = ((q - z[..., None]) * mod.scales.float()[..., None]).view(96, 128)
    assert torch.equal(mod.dequantize(), ref)
    old = _int4()
    meta = {k: v for k, v in old.meta().items() if k != "zero_point"}  # a checkpoint written before the field
    assert from_tensors(meta, old.to_tensors()).zero_point == "float"
    assert from_tensors(mod.meta(), mod.to_tensors()).zero_point == "integer"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["int8", "int4", "sparse24"])
def test_cuda_paths_match_dequantized_reference(name):
    mod = (_int4(N=128, K=256, G=32) if name == "int4" else
           _sparse(N=128, K=128)[0] if name == "sparse24" else _int8()).cuda()
    x = torch.randn(3, mod.in_features, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), mod.dequantize(torch.float64), mod.bias.double() if mod.bias is not None else None)
    assert sqnr_db(ref, mod(x)) >= 35.0


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_int8_weights_at_an_unaligned_offset_run(rows):
    """A checkpoint's tensors sit at the file's offsets; the INT8 kernel crashed on unaligned
    weights for calls of 4+ rows, so the module keeps an aligned copy."""
    N, K = 64, 96
    buf = torch.randint(-127, 128, (N * K + 8,), dtype=torch.int8, generator=_gen(3))
    qweight = buf[1:1 + N * K].view(N, K)
    assert qweight.data_ptr() % 16
    mod = Int8Linear(qweight, torch.rand(N, generator=_gen(4)) * 0.01)
    x = torch.randn(rows, K, generator=_gen(5)).to(torch.bfloat16)
    ref = x.double() @ mod.dequantize(torch.float64).T
    assert sqnr_db(ref, mod(x)) >= 35.0


@pytest.mark.parametrize("name", PACKED)
def test_no_dense_copy_outlives_a_call(name):
    mod = MODULES[name]()
    before = {k: v.data_ptr() for k, v in mod.state_dict().items()}
    mod(torch.randn(1, 300, 128, generator=_gen(6)))  # the tiled path
    tensors = [v for v in vars(mod).values() if isinstance(v, torch.Tensor)] + list(mod.buffers())
    assert {k: v.data_ptr() for k, v in mod.state_dict().items()} == before
    assert sum(t.numel() * t.element_size() for t in tensors) <= mod.nbytes() * 1.01
