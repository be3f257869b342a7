"""Suffix decoding: draft what followed the current context in the prompt, the output so far, or
earlier responses (SuffixDecoding, arXiv 2411.04975), with no model.

Each row keeps a suffix trie (`specdec.drafters.suffix_tree`) of its prompt and output; a
`SuffixCache` shared by every row and request (passed in: a spec's drafter gets its loader's,
`specdec.tuning.state.TuningState`) keeps earlier responses, bounded to `max_tokens` tokens (oldest response evicted
first). Per step, each row's last tokens are matched in both, and the tree of the most frequent
continuations with the higher expected accepted length (`Speculation.score`) is taken: its
size follows the match (at most max_factor * match length nodes, none below min_prob, at most
`max_nodes`), and it is cut to the best nodes worth their verification rows on this machine
(`specdec.tuning.costs`: block costs timed by the decode loop, nodes valued at the acceptance
measured for their probability; the rows of a batch share one budget, as they share one block)
before it is proposed. The tree is deterministic (q one-hot), so
verification is lossless as for every drafter; each node carries its frequency estimate in
`DraftTree.scores`.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from runtime.errors import ContextLengthError
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters.suffix_tree import Speculation, SuffixTrie, TrieNode
from specdec.tuning.costs import BlockCosts, NodeCalibration, batch_cut, target_costs

DEFAULT_CACHE_TOKENS = 1 << 16  # response tokens the shared cache keeps (nodes <= tokens * depth)


@dataclass(frozen=True)
class SuffixConfig:
    """depth: tokens per trie path (match + continuation, vLLM's max_tree_depth); max_nodes: the
    most nodes a step drafts (the spec's @N; 7 fits the compiled 8-token verification program);
    max_factor: nodes per matched token; min_prob: the least path probability a node may have;
    cache_tokens: the cache's bound when this drafter makes its own (0: no cache of responses);
    cut: cut each tree to its best nodes by expected tokens per second of verification, once two
    block sizes were timed (`specdec.tuning.costs`); False verifies every node the size rule allows."""

    depth: int = 24
    max_nodes: int = 7
    max_factor: float = 1.0
    min_prob: float = 0.1
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    cut: bool = True

    def __post_init__(self) -> None:
        for name, low in (("depth", 2), ("max_nodes", 1), ("cache_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SuffixConfig.{name} must be an integer >= {low}, got {value!r}")
        if not self.max_factor > 0:
            raise ValueError(f"SuffixConfig.max_factor must be > 0, got {self.max_factor!r}")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"SuffixConfig.min_prob must be in [0, 1), got {self.min_prob!r}")
        if not isinstance(self.cut, bool):
            raise ValueError(f"SuffixConfig.cut must be True or False, got {self.cut!r}")


class SuffixCache:
    """Responses shared across requests: a suffix trie of at most `max_tokens` tokens, the oldest
    response evicted first when a new token would pass the bound (so nodes <= max_tokens * depth).
    Thread-safe: rows of several generate() calls may share it."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS, depth: int = SuffixConfig.depth) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"a suffix cache holds max_tokens >= 1 tokens, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.trie = SuffixTrie(depth)
        self.tokens = 0
        self.evicted = 0  # responses evicted so far
        self._responses: OrderedDict[int, list[int]] = OrderedDict()  # key -> its tokens, oldest first
        self._keys = itertools.count()
        self._lock = threading.Lock()

    @property
    def depth(self) -> int:
        return self.trie.depth

    @property
    def responses(self) -> int:
        return len(self._responses)

    def open(self) -> int:
        """A key for a new response."""
        with self._lock:
            key = next(self._keys)
            self._responses[key] = []
            return key

    def extend(self, key: int, windows: list[TrieNode], tokens: list[int]) -> list[TrieNode] | None:
        """Append `tokens` to response `key` (its open windows: [] at first); the new windows, or
        None once the response was evicted (then it is no longer cached)."""
        with self._lock:
            seq = self._responses.get(key)
            if seq is None:
                return None
            room = self.max_tokens - len(seq)  # a response longer than the bound keeps its start
            tokens = tokens[:max(room, 0)]
            while self.tokens + len(tokens) > self.max_tokens:
                self._evict_oldest(but=key)
            seq.extend(tokens)
            self.tokens += len(tokens)
            return self.trie.extend(windows, tokens)

    def add(self, tokens: list[int]) -> None:
        """Cache one whole response (what a row's extends add up to): how a resumed `specdec eval`
        restores the answers an interrupted run had cached."""
        self.extend(self.open(), [], list(tokens))

    def _evict_oldest(self, but: int) -> None:
        key = next(k for k in self._responses if k != but)  # exists: the others hold the excess
        seq = self._responses.pop(key)
        self.trie.remove(seq)
        self.tokens -= len(seq)
        self.evicted += 1

    def speculate(self, context: list[int], config: SuffixConfig) -> Speculation:
        with self._lock:
            return self.trie.speculate(context, config.max_nodes, config.max_factor, config.min_prob)

    def clear(self) -> None:
        """Forget every response (rows still extending theirs stop caching them)."""
        with self._lock:
            self._responses.clear()
            self.trie = SuffixTrie(self.trie.depth)
            self.tokens = 0


class _Row:
    """One row's state: its own trie (prompt + output), the tokens it has read, its response's key
    and open windows in the shared cache."""

    def __init__(self, prompt: torch.Tensor, depth: int, cache: SuffixCache | None) -> None:
        self.trie = SuffixTrie(depth)
        ids = prompt.tolist()
        self.windows = self.trie.extend([], ids)
        self.read = len(ids)
        self.prompt_len = len(ids)
        self.key = cache.open() if cache is not None else None
        self.cache_windows: list[TrieNode] | None = []


class SuffixDrafter(Drafter):
    """Suffix decoding over each row's prompt and output and a shared cache of earlier responses
    (module docstring). `cache`: the SuffixCache to share (default: a new one of its own, of
    config.cache_tokens; none when that is 0). `target`: the model that verifies, whose block costs
    earlier calls timed (`specdec.tuning.costs.target_costs`; default: this drafter times its own);
    `calibration`: the NodeCalibration to share (default: its own)."""

    name = "suffix"
    adaptive = False

    def __init__(self, config: SuffixConfig | None = None, cache: SuffixCache | None = None, target=None,
                 calibration: NodeCalibration | None = None) -> None:
        self.config = config or SuffixConfig()
        if cache is None and self.config.cache_tokens:
            cache = SuffixCache(self.config.cache_tokens, self.config.depth)
        if cache is not None and cache.depth != self.config.depth:
            raise ValueError(f"the suffix cache has depth {cache.depth} but the drafter's config {self.config.depth}")
        self.cache = cache
        self.rows: list[_Row | None] = []
        self.target = target
        self.costs = BlockCosts()  # this machine's verification seconds by block size (begin: the target's)
        # how often nodes are accepted, by their path probability
        self.calibration = NodeCalibration() if calibration is None else calibration
        self.proposed: dict[int, list[float]] = {}  # row -> its last proposal's path probabilities

    def max_nodes(self, k: int) -> int:
        return self.config.max_nodes

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        self.rows = [_Row(p, self.config.depth, self.cache) for p in prompts]
        self._time_blocks(len(prompts))

    def reserve(self, batch_size: int, max_len: int) -> None:
        self.rows = [None] * batch_size
        self._time_blocks(batch_size)

    def _time_blocks(self, batch_size: int) -> None:
        """Size proposals by the target's block costs at this batch size, as earlier calls timed them."""
        if self.target is not None:
            self.costs = target_costs(self.target, batch_size)

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.rows[row] = _Row(prompt, self.config.depth, self.cache)

    def release(self, row: int) -> None:
        self.rows[row] = None

    def _read(self, state: _Row, seq: torch.Tensor) -> list[int]:
        """Add what row `state` committed since it last read `seq` to its trie and to the cache; its
        context (the last depth - 1 tokens)."""
        new = seq[state.read:].tolist()
        if new:
            state.windows = state.trie.extend(state.windows, new)
            state.read = seq.numel()
            if state.cache_windows is not None and self.cache is not None:
                out = seq[max(state.prompt_len, seq.numel() - len(new)):].tolist()  # response tokens only
                state.cache_windows = self.cache.extend(state.key, state.cache_windows, out)
        return seq[max(0, seq.numel() - self.config.depth + 1):].tolist()

    def speculate(self, row: int, seq: torch.Tensor) -> Speculation:
        """Row `row`'s best tree after `seq`: its own trie's or the shared cache's, whichever scores higher."""
        state = self.rows[row]
        context = self._read(state, seq)
        c = self.config
        best = state.trie.speculate(context, c.max_nodes, c.max_factor, c.min_prob)
        if self.cache is not None:
            shared = self.cache.speculate(context, c)
            if shared.score > best.score:
                best = shared
        return best

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        B, n = len(seqs), self.config.max_nodes
        tokens = torch.zeros(B, n, dtype=torch.long)  # (B, N)
        parents = (torch.arange(n) - 1)[None].repeat(B, 1)  # (B, N): padding nodes form a chain
        scores = torch.zeros(B, n)  # (B, N)
        lens = torch.zeros(B, dtype=torch.long)  # (B,)
        cut = self.config.cut and self.costs.known()
        self.proposed = {}
        specs = {b: self.speculate(b, seqs[b]) for b in rows}
        # the batch's rows share one block: one budget for all of them (a row alone: best_cut)
        budget = batch_cut([[self.calibration.value(p) for p in s.probs] for s in specs.values()], self.costs) \
            if cut else n
        for b, spec in specs.items():
            m = min(budget, len(spec.tokens))
            if m:
                self.proposed[b] = list(spec.probs[:m])
                tokens[b, :m] = torch.tensor(spec.tokens[:m])
                parents[b, :m] = torch.tensor(spec.parents[:m])
                scores[b, :m] = torch.tensor(spec.probs[:m])
                lens[b] = m
        return DraftTree(tokens, parents, lens, scores=scores)

    def commit(self, accepted: Accepted) -> None:
        """Read what each row committed into its trie and the shared cache (so the cache holds every
        answer whole: a row's last step is read here, not at a next propose that never comes); learn
        the verification's cost by block size and how much of the verified trees was accepted."""
        for b, seq in enumerate(accepted.seqs):
            state = self.rows[b] if b < len(self.rows) else None
            if state is not None:
                self._read(state, seq)
        if accepted.target_s > 0:
            self.costs.observe(accepted.block, accepted.target_s, accepted.step)
        for b, probs in self.proposed.items():
            if accepted.verified is None or accepted.verified[b]:
                kept = set(accepted.paths[b])
                self.calibration.observe(probs, [i in kept for i in range(len(probs))])


def from_spec(spec, target, loader) -> SuffixDrafter:
    """`suffix[@N]` (specdec.methods): a SuffixDrafter drafting trees of up to N nodes from the
    cache the loader's tuning state gives (generate()'s default: the process's; the serving engine
    keeps one drafter, so its requests share it). N must be below the target's context
    (ContextLengthError naming the spec)."""
    config = SuffixConfig() if spec.size is None else SuffixConfig(max_nodes=spec.size)
    positions = target.config.max_position_embeddings
    if config.max_nodes >= positions:  # a tree that never fits would only size the cache past the model
        raise ContextLengthError(f"{str(spec)!r}: N = {config.max_nodes} tree nodes do not fit the target's context "
                                 f"of {positions} positions (the prompt needs one too); use N below {positions} "
                                 f"(default {SuffixConfig.max_nodes})")
    return SuffixDrafter(config, cache=loader.suffix_cache(config.depth, config.cache_tokens), target=target,
                         calibration=loader.node_calibration(("suffix", config)))
