"""Bad input to the loaders: a clear error naming the file, before anything is built or run.

Foreign code (`auto_map`) is refused before transformers is asked anything, and transformers is
always called with trust_remote_code=False; configs that disagree with the weights (layers,
heads, widths, vocabulary, positions) fail before a module is constructed; malformed JSON,
unparsable safetensors, shard paths outside the checkpoint, integer or NaN weights and unknown
devices are errors of their own, never a KeyError or a traceback from deep inside.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import runtime
from runtime.errors import CheckpointError, UnsupportedModelError
from runtime.hardware import check_device
from runtime.loading import from_hf_state
from runtime.model import Transformer
from runtime.tiny import tiny_hf_config, tiny_model, tiny_pair


def _refuse_to_build(*args, **kwargs):
    raise AssertionError("a Transformer was built before the config was checked against the weights")


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if a Transformer is constructed (the check must come before any module)."""
    monkeypatch.setattr(Transformer, "__init__", _refuse_to_build)


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _checkpoint(model, path, **config_changes):
    """A saved tiny transformers model, its config.json changed by `config_changes`."""
    model.save_pretrained(path)
    if config_changes:
        _edit_json(path / "config.json", **config_changes)
    return path


def _raises(exc, call, start, *phrases):
    """Run `call`, expect `exc` whose message starts with `start` and holds `phrases`; return the text."""
    with pytest.raises(exc) as err:
        call()
    text = str(err.value)
    assert text.startswith(str(start)), text
    for phrase in phrases:
        assert phrase in text, text
    return text


# --- foreign code -------------------------------------------------------------------------------

def test_auto_map_in_config_is_refused_before_transformers_reads_it(tiny_llama, tmp_path, monkeypatch):
    import transformers

    ckpt = _checkpoint(tiny_llama, tmp_path, auto_map={"AutoConfig": "evil.EvilConfig",
                                                       "AutoModelForCausalLM": "evil.EvilModel"})
    (ckpt / "evil.py").write_text("raise SystemExit('foreign code ran')\n")

    def never(*args, **kwargs):
        raise AssertionError("transformers was asked to read a checkpoint that asks for remote code")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", never)
    _raises(UnsupportedModelError, lambda: runtime.load_model(ckpt), ckpt / "config.json", "'auto_map'",
            "evil.EvilModel")
    _raises(UnsupportedModelError, lambda: runtime.load_tokenizer(ckpt), ckpt / "config.json", "'auto_map'")
    from specdec.evaluation.baselines import load_hf_model

    _raises(UnsupportedModelError, lambda: load_hf_model(ckpt, torch.float32), ckpt / "config.json", "'auto_map'")


def test_auto_map_in_tokenizer_config_is_refused(tiny_llama, tmp_path):
    ckpt = _checkpoint(tiny_llama, tmp_path)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    _raises(UnsupportedModelError, lambda: runtime.load_tokenizer(ckpt), ckpt / "tokenizer_config.json",
            "'auto_map'")
    _raises(UnsupportedModelError, lambda: runtime.load_model(ckpt), ckpt / "tokenizer_config.json", "'auto_map'")


def test_transformers_is_always_told_not_to_trust_remote_code(tiny_llama, tmp_path, monkeypatch):
    import transformers

    ckpt = _checkpoint(tiny_llama, tmp_path)
    seen = []
    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def recording(klass, *args, _original=original, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code", "missing")))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    runtime.load_model(ckpt, dtype=torch.float32)
    from specdec.evaluation.baselines import load_hf_model

    load_hf_model(ckpt, torch.float32)
    assert ("AutoConfig", False) in seen and ("AutoModelForCausalLM", False) in seen
    assert all(trust is False for _, trust in seen), seen


def test_gguf_conversion_does_not_trust_remote_code(tiny_llama, gguf_writer, tmp_path, monkeypatch):
    import transformers

    from runtime.gguf import convert_gguf

    gguf_writer(tiny_llama, tmp_path / "tiny.gguf")
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "missing"))
        raise ValueError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    _raises(CheckpointError, lambda: convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False),
            "transformers could not load")
    assert seen == [False]


