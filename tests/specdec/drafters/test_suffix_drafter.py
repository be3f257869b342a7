"""The suffix drafter: lossless (greedy equals plain, sampling keeps the target's law), the shared
cache's bound and eviction, and what the cache brings to a repeated workload."""

import pytest
import torch

import specdec
from specdec.drafter import Accepted
from specdec.drafters.suffix import DEFAULT_CACHE_TOKENS, SuffixCache, SuffixConfig, SuffixDrafter
from specdec.drafters.suffix_tree import SuffixTrie
from specdec.loader import make_drafter
from specdec.tuning.costs import target_costs
from specdec.tuning.state import process_state
from tests.specdec.test_decode import _rows, _same, assert_two_token_law
from tests.specdec.tuning.test_costs import _costs


def _drafter(cache_tokens: int = 4096, **config) -> SuffixDrafter:
    """The size rule alone by default (cut=False): a cut follows measured timings, so proposals would vary."""
    config = SuffixConfig(**{"cut": False, **config})
    return SuffixDrafter(config, cache=SuffixCache(cache_tokens, config.depth))


@pytest.mark.parametrize("max_nodes", [1, 3, 7])
def test_greedy_output_equals_plain_on_ragged_rows(target, max_nodes):
    rows = _rows(seed=5, lengths=(3, 12, 6, 1))
    plain = specdec.generate(target, rows, max_new_tokens=30).sequences
    drafter = _drafter(max_nodes=max_nodes, max_factor=4.0)
    for _ in range(2):  # the second pass drafts from the cache of the first
        out = specdec.generate(target, rows, draft=drafter, max_new_tokens=30)
        assert _same(out.sequences, plain)
    assert out.stats.acceptance_rate > 0


def test_a_batched_row_equals_the_row_alone(target):
    rows = _rows(seed=6, lengths=(2, 9, 5))
    batch = specdec.generate(target, rows, draft=_drafter(), max_new_tokens=20).sequences
    for r, s in zip(rows, batch):
        assert torch.equal(specdec.generate(target, [r], draft=_drafter(), max_new_tokens=20).sequences[0], s)


def test_sampling_keeps_the_joint_law_of_two_tokens(target):
    """The prompt holds every token once, each followed by another, so every row drafts after its
    first token x1 (from the prompt, or from the cache of the 3000 rows' responses): the pair
    (x1, x2) still follows the target's exact law."""
    n = 3000
    prompt = torch.stack([torch.arange(64), (torch.arange(64) * 7 + 3) % 64], dim=1).flatten()
    kw = dict(temperature=0.8, top_k=12, top_p=0.9)
    out = specdec.generate(target, [prompt] * n, draft=_drafter(depth=4, max_nodes=2, max_factor=4.0, min_prob=0.0),
                           max_new_tokens=3, generator=torch.Generator().manual_seed(2), **kw)
    assert out.stats.drafted_tokens >= n and out.stats.accepted_tokens > 0
    assert_two_token_law(target, prompt, out.sequences, kw)


def test_the_shared_cache_raises_acceptance_on_a_repeated_workload(target):
    rows = _rows(seed=8, lengths=(4, 7, 10))
    drafter = _drafter()
    first = specdec.generate(target, rows, draft=drafter, max_new_tokens=40).stats
    second = specdec.generate(target, rows, draft=drafter, max_new_tokens=40).stats
    assert second.mean_accepted_tokens > 1.3 * first.mean_accepted_tokens
    without = SuffixDrafter(SuffixConfig(cache_tokens=0, cut=False))
    assert without.cache is None
    again = [specdec.generate(target, rows, draft=without, max_new_tokens=40).stats for _ in range(2)]
    assert again[0].mean_accepted_tokens == again[1].mean_accepted_tokens  # nothing carried over


def _fill(cache: SuffixCache, seq: list[int]) -> None:
    key, windows = cache.open(), []
    for i in range(0, len(seq), 3):  # appended in chunks, as steps commit them
        windows = cache.extend(key, windows, seq[i:i + 3])


def test_the_cache_stays_within_its_bound_evicting_the_oldest_response():
    cache = SuffixCache(max_tokens=40, depth=6)
    responses = [[r * 10 + (j % 7) for j in range(15)] for r in range(6)]
    for r in responses:
        _fill(cache, r)
        assert cache.tokens <= 40 and cache.trie.nodes <= 1 + 40 * 6
    assert cache.responses == 2 and cache.evicted == 4 and cache.tokens == 30
    config = SuffixConfig(depth=6)
    assert cache.speculate([0, 1], config).tokens == ()  # the oldest responses are gone
    assert cache.speculate([51, 52], config).tokens[:2] == (53, 54)  # the newest is there
    rebuilt = SuffixTrie(6)
    for r in responses[-2:]:
        rebuilt.extend([], r)
    assert cache.trie.nodes == rebuilt.nodes


def test_a_response_longer_than_the_bound_keeps_its_start_and_an_evicted_one_stops():
    cache = SuffixCache(max_tokens=10, depth=4)
    key = cache.open()
    windows = cache.extend(key, [], list(range(8)))
    windows = cache.extend(key, windows, list(range(8, 16)))
    assert cache.tokens == 10
    other = cache.open()
    cache.extend(other, [], [100, 101])  # evicts the first response
    assert cache.extend(key, windows, [16]) is None and cache.tokens == 2


