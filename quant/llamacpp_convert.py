"""llama.cpp's own Hugging Face -> GGUF converter (`convert_hf_to_gguf.py`), run as a subprocess.

The converter (with its `conversion/` package and the `gguf-py` it ships, which knows llama.cpp's
newest architectures such as EAGLE3) comes from the source that the llama-cpp-python sdist on the
package index vendors, the same source `make llamacpp` builds the binaries from:

1. `$SPECDEC_LLAMACPP_SRC`, a llama.cpp source directory holding `convert_hf_to_gguf.py`;
2. else `make llamacpp`'s extracted sdist under `$SPECDEC_HOME/llama.cpp`;
3. else `$SPECDEC_HOME/llama.cpp/converter-VERSION`, fetched once with `pip download` (77 MB, ~15 s)
   and unpacked (only the converter's files), built atomically (runtime.catalogue.build_once).

The converter is our choice over a hand-written writer: it picks the GGUF architecture, the tensor
names and the tokenizer's pre-tokenizer exactly as llama.cpp expects them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from runtime.catalogue import build_once, cache_home, is_complete
from runtime.errors import SpecdecError
from runtime.gguf import SOURCE_FILE

LLAMACPP_VERSION = "0.3.36"  # keep equal to the Makefile's LLAMACPP_VERSION (`make llamacpp` builds this source)
CONVERTER = "convert_hf_to_gguf.py"
CONVERTER_FILES = (CONVERTER, "conversion", "gguf-py")  # what the converter imports from its own tree
SDIST_ROOT = f"llama_cpp_python-{LLAMACPP_VERSION}/vendor/llama.cpp/"
OUTTYPES = ("bf16", "f16", "f32", "q8_0")  # the converter's --outtype values specdec passes on


class ConverterError(SpecdecError, RuntimeError):
    """llama.cpp's converter could not be found, fetched or run."""


def _make_home() -> Path:
    return cache_home() / "llama.cpp" / SDIST_ROOT


def _fetched_home() -> Path:
    return cache_home() / "llama.cpp" / f"converter-{LLAMACPP_VERSION}"


def converter_dir(fetch: bool = True) -> Path:
    """The llama.cpp source directory whose converter specdec runs (see the module docstring);
    fetches it once when `fetch` and it is not here. ConverterError saying how to get it otherwise."""
    env = os.environ.get("SPECDEC_LLAMACPP_SRC")
    if env:
        path = Path(env).expanduser()
        if not (path / CONVERTER).is_file():
            raise ConverterError(f"SPECDEC_LLAMACPP_SRC={env} holds no {CONVERTER}; point it at a llama.cpp "
                                 "source directory, or unset it to let specdec fetch the converter")
        return path
    if (_make_home() / CONVERTER).is_file():
        return _make_home()
    if is_complete(_fetched_home()):
        return _fetched_home()
    if not fetch:
        raise ConverterError(f"llama.cpp's converter is not here ({_fetched_home()} does not exist): run any "
                             f"`specdec export gguf` once with the package index reachable, or `make llamacpp`")
    return build_once(_fetched_home(), _fetch_into)


def converter_available() -> bool:
    """Whether the converter is here without fetching it."""
    try:
        converter_dir(fetch=False)
    except ConverterError:
        return False
    return True


def _fetch_into(staging: Path) -> None:
    """Download the llama-cpp-python sdist and unpack the converter's files into `staging`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               "--progress-bar", "off", "-d", tmp, f"llama-cpp-python=={LLAMACPP_VERSION}"]
        print(f"fetching llama.cpp's converter: {' '.join(cmd[2:])}", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode or not sdists:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            raise ConverterError(f"could not download llama-cpp-python=={LLAMACPP_VERSION} (its sdist vendors "
                                 f"llama.cpp's converter); connect to the package index, or set "
                                 f"SPECDEC_LLAMACPP_SRC to a llama.cpp source directory.\npip said:\n{tail}")
        with tarfile.open(sdists[0]) as tar:
            members = []
            for member in tar.getmembers():
                rel = member.name[len(SDIST_ROOT):] if member.name.startswith(SDIST_ROOT) else ""
                if rel.split("/")[0] in CONVERTER_FILES and (member.isfile() or member.isdir()):
                    member.name = rel
                    members.append(member)
            tar.extractall(staging, members=members, filter="data")
    if not (staging / CONVERTER).is_file():
        raise ConverterError(f"llama-cpp-python=={LLAMACPP_VERSION}'s sdist holds no {SDIST_ROOT}{CONVERTER}")
    (staging / SOURCE_FILE).write_text(json.dumps({"source": f"llama-cpp-python=={LLAMACPP_VERSION} sdist",
                                                   "files": list(CONVERTER_FILES)}) + "\n")


def convert(model_dir: str | Path, out_file: str | Path, outtype: str = "bf16",
            target_dir: str | Path | None = None) -> Path:
    """Run llama.cpp's converter on Hugging Face directory `model_dir`, writing `out_file` with its
    float tensors as `outtype` (one of OUTTYPES); `target_dir`: the target model's directory, which an
    EAGLE-3 head's conversion reads the tokenizer and layer count from. ConverterError with the
    converter's last lines when it fails."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    src = converter_dir()
    cmd = [sys.executable, str(src / CONVERTER), str(model_dir), "--outtype", outtype, "--outfile", str(out_file)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py, not ours
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode or not Path(out_file).is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise ConverterError(f"llama.cpp's converter ({src / CONVERTER}) failed on {model_dir} "
                             f"(exit {proc.returncode}):\n{tail}")
    return Path(out_file)
