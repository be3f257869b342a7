"""Building and loading a C++ kernel library so that no build can wedge or crash a process.

`torch.utils.cpp_extension.load` alone waits forever on the `lock` file a killed build leaves in its
build directory, gives the compiler no time limit, says nothing for the minute a build takes, and
dlopens whatever library file is there (a truncated one kills the process with SIGBUS). `load_built`
wraps it:

- the build runs in a child process (`cpp_extension.load` with the same sources, flags and build
  directory), in its own process group, killed with everything it started when it passes
  `build_timeout()` seconds (SPECDEC_KERNEL_BUILD_TIMEOUT, default 900) or when the parent is
  interrupted;
- builders of one directory exclude each other by an `flock` on `specdec-build.lock` there, which
  the kernel drops when its holder dies however it ends; while holding it, torch's own `lock` file
  (only ever a killed build's leftover then) is removed;
- a line on stderr says that the kernels are being built, and another every `HEARTBEAT_S` seconds;
- the built library's size and sha256 are written beside it (`<library>.sha256`) and checked before
  every load: a library without a matching checksum is rebuilt (relinked from its objects, or built
  from scratch when that fails), never dlopened;
- every failure is a `KernelBuildError` whose one-line message names the cause and what to do
  (the caller falls back to its dense path).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.atomic import atomic_write_text, file_sha256
from runtime.errors import SpecdecError

TIMEOUT_ENV = "SPECDEC_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 900.0
HEARTBEAT_S = 10.0
LOCK_FILE = "specdec-build.lock"  # our flock; torch's FileBaton uses "lock"
LOG_FILE = "build.log"  # the last build's compiler output
TORCH_LOCK = "lock"
REMEDY = "set SPECDEC_BLOCKQ_KERNELS=0 to skip the build (the dense fallback runs either way)"

# the child: cpp_extension.load with the arguments in argv[1] (JSON), which builds if needed and loads
_CHILD = """
import json, sys
from torch.utils import cpp_extension
a = json.loads(sys.argv[1])
cpp_extension.load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_ldflags=a["ldflags"],
                   build_directory=a["directory"], is_python_module=False, verbose=False)
"""


class KernelBuildError(SpecdecError, RuntimeError):
    """A kernel library that could not be built or loaded; the message names the cause and what to do."""


class KernelBuildTimeout(KernelBuildError):
    """A build stopped at its time limit (SPECDEC_KERNEL_BUILD_TIMEOUT)."""


@dataclass(frozen=True)
class KernelBuild:
    """One library: `name` (the .so's stem), its C++ `sources`, compiler and linker flags, the build
    directory, and what progress lines call it (`what`)."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    directory: Path
    what: str = "the CPU kernels"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"KernelBuild.name must be an identifier, got {self.name!r}")
        if not self.sources or not all(isinstance(s, str) for s in self.sources):
            raise ValueError(f"KernelBuild.sources must be a non-empty tuple of paths, got {self.sources!r}")
        object.__setattr__(self, "directory", Path(self.directory))

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def checksum(self) -> Path:
        return self.directory / f"{self.name}.so.sha256"


