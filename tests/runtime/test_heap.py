"""runtime.heap: giving freed heap memory back to the OS."""

import ctypes.util
import sys

import pytest

from runtime.heap import release_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="malloc_trim is glibc's")
def test_release_freed_memory_runs_on_glibc():
    big = bytearray(64 << 20)
    del big
    assert release_freed_memory() is True
