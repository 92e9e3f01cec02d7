"""Step time of two modules side by side: forward + backward, interleaved step by step, so that
machine noise hits both alike. Used by ``python -m memopt bench`` and the benchmarks in tools/."""
from __future__ import annotations

import statistics
import time
from typing import Any, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memopt.cost_model.step import LossFn, compute_loss
from memopt.core.inputs import normalize_inputs


def _synchronize(args: tuple, kwargs: dict) -> None:
    # CUDA kernels run asynchronously: a step has ended only when the device has finished it
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)


def _step_seconds(module: nn.Module, args: tuple, kwargs: dict, loss_fn: Optional[LossFn]) -> float:
    module.zero_grad(set_to_none=True)
    _synchronize(args, kwargs)
    start = time.perf_counter()
    compute_loss(module(*args, **kwargs), loss_fn).backward()
    _synchronize(args, kwargs)
    return time.perf_counter() - start


def step_time_ratio(candidate: nn.Module, reference: nn.Module, example_inputs: Any, *, repeats: int = 5,
                    warmup: int = 1, loss_fn: Optional[LossFn] = None) -> Tuple[float, float]:
    """(median step time of ``candidate`` / median of ``reference``, median reference seconds).

    Each of ``repeats`` rounds times one step of each; ``warmup`` untimed steps of each come first.
    ``loss_fn`` maps the output to a scalar (default: the sum of every floating output).
    """
    args, kwargs = normalize_inputs(example_inputs)
    for _ in range(warmup):
        _step_seconds(candidate, args, kwargs, loss_fn)
        _step_seconds(reference, args, kwargs, loss_fn)
    ours: List[float] = []
    stock: List[float] = []
    for _ in range(repeats):
        ours.append(_step_seconds(candidate, args, kwargs, loss_fn))
        stock.append(_step_seconds(reference, args, kwargs, loss_fn))
    return statistics.median(ours) / statistics.median(stock), statistics.median(stock)
