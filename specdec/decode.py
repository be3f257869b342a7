"""The decode loop: every drafter (or none) runs through these few functions.

Per step, for the whole batch: the drafter proposes a tree per row (`specdec.drafter`); one
target forward scores [root, nodes] (causal for a chain, the tree's ancestor mask otherwise);
`specdec.verify` keeps each row's accepted path plus one target token; the target's cache keeps
the accepted path (a length change for a chain, an in-place compaction for a tree) and the
drafter is told what was accepted. Plain decoding is the same loop with no drafts. Rows advance
independently; a finished row is carried along but writes nothing that stays in the cache.
"""

from __future__ import annotations

import time

import torch

from runtime.compile import DECODE_STATIC_TOKENS
from specdec.autok import AutoK
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.rows import RowState, check_lengths, prefill
from specdec.sampling import select_next
from specdec.stats import AcceptanceStats
from specdec.verify import Verdict, verify

MAX_DRAFT_TOKENS = 16
# "auto" on a compiled target: verification blocks of 2..8 tokens share one compiled program
# (runtime.compile.static_tokens); 9..16 would compile another, with its own frozen weights.
MAX_DRAFT_TOKENS_COMPILED = DECODE_STATIC_TOKENS - 1


def draft_length(num_draft_tokens: int | str, target, drafter: Drafter | None) -> tuple[int, AutoK | None]:
    """k, and the AutoK that tunes it per step when num_draft_tokens is "auto" (and the drafter
    drafts chains of any length)."""
    if num_draft_tokens == "auto":
        k_max = MAX_DRAFT_TOKENS_COMPILED if getattr(target, "compiled", False) else MAX_DRAFT_TOKENS
        adaptive = drafter is not None and drafter.adaptive
        return k_max, AutoK(k_max=k_max) if adaptive else None
    return num_draft_tokens, None


def decode(target, drafter: Drafter | None, state: RowState, num_draft_tokens: int | str,
           temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
           hidden: list[list[torch.Tensor]] | None = None) -> AcceptanceStats:
    """Generate every row of `state` (plain decoding when drafter is None); returns the stats.

    hidden: a list of B empty lists that receive, per row, the target's final hidden state (C,)
    behind each emitted token (the state whose logits chose it).
    """
    layers = drafter.hidden_layers if drafter is not None else ()
    if not layers:
        return _decode(target, drafter, state, num_draft_tokens, temperature, top_k, top_p, generator, hidden)
    if not hasattr(target, "aux_outputs"):
        raise ValueError(f"drafter {drafter.name!r} reads the target's layers {tuple(layers)}, which only a runtime "
                         "Transformer returns (runtime.load_model), not a transformers model")
    with target.aux_outputs(layers):
        return _decode(target, drafter, state, num_draft_tokens, temperature, top_k, top_p, generator, hidden)


