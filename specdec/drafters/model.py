"""A draft model: a small model with the target's vocabulary decodes k tokens over its own cache.

The draft keeps a static KV cache of what it has read of each row. `propose` first feeds what
the row committed since (the tokens the target accepted, up to k + 1), then decodes k tokens,
greedily or by sampling with the target's temperature / top-k / top-p (the distributions go
with the drafts, for lossless verification). `commit` rolls the cache back to the longest
prefix it shares with the committed sequences.

Confidence-bounded drafting (llama.cpp's `--draft-p-min`, vLLM's dynamic speculation length): a
row stops drafting at the first token whose draft probability falls below `p_min` (the top
probability of the draft's distribution, at temperature 1 for greedy drafts), and the step stops
when every row has; k (fixed or `auto`'s choice from its cost model) stays the upper bound. Each
draft's `DraftTree.scores` is the product of those probabilities along its chain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

import runtime.loading
from runtime.cache import KVCache
from runtime.errors import SpecdecError
from runtime.kernels.cpu_argmax import argmax
from runtime.prefix_cache import PrefixCache
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.rows import common_prefix, prefill, prefill_after, runs
from specdec.sampling import check_finite, probs_from_logits


@dataclass(frozen=True)
class DraftModel:
    """generate()'s draft argument for `draft:NAME[@K:pP]`: the model and the probability below which
    a row stops drafting (0: never stops early); generate() adds its sampling (a ModelDrafter)."""

    model: object
    p_min: float = 0.0


class VocabularyMismatchError(SpecdecError, ValueError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""


class ModelDrafter(Drafter):
    """A small model sharing the target's vocabulary, decoding k tokens over its own static cache."""

    name = "draft"
    runs_model = True

    def __init__(self, model, target, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, p_min: float = 0.0) -> None:
        check_vocabularies(model, target)
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0 <= p_min < 1:
            raise ValueError(f"p_min (a draft stops below this probability) must be in [0, 1), got {p_min!r}")
        self.model, self.temperature, self.top_k, self.top_p = model, temperature, top_k, top_p
        self.p_min = float(p_min)
        self.generator = generator
        # a model restricted to a frequent-token vocabulary (specdec.drafters.draft_vocab) scores those ids only
        self.output_ids = getattr(model, "output_ids", None)  # (N,) or None
        self.cache = None
        self.fed: list[torch.Tensor] = []  # tokens held in the cache, per row
        self.admitted: dict[int, torch.Tensor] = {}  # row -> prompt admitted but not prefilled yet
        self.reused: dict[int, int] = {}  # admitted row -> the prompt tokens its cache row already holds
        self.prefixes: PrefixCache | None = None  # the serving engine's: prompts read, for later requests
        # measured seconds (EMA) of a step's first forward (it feeds what the target accepted,
        # up to k + 1 tokens) and of each further one-token forward: see draft_cost
        self.first_s = self.step_s = 0.0

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        # twice the target's length: a row catching up after n-gram steps feeds a long chunk, and
        # the other rows of that batched call are right-padded to it (a draft's cache is small)
        self.cache = self.model.new_cache(len(prompts), 2 * max_len)
        self.fed = [p[:0] for p in prompts]
        self.admitted, self.reused, self.prefixes = {}, {}, None

    def reserve(self, batch_size: int, max_len: int) -> None:
        self.begin([torch.zeros(0, dtype=torch.long)] * batch_size, max_len, None)
        if not isinstance(self.cache, KVCache):
            raise NotImplementedError("a transformers draft model cannot serve rows that join a running batch; "
                                      "load the draft with runtime.load_model")

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Queue the prompt: the next `propose` prefills it into the row's slot of the draft's cache,
        in one forward with the rows admitted alongside (views of the cache: nothing is allocated;
        eagerly, so a compiled draft compiles no program of their count). With a prefix cache
        (`cache_prefixes`) the cached blocks the prompt starts with are copied into the row now
        and only the rest is prefilled."""
        self.cache.lengths[row] = 0
        self.fed[row] = prompt[:0]
        self.admitted[row] = prompt
        self.reused[row] = 0 if self.prefixes is None else self.prefixes.get(prompt, self.cache, row)

    def release(self, row: int) -> None:
        """Free the row; with a prefix cache, what it read stays there for later prompts."""
        self.admitted.pop(row, None)
        self.reused.pop(row, None)
        if self.prefixes is not None:
            self.prefixes.put(self.fed[row], self.cache, row)
        self.fed[row] = self.fed[row][:0]
        self.cache.lengths[row] = 0

    def cache_prefixes(self, tokens: int) -> None:
        """Keep up to `tokens` positions of what released rows read (`runtime.prefix_cache`)."""
        self.prefixes = PrefixCache(self.cache, tokens) if tokens else None

    def _prefill_admitted(self) -> None:
        """Prefill the prompts `admit` queued, one forward per run of consecutive rows (a prompt
        longer than the draft's context is not read: that row drafts nothing)."""
        fits = {b: p for b, p in self.admitted.items() if p.numel() <= self.model.config.max_position_embeddings}
        reused = {b: self.reused.pop(b, 0) for b in self.admitted}
        self.admitted = {}
        for b in [b for b in fits if reused[b]]:  # one forward each, after what the row holds
            prompt, row = fits.pop(b), self.cache.rows(b)
            row.lengths.fill_(reused[b])
            prefill_after(self.model, prompt[reused[b]:], row)
            self.fed[b] = prompt
            self.prefixes.put(prompt, self.cache, b)
        for run in runs(list(fits)):
            prompts = [fits[b] for b in run]
            prefill(self.model, prompts, self.cache.rows(run[0], len(run)),
                    eager=getattr(self.model, "compiled", False))
            for b, p in zip(run, prompts):
                self.fed[b] = p
                if self.prefixes is not None:  # at once: a request arriving beside this one may share it
                    self.prefixes.put(p, self.cache, b)

    def commit(self, accepted: Accepted) -> None:
        """Roll the cache back to the longest prefix it shares with the committed sequences."""
        new_lens = self.cache.lengths.clone()
        for b, (fed, seq) in enumerate(zip(self.fed, accepted.seqs)):
            same = common_prefix(fed, seq)
            new_lens[b] = same
            self.fed[b] = fed[:same]
        self.cache.rollback(new_lens.to(self.cache.lengths.device))

    def _feed(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """Append per-row token chunks (right-padded) to the cache; logits at each row's last one."""
        device = self.model.device
        lens = torch.tensor([c.numel() for c in chunks], device=device)
        T = max(int(lens.max()), 1)
        tokens = torch.zeros(len(chunks), T, dtype=torch.long, device=device)  # (B, T)
        for b, c in enumerate(chunks):
            tokens[b, :c.numel()] = c.to(device)
            self.fed[b] = torch.cat([self.fed[b], c])
        start = self.cache.lengths.clone()
        # a row that feeds nothing pads one slot, which may sit past the position table: clamped,
        # and dropped by the rollback below
        last_position = self.model.config.max_position_embeddings - 1
        positions = (start[:, None] + torch.arange(T, device=device)).clamp(max=last_position)  # (B, T)
        last = (lens - 1).clamp(min=0)[:, None]
        logits = self.model(tokens, positions, self.cache, logits_idx=last).logits[:, 0]  # (B, V)
        self.cache.rollback(start + lens)
        check_finite(logits, "draft")
        return logits

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        if self.admitted:
            self._prefill_admitted()
        t0 = time.perf_counter()
        B = len(seqs)
        # a row whose k drafts would pass the draft's own context gets none (the target decodes it)
        rows = [b for b in rows if seqs[b].numel() + k - 1 <= self.model.config.max_position_embeddings]
        if not rows:
            return DraftTree.chain(torch.zeros(B, k, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        # rows not asked for still take one token so every row of the batch stays aligned
        chunks = [seqs[b][self.fed[b].numel():] if b in rows else seqs[b][:0] for b in range(B)]
        # the prompt's prefill is no step's cost: timed into first_s it would make `auto` see a
        # draft step of seconds for the first steps of every prompt
        prefill = any(self.fed[b].numel() == 0 for b in rows)
        logits = self._feed(chunks)
        t1 = time.perf_counter()
        tokens = torch.zeros(B, k, dtype=torch.long)  # (B, k)
        scores = torch.zeros(B, k)  # (B, k): product of the draft's probabilities along the chain
        sampled = self.temperature > 0
        ids = self.output_ids
        vocab = self.model.config.vocab_size if ids is not None else logits.shape[-1]
        q = torch.zeros(B, k, vocab, device=logits.device) if sampled else None  # (B, k, V) on the draft's device
        lens = torch.zeros(B, dtype=torch.long)  # (B,)
        going = list(rows)  # rows still drafting
        path = torch.ones(B)  # (B,)
        forwards = 0
        for i in range(k):
            if sampled:  # drawn where the draft runs, with the caller's generator (same device)
                probs = probs_from_logits(logits, self.temperature, self.top_k, self.top_p)  # (B, V|N)
                col = torch.multinomial(probs, 1, generator=self.generator).squeeze(1).cpu()
                if ids is None:
                    q[:, i] = probs
                else:
                    q[:, i, ids.to(probs.device)] = probs  # zero outside the draft's vocabulary
                top = probs.max(-1).values.float().cpu()  # (B,)
            else:
                col = argmax(logits).cpu()
                top = torch.softmax(logits.float(), -1).max(-1).values.cpu()  # (B,)
            nxt = col if ids is None else ids[col]
            tokens[:, i] = nxt
            path = path * top
            scores[:, i] = path
            going = [b for b in going if top[b] >= self.p_min]
            lens[going] = i + 1
            if i + 1 < k and going:
                logits = self._feed([nxt[b:b + 1] if b in going else nxt[:0] for b in range(B)])
                forwards += 1
            else:
                break
        if not prefill:
            self.first_s = _ema(self.first_s, t1 - t0)
        if forwards:
            self.step_s = _ema(self.step_s, (time.perf_counter() - t1) / forwards)
        return DraftTree.chain(tokens, lens, q, scores)

    def draft_cost(self, k: int) -> float:
        """Seconds to propose k tokens: the catch-up forward, then k - 1 one-token forwards (a
        per-token mean would charge the catch-up to every token and favour short drafts)."""
        return self.first_s + (k - 1) * (self.step_s or self.first_s)


def _ema(old: float, new: float) -> float:
    return new if old == 0 else 0.8 * old + 0.2 * new


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
    check_token_strings(d_src, t_src, sample)
    draft._vocab_checked_against = checked | {t_src}


def check_token_strings(d_src: str | Path, t_src: str | Path, sample: int) -> None:
    """Raise VocabularyMismatchError unless `sample` token ids decode to the same strings."""
    d_tok, t_tok = runtime.loading.load_tokenizer(d_src), runtime.loading.load_tokenizer(t_src)
    ids = torch.randperm(min(len(d_tok), len(t_tok)), generator=torch.Generator().manual_seed(0))[:sample]
    d_strs = d_tok.convert_ids_to_tokens(ids.tolist())
    t_strs = t_tok.convert_ids_to_tokens(ids.tolist())
    bad = [(int(i), a, b) for i, a, b in zip(ids, d_strs, t_strs) if a != b]
    if bad:
        i, a, b = bad[0]
        raise VocabularyMismatchError(
            f"draft and target tokenizers disagree on {len(bad)} of {sample} sampled ids (id {i}: "
            f"draft {a!r}, target {b!r}); use a draft trained with the target's tokenizer")


def from_spec(spec, target, loader) -> DraftModel:
    """`draft:NAME_OR_PATH[@K[:pP]]` (specdec.methods): the draft model, loaded by `loader`, and its
    p_min; generate() makes the ModelDrafter with its sampling."""
    return DraftModel(loader.model(spec.arg, target), spec.p_min or 0.0)
