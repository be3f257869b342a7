"""The decode loop: every drafter (or none) runs through these few functions.

Per step, for the whole batch: the drafter proposes a tree per row (`specdec.drafter`); one
target forward scores [root, nodes] (causal for a chain, the tree's ancestor mask otherwise);
`specdec.verify` keeps each row's accepted path plus one target token; the target's cache keeps
the accepted path (a length change for a chain, an in-place compaction for a tree) and the
drafter is told what was accepted. Plain decoding is the same loop with no drafts. Rows advance
independently; a finished row is carried along but writes nothing that stays in the cache.

`DecodeLoop` holds that state over the rows of one cache: `prefill` starts every row at once
(`generate()`), `admit` starts one row in a free slot while the others run (the serving engine,
`specdec.serving.engine`), and `step` is the one draft + verify step both call. Every row has its own
`RowSampling` (its `specdec.sampling.SamplingParams` and generator): rows that share one are
verified together, greedy rows always together. Observers (`specdec.capture.DecodeObserver`)
see each row's share of the target's outputs after the prefill and after every step: how
training data is recorded while decoding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from runtime.compile import DECODE_STATIC_TOKENS
from runtime.model_output import ModelOutput
from specdec.capture import DecodeObserver
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.rows import RowState, check_lengths, prefill, prefill_after, prefill_sharing
from specdec.sampling import RowSampling, SamplingParams, select_next
from specdec.stats import AcceptanceStats
from specdec.tuning.autok import AutoK
from specdec.tuning.costs import target_costs
from specdec.verify import Verdict, verify

MAX_DRAFT_TOKENS = 16
_VERIFICATIONS = itertools.count(1)  # numbers the verifications of this process (`Accepted.step`)
# "auto" on a compiled target: verification blocks of 2..8 tokens share one compiled program
# (runtime.compile.static_tokens); 9..16 would compile another program (a minute or more on a CPU).
MAX_DRAFT_TOKENS_COMPILED = DECODE_STATIC_TOKENS - 1


def draft_length(num_draft_tokens: int | str, target, drafter: Drafter | None,
                 batch_size: int = 1) -> tuple[int, AutoK | None]:
    """k, and the AutoK that tunes it per step when num_draft_tokens is "auto" (and the drafter
    drafts chains of any length), with the costs of the target's blocks of `batch_size` rows that
    earlier calls on it timed (`specdec.tuning.costs.target_costs`)."""
    if num_draft_tokens == "auto":
        k_max = MAX_DRAFT_TOKENS_COMPILED if getattr(target, "compiled", False) else MAX_DRAFT_TOKENS
        if drafter is None or not drafter.adaptive:
            return k_max, None
        return k_max, AutoK(k_max=k_max, costs=target_costs(target, batch_size))
    return num_draft_tokens, None


def cache_slack(target, drafter: Drafter | None, num_draft_tokens: int | str) -> int:
    """Cache slots a row needs beyond prompt + new tokens: the root and the most nodes of a step."""
    k_max, _ = draft_length(num_draft_tokens, target, drafter)
    return 1 + (drafter.max_nodes(k_max) if drafter is not None else 0)


class DecodeLoop:
    """The decode state of the rows of one target cache (see the module docstring).

    sampling: one RowSampling for every row, or one per row (None for a row not in use).
    observers: DecodeObservers that see each row's share of the target's outputs after its prefill
    and after every step (`specdec.capture`); the target's forwards compute the final hidden states
    when one of them (or the drafter) asks, and the aux layers' states of the layers they and the
    drafter name (one set: they must agree).
    """

    def __init__(self, target, drafter: Drafter | None, state: RowState, cache, num_draft_tokens: int | str,
                 sampling: RowSampling | list[RowSampling | None],
                 observers: Sequence[DecodeObserver] = ()) -> None:
        self.observers = list(observers)
        self.aux_layers = _aux_layers(drafter, self.observers)
        self.target, self.drafter, self.state, self.cache = target, drafter, state, cache
        B = len(state.prompts)
        self.uniform = isinstance(sampling, RowSampling)
        self.sampling = [sampling] * B if self.uniform else list(sampling)
        self.k_max, self.auto = draft_length(num_draft_tokens, target, drafter, B)
        self.want_hidden = (any(o.return_hidden for o in self.observers)
                            or (drafter is not None and drafter.needs_hidden))
        self.want_aux = bool(self.aux_layers)
        self.pending = torch.zeros(B, dtype=torch.long)  # (B,): each row's next root, not yet scored
        self.stats = AcceptanceStats(num_calls=1)
        self.row_stats = [AcceptanceStats() for _ in range(B)]
        # drafter name (a hybrid's or composite's member) -> the steps of the rows that verified its proposals
        self.by_drafter: dict[str, AcceptanceStats] = {}
        for o in self.observers:
            o.on_start(target, B)

    def _drafter_states(self, hidden: torch.Tensor | None, aux: torch.Tensor | None) -> torch.Tensor | None:
        """What the drafter reads of a target forward: the aux layers' states when it reads layers,
        else the final hidden states when it needs them, else nothing."""
        if self.drafter.hidden_layers:
            return aux
        return hidden if self.drafter.needs_hidden else None

    def _first_tokens(self, rows: list[int], out: ModelOutput) -> list[list[int]]:
        """Pick and emit each row's first token from a prefill's output (`specdec.rows.prefill`)."""
        first = self._select(out.logits, rows).cpu()  # (R,)
        emitted = [[] for _ in self.state.prompts]
        for i, b in enumerate(rows):
            self.pending[b] = first[i]
            if self.state.done[b]:
                continue
            self.stats.target_forwards += 1
            self.row_stats[b].target_forwards += 1
            n = self.state.emit(b, [int(first[i])])
            self.stats.generated_tokens += n
            self.row_stats[b].generated_tokens += n
            emitted[b] = self.state.new[b][-n:]
            if self.observers:
                prompt = self.state.prompts[b]
                mine = ModelOutput(out.logits[i:i + 1], None if out.hidden is None else out.hidden[i:i + 1],
                                   None if out.aux is None else out.aux[i, :prompt.numel()])  # (1, V), (1, C), (T, nC)
                for o in self.observers:
                    o.on_prefill(b, prompt, mine)
        return emitted

    def _select(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The next token of each of `rows` from its logits (R, V), by the row's own sampling. An
        extension point: the serving engine overrides it (and `_verify`) to set a faulty row aside."""
        if self.uniform:
            s = self.sampling[0]
            return select_next(logits, s.temperature, s.top_k, s.top_p, s.generator)
        out = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        for i, b in enumerate(rows):
            s = self.sampling[b]
            out[i] = select_next(logits[i:i + 1], s.temperature, s.top_k, s.top_p, s.generator)[0]
        return out

    def prefill(self, max_len: int) -> list[list[int]]:
        """Prefill every row (one forward, or `specdec.rows.prefill_sharing` when prompts share a
        prefix), emit its first token and start the drafter (whose rows get `max_len` cache
        slots); returns the tokens each row emitted."""
        rows = list(range(len(self.state.prompts)))
        if self.aux_layers:  # states at every prompt position: each prompt prefilled whole
            out = prefill(self.target, self.state.prompts, self.cache, return_hidden=self.want_hidden,
                          aux_layers=self.aux_layers)
        else:  # a prefix shared by several prompts is prefilled once
            out = prefill_sharing(self.target, self.state.prompts, self.cache, return_hidden=self.want_hidden)
        emitted = self._first_tokens(rows, out)
        if self.drafter is not None:
            self.drafter.begin(self.state.prompts, max_len, self._drafter_states(out.hidden, out.aux))
        return emitted

    def admit(self, rows: list[int], prompts: list[torch.Tensor], limits: list[int], stops: list[frozenset[int]],
              sampling: list[RowSampling], cached: int = 0) -> list[list[int]]:
        """Start free `rows` (consecutive slots) on `prompts` while the other rows keep their state:
        one prefill of those rows only, into their slots of the cache (eagerly, so a compiled
        target compiles no program of their count), then the drafter's `admit` per row, each row
        with its own token limit, stop tokens and sampling. Returns each row's first token(s).
        cached: the one row's cache already holds the keys and values of its prompt's first
        `cached` tokens (a prefix the serving engine reused): only the rest is prefilled
        (`specdec.rows.prefill_after`; not for a drafter that reads the prompt's layer states)."""
        if rows != list(range(rows[0], rows[0] + len(rows))):
            raise ValueError(f"admit takes consecutive rows (one prefill through a view of them), got {rows}")
        if cached and (len(rows) != 1 or not 0 < cached < prompts[0].numel()):
            raise ValueError(f"a cached prefix is admitted one row at a time and leaves at least one prompt token "
                             f"to prefill: got {len(rows)} rows, {cached} cached tokens")
        if cached and self.drafter is not None and self.drafter.hidden_layers:
            raise ValueError(f"drafter {self.drafter.name!r} reads the target's states at every prompt position: "
                             "its rows are prefilled whole, not after a cached prefix")
        for b, prompt, limit, stop, s in zip(rows, prompts, limits, stops, sampling):
            self.state.reset(b, prompt, limit, stop)
            self.sampling[b] = s
            self.row_stats[b] = AcceptanceStats()
        slots = self.cache.rows(rows[0], len(rows))
        if cached:
            slots.lengths.fill_(cached)
            out = prefill_after(self.target, prompts[0][cached:], slots, return_hidden=self.want_hidden,
                                aux_layers=self.aux_layers)
        else:
            slots.lengths.zero_()
            out = prefill(self.target, prompts, slots, return_hidden=self.want_hidden, aux_layers=self.aux_layers,
                          eager=getattr(self.target, "compiled", False))
        emitted = self._first_tokens(rows, out)
        if self.drafter is not None:
            states = self._drafter_states(out.hidden, out.aux)
            for i, (b, prompt) in enumerate(zip(rows, prompts)):
                self.drafter.admit(b, prompt, None if states is None else states[i])
        return [emitted[b] for b in rows]

    def release(self, row: int) -> None:
        """End `row` and free its slot: its cache length drops to 0 (a paged cache takes its blocks
        back) and the drafter forgets it."""
        self.state.free(row)
        self.sampling[row] = None
        self.cache.free_row(row)
        if self.drafter is not None:
            self.drafter.release(row)

    def step(self) -> list[list[int]]:
        """One draft + verify step of every active row; returns the tokens each row emitted."""
        state, drafter, cache, stats, auto = self.state, self.drafter, self.cache, self.stats, self.auto
        B = len(state.prompts)
        emitted = [[] for _ in range(B)]
        active = state.active()
        if not active:
            return emitted
        budget = torch.zeros(B, dtype=torch.long)  # drafts a row may still use: one token is always emitted
        for b in active:
            budget[b] = state.budget(b) - 1
        k = min(auto.choose(drafter.draft_cost) if auto is not None else self.k_max, int(budget.max()))
        t_draft = time.perf_counter()
        tree = drafter.propose(state.sequences(), k, active) if drafter is not None and k > 0 \
            else DraftTree.empty(B)
        _check_proposal(drafter, tree, B, k, self.target.config.vocab_size)
        if tree.num_nodes > int(tree.lens.max()):  # score no column that no row may accept
            tree = tree.truncate(int(tree.lens.max()))
        t_verify = time.perf_counter()
        stats.draft_s += t_verify - t_draft
        depths = tree.depths()  # (B, N)
        valid = (torch.arange(tree.num_nodes)[None] < tree.lens[:, None]) & (depths <= budget[:, None])
        start_len = cache.lengths.clone()  # (B,)
        # (B, 1+N, V), (B, 1+N, C), (B, 1+N, nC)
        logits, hid, aux = _score(self.target, cache, self.pending, tree, depths, self.want_hidden, self.aux_layers)
        verdict = self._verify(logits, tree, valid, active)
        target_s = time.perf_counter() - t_verify
        for b in active:
            path = verdict.paths[b]
            deepest = int(depths[b][valid[b]].max()) if bool(valid[b].any()) else 0  # drafts on the longest path
            reached = len(path) + int(bool(valid[b][tree.parents[b] == (path[-1] if path else -1)].any()))
            n = state.emit(b, tree.tokens[b, path].tolist() + [int(verdict.next_tokens[b])])
            emitted[b] = state.new[b][-n:]
            stats.record_step(deepest, reached, len(path), n)
            self.row_stats[b].record_step(deepest, reached, len(path), n)
            if deepest:
                source = self.by_drafter.setdefault(drafter.source(b), AcceptanceStats())
                source.record_step(deepest, reached, len(path), n)
            if self.observers and n:
                chose = torch.tensor([0] + [1 + i for i in path][:n - 1], device=logits.device)  # (n,)
                mine = ModelOutput(logits[b, chose], None if hid is None else hid[b, chose],
                                   None if aux is None else aux[b, chose])  # (n, V), (n, C), (n, nC)
                for o in self.observers:
                    o.on_step(b, mine)
            if auto is not None:  # rows of a fixed-size tree tell the draft length nothing (drafted 0)
                sized = tree.sized_by_k is None or bool(tree.sized_by_k[b])
                auto.observe(len(path) * sized, int(valid[b].sum()) * sized)
        verification = next(_VERIFICATIONS)
        if auto is not None:
            auto.time_block(tree.num_nodes + 1, target_s, verification)
        _keep_paths(cache, start_len, verdict, active)
        if drafter is not None:
            drafter.commit(Accepted(state.sequences(), verdict.paths, self._drafter_states(hid, aux),
                                    block=tree.num_nodes + 1, target_s=target_s, step=verification))
        self.pending = verdict.next_tokens
        stats.verify_s += time.perf_counter() - t_verify
        return emitted

    def _verify(self, logits: torch.Tensor, tree: DraftTree, valid: torch.Tensor, active: list[int]) -> Verdict:
        """Verify every row by its own sampling: the whole batch in one call when every row shares
        one RowSampling, else one call per group of active rows with equal keys."""
        typical = self.drafter.typical if self.drafter is not None else None
        if self.uniform:
            s = self.sampling[0]
            return verify(logits, tree, valid, s.temperature, s.top_k, s.top_p, s.generator, typical)
        groups: dict[tuple, list[int]] = {}
        for b in active:
            groups.setdefault(self.sampling[b].key, []).append(b)
        B = tree.batch_size
        paths: list[list[int]] = [[] for _ in range(B)]
        next_tokens = torch.zeros(B, dtype=torch.long)
        for rows in groups.values():
            s, idx = self.sampling[rows[0]], torch.tensor(rows)
            part = verify(logits[idx.to(logits.device)], _tree_rows(tree, idx), valid[idx], s.temperature,
                          s.top_k, s.top_p, s.generator, typical)
            for i, b in enumerate(rows):
                paths[b] = part.paths[i]
            next_tokens[idx] = part.next_tokens
        return Verdict(paths, next_tokens)


