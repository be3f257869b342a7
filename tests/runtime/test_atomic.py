"""runtime.atomic and runtime.output_paths: atomic writes, the output-directory rule, the output lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.atomic import atomic_write_text
from runtime.errors import SpecdecError
from runtime.output_paths import (
    LOCK,
    OutputLockedError,
    OutputPathError,
    check_output_file,
    output_lock,
    prepare_output_dir,
    write_output_dir,
)


def _write(names):
    def write(tmp):
        for name in names:
            (tmp / name).write_text(name)
    return write


def test_atomic_write_text_replaces_and_leaves_no_temporaries(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_text(tmp_path / "a.txt", "two")
    assert (tmp_path / "a.txt").read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_new_and_empty_directories_are_accepted(tmp_path):
    assert prepare_output_dir(tmp_path / "new", "m.json") == tmp_path / "new"
    assert not (tmp_path / "new").exists()  # checking creates nothing
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / LOCK).write_text("12345\n")  # a killed job's lock file does not count
    assert prepare_output_dir(tmp_path / "empty", "m.json") == tmp_path / "empty"


def test_a_file_and_a_foreign_directory_are_refused_untouched(tmp_path, snapshot):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=r"file.* is not a directory.*nothing was written") as err:
        write_output_dir(tmp_path / "file", _write(["w"]), "m.json", {}, overwrite=True)
    assert isinstance(err.value, SpecdecError) and isinstance(err.value, ValueError)
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match=r"home is a non-empty directory that specdec did not write"):
            write_output_dir(tmp_path / "home", _write(["w"]), "m.json", {}, overwrite=overwrite)
    with pytest.raises(OutputPathError, match="holds a compressed checkpoint.*not a dense export"):
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "compression.json").write_text("{}")
        prepare_output_dir(tmp_path / "ckpt", "specdec_export.json", overwrite=True, what="dense export")
    (tmp_path / "ckpt" / "compression.json").unlink()
    (tmp_path / "ckpt").rmdir()
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "home"]  # no temporaries left


def test_overwrite_replaces_only_a_previous_output_of_the_same_kind(tmp_path, snapshot):
    out = tmp_path / "out"
    write_output_dir(out, _write(["a", "b"]), "m.json", {"v": 1}, what="thing")
    assert json.loads((out / "m.json").read_text()) == {"v": 1, "files": ["a", "b", "m.json"]}
    with pytest.raises(OutputPathError, match=r"already holds a thing \(m.json\).*--overwrite"):
        write_output_dir(out, _write(["a"]), "m.json", {"v": 2}, what="thing")
    assert (out / "b").is_file()
    write_output_dir(out, _write(["a"]), "m.json", {"v": 2}, overwrite=True, what="thing")
    assert sorted(os.listdir(out)) == ["a", "m.json"]  # b was the previous output's: replaced with it
    # a file the user added is never moved or deleted: the overwrite is refused instead
    (out / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=r"not part of the thing.*notes.txt"):
        write_output_dir(out, _write(["a"]), "m.json", {"v": 3}, overwrite=True, what="thing")
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_accepts_an_output_of_the_same_kind(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.json").write_text("{}")
    assert prepare_output_dir(tmp_path / "run", ("run.json", "report.json"), resume=True) == tmp_path / "run"


def test_check_output_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputPathError, match="is a directory"):
        check_output_file(tmp_path / "d")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(OutputPathError, match="not a records file written by specdec"):
        check_output_file(tmp_path / "notes.txt", what="records file", looks_like=lambda p: False)
    assert check_output_file(tmp_path / "new.jsonl", looks_like=lambda p: False) == tmp_path / "new.jsonl"
    # a name longer than the OS allows: was OSError [Errno 36] (File name too long) from the first look-up
    with pytest.raises(OutputPathError, match=r"the GGUF file path is \d+ characters long .* \(nothing was written\)"):
        check_output_file(tmp_path / ("y" * 300 + ".gguf"), what="GGUF file")
    with pytest.raises(OutputPathError, match="the output directory path is"):
        prepare_output_dir(tmp_path / ("d" * 256), "m.json", what="output directory")


def test_output_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    (tmp_path / LOCK).write_text("999999999\n")  # left by a killed job: its flock died with it
    with output_lock(tmp_path, "eval"):
        assert (tmp_path / LOCK).read_text() == f"{os.getpid()}\n"
        with pytest.raises(OutputLockedError, match=rf"in use by another eval \(pid {os.getpid()}\)"):
            with output_lock(tmp_path, "eval"):
                pass
        code = ("import sys; from runtime.output_paths import output_lock\n"
                "try:\n    output_lock(sys.argv[1]).__enter__()\nexcept Exception as e:\n    print(e); sys.exit(3)")
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
        assert proc.returncode == 3 and f"pid {os.getpid()}" in proc.stdout
    assert not (tmp_path / LOCK).exists()
    with output_lock(tmp_path):  # released: free again
        pass


def test_a_link_to_an_empty_directory_receives_the_output_and_stays_a_link(tmp_path):
    (tmp_path / "scratch").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "scratch")
    write_output_dir(tmp_path / "out", _write(["a"]), "m.json", {})
    assert (tmp_path / "out").is_symlink() and sorted(os.listdir(tmp_path / "scratch")) == ["a", "m.json"]
    write_output_dir(tmp_path / "out", _write(["b"]), "m.json", {}, overwrite=True)
    assert (tmp_path / "out").is_symlink() and sorted(os.listdir(tmp_path / "out")) == ["b", "m.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "scratch"]


def test_a_full_disk_is_one_line_naming_the_path_and_what_to_do(tmp_path):
    import errno

    from safetensors import SafetensorError

    from runtime.atomic import disk_full_named, is_disk_full
    from runtime.errors import DiskFullError

    rust = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           'message: "No space left on device" })')
    for err in (OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"), rust):
        assert is_disk_full(err)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("writing failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)  # the cause counts
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(ValueError("28"))
    target = tmp_path / "new" / "model.gguf"
    with pytest.raises(DiskFullError) as caught:
        with disk_full_named(target, "Free disk space there.", lambda: 3_200_000_000):
            raise rust
    text = str(caught.value)
    assert "\n" not in text and isinstance(caught.value, (SpecdecError, OSError))
    assert text.startswith(f"no space left on the disk while writing {target} (it needs about 3.2 GB, ")
    assert "is free there); nothing was kept. Free disk space there." in text
    with pytest.raises(PermissionError):  # any other error passes through as it is
        with disk_full_named(target, "x"):
            raise PermissionError(errno.EACCES, "Permission denied")
