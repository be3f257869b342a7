"""Medusa heads in vLLM's layout (export and import) and in the original Medusa layout (import)."""

import json
import os
import stat

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import distill
import specdec
from runtime.errors import CheckpointError
from runtime.output_paths import OutputPathError
from specdec.drafters.medusa.io import export_medusa_vllm, medusa_layout


def _randomized(heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in heads.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    return heads


def _hidden():
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(1))  # (N, C)


@pytest.mark.parametrize("shared,restricted", [(True, False), (False, False), (True, True)],
                         ids=["shared", "separate", "token-map"])
def test_vllm_round_trip_gives_identical_logits(target, tmp_path, shared, restricted):
    heads = _randomized(distill.attach_medusa(target, num_heads=3, num_layers=2, shared_lm_head=shared,
                                              tree=[(0,), (0, 0), (1,), (0, 0, 0)]))
    if restricted:
        heads.restrict_vocab(torch.arange(0, 64, 3))
    out = distill.save_medusa(heads, tmp_path / "vllm", format="vllm")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_heads"], config["num_hidden_layers"]) == ("medusa", 3, 2)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is shared
    assert config["truncated_vocab_size"] == (22 if restricted else 64)
    stored = load_file(out / "model.safetensors")
    assert stored["blocks.2.layers.1.weight"].shape == (64, 64) and stored["blocks.2.layers.1.bias"].shape == (64,)
    assert ("lm_heads.1.weight" in stored) is not shared and stored["lm_heads.0.weight"].shape == (64, 64)
    assert ("token_map" in stored) is restricted
    assert medusa_layout(out) == "vllm"
    loaded = distill.load_medusa(out, target, dtype=torch.float32)
    assert loaded.config == heads.config
    h = _hidden()
    assert torch.equal(loaded(h), heads(h).detach())
    assert torch.equal(loaded.top_tokens(h, 4), heads.top_tokens(h, 4))


def test_vllm_export_refuses_unbound_shared_heads_and_foreign_dirs(target, tmp_path):
    from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads

    with pytest.raises(ValueError, match="not bound"):
        export_medusa_vllm(MedusaHeads(MedusaConfig(64, 64, num_heads=2)), tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="busy"):
        export_medusa_vllm(distill.attach_medusa(target, num_heads=2), tmp_path / "busy")
    with pytest.raises(ValueError, match="format must be one of"):
        distill.save_medusa(distill.attach_medusa(target, num_heads=2), tmp_path / "y", format="onnx")


def test_heads_never_go_into_a_model_checkpoint_and_are_readable_as_the_umask_allows(target, tmp_path):
    """A model checkpoint has the vLLM layout's file names (config.json, model.safetensors): both
    writers refuse it untouched; what they write gets the umask's modes."""
    from runtime.tiny import tiny_pair

    heads = distill.attach_medusa(target, num_heads=2)
    tiny_pair("llama", seed=0)[1].save_pretrained(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    for fmt in ("specdec", "vllm"):
        for overwrite in (False, True):
            with pytest.raises(OutputPathError, match="model is a non-empty directory that specdec did not write"):
                distill.save_medusa(heads, tmp_path / "model", overwrite=overwrite, format=fmt)
        with pytest.raises(OutputPathError, match="null/x cannot be created for the .*: /dev/null is not a directory"):
            distill.save_medusa(heads, "/dev/null/x", format=fmt)
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before
    old = os.umask(0o022)
    try:
        outs = [distill.save_medusa(heads, tmp_path / fmt, format=fmt) for fmt in ("specdec", "vllm")]
    finally:
        os.umask(old)
    for out in outs:
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
        assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}


def _original_checkpoint(path, target, prefix=True, pt=False, heads=2, layers=1):
    """Heads as the original Medusa code saves them: each head layers x ResBlock then its own LM head."""
    g = torch.Generator().manual_seed(3)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(64, 64, generator=g) * 0.2
            state[f"{i}.{j}.linear.bias"] = torch.randn(64, generator=g) * 0.1
        state[f"{i}.{layers}.weight"] = target.lm_head.weight.detach() + torch.randn(64, 64, generator=g) * 0.05
    if prefix:
        state = {f"medusa_head.{k}": v for k, v in state.items()}
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                  "base_model_name_or_path": "tiny", "hidden_size": 64}))
    if pt:
        torch.save(state, path / "medusa_lm_head.pt")
    else:
        save_file(state, str(path / "medusa_lm_head.safetensors"))
    return {k.removeprefix("medusa_head."): v for k, v in state.items()}


@pytest.mark.parametrize("prefix,pt", [(True, False), (False, True)], ids=["safetensors", "weights-only-pt"])
def test_original_layout_loads_and_drafts(target, tmp_path, prefix, pt):
    state = _original_checkpoint(tmp_path / "orig", target, prefix=prefix, pt=pt)
    assert medusa_layout(tmp_path / "orig") == "original"
    heads = distill.load_medusa(tmp_path / "orig", target, dtype=torch.float32)
    assert heads.num_heads == 2 and not heads.config.shared_lm_head
    h = _hidden()
    for i in range(2):  # the original head: x + SiLU(W x + b), then its own LM head
        x = h + F.silu(h @ state[f"{i}.0.linear.weight"].T + state[f"{i}.0.linear.bias"])
        torch.testing.assert_close(heads(h)[i], x @ state[f"{i}.1.weight"].T)
    ids = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])]
    out = specdec.generate(target, ids, draft=heads, max_new_tokens=10)
    plain = specdec.generate(target, ids, max_new_tokens=10)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))
    assert out.stats.drafted_tokens > 0


def test_layout_comes_from_config_keys_and_bad_dirs_fail(target, tmp_path):
    _original_checkpoint(tmp_path / "o", target)
    (tmp_path / "o" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(CheckpointError, match="medusa_num_heads"):
        distill.load_medusa(tmp_path / "o", target)
    _original_checkpoint(tmp_path / "short", target, heads=3)
    cfg = json.loads((tmp_path / "short" / "config.json").read_text())
    (tmp_path / "short" / "config.json").write_text(json.dumps({**cfg, "medusa_num_heads": 4}))
    with pytest.raises(CheckpointError, match="do not match its config"):
        distill.load_medusa(tmp_path / "short", target)
    out = export_medusa_vllm(_randomized(distill.attach_medusa(target, num_heads=2)), tmp_path / "v")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        distill.load_medusa(out, target)
