"""Hand the C heap's free pages back to the operating system once planning is done.

Planning allocates and frees far more than a training step: fake-tensor analyses, trial graphs, the soundness check
and the fidelity gate's real steps. With glibc's malloc the freed blocks stay in the process's heap (its mmap
threshold grows to 32 MiB after large frees, so later tensors of that size come from the heap too), and the step
that follows ``optimize()`` then peaks above what its live tensors need: the resident set a user's out-of-memory
killer or ``ps`` sees (tools/bench/peak: the free heap column). ``malloc_trim(0)`` returns every free page of every
arena; it frees nothing in use and costs milliseconds. Elsewhere (another C library, macOS, Windows) nothing runs.

What a build leaves held after that (``ResidentGrowth``) is measured here too: a CPU budget plans for it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from typing import Any, Optional

import torch

_TRIM: Optional[Any] = None
_LOOKED = False


def _malloc_trim() -> Optional[Any]:
    global _TRIM, _LOOKED
    if not _LOOKED:
        _LOOKED = True
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _TRIM = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
            except OSError:
                _TRIM = None
            if _TRIM is not None:
                _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
    return _TRIM


def release_free_heap() -> bool:
    """glibc's ``malloc_trim(0)`` where it exists (True: it ran), else nothing (False)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def anonymous_resident_bytes() -> Optional[int]:
    """This process's anonymous resident memory (Linux ``RssAnon``: heaps and private mappings, not the pages of
    loaded libraries), None where ``/proc/self/status`` does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_autocast_cache() -> None:
    """Drop autocast's cache of cast parameters. Inside a user's ``torch.autocast`` region every leaf a model copy
    casts stays cached until the outermost region exits, also once the copy is gone: the fidelity gate's and the
    capture check's copies of the model would leave their low-precision weights there for as long as the user's
    region lasts (training, often). Values are unchanged: the next forward casts the user's weights again."""
    torch.clear_autocast_cache()


def settled_resident_bytes() -> Optional[int]:
    """``anonymous_resident_bytes`` once unreachable Python objects are collected, autocast's cache of casts
    dropped and the free heap handed back, so that what is read is held, not garbage or free pages the allocator
    kept."""
    gc.collect()
    release_autocast_cache()
    release_free_heap()
    return anonymous_resident_bytes()


class ResidentGrowth:
    """How much anonymous resident memory this process holds beyond what it held when this was made.

    A CPU budget is the process's resident memory, and a build leaves some of it held for good that no tensor
    of the step accounts for: the math library's buffer pools for the shapes the checks ran (float64 ones for the
    fidelity gate's reference), torch's fake-tensor caches, compiled graphs. A second build in the same process
    adds little (those pools and caches exist by then), so the growth of this one build is what its training steps
    run on top of. ``bytes()`` is 0 where the resident set cannot be read."""

    def __init__(self) -> None:
        self._start = settled_resident_bytes()

    def bytes(self) -> int:
        now = settled_resident_bytes()
        return 0 if now is None or self._start is None else max(0, now - self._start)
