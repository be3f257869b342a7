"""The decode loop: every drafter is lossless at temperature 0, batches equal single rows,
eos and max_new_tokens edge cases, vocabulary checks, and sampling keeps the target's law."""

import math

import pytest
import torch

import specdec
from runtime.tiny import tiny_model, tiny_pair
from specdec.drafter import Drafter, DraftTree
from specdec.drafters import VocabularyMismatchError
from tests.specdec.conftest import V


def _rows(seed=0, lengths=(3, 12, 6)):
    g = torch.Generator().manual_seed(seed)
    # repetitive prompts give the n-gram drafter something to find
    return [torch.randint(0, 8, (n,), generator=g).repeat(2) for n in lengths]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("k", [1, 3, "auto"])
@pytest.mark.parametrize("which", ["self", "random", "ngram", "suffix", "hybrid", "hf"])
def test_greedy_output_equals_plain_for_every_drafter(target, random_draft, which, k):
    rows = _rows(seed=1)
    plain = specdec.generate(target, rows, max_new_tokens=24).sequences
    draft = {"self": target, "random": random_draft, "ngram": "ngram", "suffix": "suffix",
             "hybrid": ["ngram", random_draft],
             "hf": tiny_pair("qwen2", seed=7, vocab_size=V, num_hidden_layers=1)[1]}[which]
    out = specdec.generate(target, rows, draft=draft, max_new_tokens=24, num_draft_tokens=k)
    assert _same(out.sequences, plain)
    assert out.stats.generated_tokens == sum(s.numel() - r.numel() for s, r in zip(plain, rows))


def test_draft_equal_to_target_accepts_all_k_every_step(target):
    out = specdec.generate(target, _rows(seed=2), draft=target, max_new_tokens=25, num_draft_tokens=4)
    s = out.stats
    assert s.acceptance_rate == 1.0
    assert s.per_position_acceptance == [1.0, 1.0, 1.0, 1.0]
    # 3 rows x (1 prefill token + 24 tokens in steps of 5) -> 1 + 24/5 -> 6 forwards per row
    assert s.target_forwards == 3 * 6 and s.generated_tokens == 75


def test_random_draft_is_almost_never_accepted(target, random_draft):
    out = specdec.generate(target, _rows(seed=3), draft=random_draft, max_new_tokens=20, num_draft_tokens=3)
    assert out.stats.acceptance_rate < 0.3
    assert 1.0 <= out.stats.mean_accepted_tokens < 1.5


def test_batched_rows_equal_each_row_alone(target, random_draft):
    rows = _rows(seed=4, lengths=(2, 9, 5, 14))
    for draft in (random_draft, "ngram"):
        batch = specdec.generate(target, rows, draft=draft, max_new_tokens=18).sequences
        for r, s in zip(rows, batch):
            alone = specdec.generate(target, [r], draft=draft, max_new_tokens=18).sequences[0]
            assert torch.equal(s, alone)


def test_eos_inside_an_accepted_block_ends_the_row_there(target):
    rows = _rows(seed=5, lengths=(6,))
    free = specdec.generate(target, rows, max_new_tokens=20).sequences[0]
    new = free[12:].tolist()
    eos = new[2]  # the third new token; with draft = target it lands inside the first block
    out = specdec.generate(target, rows, draft=target, max_new_tokens=20, eos_token_id=eos,
                           num_draft_tokens=6).sequences[0]
    assert out[12:].tolist() == new[:new.index(eos) + 1]


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_max_new_tokens_is_never_exceeded(target, max_new):
    rows = _rows(seed=6)
    out = specdec.generate(target, rows, draft=target, max_new_tokens=max_new, num_draft_tokens=4)
    assert [s.numel() - r.numel() for s, r in zip(out.sequences, rows)] == [max_new] * 3
    assert out.stats.generated_tokens == 3 * max_new


def test_vocabulary_mismatch_is_a_clear_error(target):
    other = tiny_model("llama", seed=1, vocab_size=V + 8)
    with pytest.raises(VocabularyMismatchError, match=f"{V + 8} entries but the target's has {V}"):
        specdec.generate(target, _rows(), draft=other, max_new_tokens=4)


def _word_tokenizer_dir(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=words[0]).save_pretrained(path)
    return str(path)