def build_timeout() -> float:
    """Seconds a build may take: $SPECDEC_KERNEL_BUILD_TIMEOUT, default 900; KernelBuildError when it
    is not a positive number."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise KernelBuildError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it (default "
                               f"{DEFAULT_TIMEOUT_S:.0f}) or give one")
    return value


def verified(build: KernelBuild) -> bool:
    """Whether the library exists and matches the checksum written when it was built."""
    try:
        recorded = json.loads(build.checksum.read_text())
        return (isinstance(recorded, dict) and recorded.get("size") == build.library.stat().st_size
                and recorded.get("sha256") == file_sha256(build.library))
    except (OSError, ValueError):
        return False


@contextmanager
def _build_lock(build: KernelBuild, wait_s: float) -> Iterator[None]:
    """Hold the flock on the build directory's LOCK_FILE (waiting up to `wait_s` for another process
    that builds there, with a line on stderr); KernelBuildError when it is still held after that."""
    path = build.directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            if time.monotonic() > deadline:
                raise KernelBuildError(f"another process (pid {holder}) has been building {build.what} in "
                                       f"{build.directory} for over {wait_s:.0f} s; wait for it, or {REMEDY}")
            if not told:
                print(f"waiting for another process (pid {holder}) building {build.what}...", file=sys.stderr,
                      flush=True)
                told = True
            time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (the compiler, ninja) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_line(log: Path) -> str:
    """The most telling line of a failed build's log: its last error line, else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln for ln in lines if "error" in ln.lower()]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def _compile(build: KernelBuild, timeout_s: float) -> None:
    """Run the child build, with a progress line and a heartbeat on stderr; KernelBuildError on a
    failure or when it passes `timeout_s`."""
    args = {"name": build.name, "sources": list(build.sources), "cflags": list(build.cflags),
            "ldflags": list(build.ldflags), "directory": str(build.directory)}
    log = build.directory / LOG_FILE
    start = time.monotonic()
    print(f"building {build.what} (once per machine, about a minute)...", file=sys.stderr, flush=True)
    with open(log, "wb") as sink:
        try:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(args)], stdin=subprocess.DEVNULL,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            raise KernelBuildError(f"could not start the build of {build.what} ({err.strerror or err}); "
                                   f"{REMEDY}") from err
        try:
            while True:
                left = timeout_s - (time.monotonic() - start)
                if left <= 0:
                    _kill_group(proc)
                    raise KernelBuildTimeout(
                        f"building {build.what} took over {timeout_s:g} s and was stopped (is the compiler "
                        f"{os.environ.get('CXX', 'c++')} hanging?); raise {TIMEOUT_ENV} on a slow machine, or "
                        f"{REMEDY}")
                try:
                    code = proc.wait(timeout=min(HEARTBEAT_S, left))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - start >= timeout_s:
                        continue  # the limit, not a heartbeat: stopped above
                    print(f"  still building {build.what} ({time.monotonic() - start:.0f} s)...", file=sys.stderr,
                          flush=True)
        except BaseException:  # Ctrl-C, or the timeout above: nothing of the build outlives it
            if proc.returncode is None:
                _kill_group(proc)
            raise
    if code != 0:
        how = f"exit {code}" if code > 0 else f"killed by signal {-code}"
        raise KernelBuildError(f"the C++ build of {build.what} failed ({how}: {_last_line(log)}; full log "
                               f"{log}); install a working C++ compiler (set CXX to it), or {REMEDY}")
    print(f"built {build.what} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def load_built(build: KernelBuild) -> Path:
    """The library of `build`, built first when it is missing or fails its checksum, then loaded into
    this process with `torch.ops.load_library`; KernelBuildError (one line: cause and remedy) on any
    failure."""
    timeout_s = build_timeout()
    try:
        build.directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(build, wait_s=timeout_s + 60):
            if not verified(build):
                _rebuild(build, timeout_s)
            torch.ops.load_library(str(build.library))
    except OSError as err:
        raise KernelBuildError(f"{build.what} could not be built or loaded in {build.directory} "
                               f"({type(err).__name__}: {err}); {REMEDY}") from err
    except RuntimeError as err:
        if isinstance(err, KernelBuildError):
            raise
        line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise KernelBuildError(f"{build.library} did not load ({line}); delete {build.directory} to rebuild it, "
                               f"or {REMEDY}") from err
    return build.library


def _rebuild(build: KernelBuild, timeout_s: float) -> None:
    """Build the library anew (under the build lock): torch's stale lock file and the unverified
    library go first (ninja would keep a library newer than its objects, truncated or not), so ninja
    relinks it from the objects it has; when that fails (short of the time limit) and there were
    objects, once more from scratch, in case they were damaged too. The checksum is written after
    the child built and loaded the library."""
    for stale in (build.directory / TORCH_LOCK, build.checksum, build.library):
        _unlink(stale)
    objects = list(build.directory.glob("*.o"))
    try:
        _compile(build, timeout_s)
    except KernelBuildTimeout:
        raise
    except KernelBuildError:
        if not objects:
            raise
        for stale in (*build.directory.glob("*.o"), build.library):
            _unlink(stale)
        _compile(build, timeout_s)
    if not build.library.is_file():
        raise KernelBuildError(f"the build of {build.what} reported success but wrote no {build.library}; "
                               f"delete {build.directory} and try again, or {REMEDY}")
    atomic_write_text(build.checksum, json.dumps({"size": build.library.stat().st_size,
                                                  "sha256": file_sha256(build.library)}) + "\n")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
