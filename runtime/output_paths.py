"""Output directories: the one rule every specdec command that writes a directory follows.

specdec writes into a directory only when it is new, empty, or a specdec output of the same kind,
recognised by its marker file (`compression.json` for a compressed checkpoint, `medusa_config.json`
for Medusa heads, `run.json` / `report.json` for an evaluation run, ...):

- a path that is a file fails before any work starts, and so does a new path that cannot be
  created: one under a file (`/dev/null/x`) or in a directory that takes no new entries (`/proc/x`,
  a read-only or foreign directory);
- a non-empty directory without the marker fails: specdec never writes into it;
- a path in specdec's own caches (`runtime.catalogue.managed_cache`: the catalogue's GGUFs and
  checkpoints, kernel builds, ...) fails, whatever it holds: those files are fetched and checked by
  specdec, never replaced by an output;
- a directory with the marker fails too, unless the caller resumes it (an evaluation run, a
  training directory) or passes `overwrite=True` (`--overwrite`), which replaces that output only,
  never anything else: `write_output_dir` swaps in a new directory only when the old one holds
  nothing but the files its marker lists, so a file a user put there is never moved or deleted.

Every refusal is an `OutputPathError` (a `SpecdecError` and a `ValueError`) whose message names
the path and what to do. `output_lock` keeps two jobs out of one directory at once. What a writer
creates gets the umask's modes (runtime.atomic.apply_umask), so other users read an output as they
would a file the user made; directories a failed write created are removed again (`make_dirs`,
`remove_dirs`), and a run that fails before it wrote a result leaves its output path as it found it
(`created_output`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from runtime.args import check_path_length
from runtime.atomic import apply_umask
from runtime.catalogue import managed_cache
from runtime.errors import SpecdecError

LOCK = ".lock"  # output_lock's file; a crashed job's leftover does not make a directory "non-empty"
# marker file -> the output it marks (for messages that name what a directory holds)
KNOWN_MARKERS = {"compression.json": "compressed checkpoint", "specdec_export.json": "dense export",
                 "medusa_config.json": "Medusa heads directory", "run.json": "evaluation run",
                 "report.json": "evaluation run", "checkpoint/trainer.json": "Medusa training directory",
                 "specdec_eagle.json": "EAGLE-3 head directory",
                 "checkpoint/eagle_trainer.json": "EAGLE-3 training directory",
                 "budget.json": "recipe run directory"}
_OVERWRITE = "pass --overwrite (overwrite=True) to replace it"


class OutputPathError(SpecdecError, ValueError):
    """An output path specdec refuses to write: a file, a directory it did not write, another
    kind of output, an output it would replace without `overwrite`, or one a running job holds."""


def _a(noun: str) -> str:
    """`noun` with its indefinite article ("an evaluation run", "a dense export")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _markers(marker: str | Sequence[str]) -> tuple[str, ...]:
    return (marker,) if isinstance(marker, str) else tuple(marker)


def _entries(path: Path) -> list[str]:
    """Names in directory `path`, output_lock's file left out."""
    return sorted(n for n in os.listdir(path) if n != LOCK)


def find_marker(path: str | Path, marker: str | Sequence[str]) -> str | None:
    """The first of `marker` (names relative to `path`) that exists in `path`, or None."""
    path = Path(path)
    return next((m for m in _markers(marker) if (path / m).exists()), None)


def _check_creatable(path: Path, what: str) -> None:
    """OutputPathError unless new path `path` can be created: its nearest existing ancestor must be a
    directory that takes a new entry. That is tried (a temporary directory made and removed at once)
    rather than guessed from mode bits, which say yes to root in /proc or on a read-only mount."""
    ancestor = path.parent
    while not ancestor.exists() and not ancestor.is_symlink() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    where = f"{path} cannot be created for the {what}"
    if not ancestor.is_dir():
        raise OutputPathError(f"{where}: {ancestor} is not a directory; choose a path in a writable directory "
                              "(nothing was written)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specdec-probe-", dir=ancestor))
    except OSError as err:
        raise OutputPathError(f"{where}: {ancestor} is not a writable directory ({err.strerror}); choose a path "
                              "in a writable directory (nothing was written)") from None


def _check_not_empty(path: str | Path, what: str, kind: str) -> None:
    """OutputPathError for an empty (or blank) path, which Path() would read as the current directory;
    `kind` ("directory", "file") says what path to give instead."""
    if not str(path).strip():
        raise OutputPathError(f"an empty path is not an output location for the {what}; give a {kind} path "
                              "(nothing was written)")
    try:  # a name past NAME_MAX / PATH_MAX: every look-up of it would be OSError [Errno 36]
        check_path_length(f"the {what} path", str(path))
    except ValueError as err:
        raise OutputPathError(f"{err} (nothing was written)") from None


