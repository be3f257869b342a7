"""runtime.blockq and its CPU kernels: packing, exact dequantization, the kernel against the
float64 reference at 1-64 rows, every kernel path bit-identical, rows independent of the row
count, embedding lookups, and the INT4 / INT8 conversions of `quant`'s modules."""

import math

import pytest
import torch

from runtime.blockq import (
    BlockQuantLinear,
    QuantizedEmbedding,
    block_width,
    pack_codes,
    pack_scale_codes,
    unpack_codes,
    unpack_scale_codes,
)
from runtime.kernels import cpu_blockq
from runtime.loading import resolve_weights
from runtime.qlinear import Int4Linear, Int8Linear, from_tensors, pack_int4

needs_kernels = pytest.mark.skipif(not cpu_blockq.available(), reason="block-quantized CPU kernels not built here")

# (bits, group, super-block, mins share the scales' codes, out_features): the grids of GGUF's types
GRIDS = {
    "q4_k": (4, 32, 256, False, 64), "q6_k": (6, 16, 256, True, 64), "q8_0": (8, 32, 32, True, 48),
    "q5_0": (5, 32, 32, True, 64), "q5_k": (5, 32, 256, False, 96), "q4_1": (4, 32, 32, True, 64),
    "g16_4bit": (4, 16, 64, False, 96), "4bit_odd_rows": (4, 32, 32, False, 48), "5bit_g16": (5, 16, 64, False, 32),
    "8bit_g16": (8, 16, 256, True, 48), "6bit_g32": (6, 32, 32, False, 32), "6bit_odd_rows": (6, 16, 256, True, 48),
    # scale and min codes all in 0..63, as GGUF's Q4_K and Q5_K have them: kept packed in 6 bits
    "q4_k_6bit": (4, 32, 256, False, 64), "q5_k_6bit": (5, 32, 256, False, 96),
}


def _lowest_scale_code(grid: str) -> int:
    return 0 if grid.endswith("_6bit") else -20


