"""EAGLE-3 heads: shapes, the draft vocabulary maps, the speculators format (round trip, bad
input) and the target's auxiliary hidden states."""

import json

import pytest
import torch

import specdec
from runtime.errors import CheckpointError
from runtime.tiny import tiny_model
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head, default_aux_layers

V = 64


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", seed=3, vocab_size=V, num_hidden_layers=6)


def head_for(target, draft_vocab=32, seed=0, **kw):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=draft_vocab, target_name="tiny", **kw))
    head.set_draft_vocab(torch.arange(draft_vocab) * (V // draft_vocab))  # every other id for 32
    return head


def test_config_takes_the_targets_shape_and_default_layers(deep):
    cfg = Eagle3Config.from_target(deep, draft_vocab_size=32)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.aux_layers == default_aux_layers(6) == (2, 3, 3)
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and not cfg.norm_before_residual


@pytest.mark.parametrize("change,match", [({"aux_layers": (2, 3)}, "3 layer ids"),
                                          ({"aux_layers": (2, 3, 6)}, "3 layer ids"),
                                          ({"draft_vocab_size": V + 1}, "exceeds"),
                                          ({"num_kv_heads": 3}, "multiple"),
                                          ({"hidden_size": 0}, "hidden_size")])
def test_config_validates_on_construction(deep, change, match):
    fields = Eagle3Config.from_target(deep, draft_vocab_size=32).to_dict() | change
    with pytest.raises(ValueError, match=match):
        Eagle3Config(**fields)


def test_head_shapes_and_cache_match_the_uncached_forward(deep):
    head = head_for(deep)
    B, T, C = 2, 7, 64
    g = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(B, T, 3 * C, generator=g), torch.randint(0, V, (B, T), generator=g)
    pos = torch.arange(1, T + 1)[None].expand(B, -1)
    fused = head.fuse(aux)
    assert fused.shape == (B, T, C)
    logits, hidden = head(fused, deep.embed(ids), pos)
    assert logits.shape == (B, T, 32) and hidden.shape == (B, T, C)
    cache = head.new_cache(B, 16)
    first = head(fused[:, :4], deep.embed(ids[:, :4]), pos[:, :4], cache)
    rest = head(fused[:, 4:], deep.embed(ids[:, 4:]), pos[:, 4:], cache)
    assert cache.lengths.tolist() == [T, T]
    torch.testing.assert_close(torch.cat([first[0], rest[0]], 1), logits)
    torch.testing.assert_close(torch.cat([first[1], rest[1]], 1), hidden)


def test_the_head_has_the_speculators_tensor_names(deep):
    names = set(head_for(deep).state_dict())
    assert names == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    head = head_for(deep)
    assert head.layers[0].self_attn.q_proj.weight.shape == (64, 128)  # q/k/v read [embedding, fused]
    assert head.layers[0].self_attn.k_proj.weight.shape == (32, 128)  # the target's GQA shape


def test_draft_vocabulary_maps(deep):
    head = head_for(deep, draft_vocab=16)
    ids = torch.tensor([0, 3, 5, 8, 13, 21, 22, 30, 31, 40, 41, 50, 55, 60, 62, 63])
    head.set_draft_vocab(ids)
    assert head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool
    assert torch.equal(head.target_ids(torch.arange(16)), ids)
    assert torch.equal(head.d2t, ids - torch.arange(16))
    assert head.t2d.sum() == 16 and bool(head.t2d[ids].all())
    for bad in (ids.flip(0), ids[:-1], torch.cat([ids[:-1], torch.tensor([64])])):
        with pytest.raises(ValueError, match="strictly increasing"):
            head.set_draft_vocab(bad)


def test_save_load_round_trip_in_the_speculators_format(deep, tmp_path):
    head = head_for(deep, norm_before_residual=True)
    specdec.save_eagle(head, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert raw["draft_vocab_size"] == 32 and raw["target_hidden_size"] == 64
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and raw["norm_before_residual"] is True
    layer = raw["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_attention_heads"] == 4 and layer["vocab_size"] == V
    spec = raw["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy" and spec["verifier"]["name_or_path"] == "tiny"
    loaded = specdec.load_eagle(tmp_path / "h", deep)
    assert loaded.config == head.config and not loaded.training
    ref, got = head.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_the_speculators_package_parses_our_config(deep, tmp_path):
    """Only where the real `speculators` package is installed (it is not a dependency)."""
    pytest.importorskip("speculators")
    from speculators import SpeculatorModelConfig

    specdec.save_eagle(head_for(deep), tmp_path / "h")
    cfg = SpeculatorModelConfig.from_pretrained(str(tmp_path / "h"))
    assert type(cfg).__name__ == "Eagle3SpeculatorConfig"
    assert cfg.draft_vocab_size == 32 and cfg.eagle_aux_hidden_state_layer_ids == [2, 3, 3]
    assert cfg.transformer_layer_config.hidden_size == 64 and cfg.norm_before_residual is False
    assert cfg.speculators_config.default_proposal_method == "greedy"


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            raw[outer][inner] = value
        else:
            raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("changes,match", [
    ({"target_hidden_size": 32}, "hidden size is 64"),
    ({"transformer_layer_config.hidden_size": 32}, "hidden size is 64"),
    ({"transformer_layer_config.vocab_size": 99}, "vocabulary"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 3, 6]}, "each in 0..5"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 3]}, "3 layer ids"),
    ({"speculators_model_type": "eagle"}, "not 'eagle3'"),
    ({"draft_vocab_size": 16}, "shape")])
