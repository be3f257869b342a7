"""`specdec medusa tree`: re-measuring the heads' accuracy, restricting their guesses, rebuilding the tree."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import distill
import runtime
from distill.train_medusa import cache_hidden_states
from specdec.cli import main


def test_tree_restricts_older_heads_to_the_training_vocabulary(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "tiny")
    model = runtime.load_model(tmp_path / "tiny", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    records = [{"id": i, "prompt_ids": torch.randint(0, 128, (4,), generator=g).tolist(),
                "output_ids": torch.randint(0, 48, (20,), generator=g).tolist()} for i in range(30)]
    cache = cache_hidden_states(model, records, tmp_path / "cache", num_heads=2, dtype=torch.float32)
    distill.save_medusa(distill.attach_medusa(model, num_heads=2), tmp_path / "heads")  # full vocabulary
    argv = ["medusa", "tree", "--model", str(tmp_path / "tiny"), "--dtype", "float32",
            "--heads", str(tmp_path / "heads"), "--num-nodes", "5"]
    assert main(argv + ["--data-vocab"]) == 2
    assert "--data-vocab needs --data-dir" in capsys.readouterr().err
    assert main(argv + ["--data-dir", str(cache), "--data-vocab"]) == 0
    heads = distill.load_medusa(tmp_path / "heads", model)
    assert heads.config.guess_vocab == 48 and int(heads.vocab.max()) == 47
    assert len(heads.tree.paths) == 5 and heads.config.head_accuracy is not None