def _tree_rows(tree: DraftTree, idx: torch.Tensor) -> DraftTree:
    """The trees of rows `idx` (R,) of a batch's DraftTree."""
    part = DraftTree(tree.tokens[idx], tree.parents[idx], tree.lens[idx],
                     None if tree.q is None else tree.q[idx.to(tree.q.device)],
                     None if tree.scores is None else tree.scores[idx],
                     None if tree.sized_by_k is None else tree.sized_by_k[idx])
    if tree.is_chain:
        part._cache["chain"] = True
    return part


def decode_steps(target, drafter: Drafter | None, state: RowState, num_draft_tokens: int | str,
                 sampling: RowSampling, stats: AcceptanceStats, observers: Sequence[DecodeObserver] = ()
                 ) -> Iterator[list[list[int]]]:
    """Generate every row of `state`, yielding the tokens each row emitted at each step (the
    prefill's first tokens first); `stats` (a fresh AcceptanceStats) receives the counts and
    timings. Plain decoding when drafter is None. observers: see DecodeLoop."""
    cfg = target.config
    max_len = check_lengths(state.prompts, state.max_new_tokens, cfg.max_position_embeddings,
                            cfg.vocab_size) + cache_slack(target, drafter, num_draft_tokens)
    start = time.perf_counter()
    cache = target.new_cache(len(state.prompts), max_len)
    loop = DecodeLoop(target, drafter, state, cache, num_draft_tokens, sampling, observers)
    loop.stats = stats
    emitted = loop.prefill(max_len)
    stats.ttft_s = time.perf_counter() - start
    yield emitted
    while not state.all_done:
        yield loop.step()
    stats.wall_s = time.perf_counter() - start
    per_row = max(len(n) for n in state.new)
    stats.tpot_s = (stats.wall_s - stats.ttft_s) / (per_row - 1) if per_row > 1 else 0.0


