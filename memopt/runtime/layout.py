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


def rebuilt_stride(x: torch.Tensor) -> Tuple[int, ...]:
    """The strides of a tensor rebuilt from codes packed in ``memory_order(x)``: ``x``'s own when it is dense in
    some order; contiguous when ``memory_order`` had to copy it (a slice of a fused q/k/v projection): codes of a
    copy are in logical order, and ``empty_like`` would give such a tensor a permuted dense layout instead."""
    if x.is_contiguous() or x.permute(memory_order_perm(x)).is_contiguous():
        return tuple(x.stride())
    return tuple(torch.empty(x.shape, device="meta").stride())
