"""Warm-ups: untimed generations before timed ones, so that no timed step builds a compiled program.

A compiled target builds a program the first time it meets a step shape (a minute or more on a
CPU). `warm_up` runs a drafter spec once, and on a compiled target also every shape its timed runs
may meet: the draft lengths an `auto` k can pick (COMPILE_WARMUP_DRAFTS) for drafters sized by k,
every verification block (`compile_block_steps`) for kinds whose trees change size every step, and
each member alone for combinators whose gates may leave a member unrun in the warm-up. What each
kind needs is declared in its registry entry (`specdec.methods`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.compile import DECODE_STATIC_TOKENS

# draft lengths a compiled warm-up also runs, so that every block size a draft length of `auto` (or any
# k <= 7) can pick is compiled before timing: blocks of 2, 4 and 8 tokens, the draft's feeds of 1 and 2
COMPILE_WARMUP_DRAFTS = (1, 3, 7)


def warm_up(run: Callable[[object, int | None], None], spec, target, compiled: bool) -> None:
    """Untimed runs of drafter spec `spec` through `run(spec, k)` (k: a draft length in place of the
    spec's own, None: its own): once, and on a compiled target the shapes described above."""
    run(spec, None)
    if not compiled:
        return
    if spec.sized_by_k:
        for k in COMPILE_WARMUP_DRAFTS:
            run(spec, k)
    if spec.varying_blocks:
        compile_block_steps(target)
    if spec.gated_members:
        for member in spec.members:
            warm_up(run, member, target, compiled)


def compile_block_steps(target, batch_size: int = 1, cache=None) -> None:
    """Run every compiled program a verification step of up to DECODE_STATIC_TOKENS tokens may take,
    causal (a chain) and with a block mask (a tree), on a scratch cache or on `cache` (a serving
    engine's own, empty: its programs are keyed by its layout and shapes; its rows stay empty): a
    drafter whose trees change size every step (`suffix`) would otherwise compile them, seconds each,
    while it is timed or served."""
    if not getattr(target, "compiled", False):
        return
    device = target.device
    with torch.inference_mode():
        if cache is None:
            # made in inference mode as generate()'s caches are: the compiler guards on the tensors' dispatch
            # keys, so programs built for an ordinary cache are rebuilt at a timed step's first use
            cache = target.new_cache(batch_size, 2 * DECODE_STATIC_TOKENS + 2)
        batch_size = cache.batch_size
        for T in range(1, DECODE_STATIC_TOKENS + 1):
            # T = 1: a step where no row drafts (a program of its own in a batch of 2+ rows)
            masks = [None] if T == 1 else [None, torch.ones(T, T, dtype=torch.bool, device=device).tril()]
            for block in masks:
                cache.lengths.fill_(1)
                tokens = torch.zeros(batch_size, T, dtype=torch.long, device=device)
                positions = 1 + torch.arange(T, device=device)[None].expand(batch_size, T)
                target(tokens, positions, cache, block_mask=None if block is None else block.expand(batch_size, T, T))
        cache.lengths.zero_()
