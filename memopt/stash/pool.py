"""BatchNorm (training) -> ReLU -> MaxPool2d in one Function (the ResNet stem), with the chain's K-bit stash
(``bn_act_stash(..., pool=...)``).

The max-pool routes the gradient to the maximum of each window only, so the BN weight gradient
sum(g * x̂) has terms at those winners alone, where x̂ = (pooled - β) / γ exactly (pooled > 0; a
winner with pooled = 0 has ReLU's gradient 0). The pooled output is kept anyway by its consumers
(convs that keep their input for their weight gradient: the pass fuses only then), so saving it here
costs no bytes, and the BN weight gradient becomes exact given the incoming gradient. The x̂ code (split
by the exact 1-bit ReLU mask, as in ``BNActStash``) still serves the BN input gradient's variance term,
and the window offsets (4 bits for 3x3) the scatter. Forward: the original kernels, bit-identical.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memopt.core.errors import MemoptError
from memopt.runtime import kernels, triton_stash_extras
from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.core.leaf import graph_leaf
from memopt.stash.bn import bn_backward as _bn_backward
from memopt.stash.grid import x_code
from memopt.stash.stats import _per_channel, batch_norm_train, keep_where, xhat_std


class BNReLUMaxPoolStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, bits,
                kernel_size, stride, padding, dilation, ceil_mode, node, means=False):
        out, mean, invstd, _, _ = batch_norm_train(x, weight, bias, running_mean, running_var, num_batches_tracked,
                                                   momentum, eps)
        mask = ~(out <= 0)
        y = torch.relu_(out)
        pooled, indices = F.max_pool2d(y, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                                       return_indices=True)
        del y, out
        offsets, ctx.pool = pool_offsets(x.shape, pooled, indices, kernel_size, stride, padding, dilation)
        del indices
        xstd = xhat_std(x, invstd, eps)  # saved: backward cannot recover it from invstd where var << eps
        x_codes, grid, _, _, book = x_code(x, weight, bias, mean, invstd, eps, mask, bits, "relu", True, False,
                                           means=means, xstd=xstd)
        grid = grid if book is None else book  # what backward rebuilds x̂ from: rows or the bins' means
        mask_packed = pack_bits(mask, 1)
        del mask
        ctx.save_for_backward(x_codes, mask_packed, offsets, pooled, weight, bias, invstd, xstd, grid)
        ctx.shape, ctx.bits, ctx.eps, ctx.node = x.shape, bits, eps, node
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        return pooled

    @staticmethod
    def backward(ctx, grad_pool):
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through the stash node {ctx.node} is not "
                              f"supported; exclude it with memopt.StashConfig(deny=(...)) or set Config(stash=None)")
        x_codes, mask_packed, offsets, pooled, weight, bias, invstd, xstd, grid = ctx.saved_tensors
        shape, nd = ctx.shape, len(ctx.shape)
        dims = [d for d in range(nd) if d != 1]
        mask = unpack_bits(mask_packed, 1, shape.numel()).view(shape).view(torch.bool)  # 0/1 bytes: a view, no copy
        g = keep_where(pool_backward(grad_pool, offsets, ctx.pool).float(), mask)
        sum_g = g.sum(dims)
        # exact weight gradient: the winners' x̂ from the pooled output (γ = 0: from the code, below)
        gamma = weight.float() if weight is not None else torch.ones_like(invstd)
        beta = bias.float() if bias is not None else torch.zeros_like(invstd)
        ok = gamma.abs() > torch.finfo(torch.float32).tiny
        safe = torch.where(ok, gamma, torch.ones_like(gamma))
        xw = (pooled.float() - _per_channel(beta, nd)).div_(_per_channel(safe, nd))
        sum_gx = (grad_pool.float() * xw).masked_fill_(pooled <= 0, 0.0).sum(dims)  # NaN passes, as in stock
        del xw
        # a channel with γ = 0 (a constant output: the pooled values carry no x̂) keeps the code's sum
        grad_x, sum_gx = _bn_backward(g, sum_g, x_codes, mask, grid, weight, invstd, xstd, ctx.bits, shape,
                                      (sum_gx, ok))
        del mask, g
        grad_w = sum_gx if ctx.has_weight else None
        grad_b = sum_g if ctx.has_bias else None
        return (grad_x.to(grad_pool.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype if weight is not None else grad_pool.dtype),
                None, None, None, None, None, None, None, None, None, None, None, None, None)


def pool_offsets(x_shape, out, indices, kernel_size, stride, padding, dilation):
    """Where each maximum sat inside its window, packed in ceil(log2(kh*kw)) bits, and what ``pool_indices``
    needs to rebuild ATen's flat indices from it."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (_pair(v) for v in (kernel_size, stride or kernel_size, padding,
                                                                dilation))
    bits = max(1, math.ceil(math.log2(kh * kw)))
    meta = (x_shape, out.shape, bits, kw, sh, sw, ph, pw, dh, dw)
    if kernels.stash_triton(indices, "max-pool offsets"):  # one launch, the same bytes
        return triton_stash_extras.pool_offsets(indices, meta), meta
    n, c, oh, ow = out.shape
    width = x_shape[-1]
    rows = torch.arange(oh, device=out.device).view(1, 1, oh, 1) * sh - ph
    cols = torch.arange(ow, device=out.device).view(1, 1, 1, ow) * sw - pw
    offset = (torch.div(indices, width, rounding_mode="floor") - rows).div_(dh, rounding_mode="floor") * kw
    offset += (indices % width - cols).div_(dw, rounding_mode="floor")
    return pack_bits(offset, bits), meta


