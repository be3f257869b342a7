"""quant.gptq: the GPTQ / SparseGPT solver reduces the layer-output error that round-to-nearest leaves."""

import torch

from quant.gptq import HessianAccumulator, solve
from quant.grids import int4_rtn, mask_24


def _problem(N=64, K=128, n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g)
    mix = torch.randn(K, K, generator=g) / K ** 0.5 + torch.eye(K)  # correlated inputs
    X = torch.randn(n, K, generator=g) @ mix * torch.linspace(0.1, 3, K)  # (n, K)
    acc = HessianAccumulator(K, torch.device("cpu"))
    for chunk in X.split(100):
        acc.add(chunk)
    return W, X, acc.H


def _err(W, Q, X):
    return float(((X @ W.T - X @ Q.T) ** 2).mean())


def test_hessian_accumulator_equals_2xtx_over_n():
    _, X, H = _problem()
    assert torch.allclose(H, 2 * X.T @ X / X.shape[0], rtol=1e-4, atol=1e-3)


def test_gptq_beats_rtn_on_the_layer_output():
    W, X, H = _problem()
    rtn = int4_rtn(W, 32).dequantize()
    for act_order in (False, True):
        res = solve(W, H, group_size=32, act_order=act_order, block_size=32)
        assert res.codes.min() >= 0 and res.codes.max() <= 15
        assert _err(W, res.weight, X) < 0.8 * _err(W, rtn, X)


def test_gptq_with_hessian_weighted_grids_beats_rtn_and_stays_on_its_grid():
    W, X, H = _problem()
    rtn = int4_rtn(W, 32).dequantize()
    for act_order in (False, True):
        res = solve(W, H, group_size=32, act_order=act_order, block_size=32, grid="hmse")
        assert _err(W, res.weight, X) < 0.8 * _err(W, rtn, X)
        g = torch.arange(128) // 32
        assert torch.allclose((res.codes - 8) * res.scales[:, g] + res.zeros[:, g], res.weight, atol=1e-6)


def test_gptq_result_is_on_its_grid():
    W, _, H = _problem()
    res = solve(W, H, group_size=32)
    g = torch.arange(128) // 32
    deq = (res.codes - 8) * res.scales[:, g] + res.zeros[:, g]
    assert torch.allclose(deq, res.weight, atol=1e-6)


def test_sparsegpt_is_24_and_beats_magnitude():
    W, X, H = _problem()
    res = solve(W, H, sparse24=True)
    zeros = (res.weight.view(64, 32, 4) == 0).sum(-1)
    assert bool((zeros >= 2).all()) and torch.equal(res.drop.view(64, 32, 4).sum(-1), torch.full((64, 32), 2))
    magnitude = W.masked_fill(mask_24(W.abs()), 0.0)
    assert _err(W, res.weight, X) < 0.8 * _err(W, magnitude, X)


def test_sparse_and_int4_together_keep_the_pattern():
    W, X, H = _problem()
    res = solve(W, H, sparse24=True, group_size=32)
    assert torch.equal(res.weight[res.drop], torch.zeros(int(res.drop.sum())))
    assert _err(W, res.weight, X) < _err(W, torch.zeros_like(W), X) * 0.5


def test_mask_24_drops_the_two_lowest_of_each_four():
    scores = torch.tensor([[4.0, 1.0, 3.0, 2.0, 0.5, 0.1, 0.9, 0.7]])
    assert mask_24(scores).tolist() == [[False, True, False, True, True, True, False, False]]


def test_gptq_with_integer_zero_points_stays_on_an_integer_grid_and_beats_rtn():
    W, X, H = _problem()
    rtn = int4_rtn(W, 32, zero_point="integer").dequantize()
    g = torch.arange(128) // 32
    for act_order in (False, True):
        res = solve(W, H, group_size=32, act_order=act_order, block_size=32, zero_point="integer")
        z = 8 - res.zeros / res.scales
        assert torch.equal(z, z.round()) and torch.equal((8 - z) * res.scales, res.zeros)
        assert torch.equal((res.codes - z[:, g]) * res.scales[:, g], res.weight)  # the feedback saw these weights
        assert _err(W, res.weight, X) < 0.8 * _err(W, rtn, X)
