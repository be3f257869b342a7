"""The EAGLE-3 drafter on tiny random models (float32): the dynamic tree against a from-scratch
reference, the head's state after verification steps, and losslessness (greedy, sampled, compiled)."""

import pytest
import torch

import specdec
from runtime.tiny import tiny_model
from specdec.drafters import EagleDrafter, EagleTreeConfig
from specdec.drafters.eagle.drafter import _rerank
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head
from specdec.loader import make_drafter
from specdec.sampling import probs_from_logits

V = 64


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6)


def random_head(target, draft_vocab=32, seed=0, scale=1.0, **kw):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=draft_vocab, **kw))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    head.set_draft_vocab(torch.arange(draft_vocab) * (target.config.vocab_size // draft_vocab))
    return head


def prompts(n, seed=0, lo=3, hi=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(lo, hi, (), generator=g)),), generator=g) for _ in range(n)]


def test_tree_config_validates():
    assert EagleTreeConfig(depth=3, top_k=2, total_tokens=10).candidates == 10
    with pytest.raises(ValueError, match="exceeds the 10 candidates"):
        EagleTreeConfig(depth=3, top_k=2, total_tokens=11)
    with pytest.raises(ValueError, match="top_k"):
        EagleTreeConfig(top_k=0)


def test_rerank_keeps_the_best_candidates_as_a_tree():
    # candidates: 0, 1 at depth 1; 2, 3 children of 0; 4, 5 children of 1; 6 child of 3
    scores = torch.tensor([[-0.1, -0.5, -0.3, -0.2, -0.9, -0.6, -0.25]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 3]])
    tokens = torch.arange(10, 17)[None]
    head = Eagle3Head(Eagle3Config(hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8, intermediate_size=8,
                                   vocab_size=20, draft_vocab_size=20, num_target_layers=4, aux_layers=(0, 1, 2),
                                   max_position_embeddings=16))
    tree = _rerank(head, scores, tokens, parents, 5, [0])
    # order by score: 0 (-0.1), 3 (-0.2), 6 (-0.25), 2 (-0.3), 1 (-0.5)
    assert tree.tokens.tolist() == [[10, 13, 16, 12, 11]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, -1]]
    assert tree.lens.tolist() == [5]
    assert _rerank(head, scores, tokens, parents, 5, []).lens.tolist() == [0]


def _head_inputs(head, target, seq, n_committed):
    """Reference: the head's inputs for positions 1..n of `seq` from a fresh target forward."""
    aux = target(seq[None], torch.arange(seq.numel())[None], None, aux_layers=head.config.aux_layers).aux
    fused = head.fuse(aux[:, :n_committed])  # states behind tokens 0..n-1
    embeds = target.embed(seq[None, 1:n_committed + 1])  # tokens 1..n
    return fused, embeds


def _reference_tree(head, target, seq, tree_cfg):
    """EAGLE-2's tree for one row with no cache: each node's output recomputed from scratch along
    its path. Returns [(token path, score)] of the kept nodes, best first."""
    n = seq.numel() - 1  # the root's position
    fused, embeds = _head_inputs(head, target, seq, n)
    positions = torch.arange(1, n + 1)[None]

    def output(path_tokens, path_hidden):  # the head's output after the committed context + path
        h = torch.cat([fused] + [x[None, None] for x in path_hidden], 1)
        e = torch.cat([embeds, target.embed(torch.tensor(path_tokens, dtype=torch.long))[None]], 1)
        pos = torch.cat([positions, torch.arange(n + 1, n + 1 + len(path_tokens))[None]], 1)
        return head.step(h, e, pos)[0, -1]

    K = tree_cfg.top_k
    root = output([], [])
    logp = torch.log_softmax(head.logits(root).float(), -1)
    top = logp.topk(K)
    nodes = [((int(head.target_ids(t)),), float(s)) for s, t in zip(top.values, top.indices)]
    frontier = list(nodes)
    for _ in range(1, tree_cfg.depth):
        children = []
        for path, score in frontier:
            hiddens, out = [], root
            for j in range(len(path)):  # each path element reads its parent's output
                hiddens.append(out)
                out = output(list(path[:j + 1]), hiddens)
            lp = torch.log_softmax(head.logits(out).float(), -1).topk(K)
            children += [(path + (int(head.target_ids(t)),), score + float(s)) for s, t in zip(lp.values, lp.indices)]
        nodes += children
        frontier = sorted(children, key=lambda c: -c[1])[:K]
    return sorted(nodes, key=lambda c: -c[1])[:tree_cfg.total_tokens]


@pytest.mark.parametrize("norms,shape", [({}, (3, 3, 12)), ({"norm_before_fc": True, "norm_output": True}, (3, 3, 12)),
                                         ({}, (4, 5, 3))])
