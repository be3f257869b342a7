"""save_eagle follows runtime.output_paths' rule: a new or empty directory, or a head it wrote (replaced
only with overwrite=True); a model checkpoint or another directory is refused and left untouched.
The format itself (what vLLM / speculators read): test_eagle_head.py."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import runtime
import specdec
from runtime.output_paths import OutputPathError
from runtime.tiny import tiny_pair
from specdec.drafters.eagle.io import MARKER


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", seed=0)


def _head(target, seed: int = 0) -> specdec.Eagle3Head:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return specdec.Eagle3Head(specdec.Eagle3Config.from_target(target, aux_layers=(0, 1, 1)))


def test_a_model_checkpoint_is_refused_untouched_and_still_loads(pair, tmp_path, snapshot):
    target, hf = pair
    ckpt = tmp_path / "model"
    hf.save_pretrained(ckpt)  # config.json + model.safetensors, the names a head directory uses
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match=rf"^{ckpt} is a non-empty directory that specdec did not write"):
            specdec.save_eagle(_head(target), ckpt, overwrite=overwrite)
    assert snapshot(tmp_path) == before
    runtime.load_model(ckpt, dtype=torch.float32)


def test_a_foreign_directory_and_a_file_are_refused(pair, tmp_path, snapshot):
    target = pair[0]
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match="home is a non-empty directory that specdec did not write"):
        specdec.save_eagle(_head(target), tmp_path / "home")
    with pytest.raises(OutputPathError, match="file exists and is not a directory"):
        specdec.save_eagle(_head(target), tmp_path / "file")
    with pytest.raises(OutputPathError, match=r"file/h cannot be created for the EAGLE-3 head directory: .*file is not "
                                              "a directory"):
        specdec.save_eagle(_head(target), tmp_path / "file" / "h")
    assert snapshot(tmp_path) == before


def test_a_head_is_replaced_only_with_overwrite_and_never_with_a_users_file_in_it(pair, tmp_path, snapshot):
    target = pair[0]
    out = specdec.save_eagle(_head(target, seed=0), tmp_path / "h")
    assert json.loads((out / MARKER).read_text())["files"] == ["config.json", "model.safetensors", MARKER]
    first = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=r"h already holds an EAGLE-3 head directory \(specdec_eagle.json\).*"
                                              "--overwrite"):
        specdec.save_eagle(_head(target, seed=1), out)
    assert snapshot(tmp_path) == first
    specdec.save_eagle(_head(target, seed=1), out, overwrite=True)
    loaded = specdec.load_eagle(out, target)
    assert torch.equal(loaded.fc.weight, _head(target, seed=1).fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]  # no temporaries beside it
    (out / "README.md").write_text("my notes")
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match="not part of the EAGLE-3 head directory.*README.md"):
        specdec.save_eagle(_head(target, seed=2), out, overwrite=True)
    assert snapshot(tmp_path) == before


def test_other_kinds_of_specdec_output_are_named(pair, tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "compression.json").write_text("{}")
    with pytest.raises(OutputPathError, match=r"holds a compressed checkpoint \(compression.json\), not an EAGLE-3"):
        specdec.save_eagle(_head(pair[0]), tmp_path / "c", overwrite=True)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_saved_head_is_readable_by_others_as_the_umask_allows(pair, tmp_path, mask):
    old = os.umask(mask)
    try:
        out = specdec.save_eagle(_head(pair[0]), tmp_path / "h")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o666 & ~mask}


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_speculative_tokens_must_be_a_positive_int(pair, tmp_path, bad):
    with pytest.raises(ValueError, match=rf"speculative_tokens must be an int >= 1, got {bad!r}"):
        specdec.save_eagle(_head(pair[0]), tmp_path / "h", speculative_tokens=bad)
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("bad, want", [(None, r"got None \(NoneType\)"), ("x", r"got the path or name 'x'"),
                                       (torch.nn.Linear(2, 2), r"got a Linear module")])
def test_load_eagle_names_a_target_that_is_no_model(pair, tmp_path, bad, want):
    path = specdec.save_eagle(_head(pair[0]), tmp_path / "h")
    with pytest.raises(TypeError, match=rf"^target must be .*{want}"):
        specdec.load_eagle(path, bad)


@pytest.mark.parametrize("bad", [None, "head", 3])
def test_save_eagle_names_a_head_that_is_no_eagle3_head_and_writes_nothing(tmp_path, bad):
    with pytest.raises(TypeError, match=r"^save_eagle head must be an Eagle3Head, got "):
        specdec.save_eagle(bad, tmp_path / "h")
    assert not (tmp_path / "h").exists()