def pool_indices(packed, meta, device) -> torch.Tensor:
    """ATen's flat max-pool indices (n, c, oh*ow) from ``pool_offsets``."""
    if kernels.stash_triton(packed, "max-pool offsets"):  # one launch, the same indices
        return triton_stash_extras.pool_indices(packed, meta)
    shape, out_shape, bits, kw, sh, sw, ph, pw, dh, dw = meta
    n, c, oh, ow = out_shape
    offset = unpack_bits(packed, bits, math.prod(out_shape)).view(out_shape).long()
    rows = torch.arange(oh, device=device).view(1, 1, oh, 1) * sh - ph
    cols = torch.arange(ow, device=device).view(1, 1, 1, ow) * sw - pw
    indices = (rows + torch.div(offset, kw, rounding_mode="floor") * dh) * shape[-1] + cols + (offset % kw) * dw
    return indices.reshape(n, c, -1)


def pool_backward(grad, packed, meta) -> torch.Tensor:
    """Max-pool input gradient: ``grad`` scattered to the rebuilt indices (as ATen's backward)."""
    shape = meta[0]
    n, c = shape[:2]
    grad_in = torch.zeros(n, c, shape[-2] * shape[-1], dtype=grad.dtype, device=grad.device)
    grad_in.scatter_add_(2, pool_indices(packed, meta, grad.device), grad.reshape(n, c, -1))
    return grad_in.view(shape)


class MaxPoolIndices(torch.autograd.Function):
    """Max-pool that keeps only where each maximum sat inside its window: ceil(log2(kh*kw)) bits per
    output (4 bits for 3x3) instead of an int64 index. Backward rebuilds the flat indices from the
    window offsets and scatters, exactly as ATen's max-pool backward (up to float summation order)."""

    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode):
        out, indices = F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                                    return_indices=True)
        packed, ctx.meta = pool_offsets(x.shape, out, indices, kernel_size, stride, padding, dilation)
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return pool_backward(grad, packed, ctx.meta), None, None, None, None, None


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


@graph_leaf
def max_pool2d_indices_only(x, kernel_size, stride, padding, dilation, ceil_mode):
    return MaxPoolIndices.apply(x, kernel_size, stride, padding, dilation, ceil_mode)