def test_same_size_vocabularies_with_different_tokens_are_a_clear_error(tmp_path, monkeypatch):
    words = [f"w{i}" for i in range(V)]
    draft = tiny_model("llama", seed=1, vocab_size=V)
    tgt = tiny_model("llama", seed=0, vocab_size=V)
    tgt.source = _word_tokenizer_dir(tmp_path / "t", words)
    draft.source = _word_tokenizer_dir(tmp_path / "same", words)
    specdec.generate(tgt, _rows(), draft=draft, max_new_tokens=4)  # same tokens: accepted
    import runtime.loading

    loads = []
    monkeypatch.setattr(runtime.loading, "load_tokenizer", lambda src: loads.append(src))
    specdec.generate(tgt, _rows(), draft=draft, max_new_tokens=4)  # checked once per draft/target pair
    assert loads == []
    monkeypatch.undo()
    draft = tiny_model("llama", seed=1, vocab_size=V)
    draft.source = _word_tokenizer_dir(tmp_path / "d", words[:1] + words[1:][::-1])
    with pytest.raises(VocabularyMismatchError, match="tokenizers disagree"):
        specdec.generate(tgt, _rows(), draft=draft, max_new_tokens=4)


def test_impossible_draft_lengths_are_rejected(target):
    for k, kind in ((0, ValueError), (-1, ValueError), ("many", TypeError)):
        with pytest.raises(kind, match="^num_draft_tokens must be an integer in \\[1, 64\\] or 'auto'"):
            specdec.generate(target, _rows(), draft="ngram", max_new_tokens=4, num_draft_tokens=k)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def test_speculative_sampling_keeps_the_joint_law_of_two_tokens(target, random_draft):
    """The first two new tokens with top-k/top-p, 6000 rows at once: x1 from the prefill, x2 from
    a draft step (k = 1; with max_new_tokens=2 no draft step would run). The joint law of
    (x1, x2) over 64 x 64 cells matches the target's exact law within 3x the expected noise."""
    n = 6000
    prompt = torch.tensor([1, 2, 3, 4])
    kw = dict(temperature=0.8, top_k=12, top_p=0.9)
    out = specdec.generate(target, [prompt] * n, draft=random_draft, max_new_tokens=3,
                           num_draft_tokens=2, generator=torch.Generator().manual_seed(1), **kw)
    assert out.stats.drafted_tokens >= n  # every row drafted x2
    assert_two_token_law(target, prompt, out.sequences, kw)


def assert_two_token_law(target, prompt: torch.Tensor, sequences: list, kw: dict) -> None:
    """The first two new tokens of `sequences` (prompt + new) follow the target's exact joint law
    under the sampling settings `kw`, within 3x the expected total-variation noise."""
    n, P, V = len(sequences), prompt.numel(), target.config.vocab_size
    pairs = torch.stack([s[P:P + 2] for s in sequences])  # (N, 2)
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).float() / n
    from specdec.sampling import probs_from_logits

    with torch.no_grad():
        p1 = probs_from_logits(target(prompt[None], torch.arange(P)[None], None).logits[0, -1], **kw)
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)  # (V, P + 1)
        p2 = probs_from_logits(target(seqs, torch.arange(P + 1)[None].expand(V, -1), None).logits[:, -1], **kw)
    exact = (p1[:, None] * p2).flatten()
    noise = 0.5 * (2 * exact * (1 - exact) / (math.pi * n)).sqrt().sum().item()
    assert _tv(emp, exact) < 3 * noise


@pytest.mark.parametrize("which", ["plain", "ngram", "self"])
def test_ragged_rows_up_to_the_context_limit(which):
    """A long row ends at the last position while a short one goes on: the finished row rides
    along without reading past the position table, and outputs still equal plain decoding."""
    model = tiny_model("llama", seed=0, vocab_size=V, max_position_embeddings=32)
    rows = [torch.randint(0, 8, (20,), generator=torch.Generator().manual_seed(2)), torch.tensor([1, 2, 3])]
    draft = {"plain": None, "ngram": "ngram", "self": model}[which]
    out = specdec.generate(model, rows, draft=draft, max_new_tokens=12)
    assert [s.numel() for s in out.sequences] == [32, 15]
    alone = [specdec.generate(model, [r], max_new_tokens=12).sequences[0] for r in rows]
    assert _same(out.sequences, alone)