def test_drafters_made_from_a_spec_share_the_process_cache(target):
    a, b = (make_drafter("suffix@4", target) for _ in range(2))
    shared = process_state().suffix_cache(SuffixConfig.depth, DEFAULT_CACHE_TOKENS)
    assert a.cache is b.cache is shared and a.config.max_nodes == 4
    with pytest.raises(ValueError, match="depth"):
        SuffixDrafter(SuffixConfig(depth=8), cache=SuffixCache(10, depth=6))
    with pytest.raises(ValueError, match="min_prob"):
        SuffixConfig(min_prob=1.0)


def test_drafters_made_from_a_spec_share_the_targets_block_costs_and_their_calibration(target):
    """What one call learns (the target's block costs at a batch size, how often nodes of a probability
    are accepted) starts the next call's cut; a drafter made without a target keeps its own."""
    a, b = (make_drafter("suffix", target) for _ in range(2))
    a.begin([torch.tensor([1, 2, 3])], 64, None)
    b.reserve(1, 64)
    assert a.costs is b.costs is target_costs(target, 1)
    assert a.calibration is b.calibration is process_state().node_calibration(("suffix", SuffixConfig()))
    b.reserve(3, 64)
    assert b.costs is target_costs(target, 3) is not a.costs
    assert make_drafter("suffix@4", target).calibration is not a.calibration  # another config
    alone = SuffixDrafter(SuffixConfig())
    alone.begin([torch.tensor([1, 2, 3])], 64, None)
    assert alone.costs is not a.costs and alone.calibration is not a.calibration


def test_the_cut_verifies_only_the_nodes_that_pay_on_the_measured_costs():
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8] * 3)
    seq = torch.cat([prompt, torch.tensor([1, 2, 3])])
    lens = {}
    for name, table in (("uncut", None), ("free rows", {1: 1.0, 8: 1.0}), ("costly rows", {1: 1.0, 2: 1.05, 8: 10.0})):
        drafter = SuffixDrafter(SuffixConfig(max_factor=4.0, cut=table is not None), cache=None)
        if table:
            drafter.costs = _costs(table)
        drafter.begin([prompt], 64, None)
        tree = drafter.propose([seq], 7, [0])
        lens[name] = int(tree.lens[0])
        assert tree.tokens[0, :lens[name]].tolist() == [4, 5, 6, 7, 8, 1, 2][:lens[name]]
    assert lens == {"uncut": 7, "free rows": 7, "costly rows": 1}
    # what was verified teaches the calibration; a row whose proposal another member's replaced does not
    drafter.commit(Accepted([seq], [[]], block=2, target_s=1.05, verified=[False]))
    assert drafter.calibration.value(1.0) == pytest.approx(0.95)  # the prior of its bin
    drafter.commit(Accepted([seq], [[]], block=2, target_s=1.05))
    assert drafter.calibration.value(1.0) == pytest.approx(0.95 * 2 * 0.98 / (2 * 0.98 + 1))  # its node rejected


def test_a_cutting_drafter_learns_the_costs_from_the_loop_and_stays_lossless(target):
    rows = _rows(seed=5, lengths=(3, 12, 6, 1))
    plain = specdec.generate(target, rows, max_new_tokens=30).sequences
    drafter = SuffixDrafter(SuffixConfig(max_factor=4.0), cache=SuffixCache(4096))
    assert drafter.config.cut and not drafter.costs.known()
    for _ in range(2):
        assert _same(specdec.generate(target, rows, draft=drafter, max_new_tokens=30).sequences, plain)
    assert drafter.costs.known()  # timed by the decode loop, block size by block size


def test_a_tree_past_the_models_context_is_refused_naming_the_spec_and_n(target):
    """suffix@N sizes the verification cache: N at or past the target's positions (512 here) is refused
    before anything is allocated, with a message naming the spec and N."""
    from runtime.errors import ContextLengthError

    positions = target.config.max_position_embeddings
    for n in (positions, 999999999):
        with pytest.raises(ContextLengthError, match=rf"'suffix@{n}': N = {n} tree nodes .* {positions} positions"):
            make_drafter(f"suffix@{n}", target)
    assert make_drafter(f"suffix@{positions - 1}", target).config.max_nodes == positions - 1


def test_the_cache_holds_every_answer_whole_and_add_rebuilds_it(target):
    """The last step's tokens reach the cache at its commit (no propose follows it), so the cache holds
    exactly the answers; `SuffixCache.add` of those answers rebuilds the same trie (a resumed eval)."""
    rows = _rows(seed=8, lengths=(4, 7))
    drafter = _drafter()
    out = specdec.generate(target, rows, draft=drafter, max_new_tokens=17)
    answers = [s[len(r):].tolist() for r, s in zip(rows, out.sequences)]
    assert drafter.cache.tokens == sum(map(len, answers)) == 34
    rebuilt = SuffixCache(4096, drafter.config.depth)
    for a in answers:
        rebuilt.add(a)
    context = answers[1][:3]
    again = rebuilt.speculate(context, drafter.config)
    assert again.tokens and again == drafter.cache.speculate(context, drafter.config)