def decode(target, drafter: Drafter | None, state: RowState, num_draft_tokens: int | str,
           temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
           on_tokens: Callable[[list[list[int]]], None] | None = None,
           observers: Sequence[DecodeObserver] = ()) -> AcceptanceStats:
    """Generate every row of `state` (plain decoding when drafter is None); returns the stats.

    on_tokens: called with the tokens each row emitted, at every step. observers: see DecodeLoop.
    """
    stats = AcceptanceStats(num_calls=1)
    sampling = RowSampling(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), generator)
    for emitted in decode_steps(target, drafter, state, num_draft_tokens, sampling, stats, observers):
        if on_tokens is not None:
            on_tokens(emitted)
    return stats


def _aux_layers(drafter: Drafter | None, observers: list[DecodeObserver]) -> tuple[int, ...]:
    """The one set of aux layers the target's forwards compute: the drafter's (EAGLE-3) and the
    observers' must be the same where both name some."""
    named = {tuple(o.aux_layers) for o in observers if o.aux_layers}
    if drafter is not None and drafter.hidden_layers:
        named.add(tuple(drafter.hidden_layers))
    if len(named) > 1:
        who = f" (drafter {drafter.name!r} reads {tuple(drafter.hidden_layers)})" if drafter is not None \
            and drafter.hidden_layers else ""
        raise ValueError(f"one decode computes one set of the target's aux_layers, but its drafter and observers "
                         f"name {sorted(named)}{who}: record the drafter's own layers")
    return named.pop() if named else ()


