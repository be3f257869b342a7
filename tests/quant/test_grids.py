"""quant.grids: the INT4 grids (min-max and clipped-range search) and round-to-nearest."""

import pytest
import torch

from quant.grids import int4_codes, int4_dequant, int4_grid, int4_rtn


def _gaussian_rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(256, 64, generator=g)  # (N, G): one group per row


def _row_error(w, grid):
    scale, zero = int4_grid(w, grid)
    q = int4_dequant(int4_codes(w, scale[:, None], zero[:, None]), scale[:, None], zero[:, None])
    return (q - w).square().sum(dim=-1)  # (N,)


def test_mse_grid_never_worse_than_minmax_and_better_on_gaussian_rows():
    w = _gaussian_rows()
    mse, minmax = _row_error(w, "mse"), _row_error(w, "minmax")
    assert torch.all(mse <= minmax + 1e-6)  # ratio 1.0 is among the candidates
    assert float(mse.sum()) < 0.95 * float(minmax.sum())  # measured 0.91: the tails of a Gaussian are worth clipping


def test_importance_weights_the_clip_choice_towards_the_important_weights():
    w = _gaussian_rows()
    importance = torch.ones(64)
    importance[:4] = 100.0  # four inputs that see large activations
    s_w, z_w = int4_grid(w, "mse", importance)
    s_u, z_u = int4_grid(w, "mse")

    def weighted(scale, zero):
        q = int4_dequant(int4_codes(w, scale[:, None], zero[:, None]), scale[:, None], zero[:, None])
        return float(((q - w).square() * importance).sum())

    assert weighted(s_w, z_w) < weighted(s_u, z_u)


def test_minmax_grid_spans_the_row():
    w = _gaussian_rows()
    scale, zero = int4_grid(w, "minmax")
    lo, hi = int4_dequant(torch.zeros(()), scale, zero), int4_dequant(torch.full((), 15.0), scale, zero)
    step = scale.abs()
    assert torch.all(lo <= w.amin(-1) + step) and torch.all(hi >= w.amax(-1) - step)


def test_rtn_with_mse_grid_has_lower_weight_error_and_unknown_grid_raises():
    w = _gaussian_rows().view(64, 256)

    def mse(grid):
        return float(((int4_rtn(w, 64, grid=grid).dequantize().float() - w) ** 2).mean())

    assert mse("mse") < mse("minmax")
    with pytest.raises(ValueError, match="grid"):
        int4_grid(w, "absmax")


def test_constant_and_one_sided_rows():
    w = torch.stack([torch.full((64,), 0.3), torch.linspace(0.5, 1.0, 64), torch.linspace(-2.0, -1.0, 64)])
    for grid in ("mse", "minmax"):
        scale, zero = int4_grid(w, grid)
        assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
    err = _row_error(w, "mse")
    assert float(err[0]) < 1e-4  # a constant row is represented (to bf16 grid precision)
    assert torch.all(err <= _row_error(w, "minmax") + 1e-6)


@pytest.mark.parametrize("grid", ["mse", "minmax"])
def test_integer_zero_points_are_exact_integers_and_the_grid_holds_zero(grid):
    w = torch.cat([_gaussian_rows(), torch.linspace(0.5, 1.0, 64)[None], torch.linspace(-2.0, -1.0, 64)[None]])
    scale, zero = int4_grid(w, grid, zero_point="integer")
    assert scale.dtype == zero.dtype == torch.float32
    assert torch.equal(scale, scale.to(torch.bfloat16).float())  # the scale is a bf16 value
    z = 8 - zero / scale
    assert torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= 15
    assert torch.equal((8 - z) * scale, zero)  # (8 - z) * s is exact in float32
    codes = int4_codes(w, scale[:, None], zero[:, None])
    # our kernel form equals compressed-tensors' (q - z) * s bit for bit
    assert torch.equal(int4_dequant(codes, scale[:, None], zero[:, None]), (codes - z[:, None]) * scale[:, None])


def test_integer_zero_points_cost_little_weight_error_and_unknown_kind_raises():
    w = _gaussian_rows()
    for grid in ("mse", "minmax"):
        s_f, z_f = int4_grid(w, grid)
        s_i, z_i = int4_grid(w, grid, zero_point="integer")

        def err(s, z):
            return float((int4_dequant(int4_codes(w, s[:, None], z[:, None]), s[:, None], z[:, None]) - w)
                         .square().sum())

        assert err(s_f, z_f) < err(s_i, z_i) < 1.1 * err(s_f, z_f)  # measured: mse 1.035x, minmax 1.02x
    with pytest.raises(ValueError, match="zero_point"):
        int4_grid(w, "mse", zero_point="int")


def test_rtn_with_integer_zero_points_builds_an_integer_int4_linear():
    w = _gaussian_rows().view(64, 256)
    mod = int4_rtn(w, 64, zero_point="integer")
    assert mod.zero_point == "integer" and mod.zeros.dtype == torch.float32
    assert mod.meta()["zero_point"] == "integer"
    assert int4_rtn(w, 64).meta()["zero_point"] == "float"
