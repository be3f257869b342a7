"""GGUF -> checkpoint conversion on tiny GGUF files written with gguf.GGUFWriter (no real weights)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

import runtime
from runtime.catalogue import gguf_to_checkpoint
from runtime.errors import CheckpointError
from runtime.gguf import SOURCE_FILE, convert_gguf, supported_tensor_types
from runtime.loading import from_hf_state

TOKENS = torch.tensor([[5, 17, 99, 3, 64, 120, 8, 42], [1, 2, 3, 4, 5, 6, 7, 127]])  # (B, T)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _leftovers(folder) -> list[str]:
    """What a failed conversion left in the cache folder, lock files aside."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def _runtime_logits(model) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        return model(TOKENS, positions, None).logits


@pytest.mark.parametrize("fixture, quantize", [
    ("tiny_llama", {}),
    ("tiny_llama", {"blk.0.ffn_up.weight": "Q8_0", "blk.1.attn_k.weight": "Q8_0"}),
    ("tiny_qwen2", {"blk.1.ffn_down.weight": "Q8_0", "output.weight": "Q8_0"}),
])
def test_gguf_round_trip_matches_source_logits(fixture, quantize, request, tmp_path, home, gguf_writer):
    source = request.getfixturevalue(fixture)
    path = tmp_path / "tiny.gguf"
    expected = gguf_writer(source, path, quantize=quantize)

    model = runtime.load_model(path, dtype=torch.float32, weights="dense")
    reference = from_hf_state(expected, source.config, dtype=torch.float32)
    assert torch.equal(_runtime_logits(model), _runtime_logits(reference))

    if not quantize:  # bf16-exact source weights survive unchanged: the source model's logits
        with torch.no_grad():
            hf = source(TOKENS).logits
        torch.testing.assert_close(_runtime_logits(model), hf, rtol=0, atol=1e-5)

    ckpt = gguf_to_checkpoint(path)
    assert ckpt.parent == home / "gguf" and ckpt.name.startswith("tiny-")
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == source.config.model_type
    assert config["tie_word_embeddings"] == source.config.tie_word_embeddings
    assert ("lm_head.weight" in names) != source.config.tie_word_embeddings
    assert "quantization_config" not in config
    assert (ckpt / "generation_config.json").is_file()


