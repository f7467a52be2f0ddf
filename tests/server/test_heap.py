"""server/heap.py: while the model loads, large buffers get mappings of their own (returned to
the system when freed); once it has loaded, a step's buffers come from the heap again."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# NOTE: a fresh process each, so that no earlier allocation has moved glibc's threshold. It
# frees one 8 MiB block (which, by default, raises the mmap threshold to 8 MiB), then asks
# for a 1 MiB block and prints whether glibc mapped it on its own (IS_MMAPPED, bit 1 of the
# chunk's size word, just before the pointer).
_PROBE = textwrap.dedent("""
    import ctypes, sys
    from server import heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def mapped(size):
        p = libc.malloc(size)
        flag = bool(ctypes.c_size_t.from_address(p - 8).value & 2)
        libc.free(p)
        return int(flag)
    if sys.argv[1] in ("loading", "loaded"):
        assert heap.while_loading()
    libc.free(libc.malloc(8 << 20))
    if sys.argv[1] == "loaded":
        assert heap.after_loading()
    print(mapped(1 << 20), mapped(64 << 20))
""")


def _mapped(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])  # where `server` imports from
    return out.stdout.strip()


def test_large_buffers_are_mapped_on_their_own_only_while_loading():
    assert _mapped("default") == "0 1"  # the trap: after one large free, 1 MiB comes from a heap
    assert _mapped("loading") == "1 1"
    assert _mapped("loaded") == "0 1"  # serving: reused from the heap, not faulted in each step
