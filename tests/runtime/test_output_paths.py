"""runtime.output_paths and runtime.atomic, the guard's edges: the modes of what a writer creates (the
umask's, not tempfile's private ones), new paths that cannot be created (under a file, in /proc),
a failed write that leaves nothing behind, and a run that fails before its first result leaving its
output path as it found it. The output-directory rule itself: test_atomic.py."""

from __future__ import annotations

import os
import re
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.atomic import apply_umask, atomic_write_text, current_umask
from runtime.output_paths import (
    OutputPathError,
    check_output_file,
    created_output,
    make_dirs,
    prepare_output_dir,
    write_output_dir,
)


@contextmanager
def umask(mask: int):
    """Run the block under process umask `mask` (set back after)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _write(tmp: Path) -> None:
    """What writers do: safetensors' save_file (which makes its file 0600), an atomic write (mkstemp's
    0600), a private subdirectory."""
    save_file({"w": torch.zeros(2)}, str(tmp / "weights.safetensors"))
    atomic_write_text(tmp / "config.json", "{}")
    (tmp / "tokenizer").mkdir(mode=0o700)
    (tmp / "tokenizer" / "vocab.json").write_text("{}")


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                       (0o027, 0o640, 0o750)])
def test_outputs_get_the_umasks_modes(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        assert current_umask() == mask
        out = write_output_dir(tmp_path / "out", _write, "m.json", {})
        atomic_write_text(tmp_path / "single.txt", "x")
    assert _mode(out) == dir_mode
    assert {str(p.relative_to(out)): _mode(p) for p in out.rglob("*")} == {
        "weights.safetensors": file_mode, "config.json": file_mode, "m.json": file_mode, "tokenizer": dir_mode,
        "tokenizer/vocab.json": file_mode}
    assert _mode(tmp_path / "single.txt") == file_mode


def test_apply_umask_opens_a_private_file_and_directory_as_far_as_the_umask_allows(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    for p in (tmp_path / "f", tmp_path / "d"):
        p.chmod(0o600 if p.is_file() else 0o700)
    with umask(0o002):
        apply_umask(tmp_path / "f")
        apply_umask(tmp_path / "d")
    assert _mode(tmp_path / "f") == 0o664 and _mode(tmp_path / "d") == 0o775


@pytest.mark.parametrize("where", ["/dev/null/x", "FILE/x", "FILE/deeper/x"])
def test_a_path_under_a_file_is_refused_at_the_check(tmp_path, where, snapshot):
    (tmp_path / "FILE").write_text("mine")
    path = where.replace("FILE", str(tmp_path / "FILE"))
    parent = "/dev/null" if where.startswith("/dev") else str(tmp_path / "FILE")
    before = snapshot(tmp_path)
    want = rf"^{re.escape(path)} cannot be created for the thing: {re.escape(parent)} is not a directory"
    with pytest.raises(OutputPathError, match=want):
        prepare_output_dir(path, "m.json", what="thing")
    with pytest.raises(OutputPathError, match=want):
        check_output_file(path, what="thing")
    with pytest.raises(OutputPathError, match=want):
        write_output_dir(path, _write, "m.json", {}, what="thing")
    assert snapshot(tmp_path) == before


def test_a_directory_that_takes_no_new_entries_is_refused_at_the_check():
    with pytest.raises(OutputPathError, match=r"^/proc/x cannot be created for the thing: /proc is not a writable "
                                              r"directory \(.+\); choose a path in a writable directory"):
        prepare_output_dir("/proc/x", "m.json", what="thing")
    with pytest.raises(OutputPathError, match=r"^/proc/x/y\.jsonl cannot be created for the records: /proc is not"):
        check_output_file("/proc/x/y.jsonl", what="records")


def test_a_failed_write_removes_the_directories_it_created(tmp_path, snapshot):
    (tmp_path / "keep").mkdir()

    def fail(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    before = snapshot(tmp_path)
    with pytest.raises(RuntimeError, match="disk full"):
        write_output_dir(tmp_path / "keep" / "a" / "b" / "out", fail, "m.json", {})
    assert snapshot(tmp_path) == before  # a/b made for the output are gone again; keep stays


def test_make_dirs_returns_only_what_it_created(tmp_path):
    (tmp_path / "a").mkdir()
    assert make_dirs(tmp_path / "a" / "b" / "c") == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    assert make_dirs(tmp_path / "a" / "b") == []


def _fail_in(out: Path, write) -> None:
    """A run in `created_output(out, own=["run.json"])` that writes `write(out)`, then fails."""
    with pytest.raises(RuntimeError, match="^first batch failed$"):
        with created_output(out, own=["run.json"]) as path:
            assert path == out and out.is_dir()
            write(out)
            raise RuntimeError("first batch failed")


def _settings(out: Path) -> None:
    (out / "run.json").write_text("{}")
    (out / "cache" / "train").mkdir(parents=True)


def test_a_run_that_fails_before_a_result_leaves_a_new_or_empty_path_as_it_was(tmp_path, snapshot):
    (tmp_path / "empty").mkdir()
    before = snapshot(tmp_path)
    _fail_in(tmp_path / "new" / "deeper" / "out", lambda out: None)  # nothing written: the new parents go too
    assert snapshot(tmp_path) == before
    for out in (tmp_path / "new" / "out", tmp_path / "empty"):  # its own files and empty folders go with it
        _fail_in(out, _settings)
        assert snapshot(tmp_path) == before
    with created_output(tmp_path / "done", own=["run.json"]) as out:  # no failure: nothing is removed
        _settings(out)
    assert list(snapshot(tmp_path / "done")) == ["cache", "cache/train", "run.json"]


def test_a_run_that_fails_after_a_result_or_in_a_used_directory_keeps_everything(tmp_path, snapshot):
    def result(out: Path) -> None:  # a checkpoint, a record: a resumed run goes on from it
        _settings(out)
        (out / "cache" / "train" / "shard_00000.safetensors").write_bytes(b"x")

    _fail_in(tmp_path / "new", result)
    assert list(snapshot(tmp_path / "new")) == ["cache", "cache/train", "cache/train/shard_00000.safetensors",
                                                 "run.json"]
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "run.json").write_text("{\"settings\": 1}")  # a run resumed: nothing of it is removed
    _fail_in(tmp_path / "used", lambda out: (out / "cache").mkdir())
    assert list(snapshot(tmp_path / "used")) == ["cache", "run.json"]
    assert (tmp_path / "used" / "run.json").read_text() == "{\"settings\": 1}"
    # someone else's file appears in the new directory: it all stays
    _fail_in(tmp_path / "other", lambda out: (_settings(out), (out / "notes.txt").write_text("keep me")))
    assert list(snapshot(tmp_path / "other")) == ["cache", "cache/train", "notes.txt", "run.json"]
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C before a result: as an error
        with created_output(tmp_path / "stopped"):
            raise KeyboardInterrupt
    assert not (tmp_path / "stopped").exists()



@pytest.mark.parametrize("path", ["", "   ", "\t"])
def test_an_empty_path_is_refused_even_in_an_empty_current_directory(tmp_path, monkeypatch, path, snapshot):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    want = r"^an empty path is not an output location for the thing; give a {} path \(nothing was written\)$"
    with pytest.raises(OutputPathError, match=want.format("directory")):
        prepare_output_dir(path, "m.json", what="thing")
    with pytest.raises(OutputPathError, match=want.format("directory")):
        write_output_dir(path, _write, "m.json", {}, what="thing")
    with pytest.raises(OutputPathError, match=want.format("file")):
        check_output_file(path, what="thing")
    assert snapshot(tmp_path) == before


def test_specdecs_own_caches_are_never_an_output_location(tmp_path, monkeypatch):
    """Every writer refuses the cache home and the caches specdec fills and checks itself (catalogue
    GGUFs and checkpoints, kernel builds, ...), a link into them included; the rest of the home (the
    recipes' compressed checkpoints) takes outputs as any directory does."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    (home / "models" / "m").mkdir(parents=True)
    (tmp_path / "link").symlink_to(home / "models")
    for path in (home, home / "models" / "m", home / "gguf-files" / "m" / "model.gguf", home / "kernels" / "k",
                 tmp_path / "link" / "new"):
        with pytest.raises(OutputPathError, match=r"inside specdec's cache .* choose a path outside it") as err:
            prepare_output_dir(path, "compression.json", overwrite=True, what="compressed checkpoint")
        assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)
        with pytest.raises(OutputPathError, match="inside specdec's cache"):
            check_output_file(path, what="recipe summary")
    assert prepare_output_dir(home / "compressed" / "x", "compression.json") == home / "compressed" / "x"
    assert check_output_file(tmp_path / "elsewhere.json") == tmp_path / "elsewhere.json"
