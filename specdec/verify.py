"""Verification of a draft tree against one target forward: greedy, lossless, typical.

The target scored [root, nodes] of every row (`specdec.drafter.DraftTree`); logits[b, 0] is its
distribution after the root, logits[b, 1 + i] after node i. Verification walks each row from
the root and returns the accepted path and the token that follows it.

- Greedy (temperature 0): accept a node when it equals the target's argmax after its parent;
  the path is the deepest node whose every ancestor was accepted, and the next token is the
  argmax after it. Output equals plain greedy decoding.
- Lossless (speculative sampling; Leviathan et al. 2023, Chen et al. 2023; for trees, recursive
  rejection over siblings as in SpecInfer): at a node with target distribution p, try its
  children in order; child x drawn from q is accepted with probability min(1, p(x) / q(x));
  on rejection p <- norm(max(0, p - q)) before the next sibling. When every child fails, the
  next token is drawn from what is left of p; when the path ends at a leaf, from p itself. A
  deterministic draft has q one-hot: accept when u < p(x), else zero p(x) and renormalise.
  Each emitted token is distributed exactly as the target's p.
- Typical (lossy; Cai et al. 2024): a node x passes when p(x) > min(epsilon, delta * exp(-H(p)))
  under its parent's p; as in Medusa's reference (`evaluate_posterior`), the path is the deepest
  node whose every ancestor passes (ties go to the best-ranked), and the next token is sampled
  from p at its end. Taking the first passing sibling instead would stop at a shallower branch
  where a deeper one passes too.

Only valid nodes (index < lens[b], and within the row's budget) can be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels.cpu_argmax import argmax
from specdec.drafter import DraftTree, TypicalAcceptance
from specdec.sampling import check_finite, probs_from_logits


@dataclass
class Verdict:
    """Per row: the accepted draft nodes from the root's child down (indices into the DraftTree;
    the root is not a node), and the token that follows them (B,), on the CPU."""

    paths: list[list[int]]
    next_tokens: torch.Tensor


def _leading(flags: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row of flags (B, k) -> (B,)."""
    return flags.long().cumprod(-1).sum(-1)


def verify(logits: torch.Tensor, tree: DraftTree, valid: torch.Tensor, temperature: float,
           top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
           typical: TypicalAcceptance | None = None) -> Verdict:
    """Verify `tree` against target logits (B, 1 + N, V); valid (B, N) bool: the nodes that may
    be accepted. Greedy at temperature 0; otherwise lossless, or typical when given."""
    check_finite(logits)
    if temperature == 0:
        return verify_greedy(logits, tree, valid)
    if typical is not None:
        return verify_typical(logits, tree, valid, temperature, top_k, top_p, generator, typical)
    if tree.is_chain:
        return verify_chain_sampling(logits, tree, valid, temperature, top_k, top_p, generator)
    return _walk_lossless(logits, tree, valid, temperature, top_k, top_p, generator)


def verify_greedy(logits: torch.Tensor, tree: DraftTree, valid: torch.Tensor) -> Verdict:
    """Greedy verification: the deepest node whose whole path equals the target's argmax."""
    best = argmax(logits).cpu()  # (B, 1 + N)
    match = (tree.tokens == best.gather(1, tree.parents + 1)) & valid  # (B, N)
    if tree.is_chain:
        accepted = _leading(match)  # (B,)
        paths = [list(range(a)) for a in accepted.tolist()]
        return Verdict(paths, best.gather(1, accepted[:, None])[:, 0])
    deepest = _deepest_passing(tree, match)
    paths = [tree.path(b, int(node)) for b, node in enumerate(deepest)]
    return Verdict(paths, best.gather(1, (deepest + 1)[:, None])[:, 0])


def _deepest_passing(tree: DraftTree, passed: torch.Tensor) -> torch.Tensor:
    """(B,) per row the deepest node whose path from the root passes entirely (passed (B, N) bool,
    on the CPU); -1 = the root. Ties go to the first (best-ranked) node."""
    B = passed.shape[0]
    anc = tree.block_mask()[:, 1:, 1:]  # (B, N, N): ancestors among the nodes, self included
    ok = ~((~passed)[:, None, :] & anc).any(-1)  # (B, N): every node on the path passes
    score = torch.cat([torch.zeros(B, 1, dtype=torch.long), ok * tree.depths()], dim=1)  # (B, 1 + N)
    return score.argmax(-1) - 1


