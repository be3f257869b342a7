"""benchmarks/composite_replay.py: what it replays is what decoding does. On tiny float32 models a
drafter's replayed steps are the steps specdec.generate takes with it, and no policy beats the oracle."""

import torch

from runtime.tiny import tiny_model
from specdec.drafters.composite import MemberRecord
from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter
from specdec.generate import generate
from specdec.tuning.costs import NodeCalibration


def test_replayed_steps_are_the_steps_of_real_decoding_and_the_oracle_bounds_every_policy(load):
    replay = load("composite_replay")
    target = tiny_model("llama", seed=3, vocab_size=64)
    draft = tiny_model("llama", seed=3, vocab_size=64)
    with torch.no_grad():  # the target's weights, perturbed: a draft that is right often, not always
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(0, 64, (n,), generator=g)) for i, n in enumerate((5, 9, 12))]
    records = replay.plain_pass(target, draft, prompts, 40, [])
    unit = {"verify": {n: 1.0 for n in range(1, 9)}, "draft": {k: 0.0 for k in range(1, 8)}}  # seconds = steps
    config = SuffixConfig(cut=False)
    accepted = 0
    for rec, (_, ids) in zip(records, prompts):
        replay.replay_drafters([rec], config)  # a cache of its own, as the real drafter's below
        rec["suffix_s"] = 0.0
        play = replay.Replay(rec, unit)
        real = generate(target, [ids], draft=SuffixDrafter(config, cache=SuffixCache()), max_new_tokens=40).stats
        assert play.fixed(["suffix"], 7) == real.target_forwards - 1
        for k in (1, 3):
            real = generate(target, [ids], draft=draft, num_draft_tokens=k, max_new_tokens=40).stats
            assert play.fixed(["draft"], k) == real.target_forwards - 1
            accepted += real.accepted_tokens
        best = play.oracle(merged=True)[0]
        rules = [play.fixed(order, k) for order in (["suffix"], ["draft"], ["suffix", "draft"]) for k in (1, 3)]
        rules.append(play.composite(NodeCalibration(), None, 1))
        rules.append(play.composite(NodeCalibration(), [MemberRecord(), MemberRecord()], 3))
        assert best <= min(rules)
    assert accepted > 0  # the draft was right at times: the chains' replay was tested on acceptances too