def _check_proposal(drafter: Drafter | None, tree: DraftTree, batch_size: int, k: int, vocab_size: int) -> None:
    """Fail fast, naming the drafter, when a proposal does not fit the batch, the caches or the target's
    vocabulary (every token the target will score: the nodes up to the longest row's, padding included)."""
    if drafter is None:
        return
    if tree.batch_size != batch_size:
        raise ValueError(f"drafter {drafter.name!r} proposed {tree.batch_size} rows for a batch of {batch_size}")
    if tree.num_nodes > drafter.max_nodes(k):
        raise ValueError(f"drafter {drafter.name!r} proposed {tree.num_nodes} nodes, more than its max_nodes({k}) = "
                         f"{drafter.max_nodes(k)} the caches were sized for; make Drafter.max_nodes return the "
                         "most nodes propose() can return")
    scored = tree.tokens[:, :int(tree.lens.max())] if tree.num_nodes else tree.tokens  # (B, n)
    if scored.numel():
        bad = scored[(scored < 0) | (scored >= vocab_size)]
        if bad.numel():
            raise ValueError(f"drafter {drafter.name!r} proposed token ids outside the target's vocabulary "
                             f"[0, {vocab_size}), e.g. {int(bad[0])}; a drafter's DraftTree.tokens (padding "
                             "included) must be ids of the target's tokenizer")