# --- runaway sizes ------------------------------------------------------------------------------

def test_a_layer_count_the_weights_do_not_have_fails_before_building(tiny_llama, tmp_path, no_build):
    ckpt = _checkpoint(tiny_llama, tmp_path, num_hidden_layers=100_000)
    _raises(CheckpointError, lambda: runtime.load_model(ckpt), ckpt / "config.json",
            "says num_hidden_layers=100000", "hold 2 layers (0..1)")
    # the same check guards a state dict in memory (weights-only .bin files take this path)
    cfg = tiny_hf_config(num_hidden_layers=100_000)
    _raises(CheckpointError, lambda: from_hf_state(tiny_llama.state_dict(), cfg), "the config says",
            "num_hidden_layers=100000")


@pytest.mark.parametrize("key, value, phrase", [
    ("num_hidden_layers", 100_000, "block_count=100000, but the file holds 2 layers (0..1)"),
    ("max_position_embeddings", 2**21, "context_length=2097152; the runtime supports 1 to 1048576"),
])
def test_gguf_metadata_is_checked_against_its_tensors_before_transformers(gguf_writer, tmp_path, monkeypatch,
                                                                          key, value, phrase):
    import transformers

    from runtime.gguf import convert_gguf

    _, hf = tiny_pair("llama")
    setattr(hf.config, key, value)  # the metadata now disagrees with the 2 blocks written
    gguf_writer(hf, tmp_path / "bad.gguf")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # must not be reached
    _raises(CheckpointError, lambda: convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False),
            f"{tmp_path / 'bad.gguf'}: its metadata says llama.{phrase}")


@pytest.mark.parametrize("change, tensor, keys", [
    ({"hidden_size": 128}, "model.embed_tokens.weight", "hidden_size=128"),
    ({"vocab_size": 50_000_000}, "model.embed_tokens.weight", "vocab_size=50000000"),
    ({"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight", "num_key_value_heads * head_dim=64"),
    ({"num_attention_heads": 8, "head_dim": 16}, "model.layers.0.self_attn.o_proj.weight",
     "num_attention_heads * head_dim=128"),
    ({"intermediate_size": 10**9}, "model.layers.0.mlp.down_proj.weight", "intermediate_size=1000000000"),
])
def test_widths_heads_and_vocabulary_are_checked_against_the_shapes(tiny_llama, tmp_path, no_build, change,
                                                                     tensor, keys):
    ckpt = _checkpoint(tiny_llama, tmp_path, **change)
    _raises(CheckpointError, lambda: runtime.load_model(ckpt), f"tensor {tensor} in {ckpt} has shape", keys,
            "config does not belong to these weights")


def test_positions_past_the_bound_fail_with_a_message(tiny_llama, tmp_path, no_build):
    ckpt = _checkpoint(tiny_llama, tmp_path, max_position_embeddings=10**12)
    _raises(CheckpointError, lambda: runtime.load_model(ckpt), f"{ckpt / 'config.json'} is invalid",
            "max_position_embeddings is 1000000000000", "2**20")
    with pytest.raises(ValueError, match="max_position_embeddings is 1048577"):
        tiny_model(max_position_embeddings=2**20 + 1)


@pytest.mark.parametrize("change, phrase", [
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers must be an integer >= 1, got 'two'"),
    ({"hidden_size": None}, "hidden_size must be an integer >= 1, got None"),
])
def test_sizes_that_are_not_positive_integers_are_checkpoint_errors(tiny_llama, tmp_path, no_build, change,
                                                                    phrase):
    ckpt = _checkpoint(tiny_llama, tmp_path, **change)
    _raises(CheckpointError, lambda: runtime.load_model(ckpt), f"{ckpt / 'config.json'}: {phrase}")


# --- malformed files ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, phrase", [("{not json", "cannot be read as JSON"),
                                          ("[1, 2]", "holds a JSON list, not an object")])