def test_checkpoint_loads_in_transformers(tiny_llama, tmp_path, home, gguf_writer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / "plain.gguf"
    gguf_writer(tiny_llama, path)
    ckpt = gguf_to_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, tiny_llama(TOKENS).logits, rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.decode(tok("abcd ef")["input_ids"]) == "abcd ef"
    assert runtime.load_tokenizer(path).eos_token_id == 2


def test_conversion_is_cached_and_keyed_on_the_file(tiny_llama, tmp_path, home, gguf_writer):
    path = tmp_path / "m.gguf"
    gguf_writer(tiny_llama, path)
    first = gguf_to_checkpoint(path)
    stamp = (first / SOURCE_FILE).stat().st_mtime_ns
    assert gguf_to_checkpoint(path) == first
    assert (first / SOURCE_FILE).stat().st_mtime_ns == stamp  # not converted again
    gguf_writer(tiny_llama, path, quantize={"blk.0.ffn_gate.weight": "Q8_0"})  # rewritten file
    second = gguf_to_checkpoint(path)
    assert second != first and second.is_dir()
    assert json.loads((second / SOURCE_FILE).read_text())["tensor_types"]["Q8_0"] == 1


def _write_with_tensor_type(path, qtype: gguf.GGMLQuantizationType) -> None:
    """A llama GGUF with one 64x64 tensor stored (as zero blocks) in `qtype`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64 // block_elems * block_bytes), dtype=np.uint8),
                      raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_tensor_type_is_named(tmp_path, home):
    path = tmp_path / "q81.gguf"
    _write_with_tensor_type(path, gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(CheckpointError) as err:
        runtime.load_model(path)
    message = str(err.value)
    assert "blk.0.attn_q.weight" in message and "Q8_1" in message and "Q4_K" in message
    assert _leftovers(home / "gguf") == []


def test_supported_types_cover_the_catalogue_files():
    assert {"F32", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(supported_tensor_types())
    assert "Q8_1" not in supported_tensor_types()


def test_missing_tensor_fails_and_leaves_no_checkpoint(tiny_llama, tmp_path, home, gguf_writer):
    path = tmp_path / "holey.gguf"
    gguf_writer(tiny_llama, path, skip=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        gguf_to_checkpoint(path)
    assert _leftovers(home / "gguf") == []


def test_corrupt_gguf_is_a_clear_error(tmp_path, home):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        runtime.load_model(path)


def test_gguf_without_tokenizer_converts_weights_only(tiny_llama, tmp_path, home, gguf_writer):
    path = tmp_path / "notok.gguf"
    gguf_writer(tiny_llama, path, tokenizer=False)
    model = runtime.load_model(path, dtype=torch.float32, weights="dense")
    assert model.config.vocab_size == 128
    with pytest.raises(CheckpointError, match="no usable tokenizer"):
        runtime.load_tokenizer(path)


def test_convert_gguf_refuses_a_non_empty_directory(tiny_llama, tmp_path, gguf_writer):
    path = tmp_path / "m.gguf"
    gguf_writer(tiny_llama, path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_gguf(path, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_llama_gguf_with_qkv_biases_keeps_them_on_every_path(tiny_qwen2, tmp_path, home, gguf_writer):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "biased.gguf"
    gguf_writer(tiny_qwen2, path, arch="llama")  # Qwen2 weights (q / k / v biases) in a llama file
    with torch.no_grad():
        hf = tiny_qwen2(TOKENS).logits
    for weights in ("dense", "gguf"):  # the 4-bit path keeps the file's F32 tensors dense
        model = runtime.load_model(path, dtype=torch.float32, weights=weights)
        assert model.layers[0].attn.wqkv.bias is not None, weights
        torch.testing.assert_close(_runtime_logits(model), hf, rtol=0, atol=1e-4)
    ckpt = gguf_to_checkpoint(path)  # what transformers reads: a Qwen2 checkpoint, biases included
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen2"
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)(TOKENS).logits
    torch.testing.assert_close(converted, hf, rtol=0, atol=1e-4)


@pytest.mark.parametrize("extra, phrase", [
    ({"blk.0.attn_output.bias": np.zeros(64, np.float32)}, "holds 1 tensors a llama model does not have, e.g. "
                                                           "blk.0.attn_output.bias"),
    ({"blk.1.attn_q.bias": np.zeros(64, np.float32)}, "layer 1 has some of the q / k / v biases"),
])
def test_gguf_tensors_the_model_would_drop_are_named(tiny_llama, tmp_path, home, gguf_writer, extra, phrase):
    path = tmp_path / "extra.gguf"
    gguf_writer(tiny_llama, path, extra=extra)
    for weights in ("dense", "gguf"):
        with pytest.raises(CheckpointError, match=phrase.replace(".", r"\.")) as err:
            runtime.load_model(path, dtype=torch.float32, weights=weights)
        assert str(path) in str(err.value)


def test_a_full_disk_during_conversion_is_one_line_and_keeps_nothing(tiny_llama, tmp_path, home, gguf_writer,
                                                                      monkeypatch):
    """safetensors reports ENOSPC as a SafetensorError wrapping Rust's io error: it becomes one
    DiskFullError naming the cache directory, the bf16 size and SPECDEC_HOME, and no directory stays."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from runtime.errors import DiskFullError

    path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_llama, path)

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    real = transformers.modeling_utils.safe_save_file
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(DiskFullError, match=r"no space left on the disk while writing .*gguf.tiny-\w+ \(it needs "
                                            r"about .* kB, .* free there\); nothing was kept.*SPECDEC_HOME") as err:
        gguf_to_checkpoint(path, progress=False)
    assert "\n" not in str(err.value)
    assert _leftovers(home / "gguf") == []
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real)
    assert (gguf_to_checkpoint(path, progress=False) / SOURCE_FILE).is_file()  # space again: it converts


@pytest.mark.parametrize("key, value, vtype, phrase", [
    ("general.architecture", 7, "UINT32", r"general.architecture is 7 \(int\), not an architecture's name"),
    ("tokenizer.ggml.tokens", 7, "UINT32", "tokenizer.ggml.tokens is a uint32, not an array of strings"),
])
def test_metadata_of_the_wrong_type_is_named(tiny_llama, tmp_path, home, gguf_writer, monkeypatch, key, value, vtype,
                                             phrase):
    """Such a file gave transformers' TypeError ("argument of type 'int' is not iterable", "'int' object is not
    subscriptable") on both load paths."""
    real = gguf.GGUFWriter.add_key_value

    def add_key_value(self, name, val, val_type, sub_type=None, **kw):
        if name == key:
            return real(self, name, value, gguf.GGUFValueType[vtype])
        return real(self, name, val, val_type, sub_type=sub_type, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", add_key_value)
    path = tmp_path / "typed.gguf"
    gguf_writer(tiny_llama, path)
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", real)
    for weights in ("dense", "gguf"):
        with pytest.raises(CheckpointError, match=phrase):
            runtime.load_model(path, weights=weights)
    assert _leftovers(home / "gguf") == []


def test_a_path_that_is_not_a_path_is_named(home):
    """gguf_to_checkpoint(5) was pathlib's TypeError, which names no argument."""
    with pytest.raises(TypeError, match=r"path must be a .gguf file \(a str or a Path\), got 5 \(int\)"):
        gguf_to_checkpoint(5)
