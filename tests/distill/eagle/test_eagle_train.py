"""EAGLE-3 training: the feature cache, the soft targets, the unrolled loss, learning, checkpoint /
resume, configuration checks and the `specdec eagle` commands, on tiny random targets."""

import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import distill
import specdec
from distill.data.features import (
    EagleLayout,
    EagleSplit,
    FeatureWriter,
    cache_eagle_states,
    cache_hidden_states,
    load_split,
    read_manifest,
)
from distill.eagle.train import (
    ANSWERS_CACHE_DIR,
    EagleTrainConfig,
    answer_vocab,
    batch_teacher,
    check_train_dir,
    lm_head_rows,
    make_batch,
    soft_targets,
    ttt_loss,
    unroll,
)
from runtime.output_paths import OutputPathError
from runtime.tiny import tiny_model
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head

V, LAYERS = 128, (1, 2, 3)
FAST = dict(draft_vocab_size=96, aux_layers="1,2,3", lr=3e-3, batch_tokens=256, warmup_steps=3,
            mixed_precision="no", heldout_every=5)


@pytest.fixture(scope="module")
def target():
    """A 4-layer random target whose LM head is scaled up so that its next-token distributions are
    peaked (a random model's are nearly uniform: nothing to learn)."""
    model = tiny_model("llama", seed=0, vocab_size=V, num_hidden_layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


@pytest.fixture(scope="module")
def records():
    """Answers that walk a fixed permutation of 80 tokens after a random prompt."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(80, generator=g)
    out = []
    for i in range(40):
        prompt = torch.randint(0, V, (int(torch.randint(2, 8, (), generator=g)),), generator=g).tolist()
        x, answer = int(torch.randint(0, 80, (), generator=g)), []
        for _ in range(int(torch.randint(10, 30, (), generator=g))):
            answer.append(x)
            x = int(perm[x])
        out.append({"id": i, "prompt_ids": prompt, "output_ids": answer})
    return out


@pytest.fixture(scope="module")
def features(target, records, tmp_path_factory):
    return cache_eagle_states(target, records, tmp_path_factory.mktemp("features"), LAYERS, heldout_every=5,
                              dtype=torch.float32)


def test_soft_targets_are_the_targets_distribution_restricted_to_the_draft_vocabulary():
    hidden = torch.tensor([[1.0, 2.0]])  # (1, C)
    lm_head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])  # (V, C): logits 1, 2, 3, -1
    ids = torch.tensor([0, 2])
    p = soft_targets(hidden, lm_head[ids])
    e1, e3 = torch.exp(torch.tensor(1.0)), torch.exp(torch.tensor(3.0))
    torch.testing.assert_close(p, torch.tensor([[e1 / (e1 + e3), e3 / (e1 + e3)]]))
    full = (hidden @ lm_head.T).softmax(-1)[0]
    torch.testing.assert_close(p[0], full[ids] / full[ids].sum())  # renormalised restriction


def test_lm_head_rows_are_the_targets(target):
    ids = torch.tensor([3, 7, 100])
    torch.testing.assert_close(lm_head_rows(target, ids), target.lm_head.weight[ids].float())


def test_the_unrolled_loss_weighs_step_s_by_decay_to_the_s():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(5, 7, generator=g, requires_grad=True) for _ in range(3)]
    teacher = [torch.randn(5, 7, generator=g).softmax(-1) for _ in range(3)]
    teacher[1] = F.one_hot(torch.tensor([0, 1, 2, 3, 4]), 7).float()
    loss, ce, acc = ttt_loss(logits, teacher, 0.8)
    with torch.no_grad():
        ref = [-(p * q.log_softmax(-1)).sum(-1).mean() for q, p in zip(logits, teacher)]
    assert ce == pytest.approx([float(r) for r in ref], rel=1e-5)
    assert float(ref[1]) == pytest.approx(float(F.cross_entropy(logits[1].detach(), torch.arange(5))), rel=1e-5)
    assert loss.item() == pytest.approx(float(ref[0] + 0.8 * ref[1] + 0.64 * ref[2]), rel=1e-5)
    assert acc[1] == pytest.approx(float((logits[1].argmax(-1) == torch.arange(5)).float().mean()))
    empty = ttt_loss([logits[0], logits[1][:0]], [teacher[0], teacher[1][:0]], 0.8)
    assert empty[1][1] is None and empty[2][1] is None and empty[0].item() == pytest.approx(ce[0], rel=1e-5)


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens():
    tokens = torch.tensor([5, 5, 5, 9, 9, 7, 3, 3, 1])
    assert answer_vocab(tokens, 12, 3).tolist() == [3, 5, 9]  # 5 x3, 9 x2, 3 x2; sorted ids
    assert answer_vocab(tokens, 12, 2).tolist() == [3, 5]  # 9 and 3 tie: the lower id is kept
    assert answer_vocab(tokens, 12, 7).tolist() == [0, 1, 2, 3, 5, 7, 9]  # unseen ids fill up by lower id
    fill = torch.tensor([11, 11, 3, 3, 3, 9, 10])
    assert answer_vocab(tokens, 12, 2, fill).tolist() == [3, 5]  # the fill breaks 9 and 3's tie
    assert answer_vocab(tokens, 12, 7, fill).tolist() == [1, 3, 5, 7, 9, 10, 11]  # then ranks the unseen ids


def test_cached_features_are_the_targets_and_the_cache_resumes(target, records, features, tmp_path):
    train, held = load_split(features, "train"), load_split(features, "heldout")
    assert len(held) == 8 and len(train) == 32  # records 0, 5, 10, ... are held out
    assert held.num_positions == sum(len(records[i]["output_ids"]) for i in range(0, 40, 5))
    aux, hidden, tokens, P = train.record(1)  # record 2
    r = records[2]
    seq = torch.tensor(r["prompt_ids"] + r["output_ids"])
    with torch.no_grad():
        _, ref_h, ref_aux = target(seq[None], torch.arange(seq.numel())[None], None, return_hidden=True,
                                   aux_layers=LAYERS)
    assert P == len(r["prompt_ids"]) and torch.equal(tokens, seq)
    torch.testing.assert_close(aux, ref_aux[0], rtol=1e-4, atol=1e-4)  # (L, 3C)
    torch.testing.assert_close(hidden, ref_h[0, P - 1:-1], rtol=1e-4, atol=1e-4)  # (n, C)
    assert torch.equal(train.answer_tokens(), torch.tensor(
        [t for i in range(40) if i % 5 for t in records[i]["output_ids"]]))
    # resume: a run stopped by its deadline keeps whole records; the same call finishes the job
    cache_eagle_states(target, records[:13], tmp_path / "c", LAYERS, heldout_every=5, batch_tokens=64,
                       shard_tokens=50, dtype=torch.float32)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["records_done"] == 13 and len(manifest["shards"]["train"]) > 1
    cache_eagle_states(target, records, tmp_path / "c", LAYERS, heldout_every=5, dtype=torch.float32,
                       deadline=0.0)  # past: nothing new
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["records_done"] == 13
    cache_eagle_states(target, records, tmp_path / "c", LAYERS, heldout_every=5, dtype=torch.float32)
    again = load_split(tmp_path / "c", "train")
    assert torch.equal(again.tokens, train.tokens) and torch.equal(again.lengths, train.lengths)
    torch.testing.assert_close(again.aux, train.aux)
    with pytest.raises(ValueError, match="belongs to other data"):
        cache_eagle_states(target, records[1:], tmp_path / "c", LAYERS, heldout_every=5)
    # nothing to cache creates nothing; records a deadline stopped before the first batch: a readable empty cache
    cache_eagle_states(target, [], tmp_path / "none" / "c", LAYERS)
    FeatureWriter(tmp_path / "none" / "c", EagleLayout(64, LAYERS)).flush()
    assert not (tmp_path / "none").exists()
    cache_eagle_states(target, records, tmp_path / "late", LAYERS, deadline=0.0)
    assert sorted(p.name for p in (tmp_path / "late").iterdir()) == ["manifest.json"]
    assert json.loads((tmp_path / "late" / "manifest.json").read_text())["records_done"] == 0
    with pytest.raises(ValueError, match="aux layers"):
        cache_eagle_states(target, records, tmp_path / "c", (0, 1, 2), heldout_every=5)
    cache_hidden_states(target, records[:2], tmp_path / "medusa", num_heads=1)
    with pytest.raises(OutputPathError, match="Medusa hidden-state cache is another format"):
        cache_eagle_states(target, records, tmp_path / "medusa", LAYERS)


def test_a_batch_aligns_each_step_with_the_token_and_the_distribution_it_predicts():
    """Record of L = 6 tokens, prompt of 3: step s at row j (position j + 1) reads token j + 1 + s and
    is scored against the target's state at position j + 1 + s, for positions 2..4 (the last prompt
    token to the last answer token but one)."""
    L, P, C = 6, 3, 1
    pos = torch.arange(L, dtype=torch.float32)
    split = EagleSplit(aux=pos[:, None].repeat(1, 3 * C), hidden=pos[P - 1:L - 1, None],
                       tokens=torch.arange(10, 10 + L), lengths=torch.tensor([L]), prompt_lengths=torch.tensor([P]))
    b = make_batch(split, [0], steps=3)
    T = L - 1
    assert b.aux[0, :, 0].tolist() == [0, 1, 2, 3, 4]  # step 0 at position j + 1 reads the states at j
    for s in range(3):
        assert b.tokens[0, s:s + T].tolist() == [10 + j + 1 + s if j + 1 + s < L else 0 for j in range(T)]
        valid = b.valid[0, s:s + T]
        assert [j + 1 + s for j in range(T) if valid[j]] == [q for q in range(P - 1, L - 1) if q >= 1 + s]
        assert b.teacher[0, s:s + T][valid][:, 0].tolist() == [float(q) for q in range(max(P - 1, 1 + s), L - 1)]


def test_step_zero_of_the_unroll_is_the_heads_forward_at_the_drafting_alignment(target, features):
    split = load_split(features, "train")
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=V, aux_layers=LAYERS))
    batch = make_batch(split, [0, 1], steps=2)
    with torch.no_grad():
        steps = unroll(head, target.embed, batch, 2)
        aux, _, tokens, _ = split.record(0)
        L = tokens.numel()
        ref, _ = head(head.fuse(aux[None, :L - 1]), target.embed(tokens[None, 1:]), torch.arange(1, L)[None])
    assert [s.shape[1] for s in steps] == [V, V]
    n0 = int(batch.valid[0, :batch.aux.shape[1]].sum())
    torch.testing.assert_close(steps[0][:n0], ref[0][batch.valid[0, :L - 1]])
    weight = lm_head_rows(target, torch.arange(V))
    teacher = batch_teacher(batch, weight, 2)
    assert [t.shape for t in teacher] == [s.shape for s in steps]
    T = batch.aux.shape[1]
    for s in range(2):  # each step's rows: the distributions at its own shifted loss positions
        torch.testing.assert_close(teacher[s], soft_targets(batch.teacher[:, s:s + T][batch.valid[:, s:s + T]], weight))
    with torch.no_grad():
        ref_h = target(tokens[None], torch.arange(L)[None], None, return_hidden=True).hidden
    P = split.record(0)[3]
    full = (ref_h[0, P - 1:L - 1] @ target.lm_head.weight.T).softmax(-1)  # the target's own next-token law
    torch.testing.assert_close(teacher[0][:L - P], full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change,match", [({"ttt_steps": 0}, "ttt_steps must be >= 1"),
                                          ({"draft_vocab_size": 0}, "draft_vocab_size must be >= 1"),
                                          ({"decay": 0.0}, "decay must be in"),
                                          ({"lr": 0.0}, "lr must be > 0"),
                                          ({"max_grad_norm": -1.0}, "max_grad_norm must be > 0"),
                                          ({"batch_tokens": 0}, "batch_tokens must be >= 1"),
                                          ({"aux_layers": "1,2"}, "three comma-separated"),
                                          ({"heldout_every": 1}, "heldout_every must be >= 2"),
                                          ({"mixed_precision": "fp8"}, "mixed_precision must be one of"),
                                          ({"save_dtype": "int8"}, "save_dtype must be one of"),
                                          ({"norm_before_fc": True, "fc_norm": True}, "exclude each other")])
def test_bad_configs_are_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        EagleTrainConfig(**change)


def test_aux_layers_default_to_eagle3s_and_are_checked_against_the_target(target, records, tmp_path):
    assert EagleTrainConfig().layers(28) == (2, 14, 25) and EagleTrainConfig(aux_layers="1, 2,3").layers(4) == LAYERS
    with pytest.raises(ValueError, match="0..3"):
        distill.train_eagle(target, records[:6], EagleTrainConfig(aux_layers="1,2,9"), tmp_path / "out")


def test_training_lowers_the_loss_and_saves_a_head_that_drafts_losslessly(target, records, features, tmp_path):
    cfg = EagleTrainConfig(epochs=6, **FAST)
    head = distill.train_eagle(target, features, cfg, tmp_path / "out")
    out = tmp_path / "out"
    trainer = json.loads((out / "checkpoint" / "eagle_trainer.json").read_text())
    losses = trainer["losses"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == metrics["planned_steps"] == len(losses) == trainer["step"] > 10
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
    assert len(trainer["accuracy"][0]) == 3 and len(metrics["heldout"]["accuracy_per_step"]) == 3
    assert metrics["draft_vocab_size"] == 96 and metrics["draft_vocab_coverage"]["train"] == 1.0  # 80 tokens used
    assert (out / "loss.png").stat().st_size > 1000
    assert not head.training and head.config.draft_vocab_size == 96
    assert head.config.fc_norm and head.config.norm_output and not head.config.norm_before_fc  # Eagle 3.1's norms
    loaded = specdec.load_eagle(out, target)
    assert loaded.config == head.config and loaded.fc.weight.dtype == torch.float32  # the target's dtype
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # save_dtype
    assert torch.equal(loaded.d2t, head.d2t)
    rows = [torch.tensor(r["prompt_ids"]) for r in records[:3]]
    drafted = specdec.generate(target, rows, draft=loaded, max_new_tokens=12)
    plain = specdec.generate(target, rows, max_new_tokens=12)
    assert all(torch.equal(a, b) for a, b in zip(drafted.sequences, plain.sequences))


def test_several_caches_train_together_and_the_first_one_measures(target, records, features, tmp_path):
    second = cache_eagle_states(target, records[:20], tmp_path / "second", LAYERS, heldout_every=5,
                                dtype=torch.float32)
    distill.train_eagle(target, [features, second], EagleTrainConfig(epochs=1, **FAST), tmp_path / "out")
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    one, two = load_split(features, "train"), load_split(second, "train")
    both = EagleSplit.concat([one, two])
    assert metrics["train_records"] == len(both) == len(one) + len(two)
    assert metrics["train_positions"] == one.num_positions + two.num_positions
    assert metrics["heldout_positions"] == load_split(features, "heldout").num_positions
    for got, want in zip(both.record(len(one) + 2), two.record(2)):  # records keep their own rows
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    stopped = tmp_path / "stopped"  # a run stopped while caching ShareGPT's answers resumes in its directory
    cache_eagle_states(target, records[:3], stopped / ANSWERS_CACHE_DIR, LAYERS, heldout_every=5)
    assert check_train_dir(stopped) == stopped
    empty = cache_eagle_states(target, records, tmp_path / "empty", LAYERS, heldout_every=5, deadline=0.0)
    normed = EagleTrainConfig(epochs=1, norm_before_fc=True, fc_norm=False, **FAST)  # speculators' default norms
    distill.train_eagle(target, [features, empty], normed, tmp_path / "alone")
    assert json.loads((tmp_path / "alone" / "metrics.json").read_text())["train_records"] == len(one)
    head = specdec.load_eagle(tmp_path / "alone", target)
    assert head.config.norm_before_fc and head.config.norm_output and not head.config.fc_norm
    with pytest.raises(ValueError, match="not EAGLE-3 feature caches"):
        distill.train_eagle(target, [features, tmp_path], EagleTrainConfig(epochs=1, **FAST), tmp_path / "bad")
    narrow = EagleSplit(one.aux[:, :8], one.hidden, one.tokens, one.lengths, one.prompt_lengths)
    with pytest.raises(ValueError, match="different widths"):
        EagleSplit.concat([one, narrow])


def test_a_stopped_run_resumes_to_the_state_of_an_uninterrupted_one(target, features, tmp_path, monkeypatch):
    te = importlib.import_module("distill.eagle.train")
    cfg = EagleTrainConfig(epochs=2, checkpoint_every=4, **FAST)
    distill.train_eagle(target, features, cfg, tmp_path / "whole")
    calls, loss = [], te.ttt_loss

    def interrupted(*a, **k):  # Ctrl-C during the 7th step
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return loss(*a, **k)

    monkeypatch.setattr(te, "ttt_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill.train_eagle(target, features, cfg, tmp_path / "parts")
    first = json.loads((tmp_path / "parts" / "checkpoint" / "eagle_trainer.json").read_text())
    assert first["step"] == 6 and len(first["losses"]) == 6
    monkeypatch.setattr(te, "ttt_loss", loss)
    distill.train_eagle(target, features, cfg, tmp_path / "parts")
    a = json.loads((tmp_path / "whole" / "checkpoint" / "eagle_trainer.json").read_text())
    b = json.loads((tmp_path / "parts" / "checkpoint" / "eagle_trainer.json").read_text())
    assert a["step"] == b["step"] > 6 and a["losses"] == pytest.approx(b["losses"], rel=1e-6)
    wa = load_file(str(tmp_path / "whole" / "checkpoint" / "model.safetensors"))
    wb = load_file(str(tmp_path / "parts" / "checkpoint" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"draft_vocab_size \(checkpoint 96, asked 64\)"):  # another head: no resume
        distill.train_eagle(target, features, EagleTrainConfig(epochs=2, **{**FAST, "draft_vocab_size": 64}),
                            tmp_path / "parts")
    old = EagleTrainConfig(epochs=2, fc_norm=False, norm_output=False, **FAST)  # a head trained before Eagle 3.1
    with pytest.raises(ValueError, match=r"fc_norm \(checkpoint True, asked False\).*--no-fc-norm --no-norm-output"):
        distill.train_eagle(target, features, old, tmp_path / "parts")


def test_training_refuses_a_directory_specdec_did_not_write(target, features, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match="did not write"):
        distill.train_eagle(target, features, EagleTrainConfig(), tmp_path / "home")
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]


def test_a_refused_or_failed_training_leaves_no_output_directory(target, records, features, tmp_path, monkeypatch,
                                                                 snapshot):
    cfg = EagleTrainConfig(epochs=1, **FAST)
    other = cache_eagle_states(target, records[:6], tmp_path / "other", (0, 1, 2), heldout_every=5)
    (tmp_path / "empty").mkdir()
    before = snapshot(tmp_path)
    out = tmp_path / "new" / "out"
    bad = [{"id": "x", "prompt_ids": [1, 2], "output_ids": [3, V]}]
    for data, config, error, message in [
            (42, cfg, TypeError, "data must be a feature cache directory"),
            ([], cfg, ValueError, "no self-distillation records in data"),
            (tmp_path / "none.jsonl", cfg, ValueError, "no self-distillation records in "),
            (bad, cfg, ValueError, "data record 0 (id 'x') holds tokens that are not ids of the target's"),
            ([{"id": 0}], cfg, TypeError, "data record 0 must be a dict with the token lists"),
            (records, EagleTrainConfig(**{**FAST, "aux_layers": "1,2,9"}), ValueError, "aux_layers must be"),
            (other, cfg, ValueError, f"{other} caches aux layers [0, 1, 2] of hidden size 64; this head reads"),
            (records, cfg, ValueError, f"{out / 'eagle_cache'} has no train records")]:  # the deadline has passed
        for where in (out, tmp_path / "empty"):
            with pytest.raises(error) as err:
                distill.train_eagle(target, data, config, where, deadline=0.0)
            assert str(err.value).startswith(message.replace("new/out", where.relative_to(tmp_path).as_posix()))
            assert snapshot(tmp_path) == before
    te = importlib.import_module("distill.eagle.train")

    def failing(*args, **kwargs):  # the first batch fails (out of memory, say)
        raise RuntimeError("first batch failed")

    monkeypatch.setattr(te, "ttt_loss", failing)
    for where in (out, tmp_path / "empty"):
        with pytest.raises(RuntimeError, match="^first batch failed$"):
            distill.train_eagle(target, features, cfg, where)
        assert snapshot(tmp_path) == before
    with pytest.raises(RuntimeError, match="^first batch failed$"):  # features cached first: kept, to resume from
        distill.train_eagle(target, records[:10], cfg, out)
    assert {"eagle_cache/manifest.json", "eagle_cache/train"} <= set(snapshot(out))


def test_the_eagle_commands_explain_themselves(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit):
        main(["eagle", "train", "--help"])
    text = capsys.readouterr().out
    assert "training-time test" in text and "speculators format" in text and "eagle:OUT" in text
    for flag in ("--target", "--data", "--out", "--cache", "--ttt-steps", "--draft-vocab-size", "--aux-layers",
                 "--max-grad-norm", "--max-minutes", "--mixed-precision"):
        assert flag in text
    with pytest.raises(SystemExit):
        main(["eagle", "data", "--help"])
    text = capsys.readouterr().out
    assert "--target" in text and "--max-new-tokens" in text and "--hidden-cache" not in text


def test_a_bad_flag_fails_before_anything_loads(tmp_path, capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit):
        main(["eagle", "train", "--target", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"),
              "--out", str(tmp_path / "out"), "--ttt-steps", "0"])
    assert "--ttt-steps" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main(["eagle", "train", "--target", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"),
              "--out", str(tmp_path / "out"), "--dataset-answers", "-1"])
    assert "argument --dataset-answers: must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main(["eagle", "data", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "sd.jsonl"),
              "--cache", str(tmp_path / "cache"), "--aux-layers", "1,2"])
    assert "three comma-separated layer ids" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "sd.jsonl").exists()


@pytest.mark.parametrize("data, message", [("nowhere.jsonl", "nowhere.jsonl does not exist"),
                                           (".", "is not a file"), ("empty.jsonl", "no records in")])
def test_eagle_train_names_data_that_is_missing_or_empty_before_anything_loads(data, message, tmp_path, capsys,
                                                                               monkeypatch, snapshot):
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    (tmp_path / "empty.jsonl").write_text("")
    before = snapshot(tmp_path)
    assert main(["eagle", "train", "--target", str(tmp_path / "none"), "--data", str(tmp_path / data),
                 "--out", str(tmp_path / "out")]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("specdec eagle train: error: --data: ") and message in first
    assert "specdec eagle data" in first and snapshot(tmp_path) == before


def test_eagle_train_end_to_end_on_a_tiny_checkpoint(records, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    import runtime
    from runtime.tiny import tiny_hf_config
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_hf_config(num_hidden_layers=4)).save_pretrained(tmp_path / "tiny")
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:20]))
    argv = ["eagle", "train", "--target", str(tmp_path / "tiny"), "--dtype", "float32", "--data", str(data),
            "--out", str(tmp_path / "head"), "--draft-vocab-size", "64", "--epochs", "2", "--batch-tokens", "256",
            "--mixed-precision", "no", "--heldout-every", "5", "--aux-layers", "1,2,3"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == summary["planned_steps"] > 0 and len(summary["heldout_accuracy_per_step"]) == 3
    target = runtime.load_model(tmp_path / "tiny", dtype=torch.float32)
    head = specdec.load_eagle(tmp_path / "head", target)
    assert head.config.aux_layers == LAYERS and head.config.draft_vocab_size == 64
    assert main(argv) == 0  # the same command again: nothing left to do, the head is saved again
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == summary["steps"]
    assert main(argv[:-2] + ["--aux-layers", "0,1,2"]) == 2  # the cache holds other layers
    assert "aux layers" in capsys.readouterr().err


def test_eagle_train_out_of_time_before_its_first_record_leaves_no_empty_cache(records, tmp_path, capsys,
                                                                              monkeypatch, snapshot):
    from transformers import AutoModelForCausalLM

    from runtime.tiny import tiny_hf_config
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    AutoModelForCausalLM.from_config(tiny_hf_config(num_hidden_layers=4)).save_pretrained(tmp_path / "tiny")
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:6]))
    before = snapshot(tmp_path)
    argv = ["eagle", "train", "--target", str(tmp_path / "tiny"), "--dtype", "float32", "--data", str(data),
            "--aux-layers", "1,2,3", "--max-minutes", "1e-9"]
    for extra, cache in [([], tmp_path / "new" / "head" / "eagle_cache"),
                         (["--cache", str(tmp_path / "features")], tmp_path / "features")]:
        assert main([*argv, "--out", str(tmp_path / "new" / "head"), *extra]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars
        assert last.startswith(f"specdec eagle train: error: {cache} has no train records")
        assert snapshot(tmp_path) == before


def test_eagle_train_reads_dataset_answers_beside_the_targets_own(records, word_tokenizer, tmp_path, capsys,
                                                                   monkeypatch):
    from transformers import AutoModelForCausalLM

    import runtime.data
    from runtime.tiny import tiny_hf_config
    from specdec.cli import main

    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_hf_config(num_hidden_layers=4)).save_pretrained(tmp_path / "tiny")
    word_tokenizer.save_pretrained(tmp_path / "tiny")
    g = torch.Generator().manual_seed(1)
    words = [" ".join(f"w{int(i)}" for i in torch.randint(5, 120, (n,), generator=g)) for n in range(12, 36)]
    conversations = [[{"role": "user", "content": words[i]}, {"role": "assistant", "content": words[-1 - i]}]
                     for i in range(12)]
    monkeypatch.setattr(runtime.data, "sharegpt_conversations", lambda split, limit=None: conversations)
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:20]))
    argv = ["eagle", "train", "--target", str(tmp_path / "tiny"), "--dtype", "float32", "--data", str(data),
            "--out", str(tmp_path / "head"), "--draft-vocab-size", "64", "--epochs", "1", "--batch-tokens", "256",
            "--mixed-precision", "no", "--heldout-every", "5", "--aux-layers", "1,2,3", "--dataset-answers", "10"]
    assert main(argv) == 0
    head = tmp_path / "head"
    answers = read_manifest(head / "eagle_cache_answers")
    assert answers["records_done"] == 10 and answers["last_id"] == "sharegpt-answer/2"  # from the end backwards
    metrics = json.loads((head / "metrics.json").read_text())
    own, extra = load_split(head / "eagle_cache", "train"), load_split(head / "eagle_cache_answers", "train")
    assert metrics["train_records"] == len(own) + len(extra) and len(extra) == 10  # none held out
    assert not answers["shards"]["heldout"]
    with pytest.raises(ValueError, match="heldout_every must be >= 0"):
        FeatureWriter(tmp_path / "bad", EagleLayout(64, LAYERS), heldout_every=-1)
    assert not (tmp_path / "bad").exists()
    assert metrics["heldout_positions"] == load_split(head / "eagle_cache", "heldout").num_positions