def test_bad_configs_fail_naming_the_problem(deep, tmp_path, changes, match):
    specdec.save_eagle(head_for(deep), tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match):
        specdec.load_eagle(tmp_path, deep)


def test_corrupt_or_missing_files_fail_naming_them(deep, tmp_path):
    with pytest.raises(CheckpointError, match="not an EAGLE-3 head directory"):
        specdec.load_eagle(tmp_path, deep)
    specdec.save_eagle(head_for(deep), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json cannot be read as JSON"):
        specdec.load_eagle(tmp_path, deep)
    specdec.save_eagle(head_for(deep), tmp_path, overwrite=True)  # replaces the head whose config was broken
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["layers.0.hidden_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['layers.0.hidden_norm.weight'\]"):
        specdec.load_eagle(tmp_path, deep)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        specdec.load_eagle(tmp_path, deep)


def test_inconsistent_vocabulary_maps_are_refused(deep, tmp_path):
    from safetensors.torch import load_file, save_file

    specdec.save_eagle(head_for(deep), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["t2d"] = ~state["t2d"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="t2d"):
        specdec.load_eagle(tmp_path, deep)


def test_a_head_for_another_model_is_refused(deep, tmp_path):
    specdec.save_eagle(head_for(deep), tmp_path)
    other = tiny_model("llama", seed=0, vocab_size=V, hidden_size=32, num_hidden_layers=6)
    with pytest.raises(CheckpointError, match="hidden size is 32"):
        specdec.load_eagle(tmp_path, other)
    shallow = tiny_model("llama", seed=0, vocab_size=V, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="each in 0..2"):
        specdec.load_eagle(tmp_path, shallow)


def test_aux_states_are_the_inputs_of_the_named_layers(deep):
    """forward(aux_layers=...) returns the states entering each named layer (vLLM's numbering:
    layer i's input, 0 = the embedding), chained by hand with run_block, on the eager path."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 9), generator=g)
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        states = [deep.embed(ids)]
        for i in range(6):
            states.append(deep.run_block(i, states[-1], pos))
        logits, hidden, aux = deep(ids, pos, deep.new_cache(2, 16), return_hidden=True, aux_layers=(2, 3, 5))
        only = deep(ids, pos, None, aux_layers=(2, 3, 5))
        plain = deep(ids, pos, None)
    assert not hasattr(deep, "aux_layers")  # an argument of the forward, no state of the model
    assert aux.shape == (2, 9, 3 * 64)
    torch.testing.assert_close(aux, torch.cat([states[2], states[3], states[5]], -1))
    torch.testing.assert_close(only.aux, aux)
    torch.testing.assert_close(logits, plain.logits)
    assert only.hidden is None and plain.aux is None
    with pytest.raises(ValueError, match="0..5"):
        deep(ids, pos, None, aux_layers=(1, 6, 2))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_decoder_layer_equals_the_speculators_one(deep, norm_before_residual):
    """Only where the real `speculators` package is installed: its Eagle3 first layer, loaded with
    our layers.0.* tensors, computes what ours does (input order [embedding, fused], norms, residual)."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3.model_definitions import LlamaDecoderEagle3FirstLayer
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head = _perturb_norms(head_for(deep, norm_before_residual=norm_before_residual))
    cfg = LlamaConfig(**head.config.layer_config())
    cfg._attn_implementation = "sdpa"
    ref = LlamaDecoderEagle3FirstLayer(cfg, 0, norm_before_residual=norm_before_residual).eval()
    ref.load_state_dict({k.removeprefix("layers.0."): v for k, v in head.state_dict().items()
                         if k.startswith("layers.0.")}, strict=True)
    g = torch.Generator().manual_seed(0)
    fused, embeds = torch.randn(2, 7, 64, generator=g), torch.randn(2, 7, 64, generator=g)
    pos = torch.arange(3, 10)[None].expand(2, -1)
    with torch.no_grad():
        want = ref(torch.cat([embeds, fused], -1), attention_mask=None, position_ids=pos,
                   position_embeddings=LlamaRotaryEmbedding(cfg)(fused, pos))
        got = head.step(fused, embeds, pos)
    torch.testing.assert_close(got, want)


def test_unrolled_steps_train_through_an_unroll_cache(deep):
    """Training-time test: three unrolled steps over an UnrollCache compute what the drafting
    KVCache computes with EAGLE-3's unrolled mask, and gradients reach fc through every step."""
    from specdec.drafters.eagle.head import UnrollCache

    head = head_for(deep)
    B, T = 2, 5
    g = torch.Generator().manual_seed(2)
    aux, ids = torch.randn(B, T, 3 * 64, generator=g), torch.randint(0, V, (B, T + 2), generator=g)
    pos = torch.arange(1, T + 1)[None].expand(B, -1)
    assert UnrollCache.mask(2, 2).tolist() == [[True, False, True, False], [True, True, False, True]]
    with torch.no_grad():
        embeds = [deep.embed(ids[:, s:s + T]) for s in range(3)]
    unroll, kv = UnrollCache(), head.new_cache(B, 3 * T)
    hidden = ref_hidden = head.fuse(aux)
    loss = 0.0
    for s in range(3):
        logits, hidden = head(hidden, embeds[s], pos + s, unroll)
        with torch.no_grad():
            mask = UnrollCache.mask(T, s + 1)[None].expand(B, -1, -1)
            ref_logits, ref_hidden = head(ref_hidden, embeds[s], pos + s, kv, mask)
        torch.testing.assert_close(logits.detach(), ref_logits)
        loss = loss + 0.8 ** s * logits.logsumexp(-1).mean()
    loss.backward()
    assert head.fc.weight.grad is not None and bool(head.fc.weight.grad.abs().sum() > 0)


NORMS = [{"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}]


def _perturb_norms(head):
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:  # norms away from 1, so that each one matters
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return head


@pytest.mark.parametrize("norms", NORMS)
def test_later_speculators_norm_options_round_trip(deep, tmp_path, norms):
    """norm_before_fc (input_norm over the 3C states), fc_norm (one norm per layer) and norm_output
    (steps return the normed state) are saved, loaded, and change what the head computes."""
    head = _perturb_norms(head_for(deep, **norms))
    names = set(head.state_dict())
    assert ("input_norm.weight" in names) == bool(norms.get("norm_before_fc"))
    assert ({f"fc_norm.{i}.weight" for i in range(3)} <= names) == bool(norms.get("fc_norm"))
    specdec.save_eagle(head, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert {k: raw[k] for k in ("norm_before_fc", "fc_norm", "norm_output")} == {
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, **norms}
    loaded = specdec.load_eagle(tmp_path / "h", deep)
    assert loaded.config == head.config
    g = torch.Generator().manual_seed(4)
    aux, ids = torch.randn(2, 6, 3 * 64, generator=g), torch.randint(0, V, (2, 6), generator=g)
    pos = torch.arange(1, 7)[None].expand(2, -1)
    plain = Eagle3Head(Eagle3Config.from_target(deep, draft_vocab_size=32))
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if k in plain.state_dict()})
    with torch.no_grad():
        logits, hidden = head(head.fuse(aux), deep.embed(ids), pos)
        torch.testing.assert_close(loaded(loaded.fuse(aux), deep.embed(ids), pos)[0], logits)
        assert not torch.allclose(plain.fuse(aux), head.fuse(aux))  # the aux states are normed before fc
        if norms.get("norm_output"):
            raw_out = plain.step(head.fuse(aux), deep.embed(ids), pos)
            torch.testing.assert_close(hidden, head.norm(raw_out))
            torch.testing.assert_close(logits, head.lm_head(hidden))
    with pytest.raises(ValueError, match="exclude each other"):
        Eagle3Config(**{**head.config.to_dict(), "norm_before_fc": True, "fc_norm": True})
    (tmp_path / "h" / "config.json").write_text(json.dumps({k: v for k, v in raw.items()
                                                           if k not in ("norm_before_fc", "fc_norm")}))
    with pytest.raises(CheckpointError, match="unexpected"):  # a missing option reads as False
        specdec.load_eagle(tmp_path / "h", deep)


@pytest.mark.parametrize("norms", [{}, *NORMS])
def test_unrolled_steps_equal_the_speculators_eagle3_model(deep, tmp_path, norms):
    """Only where the real `speculators` package is installed: its Eagle3DraftModel, loaded from our
    saved head, drafts what three of our unrolled training-time-test steps draft (step s reads the
    previous step's output and the tokens s further on, positions + s), with each norm option."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from specdec.drafters.eagle.head import UnrollCache

    head = _perturb_norms(head_for(deep, **norms))
    specdec.save_eagle(head, tmp_path / "h")
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "h"))
    cfg.transformer_layer_config._attn_implementation = "eager"
    ref = Eagle3DraftModel(cfg).eval()
    state = {**head.state_dict(), "embed_tokens.weight": deep.embed.weight.detach().float()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"verifier_norm.weight", "verifier_lm_head.weight"}  # training only
    T = 7
    g = torch.Generator().manual_seed(5)
    aux, ids = torch.randn(1, T, 3 * 64, generator=g), torch.randint(0, V, (1, T), generator=g)
    pos = torch.arange(1, T + 1)[None]
    with torch.no_grad():
        want = ref(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long),
                   position_ids=pos, ttt_steps=3)
        cache, hidden, got = UnrollCache(), head.fuse(aux), []
        for s in range(3):
            shifted = torch.cat([ids[:, s:], ids.new_zeros(1, s)], dim=1)  # the tokens s further on
            logits, hidden = head(hidden, deep.embed(shifted), pos + s, cache)
            got.append(logits.argmax(-1))
    for s in range(3):
        assert torch.equal(got[s], want[s]), f"step {s}"