def verify_typical(logits: torch.Tensor, tree: DraftTree, valid: torch.Tensor, temperature: float, top_k: int,
                   top_p: float, generator: torch.Generator | None, typical: TypicalAcceptance) -> Verdict:
    """Typical acceptance, every row at once: the deepest path of nodes x with p(x) above their
    parent's threshold min(epsilon, delta * exp(-H(p))), then a token sampled from p at its end."""
    B = tree.tokens.shape[0]
    device = logits.device
    p = probs_from_logits(logits, temperature, top_k, top_p)  # (B, 1 + N, V)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B, 1 + N)
    threshold = torch.minimum(torch.full_like(entropy, typical.epsilon), typical.delta * torch.exp(-entropy))
    rows = torch.arange(B, device=device)
    parents = (tree.parents + 1).to(device)  # (B, N): each node's parent in [root, nodes]
    p_node = p[rows[:, None], parents, tree.tokens.to(device)]  # (B, N): p(x) under its parent
    passed = (p_node > threshold.gather(1, parents)).cpu() & valid.cpu()  # (B, N)
    deepest = _deepest_passing(tree, passed)
    at = p[rows, (deepest + 1).to(device)]  # (B, V): p where the path ends
    nxt = torch.multinomial(at, 1, generator=generator).squeeze(1).cpu()
    return Verdict([tree.path(b, int(node)) for b, node in enumerate(deepest)], nxt)


def verify_chain_sampling(logits: torch.Tensor, tree: DraftTree, valid: torch.Tensor, temperature: float,
                          top_k: int, top_p: float, generator: torch.Generator | None) -> Verdict:
    """Lossless rejection sampling of a chain, every row at once (the tree walk's chain case)."""
    device = logits.device
    drafts = tree.tokens.to(device)  # (B, k)
    B, k = drafts.shape
    q = None if tree.q is None else tree.q.to(device)
    p = probs_from_logits(logits, temperature, top_k, top_p)  # (B, k+1, V)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (B, k): p(x_i)
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    u = _uniforms(valid, generator, device)  # (B, k)
    accepted = _leading((u * q_draft < p_draft) & valid.to(device))  # (B,)
    rows = torch.arange(B, device=device)
    at = p[rows, accepted]  # (B, V): target distribution where the chain stopped
    rejected = accepted < valid.to(device).sum(-1)
    if bool(rejected.any()):
        idx = accepted.clamp(max=k - 1)
        q_at = torch.zeros_like(at).scatter(-1, drafts[rows, idx][:, None], 1.0) if q is None else q[rows, idx]
        at = torch.where(rejected[:, None], _residual(at, q_at), at)
    nxt = torch.multinomial(at, 1, generator=generator).squeeze(1).cpu()
    return Verdict([list(range(a)) for a in accepted.tolist()], nxt)


def _uniforms(valid: torch.Tensor, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(B, k) uniforms for each row's valid drafts (a prefix of a chain; 1 after it), row by row: a
    row draws as many numbers as it has drafts, however long the batch's longest draft is, so with
    a fixed draft length a seeded row samples the same tokens whatever rows run beside it."""
    B, k = valid.shape
    u = torch.ones(B, k, device=device)
    source = generator.device if generator is not None else device
    for b, n in enumerate(valid.sum(-1).tolist()):
        if n:
            u[b, :n] = torch.rand(n, generator=generator, device=source).to(device)
    return u


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; p itself where p == q up to rounding."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


def _walk_lossless(logits: torch.Tensor, tree: DraftTree, valid: torch.Tensor, temperature: float, top_k: int,
                   top_p: float, generator: torch.Generator | None) -> Verdict:
    """Walk each row from the root; at each node recursive rejection over its children
    (`_choose_child`) accepts one or none, and the next token is drawn from (what is left of) p
    at the node where the walk stops."""
    B, n = tree.tokens.shape
    parents, ok = tree.parents.tolist(), valid.tolist()
    paths, nxt = [], []
    for b in range(B):
        children: list[list[int]] = [[] for _ in range(n + 1)]  # [1 + i]: children of node i
        for i in range(n):
            if ok[b][i]:
                children[parents[b][i] + 1].append(i)
        tokens = tree.tokens[b].tolist()
        node, path = -1, []
        while True:
            p = probs_from_logits(logits[b, node + 1], temperature, top_k, top_p)  # (V,)
            kids = children[node + 1]
            pick = _choose_child(p, tree.q, b, kids, [tokens[c] for c in kids], generator) if kids else None
            if pick is None:
                nxt.append(int(torch.multinomial(p, 1, generator=generator)))
                break
            node = kids[pick]
            path.append(node)
        paths.append(path)
    return Verdict(paths, torch.tensor(nxt, dtype=torch.long))


def _choose_child(p: torch.Tensor, q: torch.Tensor | None, row: int, kids: list[int], xs: list[int],
                  generator: torch.Generator | None) -> int | None:
    """Recursive rejection over siblings: child x (drawn from q) passes with min(1, p(x) / q(x));
    the index into `kids` of the accepted child, or None with p left as the residual the next
    token is drawn from."""
    for i, (c, x) in enumerate(zip(kids, xs)):
        u = float(torch.rand((), generator=generator, device=p.device))
        if q is None:  # one-hot q: accept with p(x), else zero p(x)
            if u < float(p[x]):
                return i
            p[x] = 0.0
            p.div_(p.sum())  # positive: a rejection means p(x) < 1
        else:
            qc = q[row, c].to(p.device)
            if u * float(qc[x]) < float(p[x]):
                return i
            p.copy_(_residual(p, qc))
    return None
