"""The BatchNorm backward from a K-bit x̂ code: shared by the chain (``ops.py``) and the stem's fused
max-pool (``pool.py``)."""
from __future__ import annotations

import torch

from memopt.runtime import kernels, native, triton_bn
from memopt.runtime.bitpack import unpack_bits
from memopt.stash.grid import _from_codes
from memopt.stash.stats import _per_channel, batch_slices


def gamma_invstd(weight, invstd):
    """γ / σ per channel (float32): the BN input gradient's scale (γ = 1 without an affine weight)."""
    return (weight.float() if weight is not None else torch.ones_like(invstd)) * invstd


def bn_backward(g, sum_g, x_codes, mask, grid, weight, invstd, xstd, bits: int, shape, exact=None, out=None):
    """BN input and weight gradients from the output gradient ``g`` (float32) and the x̂ code, rebuilt from
    ``grid`` (rows, the bin midpoints, or a code book: ``memopt.stash.grid.code_book``): the mean term
    (``sum_g``) and σ are exact; x̂ enters only through the variance term and the weight gradient
    sum(g x̂) (``exact``: (values, where to use them) instead). At most two full-size temporaries. The
    rebuilt x̂ is centred per channel as the true one is, so the input gradient sums to zero per channel
    exactly as stock's does (a conv bias before a training-mode BN gets no quantisation noise:
    docs/results/stash/stash_gradients*.md). ``xstd``: x̂'s std per channel, the one the forward coded with
    (``memopt.stash.stats.xhat_std``, saved: it cannot be recovered from invstd where var << eps)."""
    nd, n = len(shape), shape.numel()
    scale = gamma_invstd(weight, invstd)
    packed_mask = isinstance(mask, native.PackedMask)
    if g.dtype in (torch.float32, torch.bfloat16) and native.applies(g, x_codes) and (
            mask is None or packed_mask or mask.is_contiguous()):
        # two fused passes over the code, no full-size x̂ at all
        return native.bn_backward(x_codes, bits, shape, grid, mask, xstd, scale, g=g, sum_g=sum_g, exact=exact,
                                  out=out)[:2]
    if kernels.stash_triton(g, "BatchNorm backward from the x̂ code"):  # two launches, no full-size x̂
        return triton_bn.bn_backward(g, sum_g, x_codes, bits, shape, grid, mask, xstd, scale, exact)
    if packed_mask:
        mask = mask.unpacked(shape)
    xhat = _from_codes(unpack_bits(x_codes, bits, n).view(shape), mask, grid).mul_(_per_channel(xstd, nd))
    dims = [d for d in range(nd) if d != 1]
    xhat.sub_(_per_channel(xhat.mean(dims), nd))
    # a batch slice at a time: the product g * x̂ at full size was a third full-size temporary at the backward
    # peak (ResNet-50 at batch 32: backward temporaries are most of the step's peak, docs/results/stash/stash_memory.md)
    sum_gx = sum((g[s] * xhat[s]).sum(dims) for s in batch_slices(g))
    if exact is not None:
        sum_gx = torch.where(exact[1], exact[0], sum_gx)
    count = n // shape[1]
    grad_x = xhat.mul_(_per_channel(-sum_gx / count, nd)).add_(g).sub_(_per_channel(sum_g / count, nd)) \
        .mul_(_per_channel(scale, nd))
    return grad_x, sum_gx
