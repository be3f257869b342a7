"""Medusa heads and tree decoding on tiny random models (float32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import specdec
from runtime.loading import from_hf_state
from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads
from specdec.drafters.medusa.tree import Tree, draft_tree
from specdec.sampling import probs_from_logits
from specdec.verify import verify


def tiny(vocab=128, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return from_hf_state(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg)


@pytest.fixture(scope="module")
def model():
    return tiny()


def random_heads(model, num_heads=3, tree=None, seed=0, shared=True):
    cfg = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads,
                       tree=tree, shared_lm_head=shared)
    heads = MedusaHeads(cfg, model.lm_head)
    g = torch.Generator().manual_seed(seed)
    for blk in heads.blocks:
        blk[0].linear.weight.data = torch.randn(64, 64, generator=g) * 0.3
    return heads


def prompts(n, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
            for _ in range(n)]


def test_zero_initialised_heads_start_as_the_base_lm_head(model):
    heads = MedusaHeads(MedusaConfig(64, 128, num_heads=2), model.lm_head)
    h = torch.randn(5, 64)
    logits = heads(h)  # (K, 5, V)
    assert logits.shape == (2, 5, 128)
    for k in range(2):
        torch.testing.assert_close(logits[k], model.lm_head(h))
    assert sum(p.numel() for p in heads.parameters()) == 2 * (64 * 64 + 64)


def test_separate_lm_heads_are_trainable_copies(model):
    heads = MedusaHeads(MedusaConfig(64, 128, num_heads=2, shared_lm_head=False), model.lm_head)
    assert len(heads.lm_heads) == 2
    torch.testing.assert_close(heads.lm_heads[0].weight, model.lm_head.weight)
    assert heads.lm_heads[0].weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_greedy_medusa_equals_plain_decoding_on_ragged_batches(model):
    heads = random_heads(model, tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    rows = prompts(5)
    plain = specdec.generate(model, rows, max_new_tokens=24)
    out = specdec.generate(model, rows, draft=heads, max_new_tokens=24)
    for a, b in zip(out.sequences, plain.sequences):
        assert torch.equal(a, b)
    s = out.stats
    assert s.generated_tokens == 5 * 24 and s.num_calls == 1
    assert s.target_forwards < plain.stats.target_forwards
    assert s.mean_accepted_tokens > 1.0 and s.drafted_tokens > 0
    assert len(s.per_position_acceptance) == 3


@pytest.mark.parametrize("shared", [True, False])
def test_a_shallow_tree_runs_only_the_heads_it_reaches(model, shared):
    heads = random_heads(model, num_heads=4, seed=1, shared=shared)
    hidden = torch.randn(3, 64)
    heads.restrict_vocab(torch.arange(10, 100))
    assert heads.features(hidden, 2).shape == (2, 3, 64)
    torch.testing.assert_close(heads.features(hidden, 2), heads.features(hidden)[:2])
    assert torch.equal(heads.top_tokens(hidden, 5, 2), heads.top_tokens(hidden, 5)[:2])
    calls = []
    hook = heads.blocks[2].register_forward_hook(lambda *_: calls.append(2))
    heads.guesses(hidden, (2, 1))  # a depth-2 tree: heads 2 and 3 stay idle
    assert calls == []
    hook.remove()


def test_heads_restricted_to_a_guess_vocabulary_stay_lossless(model):
    heads = random_heads(model, tree=((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)))
    heads.restrict_vocab(torch.arange(40, 128))
    rows = prompts(4, seed=5)
    hidden = torch.randn(4, 64)
    assert all(int(g.min()) >= 40 for g in heads.guesses(hidden, (3, 2, 1)))
    feats = heads.features(hidden)  # the guess rows are gathered once and kept, not per step
    torch.testing.assert_close(heads.head_logits(feats, heads.vocab),
                               heads.head_logits(feats, heads.vocab.clone()))
    assert heads._base_rows() is heads._base_rows()
    plain = specdec.generate(model, rows, max_new_tokens=20)
    out = specdec.generate(model, rows, draft=heads, max_new_tokens=20)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))
    with pytest.raises(ValueError, match="token id 128 is outside the vocabulary \\[0, 128\\)"):
        heads.restrict_vocab(torch.tensor([5, 128]))
    heads.restrict_vocab(torch.tensor([7, 3, 7, 5]))  # repeats would waste tree nodes on one token
    assert heads.vocab.tolist() == [3, 5, 7] and heads.config.guess_vocab == 3
    heads.restrict_vocab(None)
    assert heads.vocab is None and heads.config.guess_vocab == 0


def test_the_gathered_guess_rows_follow_changes_of_the_base_head():
    other = tiny(seed=3)  # changed in place below: not the shared model
    heads = random_heads(other)
    heads.restrict_vocab(torch.arange(40, 128))
    cached = heads._base_rows()
    with torch.no_grad():
        other.lm_head.weight[40] += 1.0
    assert heads._base_rows() is not cached
    torch.testing.assert_close(heads._base_rows(), other.lm_head.weight[40:])
    with torch.inference_mode():  # restricted and gathered inside inference mode, usable outside it
        heads.restrict_vocab(torch.arange(60, 128))
        heads.guesses(torch.randn(2, 64), (3, 2, 1))
    assert not heads._base_rows().is_inference()
    assert heads.head_logits(heads.features(torch.randn(2, 64)), heads.vocab).shape == (3, 2, 68)

def test_greedy_medusa_with_eos_and_tensor_input(model):
    heads = random_heads(model, tree=((0,), (1,), (0, 0), (0, 0, 0)))
    ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(3))
    plain = specdec.generate(model, ids, max_new_tokens=30)
    eos = int(plain.sequences[0, 10])  # stops row 0 early (and maybe others)
    plain = specdec.generate(model, ids, max_new_tokens=30, eos_token_id=eos)
    out = specdec.generate(model, ids, draft=heads, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(out.sequences, plain.sequences)


class OracleHeads(MedusaHeads):
    """Heads that know the target's greedy continuation: rank 0 of head i is the true token t+2+i.

    The position is recovered by matching the hidden state against those of the full greedy
    sequence; ranks > 0 hold other (wrong) tokens.
    """

    def __init__(self, model, sequences, num_heads):
        super().__init__(MedusaConfig(64, model.config.vocab_size, num_heads=num_heads,
                                      tree=[(0,) * num_heads, (1,), (0, 1)]), model.lm_head)
        self.seqs = sequences
        self.hidden = [model(s[None], torch.arange(s.numel())[None], None, return_hidden=True).hidden[0]
                       for s in sequences]

    def guesses(self, hidden, topk):
        out = [torch.zeros(hidden.shape[0], k, dtype=torch.long) for k in topk]
        for b in range(hidden.shape[0]):
            t = int((self.hidden[b] - hidden[b]).norm(dim=-1).argmin())
            for i, k in enumerate(topk):
                true = int(self.seqs[b][t + 2 + i])
                out[i][b] = (true + torch.arange(k)) % self.config.vocab_size
        return out


def test_oracle_heads_get_the_full_depth_accepted_every_step(model):
    rows = prompts(3, seed=5)
    D = 4
    full = specdec.generate(model, rows, max_new_tokens=40 + D + 2).sequences
    heads = OracleHeads(model, full, D)
    out = specdec.generate(model, rows, draft=heads, max_new_tokens=40)
    for a, b, p in zip(out.sequences, full, rows):
        assert torch.equal(a, b[:p.numel() + 40])
    s = out.stats
    assert s.accepted_tokens == s.drafted_tokens
    assert s.per_position_acceptance == [1.0] * D
    # 40 tokens per row: 1 from the prefill, then D + 1 per step
    assert s.target_forwards == 3 * (1 + -(-39 // (D + 1)))


class HalfBlindOracleHeads(OracleHeads):
    """Oracle heads for the rows not in `blind`; for those every guess is wrong."""

    def __init__(self, model, sequences, num_heads, blind):
        super().__init__(model, sequences, num_heads)
        self.blind = blind

    def guesses(self, hidden, topk):
        out = super().guesses(hidden, topk)
        for b in self.blind:
            for g in out:
                g[b] = (g[b] + 1) % self.config.vocab_size
        return out


def test_a_row_that_accepts_past_max_new_tokens_leaves_room_for_the_others(model):
    # row 0 (the longest prompt) accepts the full depth and ends mid-block, its cache past
    # prompt + max_new_tokens; row 1 accepts nothing and keeps the batch stepping after it.
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, 128, (12,), generator=g), torch.randint(0, 128, (4,), generator=g)]
    D, new = 4, 18  # 17 tokens after the prefill: 3 full steps of 5, then 2 of a 5-token step
    full = specdec.generate(model, rows, max_new_tokens=new + 3 * D).sequences
    heads = HalfBlindOracleHeads(model, full, D, blind=[1])
    out = specdec.generate(model, rows, draft=heads, max_new_tokens=new)
    for a, b, p in zip(out.sequences, full, rows):
        assert torch.equal(a, b[:p.numel() + new])


def test_compaction_leaves_the_cache_equal_to_a_fresh_prefill(model):
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, 128, (9,), generator=g), torch.randint(0, 128, (5,), generator=g)]
    full = specdec.generate(model, rows, max_new_tokens=8).sequences
    tree = Tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)))
    cache = model.new_cache(2, 64)
    specdec.rows.prefill(model, rows, cache)
    lens = cache.lengths.clone()
    # root = true next token; rank 1 of head 0 is true, rank 0 of head 1 is true, then a wrong one
    root = torch.stack([full[b][lens[b]] for b in range(2)])
    guesses = [torch.stack([torch.stack([full[b][lens[b] + 1] + 1, full[b][lens[b] + 1]]) for b in range(2)]) % 128,
               torch.stack([torch.stack([full[b][lens[b] + 2], full[b][lens[b] + 2] + 1]) for b in range(2)]) % 128,
               torch.stack([full[b][lens[b] + 3:lens[b] + 4] + 1 for b in range(2)]) % 128]
    draft = draft_tree(tree, guesses)
    tokens = torch.cat([root[:, None], draft.tokens], dim=1)  # (B, N): the root, then the nodes
    positions = lens[:, None] + torch.tensor(tree.depth)[None]  # (B, N)
    logits = model(tokens, positions, cache, block_mask=draft.block_mask()).logits
    verdict = verify(logits, draft, torch.ones_like(draft.tokens, dtype=torch.bool), 0.0)
    keep = torch.zeros(2, 4, dtype=torch.long)
    count = torch.zeros(2, dtype=torch.long)
    for b, nodes in enumerate(verdict.paths):
        assert nodes == [1, 4]  # (1,) then (1, 0): two accepted draft tokens
        path = torch.tensor([0] + [1 + i for i in nodes])
        keep[b, :path.numel()] = lens[b] + path
        count[b] = path.numel()
    cache.compact(keep, lens, count)
    assert cache.lengths.tolist() == (lens + 3).tolist()
    bonus = verdict.next_tokens
    nxt = model(bonus[:, None], cache.lengths[:, None].clone(), cache).logits[:, 0]  # (B, V)
    for b in range(2):
        seq = torch.cat([full[b][:lens[b] + 3], bonus[b:b + 1]])
        assert torch.equal(seq, full[b][:seq.numel()])
        ref = model(seq[None], torch.arange(seq.numel())[None], None).logits[0, -1]
        torch.testing.assert_close(nxt[b], ref, rtol=1e-4, atol=1e-4)


def test_lossless_medusa_sampling_matches_the_target_distribution():
    """Tokens 2 and 3 (drafted by the tree) follow the target's exact marginals.

    Vocabulary 8, n = 4000 identical rows in one call: each empirical probability has standard
    deviation <= sqrt(0.25 / 4000) = 0.008; the bound 0.04 is 5 standard deviations.
    """
    V = 8
    m = tiny(vocab=V, seed=1)
    heads = MedusaHeads(MedusaConfig(64, V, num_heads=2, tree=((0,), (1,), (0, 0), (1, 0))),
                        m.lm_head)
    prompt = torch.tensor([1, 5, 2])
    n = 4000
    g = torch.Generator().manual_seed(0)
    out = specdec.generate(m, [prompt] * n, draft=heads, max_new_tokens=3, temperature=0.8,
                           generator=g)
    new = torch.stack([s[3:] for s in out.sequences])  # (n, 3)
    assert out.stats.accepted_tokens > 0

    def p_next(seq):
        return probs_from_logits(m(seq[None], torch.arange(seq.numel())[None], None).logits[0, -1], 0.8)

    p1 = p_next(prompt)
    p2 = torch.zeros(V)
    p3 = torch.zeros(V)
    for a in range(V):
        pa = p_next(torch.cat([prompt, torch.tensor([a])]))
        p2 += p1[a] * pa
        for b in range(V):
            p3 += p1[a] * pa[b] * p_next(torch.cat([prompt, torch.tensor([a, b])]))
    for col, p in ((0, p1), (1, p2), (2, p3)):
        emp = torch.bincount(new[:, col], minlength=V).float() / n
        assert (emp - p).abs().max() < 0.04, (col, emp, p)


def test_heads_that_do_not_fit_the_model_are_refused(model):
    heads = MedusaHeads(MedusaConfig(32, 128, num_heads=2))
    with pytest.raises(ValueError, match="hidden size 32"):
        specdec.generate(model, [torch.tensor([1, 2])], draft=heads, max_new_tokens=4)
    with pytest.raises(ValueError, match="deep"):
        MedusaConfig(64, 128, num_heads=2, tree=((0, 0, 0),))


def test_greedy_medusa_on_a_compiled_target_runs_compiled_tree_steps(model):
    """On a runtime.compile_decode target every tree step takes the compiled program (a 6-token
    block, root + 5 nodes, padded to 8 like a causal block) and the output still equals plain decoding."""
    from runtime import compile_decode

    compiled = compile_decode(tiny())  # the fixture's weights (same seed)
    tree = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    heads = random_heads(compiled, tree=tree)
    sizes, tree_steps = [], []
    step, forward = compiled.compiled_step, compiled.forward
    compiled.compiled_step = lambda *a: sizes.append(a[0].shape[1]) or step(*a)
    compiled.forward = lambda *a, **kw: tree_steps.append(kw.get("block_mask") is not None) or forward(*a, **kw)
    rows = prompts(3, seed=4)
    plain = specdec.generate(model, rows, max_new_tokens=20)
    out = specdec.generate(compiled, rows, draft=heads, max_new_tokens=20)
    for a, b in zip(out.sequences, plain.sequences):
        assert torch.equal(a, b)
    assert sum(tree_steps) > 1 and sizes.count(8) == sum(tree_steps)  # every tree step ran compiled
