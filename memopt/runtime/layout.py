"""Memory layouts: codes are packed in a tensor's own memory order, so dense layouts are never copied."""
from __future__ import annotations

from typing import Tuple

import torch


def memory_order_perm(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``x`` from the outermost in memory to the innermost."""
    return tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d])))


def memory_order(x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """``x`` as a contiguous view in its own memory order (channels_last, transposed, ...), and the
    permutation used; codes are packed in that order, so a dense layout is never copied."""
    if x.is_contiguous():
        return x, tuple(range(x.dim()))
    perm = memory_order_perm(x)
    view = x.permute(perm)
    if view.is_contiguous():
        return view, perm
    return x.contiguous(), tuple(range(x.dim()))  # overlapping or gapped strides: one copy