def _module(grid: str, K: int = 512, bias: bool = True, seed: int = 0,
            N: int | None = None) -> tuple[BlockQuantLinear, torch.Tensor]:
    bits, G, S, shared, grid_n = GRIDS[grid]
    N = N or grid_n
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.uint8)
    sc = torch.randint(_lowest_scale_code(grid), 64, (N, K // G), generator=g).to(torch.int8)
    mc = sc if shared else torch.randint(0, 64, (N, K // G), generator=g).to(torch.int8)
    d, dm = torch.rand(N, K // S, generator=g) * 1e-3, torch.rand(N, K // S, generator=g) * 1e-3
    b = torch.randn(N, generator=g) if bias else None
    return BlockQuantLinear.from_canonical(q, sc, mc, d, dm, bits, G, S, b), q


def _formula(q, sc, mc, d, dm, G, S):
    """W = d sc q - dm mc in float64 (the module docstring's definition)."""
    rep = lambda t, n: t.double().repeat_interleave(n, dim=1)  # noqa: E731
    return rep(d, S) * rep(sc, G) * q.double() - rep(dm, S) * rep(mc, G)


@pytest.mark.parametrize("grid", list(GRIDS))
def test_pack_round_trip_and_dequantize(grid):
    module, q = _module(grid)
    assert torch.equal(unpack_codes(module.codes, module.bits, module.group_size), q)
    bits, G, S, shared, N = GRIDS[grid]
    assert module.bits == (8 if N % block_width(bits) else bits)  # 4 to 6 bits need 32-channel blocks
    assert (module.mc is module.sc) == (shared or module.packed)  # shared mins cost no bytes of their own
    g = torch.Generator().manual_seed(0)  # the same draws as _module
    q2 = torch.randint(0, 1 << bits, (N, 512), generator=g, dtype=torch.uint8)
    sc = torch.randint(_lowest_scale_code(grid), 64, (N, 512 // G), generator=g).to(torch.int8)
    mc = sc if shared else torch.randint(0, 64, (N, 512 // G), generator=g).to(torch.int8)
    d, dm = torch.rand(N, 512 // S, generator=g) * 1e-3, torch.rand(N, 512 // S, generator=g) * 1e-3
    assert module.packed == grid.endswith("_6bit")
    assert all(torch.equal(a, b) for a, b in zip(module.canonical()[1:3], (sc, mc)))
    ref = _formula(q2, sc, mc, d, dm, G, S)
    assert float((module.dequantize().double() - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


def test_pack_layout_of_5bit_planes():
    """5 bits: after the low-nibble rows, per row bit 4 of set 0's then set 1's 64 codes, 8 bytes
    each, bit i for byte i of the row."""
    q = torch.zeros(32, 16, dtype=torch.uint8)
    q[3, 5] = 0b10111  # channel 3 (set 0), input 5: row 1, byte 13
    q[16 + 1, 2] = 0b10000  # channel 17 (set 1, slot 1), input 2: row 0, byte 6
    packed = pack_codes(q, 5, 16)
    assert packed.shape == (1, 1, 20 * 16)
    low, planes = packed[0, 0, :256], packed[0, 0, 256:].view(4, 2, 8)  # (rows, sets, 8)
    assert low[64 + 13] == 0b0111 and low[6] == 0
    assert planes[1, 0, 1] == 1 << 5  # row 1, set 0: byte 13 -> bit 5 of byte 1
    assert planes[0, 1, 0] == 1 << 6  # row 0, set 1: byte 6
    assert int(planes.count_nonzero()) == 2
    assert torch.equal(unpack_codes(packed, 5, 16), q)


def test_pack_layout_of_6bit_pairs():
    """6 bits: after the low-nibble rows, per 4 rows set 0's then set 1's 64 bytes, byte i holding
    bits 4-5 of row j's code at byte i in its bits 2j, 2j + 1."""
    q = torch.zeros(32, 16, dtype=torch.uint8)
    q[3, 5] = 0b100111  # channel 3 (set 0), input 5: row 1, byte 13: bits 4-5 = 0b10
    q[16 + 1, 14] = 0b110000  # channel 17 (set 1, slot 1), input 14: row 3, byte 6: bits 4-5 = 0b11
    packed = pack_codes(q, 6, 16)
    assert packed.shape == (1, 1, 24 * 16)
    low, pairs = packed[0, 0, :256], packed[0, 0, 256:].view(2, 64)  # (sets, 64): one quad
    assert low[64 + 13] == 0b0111 and low[3 * 64 + 6] == 0
    assert pairs[0, 13] == 0b10 << 2 and pairs[1, 6] == 0b11 << 6
    assert int(pairs.count_nonzero()) == 2
    assert torch.equal(unpack_codes(packed, 6, 16), q)


def test_pack_layout_of_4bit_blocks():
    """Channel c of a 32-channel block in the low nibble, channel 16 + c in the high one; row r of a
    group holds inputs 4r..4r+3 of every channel at bytes 4c..4c+3."""
    q = torch.zeros(32, 32, dtype=torch.uint8)
    q[3, 5] = 7  # channel 3 (low nibble), input 5: row 1, byte 4 * 3 + 1
    q[16 + 2, 9] = 9  # channel 18 (high nibble of channel slot 2), input 9: row 2, byte 4 * 2 + 1
    packed = pack_codes(q, 4, 32)
    assert packed.shape == (1, 1, 512)
    assert packed[0, 0, 64 * 1 + 4 * 3 + 1] == 7
    assert packed[0, 0, 64 * 2 + 4 * 2 + 1] == 9 << 4
    assert int(packed.count_nonzero()) == 2


@needs_kernels
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 64])
def test_kernel_matches_float64_reference(grid, rows):
    module, _ = _module(grid)
    x = torch.randn(rows, module.in_features, generator=torch.Generator().manual_seed(rows))
    ref = cpu_blockq.blockq_mm_ref(x, module.dequantize(), module.bias)
    got = module(x)
    assert got.dtype == torch.float32 and got.shape == (rows, module.out_features)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@needs_kernels
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_gives_the_same_bits(grid, dtype):
    """Every path this CPU runs (AVX2 too on AVX-512 CPUs) equals the plain C++ path bit for bit, at
    every row count a verification block, a tree or a served batch meets (1-17, then up to 64), and a
    prefill chunk longer than the AVX2 path's 128 rows a pass."""
    module, _ = _module(grid)
    m = module
    assert "avx2" in cpu_blockq.isas() or "vnni" not in cpu_blockq.isas()  # AVX-512 CPUs test AVX2 too
    for rows in (*range(1, 18), 23, 31, 33, 48, 64, 133):
        x = torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
        outs = {isa: cpu_blockq.blockq_mm(x, m.codes, m.sc, m.mc, m.d, m.dm, m.bias, m.bits, m.group_size,
                                          m.super_block, isa=isa) for isa in cpu_blockq.isas()}
        base = outs["generic"]
        for isa, y in outs.items():
            assert torch.equal(y, base), f"{isa} differs from the plain C++ path at {rows} rows"


@needs_kernels
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("code", ["max", "alternating"])
def test_extreme_codes_scales_and_activations_give_the_same_bits_on_every_path(grid, code):
    """The largest products a format allows (every code at its maximum, scale codes -128 / 127 or 63 where
    packed, activation codes +-127): the AVX2 path's integer C * sc stays exact, as every other path's
    float(C) * float(sc), so each path still equals the plain C++ one bit for bit."""
    bits, G, S, shared, N = GRIDS[grid]
    K = 512
    g = torch.Generator().manual_seed(9)
    q = torch.full((N, K), (1 << bits) - 1, dtype=torch.uint8)
    if code == "alternating":
        q[:, 1::2] = 0
    top = 63 if grid.endswith("_6bit") else 127
    sc = torch.full((N, K // G), top, dtype=torch.int8)
    if not grid.endswith("_6bit"):
        sc[::2] = -128
    mc = sc if shared else torch.randint(0, 64, (N, K // G), generator=g).to(torch.int8)
    d, dm = torch.rand(N, K // S, generator=g) * 1e-3, torch.rand(N, K // S, generator=g) * 1e-3
    m = BlockQuantLinear.from_canonical(q, sc, mc, d, dm, bits, G, S)
    x = torch.ones(18, K)  # each AVX2 kernel: 1 row, 2 rows, 4 rows a tile and the 1-3 left (to 16), 17+
    x[1::3] = -1.0
    x[2::3, 1::2] = -1.0
    x[3] = torch.randn(K, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (18, 8, 5, 2, 1, 3):  # 3 last: the reference check below
            args = (m.codes, m.sc, m.mc, m.d, m.dm, None, m.bits, m.group_size, m.super_block, m.zero)
            outs = {isa: cpu_blockq.blockq_mm(x[:rows].to(dtype), *args, isa=isa) for isa in cpu_blockq.isas()}
            for isa, y in outs.items():
                assert torch.equal(y, outs["generic"]), (isa, dtype, rows)
    ref = cpu_blockq.blockq_mm_ref(x[:3], m.dequantize(), None)
    assert float((outs["generic"].float().double() - ref).abs().max() / ref.abs().max()) < 1e-2


@needs_kernels
@pytest.mark.parametrize("grid", ["q4_k_6bit", "q5_k_6bit"])
def test_six_bit_scale_codes_are_kept_packed_and_read_to_the_same_bits(grid):
    """Scale and min codes that all lie in 0..63 (GGUF's Q4_K and Q5_K) are kept in 6 bits, 48 bytes a
    group and block instead of 64, and every path reads them to the same bits as the int8 codes."""
    m, _ = _module(grid)
    sc, mc = m.scale_codes()
    assert m.packed and m.sc.dtype == torch.uint8 and m.sc.shape == (*sc.shape[:2], 48) and m.mc is m.sc
    assert torch.equal(pack_scale_codes(*unpack_scale_codes(m.sc)), m.sc)
    held = (m.codes, m.sc, m.d, m.dm, m.bias)  # what a step reads: the packed codes once
    assert m.nbytes() == sum(t.numel() * t.element_size() for t in held)
    assert 4 * m.sc.numel() == 3 * (sc.numel() + mc.numel())  # 12 bits a channel and group, not 16
    for rows in (1, 2, 3, 4, 5, 8, 16, 17, 64):
        x = torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        for isa in cpu_blockq.isas():
            args = (m.d, m.dm, m.bias, m.bits, m.group_size, m.super_block)
            packed = cpu_blockq.blockq_mm(x, m.codes, m.sc, m.sc, *args, isa=isa)
            assert torch.equal(packed, cpu_blockq.blockq_mm(x, m.codes, sc, mc, *args, isa=isa)), (isa, rows)
    with pytest.raises(RuntimeError, match=r"packed scale codes must be uint8 \(N/W, K/G, 48\).*passed as both"):
        cpu_blockq.blockq_mm(x, m.codes, m.sc, m.sc.clone(), m.d, m.dm, m.bias, m.bits, m.group_size, m.super_block)


@pytest.mark.parametrize("grid", ["q4_k", "q6_k", "q5_0", "q8_0"])
def test_float16_scales_are_kept_as_float16_and_multiply_as_float32(grid):
    """Scales that are all float16 values (GGUF's) are stored as float16 (fewer bytes a step); others stay
    float32. Either way the module dequantizes to the formula, and on every kernel path the float16
    storage gives the bits of the same scales in float32 (subnormal float16 scales included)."""
    bits, G, S, shared, N = GRIDS[grid]
    K = 512
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.uint8)
    sc = torch.randint(-20, 64, (N, K // G), generator=g).to(torch.int8)
    mc = sc if shared else torch.randint(0, 64, (N, K // G), generator=g).to(torch.int8)
    d = (torch.rand(N, K // S, generator=g) * 1e-3).half().float()
    d[0, 0] = 2.0 ** -20  # a float16 subnormal
    dm = (torch.rand(N, K // S, generator=g) * 1e-3).half().float()
    module = BlockQuantLinear.from_canonical(q, sc, mc, d, dm, bits, G, S)
    assert module.d.dtype == torch.float16 and (module.dm is None or module.dm.dtype == torch.float16)
    torch.testing.assert_close(module.dequantize().double(), _formula(q, sc, mc, d, module.canonical()[4], G, S),
                               rtol=1e-6, atol=0)
    inexact = BlockQuantLinear.from_canonical(q, sc, mc, d + 1e-9, dm, bits, G, S)
    assert inexact.d.dtype == torch.float32
    if not cpu_blockq.available():
        return
    m = module
    dm32 = None if m.dm is None else m.dm.float()
    for rows in (1, 5, 16):
        x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
        for isa in cpu_blockq.isas():
            half = cpu_blockq.blockq_mm(x, m.codes, m.sc, m.mc, m.d, m.dm, None, m.bits, G, S, m.zero, isa=isa)
            full = cpu_blockq.blockq_mm(x, m.codes, m.sc, m.mc, m.d.float(), dm32, None, m.bits, G, S, m.zero, isa=isa)
            assert torch.equal(half, full), (isa, rows)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_round_half_to_even_on_every_path(dtype):
    """Activations whose codes fall exactly half-way (every block's max is 127, so x * 127 / max = x)
    round to even on every path (the vector paths' conversions as the plain C++ path's nearbyint), as
    the float64 reference rounds them; an all-zero block and a zero row quantize to zero codes."""
    module, _ = _module("q4_k")
    K = module.in_features
    halves = (torch.arange(K, dtype=torch.float32) % 64 - 32) + 0.5  # -31.5 .. 31.5
    halves[::32] = 127.0
    x = torch.stack([halves, -halves, torch.zeros(K), halves * (torch.arange(K) >= 64)]).to(dtype)
    ref = cpu_blockq.blockq_mm_ref(x, module.dequantize(), module.bias)
    outs = {isa: cpu_blockq.blockq_mm(x, module.codes, module.sc, module.mc, module.d, module.dm, module.bias,
                                      module.bits, module.group_size, module.super_block, isa=isa)
            for isa in cpu_blockq.isas()}
    for isa, y in outs.items():
        assert torch.equal(y, outs["generic"]), isa
    if dtype == torch.float32:  # bf16 outputs are rounded further; their paths' equality is checked above
        got = outs["generic"].double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


@needs_kernels
def test_the_isa_switch_runs_a_whole_module_on_the_path_it_names(monkeypatch):
    """SPECDEC_BLOCKQ_ISA forces every call's path (an AVX-512 CPU runs as an AVX2-only one would):
    the same bits; a path the CPU lacks or a typo is a clear error."""
    module, _ = _module("q4_k", K=1536)
    x = torch.randn(6, 1536, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    base = module(x)
    for isa in cpu_blockq.isas():
        monkeypatch.setenv(cpu_blockq.ISA_ENV, isa)
        assert torch.equal(module(x), base), isa
    if "avx2" in cpu_blockq.isas():
        monkeypatch.setenv(cpu_blockq.ISA_ENV, "avx2")
        assert cpu_blockq.fast()  # weights="auto" keeps the 4-bit blocks on an AVX2 CPU
        assert resolve_weights("auto", "smollm2-135m-instruct") == "gguf"
    monkeypatch.setenv(cpu_blockq.ISA_ENV, "generic")
    assert not cpu_blockq.fast() and resolve_weights("auto", "smollm2-135m-instruct") == "dense"
    monkeypatch.setenv(cpu_blockq.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="SPECDEC_BLOCKQ_ISA='avx3' is not a kernel path"):
        module(x)
    missing = next((isa for isa in ("amx", "vnni", "avx2") if isa not in cpu_blockq.isas()), None)
    if missing:
        monkeypatch.setenv(cpu_blockq.ISA_ENV, missing)
        with pytest.raises(ValueError, match="does not run"):
            module(x)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_input_gives_non_finite_outputs_on_every_path(bad, rows, dtype):
    """NaN / inf activations are not rounded to finite int8 codes: the row's outputs are non-finite
    (so NonFiniteLogitsError fires), on every path; the other rows are untouched. In bf16 a NaN is
    stored as c10::BFloat16 stores it (0x7FC0) on every path."""
    module, _ = _module("q4_k")
    x = torch.randn(rows, module.in_features, generator=torch.Generator().manual_seed(4)).to(dtype)
    clean = module(x)
    x[rows // 2, 7] = bad
    m = module
    for isa in cpu_blockq.isas():
        y = cpu_blockq.blockq_mm(x, m.codes, m.sc, m.mc, m.d, m.dm, m.bias, m.bits, m.group_size, m.super_block,
                                 m.zero, isa=isa)
        assert not torch.isfinite(y[rows // 2]).any(), isa
        others = [i for i in range(rows) if i != rows // 2]
        assert torch.equal(y[others], clean[others]), isa
        if dtype == torch.bfloat16 and math.isnan(bad):
            assert set(y[rows // 2].view(torch.int16).tolist()) == {0x7FC0}, isa


@needs_kernels
def test_a_module_call_compiles_into_one_graph(monkeypatch):
    """Choosing the kernel path (SPECDEC_BLOCKQ_ISA, the CPU's paths) happens before tracing: a graph
    break there split every compiled layer and hit the recompile limit on a real model."""
    module, _ = _module("q4_k")
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(2))
    for isa in (None, "avx2" if "avx2" in cpu_blockq.isas() else "generic"):
        if isa:
            monkeypatch.setenv(cpu_blockq.ISA_ENV, isa)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda t: module(t) * 2)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), isa


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_threads_and_how_they_split_the_blocks_change_no_bit(rows):
    """Every path gives the same bits on 1, 2 and 3 threads: the AVX2 path's threads take a contiguous
    share of the blocks each, then chunks of the rest as they come free (here 37 blocks of 32 channels:
    both the shares and the chunks run)."""
    big, _ = _module("q4_k_6bit", N=37 * 32)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 512, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for isa in cpu_blockq.isas():
            outs = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                outs.append(cpu_blockq.blockq_mm(x, big.codes, big.sc, big.mc, big.d, big.dm, big.bias, big.bits,
                                                 big.group_size, big.super_block, big.zero, isa=isa))
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), isa
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_others(dtype):
    module, _ = _module("q4_k", K=1536)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(3)).to(dtype)
    full = module(x)
    for start, stop in ((0, 1), (5, 6), (0, 8), (3, 19), (24, 40)):
        assert torch.equal(module(x[start:stop]), full[start:stop])
    assert torch.equal(module(x.view(4, 10, 1536)), full.view(4, 10, -1))  # leading dims are rows too


@needs_kernels
def test_bf16_output_is_the_float32_result_rounded():
    module, _ = _module("q6_k")
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(module(x), module(x.float()).to(torch.bfloat16))


def test_fallback_without_kernels_multiplies_the_dequantized_weight(monkeypatch):
    module, _ = _module("q4_k")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("SPECDEC_BLOCKQ_KERNELS", "0")
    assert not cpu_blockq.available()
    ref = x.double() @ module.dequantize().double().t() + module.bias.double()
    assert torch.allclose(module(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grid", ["q4_k", "q6_k", "q5_0", "4bit_odd_rows", "8bit_g16", "6bit_g32", "q4_k_6bit",
                                  "q5_k_6bit"])
def test_rows_and_embedding_lookup(grid):
    module, _ = _module(grid)
    tokens = torch.tensor([[0, 17, module.out_features - 1], [16, 31, 5]])
    w = module.dequantize()
    assert torch.equal(module.rows(tokens, torch.float32), w[tokens])
    emb = QuantizedEmbedding(module, torch.bfloat16)
    assert torch.equal(emb(tokens), w[tokens].to(torch.bfloat16))


@pytest.mark.parametrize("to", [torch.float32, torch.float16])
def test_a_dtype_conversion_keeps_the_blocks_and_moves_the_lookups(to):
    """A model's `.to(dtype)` keeps a block module's codes and float16 scales (the kernels read no other
    scale dtypes), and its embedding then looks rows up in the new dtype, as `nn.Embedding` would."""
    module, _ = _module("q4_k")
    d = module.d.clone()
    emb = QuantizedEmbedding(module, torch.bfloat16).to(to)
    assert emb.dtype == to and module.d.dtype == d.dtype and torch.equal(module.d, d)
    tokens = torch.tensor([[0, 17, 5]])
    assert torch.equal(emb(tokens), module.dequantize()[tokens].to(to))
    x = torch.randn(2, module.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(module.to(torch.bfloat16)(x), module(x)) and module.d.dtype == d.dtype


def test_tensor_round_trip():
    for grid in ("q4_k", "q6_k", "q5_0", "q4_k_6bit"):
        module, _ = _module(grid)
        back = from_tensors(module.meta(), module.to_tensors())
        assert isinstance(back, BlockQuantLinear) and back.packed == module.packed
        assert torch.equal(back.dequantize(), module.dequantize()) and torch.equal(back.bias, module.bias)
        assert ("mc" in module.to_tensors()) == (grid in ("q4_k", "q4_k_6bit"))
        assert module.to_tensors()["sc"].dtype == torch.int8  # written unpacked, the form the constructor takes


def test_symmetric_grids_keep_neither_mins_nor_dm():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 32, (64, 64), generator=g, dtype=torch.uint8)
    sc = torch.ones(64, 2, dtype=torch.int8)
    d = (torch.rand(64, 2, generator=g) * 1e-2).half().float()  # fp16 scales, as GGUF stores: exact products
    module = BlockQuantLinear.from_canonical(q, sc, sc, d, 16 * d, 5, 32, 32)  # Q5_0: w = d (q - 16)
    assert module.zero == 16.0 and module.dm is None and set(module.to_tensors()) == {"codes", "sc", "d"}
    expected = (q.float() - 16) * d.repeat_interleave(32, dim=1)
    assert torch.equal(module.dequantize(), expected)
    asym = BlockQuantLinear.from_canonical(q, sc, sc, d, 3 * d, 5, 32, 32)  # not a power of two
    assert asym.zero == 0.0 and asym.dm is not None
    picked = module.select_rows(torch.tensor(list(range(32, 64))))
    assert torch.equal(picked.dequantize(), expected[32:])


def test_int8_and_int4_modules_convert_exactly():
    g = torch.Generator().manual_seed(0)
    q8 = torch.randint(-127, 128, (48, 256), generator=g).to(torch.int8)
    scales = (torch.rand(48, generator=g) * 1e-2).to(torch.bfloat16)  # quant's grids store bf16 scales
    int8 = Int8Linear(q8, scales, torch.randn(48, generator=g))
    assert torch.equal(BlockQuantLinear.from_int8(int8).dequantize(), int8.dequantize())
    codes = torch.randint(0, 16, (64, 256), generator=g)
    s = (torch.rand(64, 2, generator=g) * 1e-2).to(torch.bfloat16).float()
    z = torch.randint(0, 16, (64, 2), generator=g).float()
    int4 = Int4Linear(pack_int4(codes), s, (8 - z) * s, 128, zero_point="integer")
    assert torch.allclose(BlockQuantLinear.from_int4(int4).dequantize(), int4.dequantize(), rtol=0, atol=1e-7)


def test_bad_shapes_are_refused():
    module, _ = _module("q4_k")
    with pytest.raises(ValueError, match="bits"):
        BlockQuantLinear(module.codes, module.sc, module.mc, module.d, module.dm, 7, 32, 256)
    with pytest.raises(ValueError, match="sc must be"):
        BlockQuantLinear(module.codes, module.sc[:, :3], module.mc, module.d, module.dm, 4, 32, 256)
    with pytest.raises(ValueError, match="divisible by 16"):
        BlockQuantLinear.from_canonical(torch.zeros(20, 64, dtype=torch.uint8), torch.ones(20, 2, dtype=torch.int8),
                                        torch.ones(20, 2, dtype=torch.int8), torch.ones(20, 1), torch.ones(20, 1),
                                        4, 32, 64)
    with pytest.raises(ValueError, match="codes must lie"):
        BlockQuantLinear.from_canonical(torch.full((16, 64), 16, dtype=torch.uint8),
                                        torch.ones(16, 2, dtype=torch.int8), torch.ones(16, 2, dtype=torch.int8),
                                        torch.ones(16, 1), torch.ones(16, 1), 4, 32, 64)


@needs_kernels
def test_wrong_arguments_to_the_kernel_name_the_argument():
    """A misspelled isa was a KeyError, a wrong type torch's dispatcher error, a 0-d x an IndexError, and a
    weight tensor on another device (meta) was read as CPU memory: now each names the argument."""
    module, _ = _module("q4_k")
    args = dict(codes=module.codes, sc=module.sc, mc=module.mc, d=module.d, dm=module.dm, bias=module.bias,
                bits=module.bits, group=module.group_size, super_block=module.super_block)
    x = torch.randn(2, 512)
    for isa in ("AVX2", "sse", 1):
        with pytest.raises(ValueError, match=rf"blockq_mm: isa must be one of auto, generic.*got {isa!r}"):
            cpu_blockq.blockq_mm(x, **args, isa=isa)
    for name, value, got in (("bits", "4", "str"), ("group", 32.0, "float"),
                             ("amx_min_rows", 2 ** 70, "int out of range"), ("bias", [0.0] * 64, "list")):
        with pytest.raises(TypeError, match=rf"blockq_mm: {name} must be .*, got {got}"):
            cpu_blockq.blockq_mm(x, **{**args, name: value})
    with pytest.raises(TypeError, match="blockq_mm: x must be Tensor, got ndarray"):
        cpu_blockq.blockq_mm(x.numpy(), **args)
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        cpu_blockq.blockq_mm(torch.tensor(1.0), **args)
    for name in ("codes", "sc", "d", "bias"):
        with pytest.raises(ValueError, match=f"blockq_mm: {name} is on meta; the CPU kernels take CPU tensors"):
            cpu_blockq.blockq_mm(x, **{**args, name: torch.empty_like(args[name], device="meta")})
    assert cpu_blockq.blockq_mm(x, **args).shape == (2, 64)  # the right call still runs
    # the reference takes what the kernel takes: no rows (was an ambiguous view), and names a bad width
    weight = module.dequantize()
    assert cpu_blockq.blockq_mm_ref(x[:0], weight).shape == cpu_blockq.blockq_mm(x[:0], **args).shape == (0, 64)
    with pytest.raises(ValueError, match="in_features must be a multiple of 32, got 40"):
        cpu_blockq.blockq_mm_ref(torch.randn(2, 40), torch.randn(4, 40))