def test_malformed_config_json(tiny_llama, tmp_path, text, phrase):
    ckpt = _checkpoint(tiny_llama, tmp_path)
    (ckpt / "config.json").write_text(text)
    _raises(CheckpointError, lambda: runtime.load_model(ckpt), ckpt / "config.json", phrase)


def test_safetensors_that_do_not_parse_name_the_file(tiny_llama, tmp_path):
    ckpt = _checkpoint(tiny_llama, tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    _raises(CheckpointError, lambda: runtime.load_model(ckpt), ckpt / "model.safetensors", "corrupt or truncated")


def test_integer_dense_weights_are_not_cast_to_float(tiny_llama, tmp_path):
    ckpt = _checkpoint(tiny_llama, tmp_path)
    state = load_file(ckpt / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"].to(torch.int8)
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    _raises(CheckpointError, lambda: runtime.load_model(ckpt),
            f"tensor model.layers.1.mlp.down_proj.weight in {ckpt} is stored as I8, an integer type")
    hf_state = dict(tiny_llama.state_dict(), **{"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    _raises(CheckpointError, lambda: from_hf_state(hf_state, tiny_llama.config),
            "tensor model.norm.weight in the checkpoint is stored as int32")


def _sharded(model, path):
    model.save_pretrained(path, max_shard_size="50KB")
    return path / "model.safetensors.index.json"


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_shard_paths_must_stay_inside_the_checkpoint(tiny_qwen2, tmp_path, shard):
    index = _sharded(tiny_qwen2, tmp_path / "ckpt")
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path / "ckpt"), index,
            f"lists shard {shard!r}, a path outside the checkpoint directory")


@pytest.mark.parametrize("text, phrase", [("{", "cannot be read as JSON"),
                                          ('{"metadata": {}}', "has no 'weight_map' object"),
                                          ('{"weight_map": {"a": 3}}', "lists shard 3, which is not a file name")])
def test_malformed_shard_index(tiny_qwen2, tmp_path, text, phrase):
    index = _sharded(tiny_qwen2, tmp_path)
    index.write_text(text)
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path), index, phrase)


# --- compressed checkpoints ---------------------------------------------------------------------

def _compressed(path, layers=2):
    """A compressed checkpoint (layers.0.mlp.w2 INT8) of a tiny llama; returns its tensors."""
    from runtime.qlinear import Int8Linear

    model = tiny_model("llama", seed=0, num_hidden_layers=layers)
    w = model.layers[0].mlp.w2.weight.detach()
    scales = (w.abs().amax(1) / 127).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("layers.0.mlp.w2.")}
    tensors.update({"layers.0.mlp.w2.qweight": q, "layers.0.mlp.w2.scales": scales})
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    model.config.hf_config.to_json_file(str(path / "config.json"))
    meta = {"format_version": 1, "recipe": [], "modules": {"layers.0.mlp.w2": Int8Linear(q, scales).meta()}}
    (path / "compression.json").write_text(json.dumps(meta))
    return tensors


def test_compressed_layer_count_is_checked_before_building(tmp_path, monkeypatch):
    _compressed(tmp_path)
    monkeypatch.setattr(Transformer, "__init__", _refuse_to_build)
    _edit_json(tmp_path / "config.json", num_hidden_layers=100_000)
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path), tmp_path / "config.json",
            "says num_hidden_layers=100000", "hold 2 layers (0..1)")


def test_compressed_dense_shapes_are_checked_against_the_config(tmp_path, monkeypatch):
    _compressed(tmp_path)
    monkeypatch.setattr(Transformer, "__init__", _refuse_to_build)
    _edit_json(tmp_path / "config.json", intermediate_size=128)
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path),
            f"tensor layers.0.mlp.w13.weight in {tmp_path} has shape (192, 64)", "2 * intermediate_size=256")


def test_compressed_module_shapes_are_checked_against_the_linear_they_replace(tmp_path):
    tensors = _compressed(tmp_path)
    tensors["layers.0.mlp.w2.qweight"] = tensors["layers.0.mlp.w2.qweight"][:32].contiguous()
    tensors["layers.0.mlp.w2.scales"] = tensors["layers.0.mlp.w2.scales"][:32].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path),
            f"compressed module layers.0.mlp.w2 in {tmp_path} is 32 x 96 (out x in), but the config implies 64 x 96")


