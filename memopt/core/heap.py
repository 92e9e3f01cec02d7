"""Hand the C heap's free pages back to the operating system once planning is done.

Planning allocates and frees far more than a training step: fake-tensor analyses, trial graphs, the soundness check
and the fidelity gate's real steps. With glibc's malloc the freed blocks stay in the process's heap (its mmap
threshold grows to 32 MiB after large frees, so later tensors of that size come from the heap too), and the step
that follows ``optimize()`` then peaks above what its live tensors need: the resident set a user's out-of-memory
killer or ``ps`` sees (tools/bench/peak: the free heap column). ``malloc_trim(0)`` returns every free page of every
arena; it frees nothing in use and costs milliseconds. Elsewhere (another C library, macOS, Windows) nothing runs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any, Optional

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