def _score(target, cache, pending: torch.Tensor, tree: DraftTree, depths: torch.Tensor, want_hidden: bool,
           aux_layers: tuple[int, ...]) -> ModelOutput:
    """One target forward over [root, nodes] of every row -> logits (B, 1+N, V) and, when asked,
    the final hidden states (B, 1+N, C) and the aux layers' states (B, 1+N, nC). A chain is causal;
    a tree attends along its branches."""
    device = target.device
    block = torch.cat([pending[:, None], tree.tokens], dim=1).to(device)  # (B, 1+N)
    offsets = torch.cat([torch.zeros(tree.batch_size, 1, dtype=torch.long), depths], dim=1).to(device)
    # a finished row (or a node past a row's budget) may sit past the position table: its
    # outputs are discarded, so the clamp changes nothing that is kept
    positions = (cache.lengths[:, None] + offsets).clamp(max=target.config.max_position_embeddings - 1)
    block_mask = None if tree.is_chain else tree.block_mask().to(device)  # (B, 1+N, 1+N)
    return target(block, positions, cache, block_mask=block_mask, return_hidden=want_hidden, aux_layers=aux_layers)


def _keep_paths(cache, start: torch.Tensor, verdict: Verdict, active: list[int]) -> None:
    """Keep [root, accepted path] of every active row in the cache, written by the step from
    slots `start` (B,) on, and drop the rest (a finished row keeps nothing of the step): a
    length change when every path is a prefix of the block (a chain), else an in-place compaction."""
    B = len(verdict.paths)
    count = torch.zeros(B, dtype=torch.long)
    for b in active:
        count[b] = 1 + len(verdict.paths[b])
    count = count.to(start.device)
    if all(p == list(range(len(p))) for p in verdict.paths):
        cache.rollback(start + count)
        return
    keep = torch.zeros(B, 1 + max(len(p) for p in verdict.paths), dtype=torch.long)  # (B, 1 + D)
    for b in active:
        keep[b, :1 + len(verdict.paths[b])] = torch.tensor([0] + [1 + i for i in verdict.paths[b]])
    cache.compact(start[:, None] + keep.to(start.device), start, count)
