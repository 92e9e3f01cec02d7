"""Lockstep training: several optimizers, each on its own copy of one model, trained side by side.

Shared by the Shampoo training benchmarks (``bench_shampoo_training``, ``bench_shampoo_compare``).
Why lockstep: every run starts from the same initial weights and sees the same batches in the same
order, and each batch is run by every optimizer in a rotating order, so the per-step times are
measured under the same machine load (on a shared machine, load swings dwarf the differences between
separate runs). A run whose forward, backward or step raises is stopped there and reports the error
(a third-party optimizer may fail, e.g. an SVD that does not converge on a diverged statistic)
instead of ending the whole benchmark.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def train_lockstep(base: nn.Module, data, seed: int, epochs: int, batch: int,
                   makers: dict[str, Callable[[Any], torch.optim.Optimizer]]) -> dict[str, dict[str, Any]]:
    """Train a deep copy of ``base`` with each ``makers[name](model.parameters())`` on ``data`` =
    (x, y, x_test, y_test), batch order from ``seed``, dropping the last partial batch.

    Returns {name: run}; run holds "model", "opt", "losses" (mean training loss per epoch),
    "step" and "opt_step" (seconds of each training step and of its ``opt.step()``, in step order),
    "accuracy" (test accuracy in %, None if the run failed) and "error" (None, or what was raised
    and at which step).
    """
    x, y, xt, yt = data
    runs = {}
    for name, make in makers.items():
        model = copy.deepcopy(base).train()
        runs[name] = {"model": model, "opt": make(model.parameters()), "losses": [], "step": [],
                      "opt_step": [], "accuracy": None, "error": None}
    gen = torch.Generator().manual_seed(seed)
    names = list(runs)
    step = 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        epoch_loss = {name: 0.0 for name in names}
        batches = range(0, len(x) - batch + 1, batch)
        for i in batches:
            idx = order[i:i + batch]
            step += 1
            for name in names[step % len(names):] + names[:step % len(names)]:  # rotate who goes first
                run = runs[name]
                if run["error"] is not None:
                    continue
                try:
                    start = time.perf_counter()
                    loss = F.cross_entropy(run["model"](x[idx]), y[idx])
                    run["opt"].zero_grad()
                    loss.backward()
                    mid = time.perf_counter()
                    run["opt"].step()
                    end = time.perf_counter()
                except (RuntimeError, ValueError) as err:  # torch.linalg errors are RuntimeErrors
                    run["error"] = f"{type(err).__name__} at step {step}: {str(err).splitlines()[0][:120]}"
                    continue
                run["step"].append(end - start)
                run["opt_step"].append(end - mid)
                epoch_loss[name] += loss.item() / len(batches)
        for name in names:
            runs[name]["losses"].append(epoch_loss[name])
    for run in runs.values():
        if run["error"] is not None:
            continue
        run["model"].eval()
        with torch.no_grad():
            run["accuracy"] = (run["model"](xt).argmax(1) == yt).float().mean().item() * 100
    return runs