def test_the_dynamic_tree_equals_a_from_scratch_reference(deep, norms, shape):
    """Batched rows of different lengths, after a few verified steps: every kept node (as its
    token path) and its cumulative score equal EAGLE-2's tree recomputed without any cache (also
    for a head whose steps read normed states, speculators' later options, and for a small tree
    the drafter grows trimmed to depth and top_k 3 while the reference grows the full 4 x 5)."""
    head = random_head(deep, scale=3.0, **norms)
    tree_cfg = EagleTreeConfig(*shape)
    drafter = EagleDrafter(head, deep, tree_cfg)
    captured = []
    propose = drafter.propose
    drafter.propose = lambda seqs, k, rows: captured.append((list(seqs), propose(seqs, k, rows))) or captured[-1][1]
    with torch.no_grad():
        specdec.generate(deep, prompts(2, seed=3), draft=drafter, max_new_tokens=12)
        for seqs, tree in captured[:3]:
            for b, seq in enumerate(seqs):
                ref = _reference_tree(head, deep, seq, tree_cfg)
                got = [tuple(tree.tokens[b, tree.path(b, i)].tolist()) for i in range(tree.num_nodes)]
                assert got == [p for p, _ in ref]
                assert all(tree.parents[b, i] < i for i in range(tree.num_nodes))
                depth = tree.depths()[b]
                assert int(depth.max()) <= 3 and int((depth == 1).sum()) <= 3


def test_a_small_tree_is_grown_with_depth_and_top_k_capped_at_its_nodes(deep):
    """A 2-node tree of shape 5 x 8 feeds the head 2 rows once per round after the catch-up, not
    8 rows at 4 levels."""
    assert EagleTreeConfig(5, 8, 2).trimmed() == EagleTreeConfig(2, 2, 2)
    assert EagleTreeConfig(5, 8, 48).trimmed() == EagleTreeConfig(5, 8, 48)
    head = random_head(deep)
    drafter = EagleDrafter(head, deep, EagleTreeConfig(5, 8, 2))
    grown, rounds = [], []
    step, propose = head.step, drafter.propose

    def counted(hidden, embeds, positions, cache=None, mask=None):
        if mask is not None:  # a tree level (the catch-up passes none)
            grown.append(hidden.shape[1])
        return step(hidden, embeds, positions, cache, mask)

    head.step = counted
    drafter.propose = lambda *a: rounds.append(1) or propose(*a)
    with torch.no_grad():
        specdec.generate(deep, prompts(1), draft=drafter, max_new_tokens=8)
    assert rounds and grown == [2] * len(rounds)


def test_the_head_reads_the_verified_states_of_every_accepted_token(deep):
    """After generation steps that accepted drafts, the head's output at the root equals the head
    run from scratch over the whole sequence with a fresh target forward's aux states."""
    head = random_head(deep, draft_vocab=V, scale=3.0)
    drafter = EagleDrafter(head, deep, EagleTreeConfig(depth=2, top_k=4, total_tokens=8))
    checked = []
    propose = drafter.propose

    def check(seqs, k, rows):
        tree = propose(seqs, k, rows)
        for b in rows:
            n = seqs[b].numel() - 1
            fused, embeds = _head_inputs(head, deep, seqs[b], n)
            ref = head.step(fused, embeds, torch.arange(1, n + 1)[None])[0, -1]
            torch.testing.assert_close(drafter.last[b], ref, rtol=1e-4, atol=1e-4)
            checked.append(b)
        return tree

    drafter.propose = check
    out = specdec.generate(deep, prompts(3, seed=5), draft=drafter, max_new_tokens=16)
    assert len(checked) > 10 and out.stats.accepted_tokens > 0


@pytest.mark.parametrize("tree,norms", [(EagleTreeConfig(), {}),
                                        (EagleTreeConfig(depth=1, top_k=2, total_tokens=1), {}),
                                        (EagleTreeConfig(), {"fc_norm": True, "norm_output": True})])
def test_greedy_eagle_equals_plain_decoding_on_ragged_batches(deep, tree, norms):
    head = random_head(deep, **norms)
    rows = prompts(2, seed=1, lo=3, hi=20)
    plain = specdec.generate(deep, rows, max_new_tokens=24)
    out = specdec.generate(deep, rows, draft=EagleDrafter(head, deep, tree), max_new_tokens=24)
    for a, b in zip(out.sequences, plain.sequences):
        assert torch.equal(a, b)
    assert out.stats.target_forwards < 2 * 24


