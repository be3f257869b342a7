"""runtime.outputs and runtime.atomic, the guard's edges: the modes of what a writer creates (the
umask's, not tempfile's private ones), new paths that cannot be created (under a file, in /proc),
and a failed write that leaves nothing behind. The output-directory rule itself: test_atomic.py."""

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
from runtime.outputs import OutputPathError, check_output_file, make_dirs, prepare_output_dir, write_output_dir


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


def _snapshot(root: Path) -> list[str]:
    """Every entry under `root`, files and directories (what a refused run must leave as it was)."""
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*"))


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
def test_a_path_under_a_file_is_refused_at_the_check(tmp_path, where):
    (tmp_path / "FILE").write_text("mine")
    path = where.replace("FILE", str(tmp_path / "FILE"))
    parent = "/dev/null" if where.startswith("/dev") else str(tmp_path / "FILE")
    if where.startswith("/dev") and not Path("/dev/null").exists():
        pytest.skip("no /dev/null")
    before = _snapshot(tmp_path)
    want = rf"^{re.escape(path)} cannot be created for the thing: {re.escape(parent)} is not a directory"
    with pytest.raises(OutputPathError, match=want):
        prepare_output_dir(path, "m.json", what="thing")
    with pytest.raises(OutputPathError, match=want):
        check_output_file(path, what="thing")
    with pytest.raises(OutputPathError, match=want):
        write_output_dir(path, _write, "m.json", {}, what="thing")
    assert _snapshot(tmp_path) == before


def test_a_directory_that_takes_no_new_entries_is_refused_at_the_check():
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    with pytest.raises(OutputPathError, match=r"^/proc/x cannot be created for the thing: /proc is not a writable "
                                              r"directory \(.+\); choose a path in a writable directory"):
        prepare_output_dir("/proc/x", "m.json", what="thing")
    with pytest.raises(OutputPathError, match=r"^/proc/x/y\.jsonl cannot be created for the records: /proc is not"):
        check_output_file("/proc/x/y.jsonl", what="records")


def test_a_failed_write_removes_the_directories_it_created(tmp_path):
    (tmp_path / "keep").mkdir()

    def fail(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    before = _snapshot(tmp_path)
    with pytest.raises(RuntimeError, match="disk full"):
        write_output_dir(tmp_path / "keep" / "a" / "b" / "out", fail, "m.json", {})
    assert _snapshot(tmp_path) == before  # a/b made for the output are gone again; keep stays


def test_make_dirs_returns_only_what_it_created(tmp_path):
    (tmp_path / "a").mkdir()
    assert make_dirs(tmp_path / "a" / "b" / "c") == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    assert make_dirs(tmp_path / "a" / "b") == []
