"""Kernel builds that cannot wedge (runtime.kernels.build): a failing or hanging compiler, a killed
build's lock file and a truncated library all end in the dense fallback or a rebuild, never a hang
or a crash.

Every case runs in a child process with its own SPECDEC_HOME, so this process's loaded kernels and
the user's cache are untouched. Only `test_a_truncated_library_is_rebuilt_not_loaded` compiles for
real (marked kernel_build), from a copy of the sources so that edits to them meanwhile do not matter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
KERNELS = ROOT / "runtime" / "kernels"
PROBE = ("from runtime.kernels import cpu_blockq; import json; "
         "print(json.dumps([cpu_blockq.available(), cpu_blockq.unavailable_reason()]))")


def _load(home: Path, timeout: float = 120, **env: str) -> tuple[bool, str | None, str]:
    """(available(), unavailable_reason(), stderr) of a fresh process with SPECDEC_HOME=home and `env`."""
    full = {**os.environ, "SPECDEC_HOME": str(home), **env}
    full.pop("SPECDEC_BLOCKQ_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=full, cwd=ROOT,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    available, reason = json.loads(proc.stdout.strip().splitlines()[-1])
    return available, reason, proc.stderr


def _one_warning(stderr: str) -> str:
    """The one fallback warning of a failed build (no traceback, one line)."""
    assert "Traceback" not in stderr, stderr
    warnings = [line for line in stderr.splitlines() if "kernels unavailable" in line]
    assert len(warnings) == 1, stderr
    return warnings[0]


def test_a_failing_compiler_falls_back_with_one_warning(tmp_path):
    available, reason, stderr = _load(tmp_path / "home", CXX="false")
    assert not available
    assert "C++ build of the block-quantized CPU kernels failed" in reason and "SPECDEC_BLOCKQ_KERNELS=0" in reason
    assert "build.log" in _one_warning(stderr)
    assert "building the block-quantized CPU kernels (once per machine" in stderr  # the progress line


def test_a_killed_builds_lock_file_does_not_hang_a_load(tmp_path):
    """torch's FileBaton waits forever on a `lock` file a killed build left; here it is removed under our
    flock (which died with the killed process), so the load goes on (to the failing compiler's fallback)."""
    home = tmp_path / "home"
    _load(home, CXX="false")  # makes the build directory
    (directory,) = (home / "kernels").iterdir()
    (directory / "lock").write_text("")  # what an interrupted cpp_extension build leaves
    available, reason, stderr = _load(home, timeout=60, CXX="false")
    assert not available and "C++ build" in reason
    assert not (directory / "lock").exists()
    _one_warning(stderr)


def test_a_hanging_compiler_is_stopped_at_the_time_limit(tmp_path):
    pids = tmp_path / "pids"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 600\n")
    cxx.chmod(0o755)
    start = time.monotonic()
    available, reason, stderr = _load(tmp_path / "home", timeout=60, CXX=str(cxx), SPECDEC_KERNEL_BUILD_TIMEOUT="3")
    assert time.monotonic() - start < 40
    assert not available and "took over 3 s and was stopped" in reason and "SPECDEC_KERNEL_BUILD_TIMEOUT" in reason
    _one_warning(stderr)
    for pid in pids.read_text().split():  # the compiler was killed with the build, not left running
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text(errors="ignore"):
            assert time.monotonic() < deadline, f"the hanging compiler {pid} outlived the build"
            time.sleep(0.1)


def test_a_bad_time_limit_is_named(tmp_path):
    available, reason, stderr = _load(tmp_path / "home", SPECDEC_KERNEL_BUILD_TIMEOUT="soon")
    assert not available and "SPECDEC_KERNEL_BUILD_TIMEOUT='soon' is not a positive number" in reason
    _one_warning(stderr)


BUILD = """
import sys, torch
from pathlib import Path
from runtime.kernels.build import KernelBuild, load_built
src, directory = Path(sys.argv[1]), Path(sys.argv[2])
build = KernelBuild("specdec_cpu_blockq", tuple(str(src / n) for n in ("cpu_blockq.cpp", "cpu_attention.cpp",
                    "cpu_attention_isa.cpp")), ("-O3", "-std=c++17", "-fopenmp", "-DSPECDEC_OPS=specdec_build_test"),
                    ("-fopenmp",), directory)
load_built(build)
print(torch.ops.specdec_build_test.blockq_isas())
"""


@pytest.mark.kernel_build
def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path):
    """Built once for real; a library cut short (dlopen would SIGBUS on it) fails its checksum and is
    relinked before anything loads it, even with a killed build's lock file there; an intact one is
    loaded without a build."""
    src = tmp_path / "src"
    src.mkdir()
    for path in (*KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")):
        shutil.copy(path, src)
    directory = tmp_path / "build"

    def load() -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-c", BUILD, str(src), str(directory)], capture_output=True,
                              text=True, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert int(proc.stdout.split()[-1]) & 1  # the generic path, on every CPU
        return proc

    assert "building the CPU kernels" in load().stderr
    library = directory / "specdec_cpu_blockq.so"
    size = library.stat().st_size
    assert json.loads((directory / "specdec_cpu_blockq.so.sha256").read_text())["size"] == size
    with open(library, "r+b") as f:
        f.truncate(size // 3)
    (directory / "lock").write_text("")
    assert "building the CPU kernels" in load().stderr  # rebuilt (relinked), not dlopened cut short
    assert library.stat().st_size == size and not (directory / "lock").exists()
    assert "building" not in load().stderr  # verified: loaded as it is
