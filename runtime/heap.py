"""Return freed heap memory to the operating system after a load (glibc's `malloc_trim`).

Loading a compressed checkpoint frees large temporaries: each INT4 weight's stored codes once it
has rebuilt them in the CPU kernel's layout, and the unpacked codes in between. glibc keeps such
freed blocks in its heap for later allocations instead of unmapping them, so without this call the
process stays that much larger than its tensors. Other C libraries return such memory themselves
or offer no call: there this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Ask the C heap to give its free pages back to the OS; whether the call exists here."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
