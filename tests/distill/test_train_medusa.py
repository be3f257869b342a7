"""Medusa-1 training on cached hidden states: targets, caching, learning, checkpoint / resume."""

import json

import pytest
import torch

import distill
import specdec
from distill.train_medusa import (IGNORE, TrainConfig, cache_hidden_states, head_accuracy,
                                  head_targets, load_cached, medusa_loss)


@pytest.fixture(scope="module")
def records():
    """Answers that walk a fixed random permutation of the vocabulary: token t+2 is a function of
    token t, so the heads can learn it from the hidden state (which carries the current token)."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(128, generator=g)
    out = []
    for i in range(60):
        prompt = torch.randint(0, 128, (int(torch.randint(3, 9, (), generator=g)),), generator=g)
        x, answer = int(torch.randint(0, 128, (), generator=g)), []
        for _ in range(40):
            answer.append(x)
            x = int(perm[x])
        out.append({"id": i, "prompt_ids": prompt.tolist(), "output_ids": answer})
    return out


def test_head_i_at_position_t_targets_token_t_plus_2_plus_i():
    seq = torch.arange(10, 16)  # tokens 10..15
    t = head_targets(seq, 2, 3)  # positions 2, 3, 4
    assert t.tolist() == [[14, 15, IGNORE], [15, IGNORE, IGNORE], [IGNORE, IGNORE, IGNORE]]


def test_cached_hidden_states_equal_the_models(tiny_model, records, tmp_path):
    cache_hidden_states(tiny_model, records[:10], tmp_path, num_heads=2, heldout_every=5,
                        batch_tokens=128, shard_positions=64, dtype=torch.float32)
    h, t = load_cached(tmp_path, "train", 2)
    h_ho, _ = load_cached(tmp_path, "heldout", 2)
    answers = [len(r["output_ids"]) for r in records[:10]]
    assert h_ho.shape[0] == answers[0] + answers[5]  # records 0 and 5 are held out
    assert h.shape[0] == sum(answers) - h_ho.shape[0]
    r = records[1]
    seq = torch.tensor(r["prompt_ids"] + r["output_ids"])
    _, ref = tiny_model(seq[None], torch.arange(seq.numel())[None], None, return_hidden=True)
    p = len(r["prompt_ids"])
    torch.testing.assert_close(h[:len(r["output_ids"])], ref[0, p - 1:-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(t[:len(r["output_ids"])], head_targets(seq, p - 1, 2))
    # a second call with the same records is a no-op (resume)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    cache_hidden_states(tiny_model, records[:10], tmp_path, num_heads=2, heldout_every=5)
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest


def test_loss_weights_heads_by_decay():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (5, 2))
    loss, per_head = medusa_loss(logits, targets, 0.8)
    assert float(loss) == pytest.approx(per_head[0] + 0.8 * per_head[1], rel=1e-5)


def test_training_learns_checkpoints_and_resumes(tiny_model, records, tmp_path):
    data = cache_hidden_states(tiny_model, records, tmp_path / "cache", num_heads=2, dtype=torch.float32)
    heads = distill.attach_medusa(tiny_model, num_heads=2)
    hidden, targets = load_cached(data, "heldout", 2)
    before = head_accuracy(heads, hidden, targets, topk=3)
    cfg = TrainConfig(epochs=4, lr=1e-2, batch_size=128, warmup_steps=5, checkpoint_every=10,
                      topk=3, tree_nodes=6, mixed_precision="no")
    metrics = distill.train_medusa(heads, data, tmp_path / "heads", cfg)
    assert metrics["steps"] == metrics["planned_steps"]
    assert metrics["top1_accuracy"][0] > before[0][0] + 0.3, (before, metrics["top1_accuracy"])
    losses = json.loads((tmp_path / "heads" / "checkpoint" / "trainer.json").read_text())["losses"]
    assert metrics["final_loss"] < losses[0] - 1.0
    assert (tmp_path / "heads" / "loss.png").stat().st_size > 1000
    loaded = distill.load_medusa(tmp_path / "heads", tiny_model)
    assert [list(p) for p in loaded.tree.paths] == metrics["tree"] and len(metrics["tree"]) == 6
    assert loaded.config.head_accuracy is not None
    # resume: a longer schedule continues from the saved step instead of starting over
    heads2 = distill.attach_medusa(tiny_model, num_heads=2)
    more = distill.train_medusa(heads2, data, tmp_path / "heads", TrainConfig(
        epochs=5, lr=1e-2, batch_size=128, warmup_steps=5, checkpoint_every=10, topk=3, tree_nodes=6,
        mixed_precision="no"))
    trainer = json.loads((tmp_path / "heads" / "checkpoint" / "trainer.json").read_text())
    assert more["steps"] == trainer["step"] == len(trainer["losses"]) > metrics["steps"]
    rows = [torch.tensor(r["prompt_ids"]) for r in records[:4]]
    out = specdec.generate(tiny_model, rows, draft=loaded, max_new_tokens=20)
    plain = specdec.generate(tiny_model, rows, max_new_tokens=20)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))


def test_training_over_the_data_vocabulary_learns_full_vocabulary_accuracy(tiny_model, records, tmp_path):
    half = [{**r, "output_ids": [x % 64 for x in r["output_ids"]]} for r in records]  # 64 tokens used
    data = cache_hidden_states(tiny_model, half, tmp_path / "cache", num_heads=1, dtype=torch.float32)
    heads = distill.attach_medusa(tiny_model, num_heads=1)
    cfg = TrainConfig(epochs=3, lr=1e-2, batch_size=128, warmup_steps=5, topk=3, tree_nodes=3,
                      mixed_precision="no", vocab="data")
    metrics = distill.train_medusa(heads, data, tmp_path / "heads", cfg)
    assert metrics["train_vocab"] == 64
    assert metrics["top1_accuracy"][0] > 0.3  # measured over the full vocabulary
