"""Atomic file writes: write to a temporary file beside the target, then rename over it.

A reader (or a resumed job) sees either the old file or the complete new one, never a torn one.

`tempfile` makes its files 0600 and its directories 0700 (and safetensors' `save_file` its files
0600), and a rename keeps the mode: an output built that way would stay private to its writer (a
vLLM service running as another user could not read an export). `apply_umask` gives such files and
directories the mode `open()` / `mkdir()` would have given them, which every writer of an output
applies before renaming it into place.

A write that runs out of disk space (ENOSPC, or safetensors' SafetensorError wrapping it) becomes one
DiskFullError line through `disk_full_named`, naming the path, the space needed when known, the space
free there and what to do.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import DiskFullError

# how an out-of-space error reads once wrapped as text: the OS's message (pip's and llama.cpp's converter's
# output), or safetensors' Rust io::Error ("IoError(Os { code: 28, kind: StorageFull, ... })")
_DISK_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|StorageFull|QuotaExceeded|"
                             r"\[Errno (28|122)\]|code: (28|122)\b")


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


def apply_umask(path: str | Path, *, recursive: bool = False) -> None:
    """Give file or directory `path` the mode a plain `open()` / `mkdir()` would have given it:
    0o666 & ~umask for a file, 0o777 & ~umask for a directory (a link is left alone, not followed).
    recursive: also everything under directory `path` (safetensors' save_file, too, writes 0600)."""
    mask = current_umask()
    paths = [Path(path)]
    if recursive:
        paths += [Path(top) / name for top, dirs, files in os.walk(path) for name in (*dirs, *files)]
    for p in paths:
        mode = os.lstat(p).st_mode
        if not stat.S_ISLNK(mode):
            os.chmod(p, (0o777 if stat.S_ISDIR(mode) else 0o666) & ~mask)


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


def file_sha256(path: str | Path) -> str:
    """The sha256 hex digest of the file at `path`, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from, is a write that ran out of disk space: an
    OSError ENOSPC / EDQUOT, or an error whose message carries one (safetensors' SafetensorError,
    a failed pip or converter run quoting its output)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if _DISK_FULL_TEXT.search(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system of `path` (its nearest existing ancestor), None if unknown."""
    for place in (path, *path.parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


@contextmanager
def disk_full_named(path: str | Path, remedy: str, needed: Callable[[], int | None] | None = None) -> Iterator[None]:
    """Turn running out of disk space inside the block (`is_disk_full`) into one DiskFullError naming
    `path`, the space needed (`needed()`, when given and it can tell), the space free there and `remedy`.
    The block must leave nothing partial behind (the writers here write atomically)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        path = Path(path)
        try:
            need = needed() if needed is not None else None
        except Exception:  # an estimate only: the error is the full disk
            need = None
        free = _free_bytes(path)
        sizes = ", ".join(part for part in (f"it needs about {_size(need)}" if need else "",
                                            f"{_size(free)} is free there" if free is not None else "") if part)
        raise DiskFullError(f"no space left on the disk while writing {path}{f' ({sizes})' if sizes else ''}; "
                            f"nothing was kept. {remedy}") from err