def test_a_draft_with_a_shorter_context_drafts_only_where_it_fits(target):
    """The draft knows 24 positions, the target 512: past 24 the target decodes alone, losslessly."""
    short = tiny_model("llama", seed=0, vocab_size=V, max_position_embeddings=24)
    rows = _rows(seed=2, lengths=(5, 9))  # 10 and 18 tokens: the second leaves the draft first
    plain = specdec.generate(target, rows, max_new_tokens=16)
    out = specdec.generate(target, rows, draft=short, max_new_tokens=16, num_draft_tokens=3)
    assert _same(out.sequences, plain.sequences)
    assert out.stats.drafted_tokens > 0


def test_an_eos_inside_accepted_drafts_ends_the_counts_there(target):
    """A perfect draft (the target itself) keeps acceptance 1.0 when an eos cuts a step's path,
    and no more drafts are counted accepted than tokens were emitted."""
    rows = _rows(seed=1, lengths=(5,))
    new = specdec.generate(target, rows, max_new_tokens=20).sequences[0][rows[0].numel():].tolist()
    # steps emit new tokens 1-6, 7-12, ... (5 drafts + 1): an eos at one of a step's first 4 drafts
    j = next(j for j in range(7, 20) if (j - 1) % 6 < 4 and new[j] not in new[:j])
    out = specdec.generate(target, rows, draft=target, max_new_tokens=20, num_draft_tokens=5, eos_token_id=new[j])
    s = out.stats
    assert s.generated_tokens == j + 1 and s.drafted_tokens > 0
    assert s.acceptance_rate == 1.0 and set(s.per_position_acceptance) == {1.0}
    assert s.accepted_tokens <= s.generated_tokens - 1  # the prefill's token is no draft


def test_a_proposal_larger_than_max_nodes_is_refused_at_once(target):
    class Greedy(Drafter):
        name = "greedy"

        def propose(self, seqs, k, rows):  # k + 2 nodes, but max_nodes(k) is k
            return DraftTree.chain(torch.zeros(len(seqs), k + 2, dtype=torch.long), torch.full((len(seqs),), k + 2))

    with pytest.raises(ValueError, match=r"proposed 5 nodes, more than its max_nodes\(3\)"):
        specdec.generate(target, _rows(), draft=Greedy(), max_new_tokens=8, num_draft_tokens=3)


@pytest.mark.parametrize("token", [V, -1])
def test_a_proposal_outside_the_vocabulary_is_refused_at_once(target, token):
    class Wild(Drafter):
        name = "wild"

        def propose(self, seqs, k, rows):
            return DraftTree.chain(torch.full((len(seqs), k), token, dtype=torch.long), torch.full((len(seqs),), k))

    with pytest.raises(ValueError, match=rf"drafter 'wild' proposed token ids outside the target's vocabulary "
                                         rf"\[0, {V}\), e.g. {token}"):
        specdec.generate(target, _rows(), draft=Wild(), max_new_tokens=8, num_draft_tokens=3)


def test_a_list_of_drafters_refuses_a_tree(target):
    class Fork(Drafter):
        name = "fork"

        def propose(self, seqs, k, rows):
            B = len(seqs)
            return DraftTree(torch.zeros(B, 2, dtype=torch.long), torch.full((B, 2), -1), torch.full((B,), 2))

    with pytest.raises(ValueError, match="fork proposed a tree"):
        specdec.generate(target, _rows(), draft=[Fork(), "ngram"], max_new_tokens=8, num_draft_tokens=2)


# --- bf16: row-invariant forwards (runtime.invariant) make every drafter lossless there too ---

WIDE_V = 256


@pytest.fixture(scope="module")
def wide_bf16():
    """Two layers of qwen2.5-coder-1.5b's widths in bf16, where the plain kernels give a token
    other bits in a verification block than alone (at small widths they happen not to)."""
    from runtime.invariant import unsupported_reason

    assert unsupported_reason(torch.device("cpu"), torch.bfloat16) is None  # the C++ kernels build with make test
    return tiny_model("qwen2", seed=11, dtype=torch.bfloat16, hidden_size=1536, intermediate_size=8960,
                      num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=2, vocab_size=WIDE_V)


