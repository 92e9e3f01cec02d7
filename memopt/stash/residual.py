"""A chain's residual sum laid out as the graph's add lays it out (``residual_sum``; issue 39, timm iFormer)."""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype


@functools.lru_cache(maxsize=1024)
def _sum_layout(first: tuple, second: tuple, in_place: bool) -> tuple:
    """(shape, strides, dtype) of ``first + second`` (``first.add_(second)`` when ``in_place``) for operands of
    these (shape, strides, dtype), as the add's own structured meta function computes them: the same
    TensorIterator code that lays out the output on every device. Run on meta tensors outside any dispatch mode
    (the cost model's fake tensors, the storage trackers): no data, nothing allocated that a tracker would count."""
    with _disable_current_modes():
        a, b = (torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in
                (first, second))
        return _meta(a.add_(b) if in_place else a + b)


def residual_sum(out: torch.Tensor, residual: torch.Tensor, residual_first: bool, in_place: bool) -> torch.Tensor:
    """z, the residual add of a chain's BatchNorm output ``out`` (ours: it may be overwritten) and ``residual``,
    with the values, shape, dtype and strides of the graph's add (operands in the graph's order; ``in_place``:
    the graph added into its first operand).

    The values of a float add do not depend on the operands' order or layout, but the layout of the sum does:
    TensorIterator lays an out-of-place output out like its first operand where the operands' layouts differ,
    and the layout then decides the reduction order of every BatchNorm downstream, whose batch statistics and
    running buffers differ in the last bits between a channels-last and a contiguous input. Issue 39: in timm's
    iFormer the attention's projection conv gives a channels-last BN output at 4x4, added to a contiguous
    residual as ``x + bn(...)`` (a contiguous sum in eager); ``out.add_(residual)`` kept it channels-last, and
    the next block's BatchNorms (1x1 conv-BN-GELU-1x1 conv-BN) computed their statistics in another order.

    So ``out`` is overwritten (one full-size tensor fewer at the forward peak) only where the graph's add gives
    exactly out's shape, strides and dtype (the common case: both operands of one layout); else z is a new
    tensor laid out as the graph's add lays it out, the sum computed by the same add."""
    first, second = (residual, out) if residual_first else (out, residual)
    key = (_meta(first), _meta(second), in_place)
    try:
        want = _sum_layout(*key)
    except TypeError:  # symbolic sizes: not hashable, laid out afresh
        want = _sum_layout.__wrapped__(*key)
    if want == _meta(out):
        return out.add_(residual)
    if not in_place:
        return first + second
    shape, stride, dtype = want
    return torch.add(first, second, out=torch.empty_strided(shape, stride, dtype=dtype, device=out.device))


def owned_gradient(grad: torch.Tensor) -> bool:
    """Whether autograd handed ``grad`` to this backward alone, so it may be written over: one reference to the
    tensor and none but it (and the probe's own) to its storage, contiguous, not a view. A gradient the user
    passed to ``backward``, one ``retain_grad`` keeps or one an ``add`` hands to both its inputs fails it."""
    try:
        return grad._use_count() == 1 and grad._base is None and grad.is_contiguous() and \
            torch._C._storage_Use_Count(grad.untyped_storage()._cdata) == 2
    except (AttributeError, RuntimeError):  # a torch without the counts, or a tensor without a storage
        return False
