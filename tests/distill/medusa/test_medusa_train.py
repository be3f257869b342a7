"""Medusa-1 training on cached hidden states: targets, caching, learning, checkpoint / resume."""

import importlib
import json
import time

import pytest
import torch
import torch.nn.functional as F

import distill
import specdec
from distill.data.features import IGNORE, cache_hidden_states, head_targets, load_cached
from distill.medusa.train import MedusaTrainConfig, _noise, data_vocab, head_accuracy, medusa_loss, teacher_probs
from runtime.output_paths import OutputPathError


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
    ref = tiny_model(seq[None], torch.arange(seq.numel())[None], None, return_hidden=True).hidden
    p = len(r["prompt_ids"])
    torch.testing.assert_close(h[:len(r["output_ids"])], ref[0, p - 1:-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(t[:len(r["output_ids"])], head_targets(seq, p - 1, 2))
    # a second call with the same records is a no-op (resume)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    cache_hidden_states(tiny_model, records[:10], tmp_path, num_heads=2, heldout_every=5)
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest


def test_loss_weights_heads_by_decay():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 7, generator=g).requires_grad_()
    targets = torch.randint(0, 7, (6, 3), generator=g)
    targets[:2, 1] = IGNORE  # head 1 has 4 targets
    targets[:, 2] = IGNORE  # head 2 has none: it adds nothing
    loss, per_head = medusa_loss(logits, targets, 0.8)
    with torch.no_grad():
        ref = [F.cross_entropy(logits[0], targets[:, 0]), F.cross_entropy(logits[1, 2:], targets[2:, 1])]
    assert per_head == pytest.approx([float(ref[0]), float(ref[1]), 0.0], rel=1e-5)
    assert loss.item() == pytest.approx(float(ref[0] + 0.8 * ref[1]), rel=1e-5)
    loss.backward()
    assert torch.equal(logits.grad[2], torch.zeros(6, 7)) and not torch.equal(logits.grad[1, 2:], torch.zeros(4, 7))


def test_soft_targets_are_the_base_models_distribution_at_the_predicted_position(tiny_model, tmp_path):
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 5, 4, 7)]
    out = specdec.generate(tiny_model, prompts, max_new_tokens=12).sequences  # the model's own answers
    records = [{"prompt_ids": p.tolist(), "output_ids": s[p.numel():].tolist()} for p, s in zip(prompts, out)]
    cache_hidden_states(tiny_model, records, tmp_path, num_heads=3, heldout_every=100, dtype=torch.float32)
    hidden, targets = load_cached(tmp_path, "train", 3)
    heads = distill.attach_medusa(tiny_model, num_heads=3)
    idx = torch.arange(hidden.shape[0])
    probs = teacher_probs(heads, hidden, idx)  # (3, N, V)
    valid = targets.T != IGNORE  # (3, N)
    assert valid.sum() > 20 and torch.allclose(probs.sum(-1), torch.ones(3, hidden.shape[0]))
    # greedy answers: the teacher's argmax is the token each head is asked for
    assert torch.equal(probs.argmax(-1)[valid], targets.T[valid])
    one_hot = F.one_hot(targets.clamp(min=0).T, 128).float()  # (3, N, V)
    logits = torch.randn(3, hidden.shape[0], 128, generator=torch.Generator().manual_seed(1))
    assert medusa_loss(logits, targets, 0.8, one_hot)[0].item() == pytest.approx(
        medusa_loss(logits, targets, 0.8)[0].item(), rel=1e-5)
    cfg = MedusaTrainConfig(epochs=2, lr=1e-2, batch_size=16, warmup_steps=2, topk=3, tree_nodes=4,
                      mixed_precision="no", soft_targets=True, vocab="data")  # the recipe's combination
    metrics = distill.train_medusa(heads, tmp_path, tmp_path / "heads", cfg)
    losses = json.loads((tmp_path / "heads" / "checkpoint" / "trainer.json").read_text())["losses"]
    assert metrics["steps"] == metrics["planned_steps"] == len(losses) and losses[-1] < losses[0]


def test_training_learns_checkpoints_and_resumes(tiny_model, records, tmp_path):
    data = cache_hidden_states(tiny_model, records, tmp_path / "cache", num_heads=2, dtype=torch.float32)
    heads = distill.attach_medusa(tiny_model, num_heads=2)
    hidden, targets = load_cached(data, "heldout", 2)
    before = head_accuracy(heads, hidden, targets, topk=3)
    cfg = MedusaTrainConfig(epochs=4, lr=1e-2, batch_size=128, warmup_steps=5, checkpoint_every=10,
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
    more = distill.train_medusa(heads2, data, tmp_path / "heads", MedusaTrainConfig(
        epochs=5, lr=1e-2, batch_size=128, warmup_steps=5, checkpoint_every=10, topk=3, tree_nodes=6,
        mixed_precision="no"))
    trainer = json.loads((tmp_path / "heads" / "checkpoint" / "trainer.json").read_text())
    assert more["steps"] == trainer["step"] == len(trainer["losses"]) > metrics["steps"]
    rows = [torch.tensor(r["prompt_ids"]) for r in records[:4]]
    out = specdec.generate(tiny_model, rows, draft=loaded, max_new_tokens=20)
    plain = specdec.generate(tiny_model, rows, max_new_tokens=20)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "no")])