def _bf16_drafter(target, which):
    from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head
    from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads

    torch.manual_seed(5)
    if which == "draft":
        return tiny_model("qwen2", seed=12, dtype=torch.bfloat16, vocab_size=WIDE_V)
    if which == "hybrid":
        return ["ngram", tiny_model("qwen2", seed=12, dtype=torch.bfloat16, vocab_size=WIDE_V)]
    if which == "medusa":
        cfg = MedusaConfig(target.config.hidden_size, WIDE_V, num_heads=3,
                           tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
        return MedusaHeads(cfg, target.lm_head).to(torch.bfloat16)
    if which == "eagle":
        head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=WIDE_V, aux_layers=(0, 1, 1),
                                                   target_name="wide"))
        return head.to(torch.bfloat16)
    return which


@pytest.mark.parametrize("which", ["ngram", "suffix", "draft", "hybrid", "medusa", "eagle"])
def test_bf16_greedy_output_equals_plain_for_every_drafter(wide_bf16, which):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 16, (n,), generator=g).repeat(2) for n in (4, 11, 7)]  # ragged rows
    plain = specdec.generate(wide_bf16, rows, max_new_tokens=20)
    out = specdec.generate(wide_bf16, rows, draft=_bf16_drafter(wide_bf16, which), max_new_tokens=20,
                           num_draft_tokens=4)
    assert _same(out.sequences, plain.sequences)
    if which == "ngram":  # and a row's output does not depend on its batch
        for r, seq in zip(rows, plain.sequences):
            assert torch.equal(specdec.generate(wide_bf16, [r], max_new_tokens=20).sequences[0], seq)


class _ChainsAndTrees(Drafter):
    """Proposes a 2-node chain and a 3-node tree (two siblings) on alternate steps, nothing every 5th."""

    def __init__(self) -> None:
        self.steps = 0

    def max_nodes(self, k):
        return 3

    def propose(self, seqs, k, rows):
        self.steps += 1
        B = len(seqs)
        lens = torch.zeros(B, dtype=torch.long)
        lens[rows] = (2 if self.steps % 2 else 3) if self.steps % 5 else 0  # every 5th step: no drafts
        tokens = torch.tensor([[1, 2, 3]] * B)
        parents = torch.tensor([[-1, 0, 1] if self.steps % 2 else [-1, -1, 0]] * B)
        return DraftTree(tokens, parents, lens)


def test_compile_block_steps_builds_the_programs_that_decoding_then_runs():
    """Its programs are the ones generate() uses (same tensor kinds: made in inference mode), so a
    drafter whose blocks change shape compiles nothing while it is timed."""
    from torch._dynamo.utils import counters

    from runtime import compile_decode
    from specdec.tuning.warmup import compile_block_steps

    model = compile_decode(tiny_model("llama", seed=7), cpp_wrapper=False)
    prompt = torch.arange(5)
    specdec.generate(model, [prompt], max_new_tokens=3)  # the prompt's and the 1-token programs
    compile_block_steps(model)
    compiled = counters["stats"]["unique_graphs"]
    specdec.generate(model, [prompt], draft=_ChainsAndTrees(), max_new_tokens=12)
    assert counters["stats"]["unique_graphs"] == compiled


def test_compile_block_steps_of_a_batch_include_the_step_without_drafts():
    """In a batch of 2+ rows a step where no row drafts runs a 1-token program of its own: built too."""
    from torch._dynamo.utils import counters

    from runtime import compile_decode
    from specdec.tuning.warmup import compile_block_steps

    model = compile_decode(tiny_model("llama", seed=7), cpp_wrapper=False)
    prompts = [torch.arange(5), torch.arange(3, 9)]
    specdec.generate(model, prompts, max_new_tokens=1)  # the prompts' program only: no decode step
    compile_block_steps(model, batch_size=2)
    compiled = counters["stats"]["unique_graphs"]
    specdec.generate(model, prompts, draft=_ChainsAndTrees(), max_new_tokens=16)
    assert counters["stats"]["unique_graphs"] == compiled
