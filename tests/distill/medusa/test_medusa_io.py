"""attach / save / load of Medusa heads, and the load checks."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import distill
import specdec
from runtime.errors import CheckpointError
from runtime.loading import from_hf_state
from runtime.output_paths import OutputPathError


def other_model(hidden=64, vocab=128):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return from_hf_state(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg)


def trained_like(heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in heads.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    return heads


def test_attach_gives_float32_trainable_blocks_and_a_frozen_shared_head(tiny_model):
    heads = distill.attach_medusa(tiny_model, num_heads=3, num_layers=2)
    assert heads.num_heads == 3 and len(heads.blocks[0]) == 2
    assert all(p.dtype == torch.float32 and p.requires_grad for p in heads.parameters())
    assert "lm_head.weight" not in heads.state_dict() and not tiny_model.lm_head.weight.requires_grad
    assert heads.tree.max_depth <= 3


def test_save_load_round_trip_keeps_weights_tree_and_outputs(tiny_model, tmp_path):
    heads = trained_like(distill.attach_medusa(tiny_model, num_heads=2, tree=[(0, 0), (1,), (0, 1)]))
    distill.save_medusa(heads, tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["medusa.safetensors", "medusa_config.json"]
    loaded = distill.load_medusa(tmp_path / "h", tiny_model)
    assert loaded.tree == heads.tree and loaded.config.shared_lm_head
    h = torch.randn(4, 64)
    torch.testing.assert_close(loaded(h), heads(h).detach())
    ids = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])]
    out = specdec.generate(tiny_model, ids, draft=loaded, max_new_tokens=12)
    plain = specdec.generate(tiny_model, ids, max_new_tokens=12)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))


def test_a_restricted_guess_vocabulary_round_trips_and_older_heads_still_load(tiny_model, tmp_path):
    heads = trained_like(distill.attach_medusa(tiny_model, num_heads=2))
    heads.restrict_vocab(torch.arange(0, 128, 2))  # the even ids only
    distill.save_medusa(heads, tmp_path / "h")
    loaded = distill.load_medusa(tmp_path / "h", tiny_model)
    assert loaded.config.guess_vocab == 64 and torch.equal(loaded.vocab, heads.vocab)
    assert (loaded.top_tokens(torch.randn(6, 64), 4) % 2 == 0).all()
    # heads saved before the guess vocabulary existed: no `guess_vocab` in the config, no `vocab`
    plain = trained_like(distill.attach_medusa(tiny_model, num_heads=2))
    distill.save_medusa(plain, tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "medusa_config.json").read_text())
    del cfg["guess_vocab"]
    (tmp_path / "old" / "medusa_config.json").write_text(json.dumps(cfg))
    old = distill.load_medusa(tmp_path / "old", tiny_model)
    assert old.vocab is None and old.config.guess_vocab == 0

def test_separate_lm_heads_round_trip(tiny_model, tmp_path):
    heads = trained_like(distill.attach_medusa(tiny_model, num_heads=2, shared_lm_head=False))
    distill.save_medusa(heads, tmp_path)
    loaded = distill.load_medusa(tmp_path, tiny_model)
    assert loaded.lm_heads is not None
    torch.testing.assert_close(loaded.lm_heads[1].weight, heads.lm_heads[1].weight.detach())
    with pytest.raises(CheckpointError, match="shared_lm_head=False"):
        distill.load_medusa(tmp_path, tiny_model, shared_lm_head=True)


def test_load_refuses_heads_of_another_model(tiny_model, tmp_path):
    distill.save_medusa(distill.attach_medusa(tiny_model, num_heads=2), tmp_path)
    with pytest.raises(CheckpointError, match="hidden size 64"):
        distill.load_medusa(tmp_path, other_model(hidden=32))
    with pytest.raises(CheckpointError, match="vocabulary of 128"):
        distill.load_medusa(tmp_path, other_model(vocab=100))
    with pytest.raises(CheckpointError, match="not a Medusa heads directory"):
        distill.load_medusa(tmp_path / "missing", tiny_model)


def test_load_refuses_weights_that_disagree_with_the_config(tiny_model, tmp_path):
    distill.save_medusa(distill.attach_medusa(tiny_model, num_heads=2), tmp_path)
    cfg = json.loads((tmp_path / "medusa_config.json").read_text())
    cfg["num_heads"] = 3
    (tmp_path / "medusa_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="different saves"):
        distill.load_medusa(tmp_path, tiny_model)
    cfg["format"] = "other"
    (tmp_path / "medusa_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a specdec Medusa config"):
        distill.load_medusa(tmp_path, tiny_model)


def test_save_writes_only_where_heads_may_go_and_replaces_heads_only_on_request(tiny_model, tmp_path, snapshot):
    heads = distill.attach_medusa(tiny_model, num_heads=2)
    (tmp_path / "file").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match="file exists and is not a directory"):
            distill.save_medusa(heads, tmp_path / "file", overwrite=overwrite)
        with pytest.raises(OutputPathError, match="home is a non-empty directory that specdec did not write"):
            distill.save_medusa(heads, tmp_path / "home", overwrite=overwrite)
    assert snapshot(tmp_path) == before
    distill.save_medusa(heads, tmp_path / "h")
    with pytest.raises(OutputPathError, match=r"h already holds a Medusa heads directory.*--overwrite"):
        distill.save_medusa(heads, tmp_path / "h")
    (tmp_path / "h" / "notes.txt").write_text("mine")
    distill.save_medusa(heads, tmp_path / "h", overwrite=True)
    assert (tmp_path / "h" / "notes.txt").read_text() == "mine"  # heads files replaced, nothing else touched


@pytest.mark.parametrize("format", ["specdec", "vllm"])
@pytest.mark.parametrize("bad", [None, "heads", "eagle"])
def test_save_refuses_what_is_no_medusa_heads_before_creating_the_directory(tiny_model, tmp_path, format, bad):
    if bad == "eagle":
        bad = specdec.Eagle3Head(specdec.Eagle3Config.from_target(tiny_model, aux_layers=(0, 0, 0)))
    hint = "; save an EAGLE-3 head with specdec.save_eagle" if isinstance(bad, specdec.Eagle3Head) else ""
    with pytest.raises(TypeError, match=r"^save_medusa heads must be Medusa heads .*, got .*" + re.escape(hint) + "$"):
        distill.save_medusa(bad, tmp_path / "m0", format=format)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad, want", [(None, r"got None \(NoneType\)"), ("x", r"got the path or name 'x'")])
def test_load_names_a_model_argument_that_is_no_model(tiny_model, tmp_path, bad, want):
    distill.save_medusa(distill.attach_medusa(tiny_model, num_heads=2), tmp_path / "h")
    with pytest.raises(TypeError, match=rf"^model must be .*{want}"):
        distill.load_medusa(tmp_path / "h", bad)
