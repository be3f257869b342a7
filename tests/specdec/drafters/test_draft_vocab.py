"""specdec.drafters.draft_vocab: frequency-ranked draft vocabularies keep decoding lossless, greedy and
sampled; the restricted head equals the full head's rows; misuse fails clearly."""

import pytest
import torch

import specdec
from runtime.qlinear import Int4Linear, Int8Linear, pack_int4
from runtime.tiny import tiny_model
from specdec.drafters.draft_vocab import frequent_tokens, restrict_vocab, token_counts
from tests.specdec.evaluation.test_evaluate import tiny_tokenizer
from tests.specdec.test_decode import assert_two_token_law

V = 64


def _rows(seed=0, lengths=(3, 12, 6)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 16, (n,), generator=g) for n in lengths]


def test_frequent_tokens_keeps_special_tokens_then_the_most_frequent():
    tok = tiny_tokenizer()
    words = tok.convert_ids_to_tokens(list(range(10, 40)))
    texts = [" ".join(words[:5] * 3), " ".join(words[5:30])]  # ids 10..14 three times each
    counts = token_counts(tok, texts, len(tok))
    assert counts[10:15].tolist() == [3] * 5 and counts[15:40].tolist() == [1] * 25
    ids = frequent_tokens(tok, 16, len(tok), texts)
    special = sorted(i for i in tok.all_special_ids)
    assert set(special) <= set(ids.tolist())
    assert set(range(10, 15)) <= set(ids.tolist())  # the most frequent come next
    n_rest = 16 - len(special) - 5  # ties among the once-seen ids: the lower ids
    assert set(range(15, 15 + n_rest)) <= set(ids.tolist())
    assert torch.equal(ids, ids.sort().values)
    with pytest.raises(ValueError, match="multiple of 16"):
        frequent_tokens(tok, 20, len(tok), texts)


def _int4_head(model):
    w = model.lm_head.weight.detach().float()
    codes = torch.randint(0, 16, w.shape, generator=torch.Generator().manual_seed(0))
    s = torch.full((w.shape[0], w.shape[1] // 32), 0.01, dtype=model.dtype)
    return Int4Linear(pack_int4(codes), s, torch.zeros_like(s), 32)


def _int8_head(model):
    w = model.lm_head.weight.detach().float()
    q = torch.randint(-127, 128, w.shape, generator=torch.Generator().manual_seed(0)).to(torch.int8)
    return Int8Linear(q, torch.full((w.shape[0],), 0.01, dtype=model.dtype))


def _blockq_head(model):
    from runtime.blockq import BlockQuantLinear

    return BlockQuantLinear.from_int4(_int4_head(model))


@pytest.mark.parametrize("head", ["dense", "int8", "int4", "blockq"])
def test_restricted_logits_are_the_full_logits_of_the_kept_ids(head):
    model = tiny_model("qwen2", seed=1, vocab_size=V, dtype=torch.bfloat16)
    if head != "dense":
        model.lm_head = {"int8": _int8_head, "int4": _int4_head, "blockq": _blockq_head}[head](model)
    tokens = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(5)[None].expand(2, -1)
    full = model(tokens, pos, None).logits
    kind = type(model.lm_head)
    ids = torch.arange(0, V, 2)  # 32 ids
    restrict_vocab(model, ids)
    assert type(model.lm_head) is kind and model.lm_head.out_features == 32  # the head keeps its format
    assert torch.equal(model.output_ids, ids)
    assert torch.equal(model(tokens, pos, None).logits, full[..., ids])


@pytest.mark.parametrize("k", [2, "auto"])
def test_greedy_with_a_restricted_draft_equals_plain(k):
    target = tiny_model("llama", seed=0, vocab_size=V)
    rows = _rows(seed=1)
    plain = specdec.generate(target, rows, max_new_tokens=20).sequences
    said = torch.cat([s[r.numel():] for s, r in zip(plain, rows)]).unique()  # what the target says
    rest = torch.tensor([i for i in range(V) if i not in said.tolist()])
    # the target itself, scoring every token it says (padded to 32 ids): every draft accepted
    keep = torch.cat([said, rest[:32 - said.numel()]])
    draft = restrict_vocab(tiny_model("llama", seed=0, vocab_size=V), keep)
    out = specdec.generate(target, rows, draft=draft, max_new_tokens=20, num_draft_tokens=k)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain))
    assert out.stats.acceptance_rate == 1.0
    # without the target's most common tokens: drafts rejected there, the output unchanged
    common = torch.cat([s[r.numel():] for s, r in zip(plain, rows)]).bincount(minlength=V).topk(2).indices
    keep = torch.tensor([i for i in range(V) if i not in common.tolist()])[:32]
    draft = restrict_vocab(tiny_model("llama", seed=0, vocab_size=V), keep)
    out = specdec.generate(target, rows, draft=draft, max_new_tokens=20, num_draft_tokens=k)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain))
    assert 0 < out.stats.acceptance_rate < 1.0


def test_sampling_with_a_restricted_draft_keeps_the_target_law():
    """Two new tokens with top-k/top-p, 6000 rows: the second comes from a draft step (k = 1) of a
    draft that cannot propose half of the vocabulary; the joint law of (x1, x2) over 64 x 64
    cells matches the target's exact law within 3x the expected sampling noise."""
    target = tiny_model("llama", seed=0, vocab_size=V)
    draft = restrict_vocab(tiny_model("qwen2", seed=7, vocab_size=V, num_hidden_layers=1),
                           torch.arange(16, 48))
    n, prompt = 6000, torch.tensor([1, 2, 3, 4])
    kw = dict(temperature=0.8, top_k=12, top_p=0.9)
    out = specdec.generate(target, [prompt] * n, draft=draft, max_new_tokens=3, num_draft_tokens=1,
                           generator=torch.Generator().manual_seed(2), **kw)
    assert out.stats.drafted_tokens >= n and out.stats.accepted_tokens > 0  # the draft step ran
    assert_two_token_law(target, prompt, out.sequences, kw)
    second = torch.stack([s[5] for s in out.sequences])
    assert ((second < 16) | (second >= 48)).any()  # tokens the draft cannot propose still come out


def test_misuse_fails_clearly():
    restricted = restrict_vocab(tiny_model("llama", seed=0, vocab_size=V), torch.arange(32))
    with pytest.raises(ValueError, match="can only draft"):
        specdec.generate(restricted, [torch.tensor([1, 2])], max_new_tokens=2)
    with pytest.raises(ValueError, match="already restricted"):
        restrict_vocab(restricted, torch.arange(16))
    for bad in (torch.arange(20), torch.arange(V - 8, V + 8), torch.zeros(16, dtype=torch.long)):
        with pytest.raises(ValueError, match="distinct ids"):
            restrict_vocab(tiny_model("llama", seed=0, vocab_size=V), bad)
    from runtime import compile_decode

    with pytest.raises(ValueError, match="before runtime.compile_decode"):
        restrict_vocab(compile_decode(tiny_model("llama", seed=0, vocab_size=V)), torch.arange(32))
    with pytest.raises(TypeError, match="runtime Transformer"):
        restrict_vocab(torch.nn.Linear(4, 4), torch.arange(16))