@pytest.mark.parametrize("name", ["layers.1.attn.wqkv.weight", "layers.0.mlp.w2.scales"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_compressed_nan_and_inf_are_refused(tmp_path, name, bad):
    tensors = _compressed(tmp_path)
    tensors[name] = tensors[name].clone()
    tensors[name][0] = bad
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path),
            f"tensor {name} in {tmp_path / 'model.safetensors'} holds NaN or inf values")


def test_compressed_integer_dense_weight_is_refused(tmp_path):
    tensors = _compressed(tmp_path)
    tensors["norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path),
            f"tensor norm.weight in {tmp_path} is stored as int8, an integer type")


@pytest.mark.parametrize("meta, start, phrase", [
    ("{oops", "compression.json", "cannot be read as JSON"),
    ("[]", "compression.json", "holds a JSON list"),
    ({"format_version": 1, "modules": {"layers.0.mlp.w2": 7}}, "compression.json", "is a JSON int, not an object"),
    ({"format_version": 1, "modules": {"layers.0.mlp.w2": {}}}, "compression.json",
     "compressed module 'layers.0.mlp.w2' in format None is malformed (ValueError: unknown quantized-linear format "
     "None"),
    ({"format_version": 1, "modules": {"embed": {"format": "int8"}}}, "compression.json",
     "lists compressed module 'embed', which is of type Embedding, not a linear layer"),
    ({"format_version": 1, "modules": {"layers.0.mlp.nope": {"format": "int8"}}}, "compression.json",
     "lists compressed module 'layers.0.mlp.nope'"),
    ({"format_version": 1, "recipe": 3, "modules": {}}, "compression.json", "'recipe' must be a list"),
])
def test_malformed_compression_json(tmp_path, meta, start, phrase):
    _compressed(tmp_path)
    (tmp_path / "compression.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    start = tmp_path / start if start.endswith(".json") else start
    _raises(CheckpointError, lambda: runtime.load_model(tmp_path), start, phrase)


# --- Medusa heads -------------------------------------------------------------------------------

def _heads(path, num_heads=2, hidden=64, vocab=128, **config):
    from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads

    cfg = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, **config)
    heads = MedusaHeads(cfg)
    path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(path / "medusa.safetensors"))
    (path / "medusa_config.json").write_text(json.dumps({"format": "specdec-medusa", "version": 1,
                                                         **cfg.to_dict()}))
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def test_medusa_num_heads_is_checked_before_any_head_is_built(tmp_path, target, monkeypatch):
    from specdec.drafters.medusa import io as medusa_io

    _heads(tmp_path)
    _edit_json(tmp_path / "medusa_config.json", num_heads=20_000)

    def refuse(*args, **kwargs):
        raise AssertionError("MedusaHeads was built before the config was checked against the weights")

    monkeypatch.setattr(medusa_io, "MedusaHeads", refuse)
    _raises(CheckpointError, lambda: medusa_io.load_medusa(tmp_path, target), tmp_path / "medusa_config.json",
            "says num_heads=20000", "holds 2 heads")
    _edit_json(tmp_path / "medusa_config.json", num_heads=2, num_layers=5000)
    _raises(CheckpointError, lambda: medusa_io.load_medusa(tmp_path, target), tmp_path / "medusa_config.json",
            "says num_layers=5000", "holds 1 layers per head")


def test_medusa_shapes_are_checked_against_the_config(tmp_path, target, monkeypatch):
    from specdec.drafters.medusa import io as medusa_io

    _heads(tmp_path, hidden=32, shared_lm_head=False)  # heads of a narrower model ...
    _edit_json(tmp_path / "medusa_config.json", hidden_size=64)  # ... whose config was edited to fit
    monkeypatch.setattr(medusa_io, "MedusaHeads", None)
    _raises(CheckpointError, lambda: medusa_io.load_medusa(tmp_path, target), "blocks.0.0.linear.weight in",
            "has shape (32, 32), the config says (64, 64)")


