"""Atomic file writes: write to a temporary file beside the target, then rename over it.

A reader (or a resumed job) sees either the old file or the complete new one, never a torn one.

`tempfile` makes its files 0600 and its directories 0700, and a rename keeps the mode: an output
built in one would stay private to its writer (a vLLM service running as another user could not
read an export). `apply_umask` gives such a file or directory the mode `open()` / `mkdir()` would
have given it, which every writer of an output applies before renaming it into place.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def current_umask() -> int:
    """The process's umask.

    Read from /proc/self/status ("Umask:", Linux 4.7+), which changes nothing. Elsewhere it is read
    the only other way there is, `os.umask`, which sets it and sets it back: the umask is
    process-wide, so a file another thread creates in that instant gets the probe value 0o077
    (private, the safe side), never a more open mode than asked for.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give file or directory `path` the mode a plain `open()` / `mkdir()` would have given it:
    0o666 & ~umask for a file, 0o777 & ~umask for a directory (not followed through a link)."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return
    base = 0o777 if stat.S_ISDIR(mode) else 0o666
    os.chmod(path, base & ~current_umask())


def atomic_write(path: str | Path, write: Callable[[str], object]) -> Path:
    """Call `write(tmp_path)` to produce the file, then move it to `path` (temp removed on error).
    The file gets the umask's mode (`apply_umask`), not tempfile's private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        apply_umask(tmp)  # after `write`, which may have replaced the file
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
