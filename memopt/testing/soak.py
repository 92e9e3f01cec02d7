"""Long training runs of an optimized model: resident memory, leaked saved tensors and step time.

Shared by ``tools/bench/reliability/bench_soak.py`` (2000 steps, writes docs/results/reliability/soak.md) and tests/reliability/test_soak.py
(200 steps). Each step runs forward, a cross-entropy loss, backward and an SGD step on fresh random
inputs of one shape, as a training loop does. Per step it records:
- the process's resident set size (``/proc/self/statm``; ``resource`` peak RSS where there is no
  /proc), after the step's tensors are gone;
- every storage autograd packed during the forward (``saved_tensors_hooks``: memopt's codes,
  masks and statistics, and whatever the exact nodes keep), as weak references, checked after the
  step: a packed storage still alive then outlived its step (a leak);
- the step's wall time;
- optionally (``count_ops``) the ATen operators the step dispatched, forward, backward and optimizer:
  a deterministic check that no step does more work than the one before (a growing graph, hooks
  piling up), where a wall-time comparison would be at the mercy of whatever else shares the CPU.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """Resident set size of this process now (Linux), else its peak (``resource``, other Unixes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class SoakResult:
    steps: int
    warmup: int
    rss: list[int] = field(default_factory=list)  # bytes after each step
    seconds: list[float] = field(default_factory=list)  # wall time of each step
    packed: list[int] = field(default_factory=list)  # storages packed for backward in each step
    ops: list[int] = field(default_factory=list)  # ATen operators each step dispatched (count_ops=True)
    leaked: int = 0  # packed storages still alive after their step, over the run
    graphs: int = 0  # graphs the OptimizedModule captured (1: no re-capture during the run)

    def window(self) -> int:
        return max(1, min(200, (self.steps - self.warmup) // 4))

    def _ends(self, values: list, reduce) -> tuple[float, float]:
        """``reduce`` over the first window after warm-up and over the last window."""
        w = self.window()
        return reduce(values[self.warmup:self.warmup + w]), reduce(values[-w:])

    @property
    def rss_ends(self) -> tuple[float, float]:
        """Mean resident bytes over the first window after warm-up and over the last one."""
        return self._ends(self.rss, statistics.fmean)

    @property
    def time_ends(self) -> tuple[float, float]:
        """Median step seconds over the first window after warm-up and over the last one."""
        return self._ends(self.seconds, statistics.median)

    def after_warmup(self, values: list[int]) -> set[int]:
        """The distinct values of a per-step count after warm-up (one value: every step alike)."""
        return set(values[self.warmup:])

    @property
    def rss_slope(self) -> float:
        """Least-squares slope of resident bytes after warm-up, in bytes per 1000 steps."""
        ys = self.rss[self.warmup:]
        xs = range(len(ys))
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def soak(om: nn.Module, make_input: Callable[[torch.Generator], Any], classes: int, steps: int, warmup: int,
         lr: float = 0.01, seed: int = 0, count_ops: bool = False) -> SoakResult:
    """Train ``om`` (an ``OptimizedModule`` or any module) for ``steps`` steps and record each one.

    ``count_ops`` (default False) records the operators of each step in ``SoakResult.ops``; it runs
    every step under a dispatch mode, so leave it off where step times are the point.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(om.parameters(), lr=lr, momentum=0.9)
    state = {StorageWeakRef(t.untyped_storage()).cdata for t in list(om.parameters()) + list(om.buffers())}
    result = SoakResult(steps, warmup)
    refs: list[StorageWeakRef] = []  # this step's packed storages

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in state:
            refs.append(ref)
        return t

    om.train()
    for _ in range(steps):
        x = make_input(gen)
        target = torch.randint(0, classes, (x.shape[0],), generator=gen)
        counter = _OpCounter() if count_ops else contextlib.nullcontext()
        start = time.perf_counter()
        with counter:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = om(x)
            loss = F.cross_entropy(out, target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss, x
        result.seconds.append(time.perf_counter() - start)
        if count_ops:
            result.ops.append(counter.count)
        result.packed.append(len(refs))
        result.leaked += sum(not r.expired() for r in refs)
        refs.clear()  # weak storage references keep freed storages reserved: drop them every step
        result.rss.append(resident_bytes())
    gc.collect()
    result.graphs = len(getattr(om, "_memopt_built", ()))
    return result