def _check_outside_caches(path: str | Path, what: str) -> None:
    """OutputPathError when `path` is specdec's cache home or lies in a cache it manages
    (`runtime.catalogue.managed_cache`: catalogue GGUFs and checkpoints, kernel builds, ...): no
    output may replace or go into what specdec fetched and checked itself."""
    cache = managed_cache(path)
    if cache is not None:
        raise OutputPathError(f"{path} is inside specdec's cache {cache}, which is never an output location for "
                              f"the {what}; choose a path outside it (nothing was written)")


def make_dirs(path: str | Path) -> list[Path]:
    """Create directory `path` and its missing parents; returns the directories this call created,
    outermost first (for `remove_dirs` when what was to go into them fails)."""
    missing, p = [], Path(path)
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
    return missing[::-1]


def remove_dirs(created: Sequence[Path]) -> None:
    """Remove the directories `make_dirs` created, innermost first, as long as they are empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


@contextmanager
def created_output(path: str | Path, own: Sequence[str] = ()) -> Iterator[Path]:
    """Create directory `path` (and its missing parents) for a run that writes into it, and when the
    run fails (an exception, Ctrl-C included) before it wrote a result, put `path` back as it was.

    "Before a result": `path` was new or empty and now holds nothing but the files `own` names
    (paths relative to `path` of files that mean nothing without a result, e.g. an evaluation's
    run.json) and empty directories. Those files and directories are removed, then the directories
    this call created, so a refused run leaves no trace. Anything else under `path` (a checkpoint,
    cached features, a record, a file someone else put there) keeps the whole directory as it is,
    for a resumed run to go on from; a directory that held something before the call is never
    changed. Call it after the arguments are checked (`prepare_output_dir`): it creates `path`.
    """
    path = Path(path).expanduser()
    fresh = not path.exists() or (path.is_dir() and not _entries(path))
    created = make_dirs(path)
    try:
        yield path
    except BaseException:
        if fresh:
            _remove_own(path, set(own))
            remove_dirs(created)
        raise


def _remove_own(path: Path, own: set[str]) -> None:
    """Remove the files `own` names under `path` and the directories below it, but only when that is
    everything `path` holds (a link, or any other file, leaves it all in place). Never raises: it runs
    while the run's own error propagates."""
    files, dirs = [], []
    for top, subdirs, names in os.walk(path):
        dirs += [Path(top) / d for d in subdirs]
        files += [Path(top) / n for n in names]
    if any(d.is_symlink() for d in dirs) or any(f.relative_to(path).as_posix() not in own for f in files):
        return
    try:
        for f in files:
            f.unlink()
        for d in reversed(dirs):  # os.walk lists a directory before the ones inside it
            d.rmdir()
    except OSError:  # something appeared or went meanwhile: what is left stays, and the run's own error is raised
        return


def prepare_manifest_dir(path: str | Path, manifest: str, what: str, accepts: Callable[[dict], bool],
                         refusal: str) -> Path:
    """`prepare_output_dir(path, manifest, what=what, resume=True)` for a directory marked by the JSON
    file `manifest` (a cache), which must also be one this kind of directory writes when it exists:
    `accepts(parsed manifest)`, else OutputPathError "<manifest path> <refusal>"."""
    path = prepare_output_dir(path, manifest, what=what, resume=True)
    file = path / manifest
    if file.is_file():
        try:
            data = json.loads(file.read_text())
            ok = isinstance(data, dict) and accepts(data)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise OutputPathError(f"{file} {refusal}")
    return path


def prepare_output_dir(path: str | Path, marker: str | Sequence[str], overwrite: bool = False, *,
                       what: str = "specdec output", resume: bool = False) -> Path:
    """Check that `path` may receive a `what` (whose marker file(s) are `marker`); create nothing.

    Returns `path` (user-expanded). Raises OutputPathError when `path` is empty or blank (which would
    mean the current directory), a file (or anything but a
    directory), a new path that cannot be created (`_check_creatable`), a non-empty directory
    without the marker, or, unless `resume` or `overwrite`, a directory that already holds such an
    output. Call it before any expensive work, so bad input fails at once; writers call it again
    just before they write.
    """
    _check_not_empty(path, what, "directory")
    _check_outside_caches(path, what)
    path = Path(path).expanduser()
    markers = _markers(marker)
    if not path.exists() and not path.is_symlink():
        _check_creatable(path, what)
        return path
    if not path.is_dir():
        raise OutputPathError(f"{path} exists and is not a directory; the {what} goes into a directory: choose a "
                              "new or empty directory path (nothing was written, moved or deleted)")
    if not _entries(path):
        return path
    found = find_marker(path, markers)
    if found is None:
        other = next((m for m in KNOWN_MARKERS if m not in markers and (path / m).exists()), None)
        if other is not None:
            raise OutputPathError(f"{path} holds {_a(KNOWN_MARKERS[other])} ({other}), not {_a(what)}; choose "
                                  f"another directory (--overwrite replaces only a previous {what})")
        raise OutputPathError(f"{path} is a non-empty directory that specdec did not write (it has no "
                              f"{' or '.join(markers)}); choose a new or empty directory: specdec never writes "
                              "into, replaces or deletes other files")
    if not (resume or overwrite):
        raise OutputPathError(f"{path} already holds {_a(what)} ({found}); {_OVERWRITE}, or choose another "
                              "directory")
    return path