def test_auto_mixed_precision_autocasts_to_bf16_only_where_it_is_native(monkeypatch, native, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert MedusaTrainConfig().mixed_precision == "auto"
    assert MedusaTrainConfig().autocast_mode(torch.device("cpu")) == expected
    assert MedusaTrainConfig(mixed_precision="bf16").autocast_mode(torch.device("cpu")) == "bf16"  # as asked
    with pytest.raises(ValueError, match="mixed_precision must be one of 'auto'"):
        MedusaTrainConfig(mixed_precision="fp8")


def test_a_stopped_run_keeps_its_steps_and_a_resumed_one_adds_its_seconds(tiny_model, records, tmp_path,
                                                                           monkeypatch):
    tm = importlib.import_module("distill.medusa.train")  # the module (distill.train_medusa is the function)

    data = cache_hidden_states(tiny_model, records, tmp_path / "cache", num_heads=1, dtype=torch.float32)
    cfg = MedusaTrainConfig(epochs=3, lr=1e-2, batch_size=128, warmup_steps=1, checkpoint_every=100, topk=2,
                      tree_nodes=2, mixed_precision="no")
    calls, loss = [], tm.medusa_loss

    def interrupted(*a, **k):  # Ctrl-C arriving during the 7th step
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return loss(*a, **k)

    monkeypatch.setattr(tm, "medusa_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill.train_medusa(distill.attach_medusa(tiny_model, num_heads=1), data, tmp_path / "heads", cfg,
                             deadline=time.monotonic() + 600)
    trainer = tmp_path / "heads" / "checkpoint" / "trainer.json"
    first = json.loads(trainer.read_text())
    assert first["step"] == 6 and len(first["losses"]) == 6 and first["train_seconds"] > 0
    monkeypatch.setattr(tm, "medusa_loss", loss)
    more = distill.train_medusa(distill.attach_medusa(tiny_model, num_heads=1), data, tmp_path / "heads", cfg,
                                deadline=time.monotonic() + 600)
    second = json.loads(trainer.read_text())
    assert more["steps"] == more["planned_steps"] == second["step"] > 6
    assert second["train_seconds"] > first["train_seconds"]


def test_training_over_the_data_vocabulary_learns_and_guesses_among_it(tiny_model, records, tmp_path):
    half = [{**r, "output_ids": [x % 64 for x in r["output_ids"]]} for r in records]  # 64 tokens used
    data = cache_hidden_states(tiny_model, half, tmp_path / "cache", num_heads=1, dtype=torch.float32)
    heads = distill.attach_medusa(tiny_model, num_heads=1)
    cfg = MedusaTrainConfig(epochs=3, lr=1e-2, batch_size=128, warmup_steps=5, topk=3, tree_nodes=3,
                      mixed_precision="no", vocab="data")
    metrics = distill.train_medusa(heads, data, tmp_path / "heads", cfg)
    assert metrics["train_vocab"] == 64
    assert metrics["top1_accuracy"][0] > 0.3
    # the heads guess among the 64 tokens they learned to rank; the saved heads keep that set
    loaded = distill.load_medusa(tmp_path / "heads", tiny_model)
    assert loaded.config.guess_vocab == 64 and sorted(loaded.vocab.tolist()) == list(range(64))
    assert int(loaded.top_tokens(torch.randn(20, 64), 5).max()) < 64


def test_max_vocab_keeps_the_most_frequent_target_tokens():
    targets = torch.tensor([[5, 9], [5, IGNORE], [7, 5], [9, 3], [IGNORE, IGNORE]])  # 5 x3, 9 x2, 7 and 3 once
    assert data_vocab(targets).tolist() == [3, 5, 7, 9]
    assert data_vocab(targets, max_vocab=2).tolist() == [5, 9]  # sorted ids, not by count
    assert data_vocab(targets, max_vocab=10).tolist() == [3, 5, 7, 9]
    with pytest.raises(ValueError, match="max_vocab"):
        MedusaTrainConfig(max_vocab=100)  # a cap on the data vocabulary needs vocab="data"
    with pytest.raises(ValueError, match="max_vocab"):
        MedusaTrainConfig(vocab="data", max_vocab=-1)


def test_training_with_a_capped_vocabulary_guesses_among_the_cap(tiny_model, records, tmp_path):
    data = cache_hidden_states(tiny_model, records, tmp_path / "cache", num_heads=1, dtype=torch.float32)
    cfg = MedusaTrainConfig(epochs=3, lr=1e-2, batch_size=128, warmup_steps=5, topk=3, tree_nodes=3,
                      mixed_precision="no", vocab="data", max_vocab=100)
    metrics = distill.train_medusa(distill.attach_medusa(tiny_model, num_heads=1), data, tmp_path / "heads", cfg)
    assert metrics["train_vocab"] == 100
    loaded = distill.load_medusa(tmp_path / "heads", tiny_model)
    assert loaded.config.guess_vocab == 100
    # 28 of the 128 tokens are never guessed: they count as misses, so accuracy stays below the share kept
    assert 0.3 < metrics["top1_accuracy"][0] <= 100 / 128 + 0.05


def test_feature_noise_scales_with_each_states_rms():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4000, 64, generator=g) * torch.tensor([1.0, 5.0]).repeat(2000)[:, None]  # rows of RMS ~1, ~5
    noise = _noise(h, 0.1, torch.Generator().manual_seed(1))
    assert noise.shape == h.shape
    assert abs(noise[0::2].std() - 0.1) < 0.005 and abs(noise[1::2].std() - 0.5) < 0.025
    assert torch.equal(noise, _noise(h, 0.1, torch.Generator().manual_seed(1)))  # the generator decides
    with pytest.raises(ValueError, match="feature_noise"):
        MedusaTrainConfig(feature_noise=-0.1)


