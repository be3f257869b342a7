"""load_model(..., weights="gguf"): a GGUF file's quantized tensors kept as BlockQuantLinear modules
(tiny GGUF files written with gguf.GGUFWriter), the weights option, and the real smollm2 file."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import runtime
from runtime.blockq import BlockQuantLinear, QuantizedEmbedding
from runtime.kernels import cpu_blockq
from runtime.loading import resolve_weights

TOKENS = torch.tensor([[5, 17, 99, 3, 64, 120, 8, 42], [1, 2, 3, 4, 5, 6, 7, 127]])  # (B, T)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _logits(model) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        return model(TOKENS, positions, None).logits


def _quantize_all(layers: int, kinds: dict[str, str], embed: str, output: str | None) -> dict[str, str]:
    q = {f"blk.{i}.{name}.weight": kinds.get(name, kinds["*"]) for i in range(layers) for name in LINEARS}
    q["token_embd.weight"] = embed
    if output:
        q["output.weight"] = output
    return q


@pytest.mark.parametrize("fixture, kinds, embed, output", [
    # llama: q / k rows permuted by llama.cpp, tied head; every linear Q4_1 (smollm2's file type)
    ("tiny_llama", {"*": "Q4_1"}, "Q8_0", None),
    # qwen2: qkv biases, a separate head; types mixed inside the fused q/k/v projection
    ("tiny_qwen2", {"*": "Q5_0", "attn_v": "Q8_0", "ffn_down": "Q4_0"}, "Q5_0", "Q8_0"),
])
def test_quantized_weights_are_kept_and_match_the_dense_model(fixture, kinds, embed, output, request, tmp_path,
                                                              home, gguf_writer):
    source = request.getfixturevalue(fixture)
    path = tmp_path / "tiny.gguf"
    gguf_writer(source, path, quantize=_quantize_all(source.config.num_hidden_layers, kinds, embed, output))
    model = runtime.load_model(path, dtype=torch.float32, weights="gguf")
    dense = runtime.load_model(path, dtype=torch.float32, weights="dense")
    assert isinstance(model.embed, QuantizedEmbedding)
    for block in model.layers:
        for linear in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2):
            assert isinstance(linear, BlockQuantLinear)
    assert isinstance(model.lm_head, BlockQuantLinear)
    assert (model.lm_head is model.embed.table) == source.config.tie_word_embeddings
    assert model.dtype == torch.float32 and sum(model.gguf_tensor_types.values()) > 0
    # the dense model holds the same weights rounded to bf16 (the converted checkpoint's dtype)
    for ours, theirs in ((model.layers[1].attn.wqkv, dense.layers[1].attn.wqkv),
                         (model.layers[0].mlp.w2, dense.layers[0].mlp.w2)):
        torch.testing.assert_close(ours.dequantize().to(torch.bfloat16).float(), theirs.weight, rtol=0, atol=0)
    got, ref = _logits(model), _logits(dense)
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_a_model_converted_with_to_runs_as_one_loaded_in_that_dtype(tiny_qwen2, tmp_path, home, gguf_writer):
    """`model.to(dtype)` on a GGUF model keeps its blocks' storage (the kernels refuse other scale dtypes)
    and computes in the new dtype: the logits equal a model loaded with that dtype."""
    path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_qwen2, path, quantize=_quantize_all(tiny_qwen2.config.num_hidden_layers,
                                                         {"*": "Q4_1", "attn_v": "Q8_0"}, "Q5_0", "Q8_0"))
    model = runtime.load_model(path, dtype=torch.float32, weights="gguf")
    for dtype in (torch.bfloat16, torch.float32):
        loaded = runtime.load_model(path, dtype=dtype, weights="gguf")
        assert model.to(dtype).dtype == dtype
        assert torch.equal(_logits(model), _logits(loaded))


def test_dense_tensors_stay_dense(tiny_qwen2, tmp_path, home, gguf_writer):
    path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_qwen2, path, quantize={"blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q8_0"})
    model = runtime.load_model(path, dtype=torch.float32, weights="gguf")
    assert isinstance(model.layers[0].mlp.w13, BlockQuantLinear)
    assert type(model.layers[1].mlp.w13) is nn.Linear and type(model.embed) is nn.Embedding
    ref = runtime.load_model(path, dtype=torch.float32, weights="dense")
    assert float((_logits(model) - _logits(ref)).abs().max() / _logits(ref).abs().max()) < 0.05


def test_weights_option(tiny_llama, tmp_path, home, gguf_writer):
    path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_llama, path)
    with pytest.raises(ValueError, match="weights must be one of"):
        runtime.load_model(path, weights="int4")
    ckpt = runtime.loading.resolve(path)
    with pytest.raises(ValueError, match="catalogue name or a .gguf file"):
        runtime.load_model(ckpt, weights="gguf")
    assert resolve_weights("auto", ckpt) == "dense"  # a checkpoint directory has no GGUF to keep
    assert resolve_weights("auto", path) == ("gguf" if cpu_blockq.fast() else "dense")
    assert resolve_weights("dense", path) == "dense"
    assert resolve_weights("auto", path, "cuda") == "dense"  # the block kernels run on the CPU only


@pytest.mark.real_model
@pytest.mark.skipif(not cpu_blockq.fast(), reason="needs the AVX-512 VNNI kernels")
def test_smollm2_four_bit_agrees_with_the_dequantized_model():
    name = "smollm2-135m-instruct"
    tok = runtime.load_tokenizer(name)
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Germany is")])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        q = runtime.load_model(name, dtype=torch.float32, weights="gguf")(ids, positions, None).logits
        d = runtime.load_model(name, dtype=torch.float32, weights="dense")(ids, positions, None).logits
    assert float((q.argmax(-1) == d.argmax(-1)).float().mean()) >= 0.9
    assert float((q - d).abs().max() / d.abs().max()) < 0.1


def test_a_quant_checkpoint_moves_to_the_block_kernels(tmp_path, home):
    import quant
    from runtime.qlinear import Int4Linear
    from runtime.tiny import tiny_model

    model = tiny_model("llama", seed=0)
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32), progress=False)
    quant.save_compressed(model, tmp_path / "c")
    auto = runtime.load_model(tmp_path / "c", dtype=torch.float32)
    saved = runtime.load_model(tmp_path / "c", dtype=torch.float32, weights="dense")
    assert isinstance(saved.layers[0].mlp.w13, Int4Linear)
    kind = BlockQuantLinear if cpu_blockq.fast() else Int4Linear
    assert isinstance(auto.layers[0].mlp.w13, kind)
    torch.testing.assert_close(auto.layers[0].mlp.w13.dequantize(), saved.layers[0].mlp.w13.dequantize(),
                               rtol=0, atol=1e-6)
    got, ref = _logits(auto), _logits(saved)
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05


def test_a_nan_block_scale_is_refused_on_the_four_bit_path(tiny_llama, tmp_path, home, gguf_writer):
    import gguf

    from runtime.errors import CheckpointError

    path = tmp_path / "nan.gguf"
    gguf_writer(tiny_llama, path, quantize={"blk.0.ffn_up.weight": "Q8_0"})
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    with path.open("r+b") as f:  # the first block's fp16 scale d := NaN
        f.seek(int(tensor.data_offset))
        f.write(b"\x00\x7e")
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_up\.weight' holds 1 NaN or inf block scales"):
        runtime.load_model(path, dtype=torch.float32, weights="gguf")
    with pytest.raises(CheckpointError, match="NaN or inf"):  # as the dense path always did
        runtime.load_model(path, dtype=torch.float32, weights="dense")