@pytest.mark.parametrize("text, phrase", [
    ("{", "cannot be read as JSON"),
    ("[]", "holds a JSON list"),
    (json.dumps({"format": "specdec-medusa", "hidden_size": 64}), "is malformed (KeyError: 'vocab_size')"),
    (json.dumps({"format": "specdec-medusa", "hidden_size": 64, "vocab_size": 128, "num_heads": "x",
                 "num_layers": 1, "shared_lm_head": True}), "is malformed (ValueError"),
])
def test_malformed_medusa_config(tmp_path, target, text, phrase):
    from specdec.drafters.medusa.io import load_medusa

    _heads(tmp_path)
    (tmp_path / "medusa_config.json").write_text(text)
    _raises(CheckpointError, lambda: load_medusa(tmp_path, target), tmp_path / "medusa_config.json", phrase)


def test_medusa_weights_that_do_not_parse_or_hold_nan(tmp_path, target):
    from specdec.drafters.medusa.io import load_medusa

    _heads(tmp_path)
    weights = tmp_path / "medusa.safetensors"
    state = load_file(weights)
    state["blocks.1.0.linear.bias"][3] = float("nan")
    save_file(state, str(weights))
    _raises(CheckpointError, lambda: load_medusa(tmp_path, target), "tensor blocks.1.0.linear.bias in",
            "holds NaN or inf")
    weights.write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    _raises(CheckpointError, lambda: load_medusa(tmp_path, target), weights, "corrupt or truncated")


# --- devices ------------------------------------------------------------------------------------

def test_unknown_device_is_a_value_error_before_any_file_is_read(tmp_path):
    _raises(ValueError, lambda: runtime.load_model(tmp_path / "missing", device="banana"),
            "unknown device 'banana'")
    assert check_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_says_to_use_the_cpu(tmp_path):
    text = _raises(ValueError, lambda: runtime.load_model(tmp_path / "missing", device="cuda"), "device 'cuda'")
    assert text.endswith("no CUDA GPU is available; use --device cpu")
    from specdec.evaluation.baselines import load_hf_model

    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        load_hf_model(tmp_path / "missing", torch.float32, device="cuda:0")


@pytest.mark.parametrize("key, value, phrase", [
    ("attention.head_count", 0, "its metadata says llama.attention.head_count=0; it must be an integer >= 1"),
    ("attention.head_count", 3, "llama.attention.head_count=3, not a multiple of llama.attention.head_count_kv=2"),
    ("attention.head_count_kv", 0, "llama.attention.head_count_kv=0; it must be an integer >= 1"),
    ("attention.head_count_kv", 3, "llama.attention.head_count=4, not a multiple of llama.attention.head_count_kv=3"),
    ("attention.head_count", 8, "its metadata (llama.attention.head_count, with heads of 16 dimensions) implies 128 "
                                "rows for blk.0.attn_q.weight, but it holds 64"),
    ("rope.dimension_count", 15, "heads of 15 dimensions"),
    ("feed_forward_length", 0, "llama.feed_forward_length=0"),
])
def test_gguf_head_counts_and_widths_name_the_file_and_key(gguf_writer, tmp_path, monkeypatch, key, value, phrase):
    import transformers

    from runtime.gguf import convert_gguf

    _, hf = tiny_pair("llama")  # 4 heads, 2 key/value heads of 16 dimensions
    gguf_writer(hf, tmp_path / "bad.gguf", metadata={f"llama.{key}": value})
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # must not be reached
    _raises(CheckpointError, lambda: convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False),
            f"{tmp_path / 'bad.gguf'}: ", phrase)


def test_checkpoint_tensors_the_runtime_would_drop_are_refused(tiny_llama, tmp_path):
    state = dict(tiny_llama.state_dict())
    state["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64)  # a Llama attention_bias=True checkpoint's
    _raises(CheckpointError, lambda: from_hf_state(state, tiny_llama.config, source=tmp_path),
            f"checkpoint {tmp_path} holds 1 tensors the llama runtime model does not use, e.g. "
            "model.layers.0.self_attn.o_proj.bias")