def test_training_with_feature_noise_still_learns_and_differs_from_none(tiny_model, records, tmp_path):
    data = cache_hidden_states(tiny_model, records, tmp_path / "cache", num_heads=1, dtype=torch.float32)
    runs = {}
    for noise in (0.0, 0.1):
        cfg = MedusaTrainConfig(epochs=3, lr=1e-2, batch_size=128, warmup_steps=5, topk=3, tree_nodes=3,
                          mixed_precision="no", feature_noise=noise)
        metrics = distill.train_medusa(distill.attach_medusa(tiny_model, num_heads=1), data,
                                       tmp_path / f"heads{noise}", cfg)
        runs[noise] = metrics
    assert runs[0.1]["top1_accuracy"][0] > 0.3, runs[0.1]["top1_accuracy"]
    assert runs[0.1]["final_loss"] != runs[0.0]["final_loss"]


def test_training_refuses_a_directory_specdec_did_not_write_before_any_work(tiny_model, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("mine")
    heads = distill.attach_medusa(tiny_model, num_heads=1)
    with pytest.raises(OutputPathError, match="home is a non-empty directory that specdec did not write"):
        distill.train_medusa(heads, tmp_path / "no-cache", tmp_path / "home")  # the cache is not even read
    with pytest.raises(OutputPathError, match="file exists and is not a directory"):
        distill.train_medusa(heads, tmp_path / "no-cache", tmp_path / "file")
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]
    assert (tmp_path / "file").read_text() == "mine"


def test_a_refused_or_failed_training_leaves_no_output_directory(tiny_model, records, tmp_path, monkeypatch, snapshot):
    from runtime.tiny import tiny_model as random_model

    data = cache_hidden_states(tiny_model, records[:10], tmp_path / "cache", num_heads=1, heldout_every=5)
    (tmp_path / "empty").mkdir()
    before = snapshot(tmp_path)
    heads = distill.attach_medusa(tiny_model, num_heads=1)
    cfg = MedusaTrainConfig(epochs=1, batch_size=64, mixed_precision="no")
    with pytest.raises(ValueError, match="^.*no-cache is not a hidden-state cache"):
        distill.train_medusa(heads, tmp_path / "no-cache", tmp_path / "new" / "heads", cfg)
    wide = distill.attach_medusa(random_model("llama", hidden_size=96), num_heads=1)
    with pytest.raises(ValueError, match=r"^.*cache caches hidden size 64 and token ids up to \d+; these heads read "
                                         "hidden size 96"):
        distill.train_medusa(wide, data, tmp_path / "new" / "heads", cfg)
    assert snapshot(tmp_path) == before
    tm = importlib.import_module("distill.medusa.train")

    def failing(*args, **kwargs):  # the first batch fails (out of memory, say)
        raise RuntimeError("first batch failed")

    monkeypatch.setattr(tm, "medusa_loss", failing)
    for out in (tmp_path / "new" / "heads", tmp_path / "empty"):
        with pytest.raises(RuntimeError, match="^first batch failed$"):
            distill.train_medusa(heads, data, out, cfg)
        assert snapshot(tmp_path) == before


def test_a_run_whose_deadline_came_before_a_result_says_so_and_leaves_no_output(tiny_model, records, tmp_path,
                                                                                snapshot):
    empty = cache_hidden_states(tiny_model, records, tmp_path / "late", num_heads=1, deadline=0.0)  # no record
    full = cache_hidden_states(tiny_model, records[:10], tmp_path / "cache", num_heads=1, heldout_every=5)
    before = snapshot(tmp_path)
    heads = distill.attach_medusa(tiny_model, num_heads=1)
    cfg = MedusaTrainConfig(epochs=1, batch_size=64, mixed_precision="no")
    for data, when in ((empty, "any training position was cached"), (full, "the first training step")):
        with pytest.raises(ValueError, match=f"^the time budget .* ran out before {when}.* allow more time"):
            distill.train_medusa(heads, data, tmp_path / "heads", cfg, deadline=0.0)
        assert snapshot(tmp_path) == before
