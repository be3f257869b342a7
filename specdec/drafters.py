"""Drafters behind one interface: a draft model, n-gram prompt lookup, and a list tried in order.

A drafter proposes up to k tokens per row after each row's committed sequence (prompt plus
emitted tokens) and, for sampled drafts, the distributions it drew them from. After the target
verifies, `sync` tells it the new committed sequences so it can keep its own cache in step
(roll back what was rejected; the next `propose` feeds what it has not seen).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import SpecdecError
from specdec.sampling import check_finite, probs_from_logits


class VocabularyMismatchError(SpecdecError, ValueError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""


@dataclass
class Proposal:
    """tokens (B, k) (padding past lens), lens (B,) valid drafts per row, q (B, k, V) or None
    when the drafts are deterministic (one-hot q)."""

    tokens: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor | None


class NgramDrafter:
    """Prompt lookup: find the last n tokens (n from max_n down to min_n) earlier in the row and
    propose what followed the most recent such occurrence. No model; q is one-hot."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def draft_cost(self, k: int) -> float:
        """Seconds to propose k tokens: a lookup, next to nothing."""
        return 0.0

    def start(self, prompts: list[torch.Tensor], max_len: int) -> None:
        del prompts, max_len  # stateless: the committed sequences carry everything

    def lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens that followed the latest earlier occurrence of seq's last n-gram."""
        L = seq.numel()
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = seq[L - n:]
            windows = seq[:L - 1].unfold(0, n, 1)  # (L - n, n): starts whose continuation exists
            hits = (windows == tail).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                return seq[start:start + k]
        return seq[:0]

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> Proposal:
        B = len(seqs)
        tokens = torch.zeros(B, k, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        for b in rows:
            found = self.lookup(seqs[b], k)
            tokens[b, :found.numel()] = found
            lens[b] = found.numel()
        return Proposal(tokens, lens, None)

    def sync(self, seqs: list[torch.Tensor]) -> None:
        del seqs


class ModelDrafter:
    """A small model sharing the target's vocabulary, decoding k tokens over its own static cache."""

    name = "draft"

    def __init__(self, model, target, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> None:
        check_vocabularies(model, target)
        self.model, self.temperature, self.top_k, self.top_p = model, temperature, top_k, top_p
        self.generator = generator
        # a model restricted to a frequent-token vocabulary (specdec.draft_vocab) scores those ids only
        self.output_ids = getattr(model, "output_ids", None)  # (N,) or None
        self.cache = None
        self.fed: list[torch.Tensor] = []  # tokens held in the cache, per row
        # measured seconds (EMA) of a step's first forward (it feeds what the target accepted,
        # up to k + 1 tokens) and of each further one-token forward: see draft_cost
        self.first_s = self.step_s = 0.0

    def start(self, prompts: list[torch.Tensor], max_len: int) -> None:
        # twice the target's length: a row catching up after n-gram steps feeds a long chunk, and
        # the other rows of that batched call are right-padded to it (a draft's cache is small)
        self.cache = self.model.new_cache(len(prompts), 2 * max_len)
        self.fed = [p[:0] for p in prompts]

    def sync(self, seqs: list[torch.Tensor]) -> None:
        """Roll the cache back to the longest prefix it shares with the committed sequences."""
        new_lens = self.cache.lengths.clone()
        for b, (fed, seq) in enumerate(zip(self.fed, seqs)):
            n = min(fed.numel(), seq.numel())
            same = (fed[:n] == seq[:n]).long().cumprod(0).sum()
            new_lens[b] = int(same)
            self.fed[b] = fed[:int(same)]
        self.cache.rollback(new_lens.to(self.cache.lengths.device))

    def _feed(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """Append per-row token chunks (right-padded) to the cache; logits at each row's last one."""
        device = self.model.device
        lens = torch.tensor([c.numel() for c in chunks], device=device)
        T = max(int(lens.max()), 1)
        tokens = torch.zeros(len(chunks), T, dtype=torch.long, device=device)
        for b, c in enumerate(chunks):
            tokens[b, :c.numel()] = c.to(device)
            self.fed[b] = torch.cat([self.fed[b], c])
        start = self.cache.lengths.clone()
        positions = start[:, None] + torch.arange(T, device=device)  # (B, T)
        last = (lens - 1).clamp(min=0)[:, None]
        logits = self.model(tokens, positions, self.cache, logits_idx=last)[:, 0]  # (B, V)
        self.cache.rollback(start + lens)
        check_finite(logits, "draft")
        return logits

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> Proposal:
        t0 = time.perf_counter()
        B = len(seqs)
        # rows not asked for still take one token so every row of the batch stays aligned
        chunks = [seqs[b][self.fed[b].numel():] if b in rows else seqs[b][:0] for b in range(B)]
        # the prompt's prefill is no step's cost: timed into first_s it made `auto` see a draft
        # step of 0.3-2.6 s for the first steps of every prompt (INT4 0.5B draft)
        prefill = any(self.fed[b].numel() == 0 for b in rows)
        logits = self._feed(chunks)
        t1 = time.perf_counter()
        tokens = torch.zeros(B, k, dtype=torch.long)
        sampled = self.temperature > 0
        ids = self.output_ids
        q = torch.zeros(B, k, self.model.config.vocab_size if ids is not None else logits.shape[-1]) \
            if sampled else None
        for i in range(k):
            if sampled:
                probs = probs_from_logits(logits, self.temperature, self.top_k, self.top_p)  # (B, V|N)
                col = torch.multinomial(probs.cpu(), 1, generator=self.generator).squeeze(1)
                if ids is None:
                    q[:, i] = probs.cpu()
                else:
                    q[:, i, ids] = probs.cpu()  # zero outside the draft's vocabulary
            else:
                col = logits.argmax(-1).cpu()
            nxt = col if ids is None else ids[col]
            tokens[:, i] = nxt
            if i + 1 < k:
                logits = self._feed([nxt[b:b + 1] if b in rows else nxt[:0] for b in range(B)])
        lens = torch.zeros(B, dtype=torch.long)
        lens[rows] = k
        if not prefill:
            self.first_s = _ema(self.first_s, t1 - t0)
        if k > 1:
            self.step_s = _ema(self.step_s, (time.perf_counter() - t1) / (k - 1))
        return Proposal(tokens, lens, q)

    def draft_cost(self, k: int) -> float:
        """Seconds to propose k tokens: the catch-up forward, then k - 1 one-token forwards (a
        per-token mean would charge the catch-up to every token and favour short drafts)."""
        return self.first_s + (k - 1) * (self.step_s or self.first_s)


class ChainDrafter:
    """Drafters tried in order per step: each row takes the first non-empty proposal."""

    def __init__(self, drafters: list) -> None:
        if not drafters:
            raise ValueError("an empty list of drafters; pass at least one")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)

    def draft_cost(self, k: int) -> float:
        return max(d.draft_cost(k) for d in self.drafters)

    def start(self, prompts: list[torch.Tensor], max_len: int) -> None:
        for d in self.drafters:
            d.start(prompts, max_len)

    def sync(self, seqs: list[torch.Tensor]) -> None:
        for d in self.drafters:
            d.sync(seqs)

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> Proposal:
        B = len(seqs)
        tokens = torch.zeros(B, k, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        owner: dict[int, Proposal] = {}
        todo = list(rows)
        for d in self.drafters:
            if not todo:
                break
            prop = d.propose(seqs, k, todo)
            for b in todo:
                if prop.lens[b] > 0:
                    tokens[b], lens[b], owner[b] = prop.tokens[b], prop.lens[b], prop
            todo = [b for b in todo if b not in owner]
        sampled = [p.q for p in owner.values() if p.q is not None]
        if not sampled:
            return Proposal(tokens, lens, None)
        q = _one_hot(tokens, sampled[0].shape[-1])  # deterministic rows keep one-hot q
        for b, prop in owner.items():
            if prop.q is not None:
                q[b] = prop.q[b]
        return Proposal(tokens, lens, q)


def _ema(old: float, new: float) -> float:
    return new if old == 0 else 0.8 * old + 0.2 * new


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """q (B, k, V) for deterministic drafts."""
    return torch.nn.functional.one_hot(tokens, vocab).float()


def check_vocabularies(draft, target, sample: int = 64) -> None:
    """Raise VocabularyMismatchError unless draft and target share vocabulary size and tokens."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise VocabularyMismatchError(
            f"draft vocabulary has {dv} entries but the target's has {tv}; a draft must use the "
            "target's tokenizer (e.g. qwen2.5-coder-0.5b-instruct drafts for qwen2.5-coder-1.5b-instruct)")
    d_src, t_src = getattr(draft, "source", None), getattr(target, "source", None)
    if d_src is None or t_src is None or d_src == t_src:
        return
    # loading two tokenizers takes seconds and generate() checks on every call: a draft model
    # remembers the targets it was checked against
    checked = getattr(draft, "_vocab_checked_against", frozenset())
    if t_src in checked:
        return
    _check_token_strings(d_src, t_src, sample)
    draft._vocab_checked_against = checked | {t_src}


def _check_token_strings(d_src: str | Path, t_src: str | Path, sample: int) -> None:
    """Raise VocabularyMismatchError unless `sample` token ids decode to the same strings."""
    from runtime.loading import load_tokenizer

    d_tok, t_tok = load_tokenizer(d_src), load_tokenizer(t_src)
    ids = torch.randperm(min(len(d_tok), len(t_tok)), generator=torch.Generator().manual_seed(0))[:sample]
    d_strs = d_tok.convert_ids_to_tokens(ids.tolist())
    t_strs = t_tok.convert_ids_to_tokens(ids.tolist())
    bad = [(int(i), a, b) for i, a, b in zip(ids, d_strs, t_strs) if a != b]
    if bad:
        i, a, b = bad[0]
        raise VocabularyMismatchError(
            f"draft and target tokenizers disagree on {len(bad)} of {sample} sampled ids (id {i}: "
            f"draft {a!r}, target {b!r}); use a draft trained with the target's tokenizer")


def make_drafter(draft, target, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator | None):
    """Drafter for generate()'s `draft` argument: a model, "ngram", or a list of those."""
    if isinstance(draft, (list, tuple)):
        return ChainDrafter([make_drafter(d, target, temperature, top_k, top_p, generator) for d in draft])
    if isinstance(draft, str):
        if draft == "ngram":
            return NgramDrafter()
        raise ValueError(f"unknown draft {draft!r}: pass a model, 'ngram', Medusa heads or a list "
                         "(to draft with a checkpoint, load it first: runtime.load_model(name))")
    if isinstance(draft, (NgramDrafter, ModelDrafter, ChainDrafter)):
        return draft
    from specdec.generate import as_runtime_model

    return ModelDrafter(as_runtime_model(draft), target, temperature, top_k, top_p, generator)
