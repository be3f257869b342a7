"""Row-invariant bf16 forwards: a row's bits do not depend on the rows, tokens or padding beside it.

Every comparison here is bitwise (`torch.equal`) in bfloat16: linears at every row count, the
attention kernel for one query alone, in a block, in a tree and in a padded batch, and whole
forwards of a tiny model (eager and compiled) scored one token at a time, as a block, as a tree
and among other rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime import invariant
from runtime.attention import block_mask_keys, causal_mask
from runtime.tiny import tiny_model

pytestmark = pytest.mark.skipif(invariant.unsupported_reason(torch.device("cpu"), torch.bfloat16) is not None,
                                reason="row-invariant forwards unsupported here (no C++ CPU kernels)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1536, 2048), (8960, 1536), (576, 49152)])
def test_a_linear_row_is_the_same_bits_at_every_row_count(shape):
    K, N = shape
    lin = nn.Linear(K, N, bias=K == 1536).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=_gen(0)) * 0.02)
    x = torch.randn(100, K, generator=_gen(1)).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([invariant.linear(lin, x[r:r + 1], True) for r in range(100)])  # (100, N)
        for M in (2, 3, 8, 31, 32, 33, 48, 65, 100):
            assert torch.equal(invariant.linear(lin, x[:M], True), alone[:M]), M
        assert torch.equal(invariant.linear(lin, x[:12].view(3, 4, K), True), alone[:12].view(3, 4, N))


def test_quantized_and_non_invariant_linears_run_as_they_are():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(40, 64, generator=_gen(2)).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(invariant.linear(lin, x, False), F.linear(x, lin.weight, lin.bias))

    class Other(nn.Linear):  # a subclass (a quantized linear) keeps its own forward
        def forward(self, x):
            return torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)

    assert not invariant.linear(Other(64, 32).to(torch.bfloat16), x, True).any()


def _qkv(B: int, Hq: int, Hkv: int, T: int, S: int, D: int, seed: int):
    g = _gen(seed)
    q = torch.randn(B, Hq, T, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("D", [64, 128, 40])
def test_attention_of_a_query_alone_equals_it_in_a_block_and_is_accurate(D):
    B, Hq, Hkv, T, S = 2, 6, 2, 8, 80
    q, k, v = _qkv(B, Hq, Hkv, T, S, D, seed=3)
    pre = torch.tensor([30, 61])
    block = invariant.attention(q, k, v, None, pre, None)  # (B, Hq, T, D)
    for t in range(T):
        alone = invariant.attention(q[:, :, t:t + 1].contiguous(), k, v, None, pre + t, None)
        assert torch.equal(alone[:, :, 0], block[:, :, t]), t
    num = int(pre.max()) + T
    mask = causal_mask(pre, T, num)  # (B, T, S)
    assert torch.equal(invariant.attention(q, k[:, :, :num], v[:, :, :num], mask, pre, None), block)
    scores = (q.double() @ k[:, :, :num].double().repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)) / D ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    want = scores.softmax(-1) @ v[:, :, :num].double().repeat_interleave(Hq // Hkv, 1)
    assert (block.double() - want).abs().max() < 1e-2


def test_attention_of_a_row_does_not_depend_on_other_rows_or_padding():
    q, k, v = _qkv(3, 4, 4, 5, 120, 64, seed=4)
    pre = torch.tensor([17, 110, 64])
    batch = invariant.attention(q, k, v, None, pre, None)
    for b in range(3):
        keys = int(pre[b]) + 5
        alone = invariant.attention(q[b:b + 1], k[b:b + 1, :, :keys], v[b:b + 1, :, :keys], None, pre[b:b + 1], None)
        assert torch.equal(alone, batch[b:b + 1]), b


def _tree_mask(parent: list[int]) -> torch.Tensor:
    """(1, N, N) bool: node i sees itself and its ancestors (parent[i] = -1 for a root)."""
    N = len(parent)
    mask = torch.zeros(1, N, N, dtype=torch.bool)
    for i in range(N):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parent[j]
    return mask


def test_attention_of_a_tree_node_equals_its_branch_decoded_as_a_chain():
    # tree over 6 new tokens after 40 cached slots: 0 -> {1, 2}, 1 -> 3, 2 -> 4, 3 -> 5
    parent = [-1, 0, 0, 1, 2, 3]
    N, P, D = len(parent), 40, 64
    block_mask = _tree_mask(parent)
    q, k, v = _qkv(1, 6, 2, N, P + N, D, seed=5)
    pre = torch.tensor([P])
    tree = invariant.attention(q, k, v, block_mask_keys(pre, block_mask, P + N), pre, None)
    for i in range(N):
        path = [j for j in range(N) if block_mask[0, i, j]]  # ancestors then i, in slot order
        slots = list(range(P)) + [P + j for j in path]
        chain = invariant.attention(q[:, :, i:i + 1].contiguous(), k[:, :, slots], v[:, :, slots], None,
                                    torch.tensor([len(slots) - 1]), None)
        assert torch.equal(chain[:, :, 0], tree[:, :, i]), i


def test_attention_with_a_sliding_window_equals_the_windowed_mask():
    q, k, v = _qkv(2, 4, 2, 6, 70, 64, seed=6)
    pre = torch.tensor([50, 64])
    got = invariant.attention(q, k, v, None, pre, 16)
    assert torch.equal(got, invariant.attention(q, k, v, causal_mask(pre, 6, 70, 16), pre, None))


def _qwen_widths():
    """One layer of qwen2.5-coder-1.5b's widths (at smaller ones, plain kernels happen to be invariant too)."""
    return tiny_model("qwen2", dtype=torch.bfloat16, hidden_size=1536, intermediate_size=8960, num_hidden_layers=1,
                      num_attention_heads=12, num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def model():
    return _qwen_widths()


def _score(model, tokens: torch.Tensor, prompt: int, chunks: list[int], rows: int = 1) -> torch.Tensor:
    """Logits (chunk tokens of row 0) after a `prompt`-token prefill, fed in `chunks`; other rows
    (if any) hold other tokens and shorter lengths."""
    B = rows
    tok = tokens.expand(B, -1).clone()
    if B > 1:
        tok[1:] = torch.randint(0, 256, (B - 1, tok.shape[1]), generator=_gen(9))
    pos = torch.arange(tok.shape[1]).expand(B, -1)
    cache = model.new_cache(B, 96)
    with torch.inference_mode():
        from specdec.rows import prefill

        prefill(model, [tok[b, :prompt - 3 * b] for b in range(B)], cache)
        out, i = [], prompt
        for c in chunks:
            lens = cache.lengths.clone()
            step_tok = torch.stack([tok[b, int(lens[b]):int(lens[b]) + c] for b in range(B)])
            step_pos = torch.stack([pos[b, int(lens[b]):int(lens[b]) + c] for b in range(B)])
            out.append(model(step_tok, step_pos, cache).logits[:1])
            i += c
    return torch.cat(out, 1)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_forward_scores_each_token_the_same_in_any_block_or_batch(model, compiled):
    if compiled:
        model = _qwen_widths().compile_decode()
    assert model.row_invariant
    tokens = torch.randint(0, 256, (1, 40), generator=_gen(7))
    ref = _score(model, tokens, 21, [1] * 8)
    for chunks in ([8], [3, 5], [2, 2, 4]):
        assert torch.equal(_score(model, tokens, 21, chunks), ref), chunks
    assert torch.equal(_score(model, tokens, 21, [8], rows=3), ref)
    assert torch.equal(_score(model, tokens, 21, [1] * 8, rows=3), ref)
    if compiled:  # a 1-row step runs a 1-row program: no kernel of a row-invariant program splits a reduction
        shapes, step = [], model.compiled_step
        model.compiled_step = lambda tokens, *rest: (shapes.append(tuple(tokens.shape)), step(tokens, *rest))[1]
        _score(model, tokens, 21, [1])
        assert shapes == [(1, 1)]


def test_a_tree_forward_scores_each_node_as_its_branch(model):
    parent = [-1, 0, 0, 1]
    N, P = len(parent), 15
    block = _tree_mask(parent)
    depth = block.sum(-1) - 1  # (1, N)
    g = _gen(8)
    prompt = torch.randint(0, 256, (1, P), generator=g)
    nodes = torch.randint(0, 256, (1, N), generator=g)
    with torch.inference_mode():
        cache = model.new_cache(1, 64)
        model(prompt, torch.arange(P)[None], cache)
        tree = model(nodes, P + depth, cache, block_mask=block).logits  # (1, N, V)
        for i in range(N):
            path = [j for j in range(N) if block[0, i, j]]
            chain_cache = model.new_cache(1, 64)
            model(prompt, torch.arange(P)[None], chain_cache)
            chain = model(nodes[:, path], torch.arange(P, P + len(path))[None], chain_cache).logits
            assert torch.equal(chain[:, -1], tree[:, i]), i


def test_turning_it_off_restores_the_batch_dependent_kernels(model):
    model.want_row_invariant = False
    try:
        assert not model.row_invariant
    finally:
        model.want_row_invariant = True
    assert not tiny_model(dtype=torch.float32).row_invariant
    assert "bfloat16" in invariant.unsupported_reason(torch.device("cpu"), torch.float32)


def test_a_float32_model_with_block_quantized_linears_is_row_invariant_too():
    """float32 (the 4-bit default where bf16 is slow): every linear in the block kernels, attention in
    the row-invariant kernel; one dense linear makes the model batch-dependent again."""
    import quant
    from runtime.blockq import to_block_quant

    model = _qwen_widths().float()
    assert not model.row_invariant  # dense float32 linears: MKL's sgemm depends on the row count
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32, include_lm_head=True), progress=False)
    to_block_quant(model)
    assert model.row_invariant
    tokens = torch.randint(0, 256, (1, 40), generator=_gen(7))
    ref = _score(model, tokens, 21, [1] * 8)
    for chunks in ([8], [3, 5]):
        assert torch.equal(_score(model, tokens, 21, chunks), ref), chunks
    assert torch.equal(_score(model, tokens, 21, [8], rows=3), ref)
    assert invariant.unsupported_reason(torch.device("cpu"), torch.float32, dense_linears=False) is None


def test_the_dense_linear_scan_runs_once_and_follows_module_swaps():
    """float32 `row_invariant` scans the modules once, not every forward, and rescans after a swap."""
    import quant
    from runtime.blockq import to_block_quant

    model = _qwen_widths().float()
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32, include_lm_head=True), progress=False)
    to_block_quant(model)
    assert model.row_invariant
    scans = []
    walk = model.modules
    model.modules = lambda: scans.append(1) or walk()
    for _ in range(3):
        assert model.row_invariant
    assert len(scans) <= 1
    mlp = model.layers[0].mlp
    mlp.w2 = nn.Linear(mlp.w2.in_features, mlp.w2.out_features, bias=False)
    assert not model.row_invariant  # a dense float32 linear again
