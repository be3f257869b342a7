"""The runtime's one C++ extension: its sources, its build and load, and its op namespace.

`cpu_blockq.cpp` (block-quantized linears: `runtime.kernels.cpu_blockq`), `cpu_attention.cpp` and
`cpu_attention_isa.cpp` (the compiled step's cache attention and the row-invariant attention:
`runtime.kernels.cpu_attention`) and `cpu_argmax.cpp` (the greedy token choice:
`runtime.kernels.cpu_argmax`) are compiled together, once per machine, with the host's C++
compiler through `torch.utils.cpp_extension` (`runtime.kernels.build`: a child process with a time
limit and progress lines) into `$SPECDEC_HOME/kernels/cpu_blockq-<hash>-<checkout>`; later processes
load the cached library. Its ops register in the namespace `NAMESPACE` (`specdec_cpu_<hash of the
sources>`: a torch.compile cache never replays a graph made for another version of the ops).

A process whose compiler is missing or fails gets `available() == False` with the reason in
`unavailable_reason()` (one warning); the callers then run their PyTorch paths.
SPECDEC_BLOCKQ_KERNELS=0 turns the extension off without a build.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from runtime.catalogue import cache_home
from runtime.errors import CacheHomeError
from runtime.kernels.build import KernelBuild, KernelBuildError, load_built

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "cpu_blockq.cpp", "cpu_attention.cpp", "cpu_attention_isa.cpp", "cpu_argmax.cpp"))
# part of the build's hash
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_attention_rows.h", "cpu_widen.h"))
OFF_ENV = "SPECDEC_BLOCKQ_KERNELS"  # "0": no build, every caller takes its PyTorch path
# library and build-directory stem: the names of the first build (of the block-quantized kernels alone),
# kept so that libraries already built stay valid
LIBRARY = "specdec_cpu_blockq"
LANES = 16  # output channels per storage block of the block-quantized layout (blockq_mm's output shape)
_CFLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp"]  # -fopenmp: at::parallel_for runs threads only with it

log = logging.getLogger(__name__)


def _key() -> str:
    sources = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(sources + torch.__version__.encode() + " ".join(_CFLAGS).encode()).hexdigest()


# the op namespace of this version of the kernels (see the module docstring)
NAMESPACE = f"specdec_cpu_{_key()[:12]}"


def ops():
    """`torch.ops.<NAMESPACE>`: blockq_mm, blockq_isas, read_probe, cache_attention, attention_rows,
    argmax_rows (after `available()`)."""
    return getattr(torch.ops, NAMESPACE)


@functools.cache
def _load() -> str | None:
    """Build (once per machine) and load the extension; None when loaded, else why it is not.

    The build runs in a child process under a lock that dies with its holder, with a time limit and
    progress lines, and the library is checked against its checksum before it is loaded
    (`runtime.kernels.build`); any failure is the PyTorch fallback with one warning."""
    # the checkout's path in the name too: ninja rebuilds when a source's path changes, so two
    # checkouts on one machine would otherwise rebuild each other's library
    where = hashlib.sha256(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    try:
        build = KernelBuild(LIBRARY, tuple(str(p) for p in SOURCES),
                            (*_CFLAGS, f"-DSPECDEC_OPS={NAMESPACE}"), ("-fopenmp",),
                            cache_home() / "kernels" / f"cpu_blockq-{_key()[:16]}-{where}",
                            what="the block-quantized CPU kernels")
        load_built(build)
        if not hasattr(ops(), "blockq_mm"):
            # built from sources edited while it built (its ops carry another namespace): the next process
            # rebuilds it; a library this process loaded cannot be replaced in it
            build.checksum.unlink(missing_ok=True)
            raise KernelBuildError(f"{build.library} holds kernels of other sources than these (edited during its "
                                   "build); the next process rebuilds it")
    except (KernelBuildError, CacheHomeError) as err:
        reason = str(err)
        log.warning("block-quantized CPU kernels unavailable, using the dense fallback: %s", reason)
        return reason
    torch.library.register_fake(f"{NAMESPACE}::blockq_mm")(_blockq_mm_fake)
    torch.library.register_fake(f"{NAMESPACE}::cache_attention")(_cache_attention_fake)
    torch.library.register_fake(f"{NAMESPACE}::attention_rows")(_attention_rows_fake)
    return None


# the ops' results as torch.compile traces them (shape and dtype only)
def _blockq_mm_fake(x, codes, sc, mc, d, dm, bias, bits, group, super, zero=0.0, isa=0, amx_min_rows=0):
    width = LANES if bits == 8 else 2 * LANES  # output channels per block of codes (runtime.blockq.block_width)
    return x.new_empty((*x.shape[:-1], codes.shape[0] * width))


def _cache_attention_fake(q, k, v, k_cache, v_cache, layer, prefix_lens, window, block_mask, invariant=False,
                          block_table=None):
    return q.new_empty(q.shape)


def _attention_rows_fake(q, keys, values, mask, prefix_lens, window, block_table=None, num_keys=0):
    return q.new_empty(q.shape)


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the extension loads on this machine (x86-64 Linux with a C++ compiler; built on the
    first call); SPECDEC_BLOCKQ_KERNELS=0 turns it off. (A constant to `torch.compile`: decided
    before tracing.)"""
    if os.environ.get(OFF_ENV, "1") == "0":
        return False
    return _load() is None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    if os.environ.get(OFF_ENV, "1") == "0":
        return f"{OFF_ENV}=0"
    return _load()
