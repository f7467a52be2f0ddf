"""The C heap of the server process (glibc's malloc): how it is tuned while the model loads and
after, so that what loading frees goes back to the system instead of staying resident.

Why: glibc serves an allocation above its mmap threshold with a mapping of its own, returned to
the system when freed, and smaller ones from its heap arenas. The threshold starts at 128 KiB
and, by default, rises to the size of every mapped block freed (up to 32 MiB). Loading a GGUF
frees large buffers (the tokenizer's JSON, each tensor's bytes before repacking, a 30 MB
embedding) between the weights and objects it keeps: the threshold climbs, later buffers land in
the arenas among what is kept, and what is allocated afterwards is spread over more pages than
it needs. Measured on the default model's server: 26-28 MB less resident once ready, 40-50 MB
less at the peak of a 64-stream run, a few MB at one stream (where serving reuses those pages).

So: `while_loading` fixes the threshold at 128 KiB (large buffers mapped, returned on free);
`after_loading` trims the heaps and sets the thresholds where the default would have settled
after warming up (32 MiB, trim at 64 MiB), so a step's activations are reused from the arenas,
not mapped and faulted in again at every step. Neither does anything off glibc.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_LOADING_MMAP_THRESHOLD = 128 * 1024  # glibc's default starting value, held fixed
_SERVING_MMAP_THRESHOLD = 32 * 1024 * 1024  # the most the default threshold rises to on 64-bit
_SERVING_TRIM_THRESHOLD = 2 * _SERVING_MMAP_THRESHOLD  # as the default keeps it: twice the above


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist (glibc)
        return libc
    except (OSError, AttributeError):
        return None


def while_loading() -> bool:
    """Map large allocations from now until `after_loading`; False where this is not glibc."""
    libc = _libc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, _LOADING_MMAP_THRESHOLD))


def after_loading() -> bool:
    """Give the heaps' free pages back to the system and set the serving thresholds; False
    where this is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _SERVING_MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, _SERVING_TRIM_THRESHOLD))