def write_output_dir(path: str | Path, write: Callable[[Path], object], marker: str, meta: dict,
                     overwrite: bool = False, *, what: str = "specdec output") -> Path:
    """Write a directory output atomically: `write(tmp)` fills a temporary directory beside `path`,
    then the marker (JSON: `meta` plus "files", the names of what the output holds) is written
    last and the directory renamed into place. Readers see the old output or the whole new one.

    `path` follows `prepare_output_dir`'s rule. With `overwrite`, a previous output of this kind
    is replaced only when it holds nothing but the files its marker lists (or, for a marker
    without that list, the files this output writes); otherwise OutputPathError, and nothing moves.
    """
    path = prepare_output_dir(path, marker, overwrite, what=what)
    real = path.resolve() if path.is_symlink() else path  # a link to a directory: write where it points
    created = make_dirs(real.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent))
    try:
        write(tmp)
        apply_umask(tmp, recursive=True)  # mkdtemp's 0700 and save_file's 0600 would keep it from other users
        files = sorted({*os.listdir(tmp), marker})
        (tmp / marker).write_text(json.dumps({**meta, "files": files}, indent=1))
        prepare_output_dir(path, marker, overwrite, what=what)  # again: `write` may have taken minutes
        _install(tmp, real, marker, files, what)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_dirs(created)
        raise
    return path


def _owned_files(path: Path, marker: str, new_files: list[str]) -> set[str]:
    """The files of the previous output in `path`: its marker's "files" list, else the new output's."""
    try:
        listed = json.loads((path / marker).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if isinstance(listed, list) and all(isinstance(n, str) for n in listed):
        return {*listed, marker}
    return {*new_files, marker}


def _install(tmp: Path, path: Path, marker: str, files: list[str], what: str) -> None:
    if not path.exists():
        os.rename(tmp, path)
        return
    foreign = [n for n in os.listdir(path) if n not in _owned_files(path, marker, files) and n != LOCK]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputPathError(f"{path} holds files that are not part of the {what} it held ({shown}); specdec "
                              "replaces an output only when nothing else is in it: move them out, or choose another "
                              "directory (nothing was written, moved or deleted)")
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    try:
        os.rename(path, old)  # onto an empty directory: atomic on POSIX
    except OSError:
        old.rmdir()
        raise
    try:
        os.rename(tmp, path)
    except OSError:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_output_file(path: str | Path, *, what: str = "output file", looks_like: Callable[[Path], bool]
                      | None = None) -> Path:
    """Check that `path` may receive a file output: not empty or blank, not a directory, a new path that
    can be created (`_check_creatable`), and when it exists, `looks_like(path)` (a file specdec wrote,
    e.g. a jsonl it appends to). Returns `path`."""
    _check_not_empty(path, what, "file")
    _check_outside_caches(path, what)
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputPathError(f"{path} is a directory; the {what} is a file: give a file path")
    if not path.exists() and not path.is_symlink():
        _check_creatable(path, what)
    if path.exists() and looks_like is not None and path.stat().st_size and not looks_like(path):
        raise OutputPathError(f"{path} exists and is not a {what} written by specdec; choose a new file path "
                              "(specdec never appends to, truncates or replaces other files)")
    return path


class OutputLockedError(OutputPathError):
    """Another running job holds the output directory."""


@contextmanager
def output_lock(path: str | Path, what: str = "specdec job") -> Iterator[Path]:
    """Hold directory `path` (which must exist) for this process: a second `output_lock` on it, in
    this or another process, fails at once with OutputLockedError naming the holder's pid.

    The lock is an advisory `flock` on `path/.lock` (which holds the pid): the kernel drops it when
    the holder exits however it ends, so a lock file left by a killed job is simply taken over.
    The file is removed on release.
    """
    lock = Path(path) / LOCK
    fd = -1
    for _ in range(100):  # retried only when the file was replaced between open and flock
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise OutputLockedError(f"{path} is in use by another {what} (pid {holder}); wait for it to finish, "
                                    "or choose another directory") from None
        try:
            current = os.stat(lock).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # the holder removed it as we opened it: open the new one
        fd = -1
    if fd < 0:
        raise OutputLockedError(f"could not lock {lock}: it keeps being replaced")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield Path(path)
    finally:
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass
        os.close(fd)