def test_eagle_heads_pass_through_generate_and_make_drafter(deep, tmp_path):
    head = random_head(deep)
    specdec.save_eagle(head, tmp_path / "h")
    assert isinstance(make_drafter(head, deep), EagleDrafter)
    loaded = make_drafter(f"eagle:{tmp_path / 'h'}", deep)
    assert isinstance(loaded, EagleDrafter) and loaded.hidden_layers == head.config.aux_layers
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    a = specdec.generate(deep, ids, draft=head, max_new_tokens=10)
    b = specdec.generate(deep, ids, draft=f"eagle:{tmp_path / 'h'}", max_new_tokens=10)
    assert torch.equal(a.sequences, specdec.generate(deep, ids, max_new_tokens=10).sequences)
    assert torch.equal(a.sequences, b.sequences)
    with pytest.raises(ValueError, match="not made for a target"):
        make_drafter(head, tiny_model("llama", seed=0, vocab_size=V, hidden_size=32))


def test_lossless_eagle_sampling_matches_the_target_distribution():
    """Tokens 1-3 (2 and 3 drafted by the tree) follow the target's exact marginals.

    Vocabulary 8, n = 4000 identical rows in one call: each empirical probability has standard
    deviation <= sqrt(0.25 / 4000) = 0.008; the bound 0.04 is 5 standard deviations.
    """
    Vs = 8
    m = tiny_model("llama", seed=1, vocab_size=Vs, num_hidden_layers=4)
    head = random_head(m, draft_vocab=Vs, aux_layers=(1, 2, 3))
    drafter = EagleDrafter(head, m, EagleTreeConfig(depth=2, top_k=2, total_tokens=4))
    prompt = torch.tensor([1, 5, 2])
    n = 4000
    g = torch.Generator().manual_seed(0)
    out = specdec.generate(m, [prompt] * n, draft=drafter, max_new_tokens=3, temperature=0.8, generator=g)
    new = torch.stack([s[3:] for s in out.sequences])  # (n, 3)
    assert out.stats.accepted_tokens > 0

    def p_next(seq):
        return probs_from_logits(m(seq[None], torch.arange(seq.numel())[None], None).logits[0, -1], 0.8)

    with torch.no_grad():
        p1 = p_next(prompt)
        p2, p3 = torch.zeros(Vs), torch.zeros(Vs)
        for a in range(Vs):
            pa = p_next(torch.cat([prompt, torch.tensor([a])]))
            p2 += p1[a] * pa
            for b in range(Vs):
                p3 += p1[a] * pa[b] * p_next(torch.cat([prompt, torch.tensor([a, b])]))
    for col, p in ((0, p1), (1, p2), (2, p3)):
        emp = torch.bincount(new[:, col], minlength=Vs).float() / n
        assert (emp - p).abs().max() < 0.04, (col, emp, p)


def test_greedy_eagle_on_a_compiled_target_runs_compiled_tree_steps(deep):
    """On a runtime.compile_decode target the tree steps take the compiled program (returning the
    aux states too) and the output still equals plain decoding."""
    from runtime import compile_decode

    compiled = compile_decode(tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6))  # deep's weights
    head = random_head(compiled)
    tree = EagleTreeConfig(depth=3, top_k=3, total_tokens=9)
    outputs = []
    step = compiled.compiled_step
    compiled.compiled_step = lambda *a: outputs.append((r := step(*a)).aux is not None) or r
    rows = prompts(2, seed=4)
    plain = specdec.generate(deep, rows, max_new_tokens=16)
    out = specdec.generate(compiled, rows, draft=EagleDrafter(head, compiled, tree), max_new_tokens=16)
    for a, b in zip(out.sequences, plain.sequences):
        assert torch.equal(a, b)
    assert outputs.count(True) > 1 and not hasattr(compiled, "aux_layers")


def test_the_head_drafts_with_its_targets_triton_attention(deep, monkeypatch):
    """A target with attention="triton" (the interpreter on a CPU) gives its head the same backend:
    the head's catch-up and tree steps run the Triton kernel, drafting the trees SDPA drafts (same
    tau), and the output equals plain decoding."""
    import specdec.drafters.eagle.head as eagle_mod

    triton_target = tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6)  # deep's weights
    triton_target.attention = "triton"
    backends = []
    attend = eagle_mod.attend
    monkeypatch.setattr(eagle_mod, "attend", lambda *a: backends.append(a[5]) or attend(*a))
    tree = EagleTreeConfig(depth=3, top_k=3, total_tokens=9)
    rows = prompts(2, seed=6)
    plain = specdec.generate(deep, rows, max_new_tokens=10)
    sdpa = specdec.generate(deep, rows, draft=EagleDrafter(random_head(deep), deep, tree), max_new_tokens=10)
    assert set(backends) == {"sdpa"}
    backends.clear()
    head = random_head(triton_target)
    out = specdec.generate(triton_target, rows, draft=EagleDrafter(head, triton_target, tree), max_new_tokens=10)
    assert set(backends) == {"triton"} and head.attention == "triton"
    for a, b in zip(out.sequences, plain.sequences):
        assert torch.equal(a, b)
    assert out.stats.mean_accepted_tokens == sdpa.stats.mean_accepted_tokens
