"""quant.calibration: windows from jsonl / datasets / code sources, the too-little-text error, ShareGPT slices."""

import itertools
import json

import pytest
import torch

import quant
from runtime.data import (
    HELDOUT_SIZE,
    base_id,
    data_home,
    heldout_start,
    python_package_texts,
    python_stdlib_texts,
    sharegpt_conversations,
)
from tests.quant.conftest import TEXTS


def test_jsonl_windows_are_contiguous_tokens_with_eos(tokenizer, tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[:50]))
    batches = quant.calibration_batches(tokenizer, str(path), n_samples=3, seq_len=16)
    assert batches.shape == (3, 16) and batches.dtype == torch.long
    expected = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert batches.flatten()[:len(expected)].tolist() == expected[:48]


def test_one_per_text_windows_start_each_text_and_skip_short_ones(tokenizer, tmp_path):
    long_texts = [" ".join(TEXTS[i:i + 8]) for i in range(0, 40, 8)]  # several windows' worth each
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in [long_texts[0], "x = 1", *long_texts[1:]]))
    batches = quant.calibration_batches(tokenizer, str(path), n_samples=3, seq_len=16, one_per_text=True)
    assert batches.shape == (3, 16)
    for row, text in zip(batches, long_texts):  # "x = 1" is shorter than a window: skipped
        assert row.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"][:16]
    with pytest.raises(ValueError, match=r"only 5 texts of >= 16 tokens \(of 6\) but 9 windows, one per text"):
        quant.calibration_batches(tokenizer, str(path), n_samples=9, seq_len=16, one_per_text=True)


def test_datasets_source_with_messages(tokenizer):
    from datasets import Dataset

    ds = Dataset.from_list([{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}]}
                            for t in TEXTS[:40]])
    batches = quant.calibration_batches(tokenizer, ds, n_samples=2, seq_len=32)
    first = tokenizer(f"user: {TEXTS[0]}\nassistant: ok", add_special_tokens=False)["input_ids"]
    assert batches.flatten()[:len(first)].tolist() == first[:64]


def test_too_little_text_is_a_clear_error(tokenizer, tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps({"text": "def f(x): return x"}))
    with pytest.raises(ValueError, match=r"holds only \d+ tokens but 4 samples x 512 tokens = 2048"):
        quant.calibration_batches(tokenizer, path, n_samples=4, seq_len=512)


def test_bad_sources(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError):
        quant.calibration_batches(tokenizer, tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match="none of the fields"):
        quant.calibration_batches(tokenizer, bad, n_samples=1, seq_len=4)
    with pytest.raises(ValueError, match="eval source"):
        quant.eval_batches(tokenizer, "wikitext")


def test_stdlib_texts_are_python_sources(tokenizer):
    texts = python_stdlib_texts(limit=3)
    assert len(texts) == 3 and all(len(t) >= 2000 for t in texts)
    assert quant.eval_batches(tokenizer, "stdlib", n_samples=2, seq_len=64).shape == (2, 64)


def test_heldout_boundary_keeps_split_conversations_together():
    ids = [f"c{i}_0" for i in range(10)] + ["long_0", "long_1", "long_2"] + [f"d{i}_0" for i in range(HELDOUT_SIZE - 1)]
    start = heldout_start(ids)  # len - HELDOUT_SIZE = 12 falls on long_2
    assert ids[start] == "long_0" and start == 10
    assert {base_id(i) for i in ids[:start]}.isdisjoint(base_id(i) for i in ids[start:])


@pytest.mark.skipif(not (data_home() / "sharegpt_v3.jsonl").is_file(), reason="ShareGPT not downloaded yet")
def test_sharegpt_calibration_and_heldout_slices_are_disjoint():
    from runtime.data import _sharegpt_dataset

    ids = _sharegpt_dataset()["id"]
    start = heldout_start(ids)
    assert {base_id(i) for i in ids[:start]}.isdisjoint(base_id(i) for i in ids[start:])
    held = sharegpt_conversations("heldout")
    assert len(held) > HELDOUT_SIZE // 2 and sharegpt_conversations("calibration", limit=5)[0] != held[0]
    assert all(t["role"] in ("user", "assistant", "system") for conv in held for t in conv)
    with pytest.raises(ValueError, match="split"):
        sharegpt_conversations("train")


def test_code_texts_are_site_packages_sources_not_the_stdlib():
    import importlib.util
    from pathlib import Path

    code = list(itertools.islice(python_package_texts(), 6))
    assert len(code) == 6 and all(len(t) >= 2000 for t in code)
    assert not set(python_stdlib_texts()).intersection(code)

    def first_file(name):
        root = Path(importlib.util.find_spec(name).submodule_search_locations[0])
        return min(p for p in root.rglob("*.py") if p.stat().st_size >= 2000).read_text()

    # round-robin across packages: file 1 of each package, then file 2 of each, ...
    first_two = list(itertools.islice(python_package_texts(("tqdm", "yaml")), 2))
    assert first_two == [first_file("tqdm"), first_file("yaml")]
    with pytest.raises(FileNotFoundError, match="none of the packages"):
        next(python_package_texts(("no_such_package_xyz",)))


def test_sharegpt_plus_code_interleaves_half_code_windows(tokenizer, monkeypatch):
    import quant.calibration as calibration

    monkeypatch.setattr(calibration, "sharegpt_conversations",
                        lambda split: [[{"role": "user", "content": t}] for t in TEXTS])
    mixed = quant.calibration_batches(tokenizer, "sharegpt+code", n_samples=5, seq_len=32)
    chat = quant.calibration_batches(tokenizer, "sharegpt", n_samples=3, seq_len=32)
    code = quant.calibration_batches(tokenizer, "code", n_samples=2, seq_len=32)
    assert mixed.shape == (5, 32)
    assert torch.equal(mixed, torch.stack([chat[0], code[0], chat[1], code[1], chat[2]]))
    with pytest.raises(ValueError, match="sharegpt\\+code"):
        quant.calibration_batches(tokenizer, 42)
