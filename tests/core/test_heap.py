"""Planning hands its freed memory back (memopt/core/heap.py): glibc's malloc_trim after every plan, so the training
step after optimize() does not grow inside a heap that planning left full of free blocks."""
import ctypes.util
import sys

import pytest
import torch
from torch import nn

import memopt
import memopt.builder.optimized as optimized
from memopt.core import heap


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None,
                    reason="glibc's malloc_trim only")
def test_free_heap_goes_back_to_the_system():
    assert ctypes.util.find_library("c")
    blocks = [bytearray(64 << 10) for _ in range(1024)]  # 64 MiB of 64 KiB blocks: below the mmap threshold, heap
    del blocks[:-1]  # all freed but the last, which keeps the heap's top from shrinking by itself
    before = _resident_kib()
    assert heap.release_free_heap()
    assert _resident_kib() < before - 32 * 1024  # more than half of the freed 64 MiB left the resident set


def test_every_plan_releases_the_free_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(optimized, "release_free_heap", lambda: calls.append(1) or True)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    om = memopt.optimize(model, example_inputs=torch.randn(4, 8))
    assert calls == [1]
    om(torch.randn(2, 3, 8)).sum().backward()  # another rank: captured and planned again, released again
    assert len(calls) == 2
