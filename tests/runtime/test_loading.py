"""runtime.load_model on real (tiny) Hugging Face checkpoint directories, good and bad."""

from __future__ import annotations

import json

import pytest
import torch

import runtime
from runtime.errors import CheckpointError, UnsupportedModelError
from runtime.loading import from_hf_state

TOKENS = torch.tensor([[7, 1, 99, 23, 64, 5]])  # (B, T)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS, torch.arange(TOKENS.shape[1])[None], None).logits


def test_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(CheckpointError, match="does not exist"):
        runtime.load_model(missing)


def test_directory_without_weights(tiny_llama, tmp_path):
    tiny_llama.config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="holds no weights"):
        runtime.load_model(tmp_path)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no config.json"):
        runtime.load_model(tmp_path)


def test_single_file_checkpoint_loads(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path)
    model = runtime.load_model(tmp_path, dtype=torch.float32)
    reference = from_hf_state(tiny_llama.state_dict(), tiny_llama.config)
    assert torch.equal(_logits(model), _logits(reference))


def test_truncated_safetensors(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated") as err:
        runtime.load_model(tmp_path)
    assert "model.safetensors" in str(err.value)


def test_sharded_safetensors_load(tiny_qwen2, tmp_path):
    tiny_qwen2.save_pretrained(tmp_path, max_shard_size="50KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    model = runtime.load_model(tmp_path, dtype=torch.float32)
    reference = from_hf_state(tiny_qwen2.state_dict(), tiny_qwen2.config)
    assert torch.equal(_logits(model), _logits(reference))


def test_sharded_checkpoint_with_a_missing_shard(tiny_qwen2, tmp_path):
    tiny_qwen2.save_pretrained(tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / lost).unlink()
    with pytest.raises(CheckpointError, match=lost):
        runtime.load_model(tmp_path)


def test_unsupported_model_type_points_at_the_adapter(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        runtime.load_model(tmp_path)
    assert "'gpt2'" in str(err.value) and "HFAdapter" in str(err.value)


def test_a_checkpoint_missing_one_part_of_a_fused_weight_is_named_by_its_directory(tiny_llama, tmp_path):
    from safetensors.torch import save_file

    tiny_llama.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in tiny_llama.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"^checkpoint {tmp_path} is missing model.layers.1.mlp.up_proj.weight; "
                                              "fetch or convert it again$"):
        runtime.load_model(tmp_path, dtype=torch.float32, weights="dense")


@pytest.mark.parametrize("files, want", [
    ({}, r"^no usable tokenizer in {d}: it holds none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt, "
         r"tokenizer_config.json; copy the base model's tokenizer files into it"),
    ({"tokenizer.json": '{"x": 1}'}, r"^{d}/tokenizer.json is not a tokenizers file: it has no \"model\" mapping "
                                     r"\(keys: x\); the file is corrupt"),
    ({"tokenizer.json": "[1, 2]"}, r"^{d}/tokenizer.json holds a JSON list, not an object"),
    ({"tokenizer.json": '{"model": {"type": "BPE"}}'}, r"^no usable tokenizer in {d} \(tokenizer.json\): KeyError: "
                                                      r"'added_tokens'; copy the base model's tokenizer files"),
], ids=["none", "no-model", "list", "no-added-tokens"])
def test_a_missing_or_broken_tokenizer_is_one_line_naming_the_directory_or_file(tiny_llama, tmp_path, files, want):
    tiny_llama.config.save_pretrained(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=want.replace("{d}", str(tmp_path))) as err:
        runtime.load_tokenizer(tmp_path)
    assert "\n" not in str(err.value)