def _decode(target, drafter: Drafter | None, state: RowState, num_draft_tokens: int | str,
            temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
            hidden: list[list[torch.Tensor]] | None) -> AcceptanceStats:
    """`decode`, with the target's aux layers (if any) already being collected."""
    k_max, auto = draft_length(num_draft_tokens, target, drafter)
    cfg = target.config
    slack = 1 + (drafter.max_nodes(k_max) if drafter is not None else 0)
    max_len = check_lengths(state.prompts, state.max_new_tokens, cfg.max_position_embeddings,
                            cfg.vocab_size) + slack
    stats = AcceptanceStats(num_calls=1)
    if state.all_done:
        return stats
    want_hidden = hidden is not None or (drafter is not None and drafter.needs_hidden)
    want_aux = drafter is not None and bool(drafter.hidden_layers)
    B = len(state.prompts)
    start = time.perf_counter()
    cache = target.new_cache(B, max_len)
    out = prefill(target, state.prompts, cache, return_hidden=want_hidden, return_aux=want_aux)
    out = out if isinstance(out, tuple) else (out,)
    logits = out[0]  # (B, V)
    h = out[1] if want_hidden else None  # (B, C)
    aux = out[-1] if want_aux else None  # (B, T, nC)
    pending = select_next(logits, temperature, top_k, top_p, generator).cpu()  # (B,)
    for b in state.active():
        stats.target_forwards += 1
        stats.generated_tokens += state.emit(b, [int(pending[b])])
        if hidden is not None:
            hidden[b].append(h[b])
    stats.ttft_s = time.perf_counter() - start
    if drafter is not None:
        drafter.begin(state.prompts, max_len, aux if want_aux else h)
    while not state.all_done:
        active = state.active()
        budget = torch.zeros(B, dtype=torch.long)  # drafts a row may still use: one token is always emitted
        for b in active:
            budget[b] = state.max_new_tokens - len(state.new[b]) - 1
        k = min(auto.choose(drafter.draft_cost) if auto is not None else k_max, int(budget.max()))
        t_draft = time.perf_counter()
        tree = drafter.propose(state.sequences(), k, active) if drafter is not None and k > 0 \
            else DraftTree.empty(B)
        _check_proposal(drafter, tree, B, k)
        if tree.num_nodes > int(tree.lens.max()):  # score no column that no row may accept
            tree = tree.truncate(int(tree.lens.max()))
        t_verify = time.perf_counter()
        stats.draft_s += t_verify - t_draft
        depths = tree.depths()  # (B, N)
        valid = (torch.arange(tree.num_nodes)[None] < tree.lens[:, None]) & (depths <= budget[:, None])
        start_len = cache.lengths.clone()  # (B,)
        # (B, 1+N, V), (B, 1+N, C), (B, 1+N, nC)
        logits, hid, aux = _score(target, cache, pending, tree, depths, want_hidden, want_aux)
        verdict = verify(logits, tree, valid, temperature, top_k, top_p, generator,
                         drafter.typical if drafter is not None else None)
        target_s = time.perf_counter() - t_verify
        for b in active:
            path = verdict.paths[b]
            deepest = int(depths[b][valid[b]].max()) if bool(valid[b].any()) else 0  # drafts on the longest path
            reached = len(path) + int(bool(valid[b][tree.parents[b] == (path[-1] if path else -1)].any()))
            emitted = state.emit(b, tree.tokens[b, path].tolist() + [int(verdict.next_tokens[b])])
            stats.record_step(deepest, reached, len(path), emitted)
            if hidden is not None:
                hidden[b].extend(hid[b, [0] + [1 + i for i in path]][:emitted])
            if auto is not None:
                auto.observe(len(path), int(valid[b].sum()), tree.num_nodes + 1, target_s)
        _keep_paths(cache, start_len, verdict, active)
        if drafter is not None:
            told = aux if want_aux else hid if drafter.needs_hidden else None
            drafter.commit(Accepted(state.sequences(), verdict.paths, told))
        pending = verdict.next_tokens
        stats.verify_s += time.perf_counter() - t_verify
    stats.wall_s = time.perf_counter() - start
    per_row = max(len(n) for n in state.new)
    stats.tpot_s = (stats.wall_s - stats.ttft_s) / (per_row - 1) if per_row > 1 else 0.0
    return stats


def _check_proposal(drafter: Drafter | None, tree: DraftTree, batch_size: int, k: int) -> None:
    """Fail fast, naming the drafter, when a proposal does not fit the batch or the caches."""
    if drafter is None:
        return
    if tree.batch_size != batch_size:
        raise ValueError(f"drafter {drafter.name!r} proposed {tree.batch_size} rows for a batch of {batch_size}")
    if tree.num_nodes > drafter.max_nodes(k):
        raise ValueError(f"drafter {drafter.name!r} proposed {tree.num_nodes} nodes, more than its max_nodes({k}) = "
                         f"{drafter.max_nodes(k)} the caches were sized for; make Drafter.max_nodes return the "
                         "most nodes propose() can return")


def _score(target, cache, pending: torch.Tensor, tree: DraftTree, depths: torch.Tensor, want_hidden: bool,
           want_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
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
    if not want_aux:  # (a transformers target's adapter knows no return_aux)
        out = target(block, positions, cache, block_mask=block_mask, return_hidden=want_hidden)
        return (out, None, None) if not want_hidden else (out[0], out[1], None)
    out = target(block, positions, cache, block_mask=block_mask, return_hidden=want_hidden, return_aux=True)
    return out[0], out[1] if want_hidden else None, out[-1]


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
