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


def test_every_plan_drops_autocast_s_cached_casts_of_its_copies(monkeypatch):
    # inside a user's autocast region the gate's and the check's model copies leave their cast weights in autocast's
    # cache until the region exits (126 MiB on a 4-layer Llama at bf16, docs/results/peak/largest_batch_llama_bf16.md)
    calls = []
    real = torch.clear_autocast_cache
    monkeypatch.setattr(torch, "clear_autocast_cache", lambda: calls.append(1) or real())
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        om = memopt.optimize(model, example_inputs=x)
        assert calls  # before the region exits
        expected = model(x)
        assert torch.equal(om(x), expected)  # the user's weights cast again, the same values

