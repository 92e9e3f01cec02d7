"""Exact forward with a K-bit stash for backward (Chakrabarti & Moseley, NeurIPS 2019).

A chain BatchNorm (training) -> [+ residual] -> [ReLU/ReLU6/LeakyReLU] runs in ``BNActStash``: the
forward is the original ops (same kernels, same order: bit-identical output, running statistics
updated once), and backward keeps, through ``ctx.save_for_backward``, only:
- a K-bit code of the normalised BN input x̂ (over its own standard deviation, 1 up to eps and 0 in
  a constant channel) on a fixed per-channel grid: 2^K bins over
  [-h, h] with h = WINDOWS[K] (3 at K = 4 as in the paper; x̂ has zero mean and unit variance per
  channel by construction, so no min/max reduction is needed), reconstructed at bin midpoints;
  values beyond ±h clip;
- the activation's exact mask (1 bit) when there is no residual, or, after a residual add, a
  K-bit code of the activation input z on a per-channel grid of 2h standard deviations whose zero
  lies exactly on a bin edge, so the ReLU mask read from it is exact (ReLU6 keeps its 1-bit mask
  too: the code does not know where it clips at 6);
- per-channel statistics (mean, inverse std, and the z grid) in float32.
BN backward uses x̂ only in its variance term: the mean term and σ are exact. The gradient flowing
to the previous layer is therefore exact up to that term, and errors do not compound over depth.

Consumers of the activation (conv, linear, max-pool) are rewritten to keep no copy of it: conv and
linear rebuild their input from the stash for the weight gradient only (the input gradient needs
the weight alone, so it stays exact), max-pool keeps only the window offset of each maximum
(4 bits for a 3x3 window instead of an int64 index).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from memopt.errors import MemoptError
from memopt.ops import graph_leaf
from memopt.ops.bitpack import pack_bits, unpack_bits

# Half-width of the grid in standard deviations, per K. The paper uses 3 for K = 4 and 8; we
# measured the weight-gradient error of a pre-activation ResNet-20 (tools/bench_stash_depth.py
# setup) for half-widths 2..6: best 2.0 at K=2, 3.0 at K=4, 3.5 at K=6, 4.0 at K=8 (3x less error
# than 3.0 there, where clipping dominates). K = 1, 3, 5, 7 are interpolated.
WINDOWS = {1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0, 5: 3.25, 6: 3.5, 7: 3.75, 8: 4.0}


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


def _xhat_std(invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-channel standard deviation of x̂ = (x - mean) * invstd: sqrt(var / (var + eps)). It is 1 up to
    eps, except in a (nearly) constant channel (a dead ReLU before the BN), where it is about 0. The
    code is of x̂ / std, so such a channel rebuilds as 0 instead of a bin midpoint, which gave the
    BN weight a false gradient (and, with invstd near 1/sqrt(eps), the input a large one). A variance
    below a few float32 ulps of 1 is the rounding of invstd, not a signal: it counts as 0. A channel
    with a NaN or inf has NaN statistics: its std is NaN, so its rebuilt x̂ (and its gradients) are NaN
    as in stock PyTorch, never the finite bin midpoints its NaN codes would decode to."""
    var = 1 - eps * invstd.float().square()
    return var.masked_fill(var <= 8 * torch.finfo(torch.float32).eps, 0.0).sqrt()  # NaN stays NaN


def _code_(v: torch.Tensor, origin, width, bins: int) -> torch.Tensor:
    """Bin k covers (origin + k*width, origin + (k+1)*width]; values beyond the window clip.
    Works in place on ``v`` (a float32 temporary of the caller's): forward peaks matter too."""
    return v.sub_(origin).div_(width).ceil_().sub_(1).clamp_(0, bins - 1).to(torch.uint8)


def _midpoints(codes: torch.Tensor, origin: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    return origin + (codes.to(torch.float32) + 0.5) * width


def _mask(z: torch.Tensor, act: str, params: Tuple[float, ...]) -> Optional[torch.Tensor]:
    """Where the activation passes the gradient (with slope 1), with ATen's own comparisons."""
    if act == "identity":
        return None
    if act == "relu6":
        return ~((z <= 0) | (z >= 6))
    if act == "leaky_relu":
        return z > 0
    return ~(z <= 0)


def _activation(z: torch.Tensor, act: str, params: Tuple[float, ...]) -> torch.Tensor:
    if act == "identity":
        return z
    if act == "relu6":
        return F.relu6(z)
    if act == "leaky_relu":
        return F.leaky_relu(z, params[0])
    return torch.relu(z)


def _act_backward(grad: torch.Tensor, mask: Optional[torch.Tensor], act: str, params: Tuple[float, ...]) -> torch.Tensor:
    if act == "identity":
        return grad
    low = grad * params[0] if act == "leaky_relu" else 0.0
    return torch.where(mask, grad, low)


def _decode_mask(mask_packed: torch.Tensor, codes: Optional[torch.Tensor], zero_code: torch.Tensor,
                 shape: torch.Size) -> torch.Tensor:
    """The exact activation mask: stored as 1 bit, or read from a z code whose zero is a bin edge."""
    if mask_packed.numel():
        return unpack_bits(mask_packed, 1, shape.numel()).view(shape).bool()
    return codes >= _per_channel(zero_code, len(shape))


class _Stash:
    """What a chain hands to its consumers: enough to rebuild the activation for a weight gradient."""

    @staticmethod
    def rebuild(packed: torch.Tensor, mask_packed: torch.Tensor, affine: torch.Tensor, zero_code: torch.Tensor,
                bits: int, shape: torch.Size, act: str, params: Tuple[float, ...]) -> torch.Tensor:
        """act(z) at the bin midpoints, built in place in one float buffer (backward peaks matter)."""
        n, nd = shape.numel(), len(shape)
        codes = unpack_bits(packed, bits, n).view(shape)
        if act == "identity":
            return codes.to(torch.float32).mul_(_per_channel(affine[1], nd)).add_(_per_channel(affine[0], nd))
        mask = _decode_mask(mask_packed, codes, zero_code, shape)
        z = codes.to(torch.float32).mul_(_per_channel(affine[1], nd)).add_(_per_channel(affine[0], nd))
        del codes
        # the activation of the rebuilt z, with the (exact) mask deciding which side of the kink
        if act == "relu6":
            high = z > 3
            return z.clamp_(0, 6).masked_fill_(~mask & high, 6.0).masked_fill_(~mask & ~high, 0.0)
        if act == "leaky_relu":
            return torch.where(mask, z.clamp_min(0), z.clamp_max_(0).mul_(params[0]))
        return z.clamp_min_(0).masked_fill_(~mask, 0.0)


class BNActStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, residual, momentum, eps,
                act, act_params, bits, need_y, node):
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        factor = momentum if momentum is not None else 1.0 / float(num_batches_tracked)
        out, mean, invstd, _, _ = torch.ops.aten._batch_norm_impl_index(
            x, weight, bias, running_mean, running_var, True, factor, eps, torch.backends.cudnn.enabled)
        z = out if residual is None else out + residual
        del out
        y = _activation(z, act, act_params)
        nd, bins, half = x.dim(), 1 << bits, WINDOWS[bits]
        width = 2 * half / bins
        xstd = _xhat_std(invstd, eps)
        # x̂ / its std (float32, as the stats are); a constant channel codes noise that rebuilds times 0
        xhat = (x - _per_channel(mean, nd)).mul_(_per_channel(invstd / xstd.clamp_min(1e-12), nd))
        x_codes = pack_bits(_code_(xhat, -half, width, bins), bits)
        del xhat
        gamma = weight if weight is not None else torch.ones_like(mean)
        beta = bias if bias is not None else torch.zeros_like(mean)
        mask = _mask(z, act, act_params)
        empty_u8 = torch.zeros(0, dtype=torch.uint8, device=x.device)
        zero_code = torch.zeros(0, dtype=torch.int32, device=x.device)
        mask_packed = pack_bits(mask, 1) if mask is not None else empty_u8
        if residual is None:
            # consumers rebuild z = γ x̂ + β from the x̂ code: z_k = β + γ σ(-h + (k + ½) w), σ = xstd
            affine = torch.stack([beta.float() + gamma.float() * xstd * (-half + 0.5 * width),
                                  gamma.float() * xstd * width])
            y_codes = x_codes
        elif not need_y:  # nobody rebuilds y (e.g. it only feeds a pooling or an add): the mask is enough
            affine = torch.zeros(2, 0, device=x.device)
            y_codes = empty_u8
        else:
            dims = [d for d in range(nd) if d != 1]
            std, mu = torch.std_mean(z, dim=dims, correction=0)
            zwidth = (2 * half / bins) * std.float().clamp_min(torch.finfo(torch.float32).tiny)
            # the zero of z on an edge strictly inside the window: origin = -j*w with 1 <= j <= bins-1
            j = torch.clamp(torch.round(-mu.float() / zwidth) + bins // 2, 1, bins - 1)
            origin = -j * zwidth
            positive = z > 0
            # z is our own temporary, coded in place, unless it is the output itself (no activation)
            zf = z.float() if z.dtype != torch.float32 else (z.clone() if act == "identity" else z)
            codes = _code_(zf, _per_channel(origin, nd), _per_channel(zwidth, nd), bins)
            del z, zf
            zero_code = j.to(torch.int32)
            zc = _per_channel(zero_code, nd).to(torch.uint8)
            # rounding must never flip a sign: positive z go to bins >= j, the rest below
            codes = torch.where(positive, torch.maximum(codes, zc), torch.minimum(codes, zc - 1))
            y_codes = pack_bits(codes, bits)
            affine = torch.stack([origin + 0.5 * zwidth, zwidth])
            if act != "relu6":  # the code knows the sign of z exactly (not where ReLU6 clips at 6)
                mask_packed = empty_u8
        del mask
        ctx.save_for_backward(x_codes, y_codes, mask_packed, zero_code, weight, mean, invstd)
        ctx.shape, ctx.bits, ctx.act, ctx.act_params, ctx.node, ctx.eps = x.shape, bits, act, act_params, node, eps
        ctx.has_residual, ctx.has_weight, ctx.has_bias = residual is not None, weight is not None, bias is not None
        ctx.mark_non_differentiable(y_codes, mask_packed, affine, zero_code)
        return y, y_codes, mask_packed, affine, zero_code

    @staticmethod
    def backward(ctx, grad_y, *_):
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through the stash node {ctx.node} is not "
                              f"supported; exclude it with memopt.StashConfig(deny=(...)) or set Config(stash=None)")
        x_codes, y_codes, mask_packed, zero_code, weight, mean, invstd = ctx.saved_tensors
        shape, nd, bins = ctx.shape, len(ctx.shape), 1 << ctx.bits
        n = shape.numel()
        if ctx.act == "identity":
            mask = None
        else:
            codes = None if mask_packed.numel() else unpack_bits(y_codes, ctx.bits, n).view(shape)
            mask = _decode_mask(mask_packed, codes, zero_code, shape)
        grad_z = _act_backward(grad_y, mask, ctx.act, ctx.act_params)
        del mask
        half = WINDOWS[ctx.bits]
        width = 2 * half / bins
        # x̂ at the bin midpoints, then reused in place for grad_x: at most two full-size temporaries
        xhat = unpack_bits(x_codes, ctx.bits, n).view(shape).to(torch.float32).add_(0.5).mul_(width).sub_(half) \
            .mul_(_per_channel(_xhat_std(invstd, ctx.eps), nd))
        dims = [d for d in range(nd) if d != 1]
        g = grad_z.float()
        sum_g = g.sum(dims)
        sum_gx = (g * xhat).sum(dims)
        count = n // shape[1]
        gamma = weight.float() if weight is not None else torch.ones_like(invstd)
        # BN backward: the mean term (sum_g) and σ are exact; x̂ enters only through the variance term
        grad_x = xhat.mul_(_per_channel(-sum_gx / count, nd)).add_(g).sub_(_per_channel(sum_g / count, nd)) \
            .mul_(_per_channel(gamma * invstd, nd))
        del xhat
        grad_w = sum_gx if ctx.has_weight else None
        grad_b = sum_g if ctx.has_bias else None
        grad_r = grad_z if ctx.has_residual else None
        return (grad_x.to(grad_y.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype if weight is not None else grad_y.dtype),
                None, None, None, grad_r, None, None, None, None, None, None, None)


class ConvFromStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params, stride,
                padding, dilation, groups):
        out = F.conv2d(y, weight, bias, stride, padding, dilation, groups) if y.dim() == 4 else \
            F.conv1d(y, weight, bias, stride, padding, dilation, groups)
        ctx.save_for_backward(packed, mask_packed, affine, zero_code, weight)
        ctx.meta = (y.shape, y.dtype, bits, act, act_params, stride, padding, dilation, groups, bias is not None)
        return out

    @staticmethod
    def backward(ctx, grad):
        packed, mask_packed, affine, zero_code, weight = ctx.saved_tensors
        shape, dtype, bits, act, act_params, stride, padding, dilation, groups, has_bias = ctx.meta
        y_hat = _Stash.rebuild(packed, mask_packed, affine, zero_code, bits, shape, act, act_params).to(dtype)
        grad_in, grad_w, grad_b = conv_grads(grad, y_hat, weight, stride, padding, dilation, groups, has_bias)
        return grad_in, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None, None


class LinearFromStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params):
        ctx.save_for_backward(packed, mask_packed, affine, zero_code, weight)
        ctx.meta = (y.shape, y.dtype, bits, act, act_params, bias is not None)
        return F.linear(y, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        packed, mask_packed, affine, zero_code, weight = ctx.saved_tensors
        shape, dtype, bits, act, act_params, has_bias = ctx.meta
        y_hat = _Stash.rebuild(packed, mask_packed, affine, zero_code, bits, shape, act, act_params).to(dtype)
        return (*linear_grads(grad, y_hat, weight, has_bias), None, None, None, None, None, None, None)


def conv_grads(grad, x_hat, weight, stride, padding, dilation, groups, has_bias):
    """(input, weight, bias) gradients of a conv whose input is rebuilt as ``x_hat``: the input gradient
    needs the weight only (exact), the weight gradient uses ``x_hat`` (approximate)."""
    dims = x_hat.dim() - 2
    return torch.ops.aten.convolution_backward(
        grad, x_hat, weight, [weight.shape[0]] if has_bias else None, _tuple(stride, dims),
        _tuple(padding, dims), _tuple(dilation, dims), False, [0] * dims, groups, [True, True, has_bias])


def linear_grads(grad, x_hat, weight, has_bias):
    """(input, weight, bias) gradients of ``F.linear`` with its input rebuilt as ``x_hat`` (see conv_grads)."""
    grad_in = grad.matmul(weight)
    grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x_hat.reshape(-1, x_hat.shape[-1]))
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if has_bias else None
    return grad_in, grad_w, grad_b


class MaxPoolIndices(torch.autograd.Function):
    """Max-pool that keeps only where each maximum sat inside its window: ceil(log2(kh*kw)) bits per
    output (4 bits for 3x3) instead of an int64 index. Backward rebuilds the flat indices from the
    window offsets and scatters, exactly as ATen's max-pool backward (up to float summation order)."""

    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode):
        out, indices = F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                                    return_indices=True)
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (_pair(v) for v in (kernel_size, stride or kernel_size, padding,
                                                                    dilation))
        n, c, oh, ow = out.shape
        width = x.shape[-1]
        rows = torch.arange(oh, device=x.device).view(1, 1, oh, 1) * sh - ph
        cols = torch.arange(ow, device=x.device).view(1, 1, 1, ow) * sw - pw
        offset = (torch.div(indices, width, rounding_mode="floor") - rows).div_(dh, rounding_mode="floor") * kw
        offset += (indices % width - cols).div_(dw, rounding_mode="floor")
        del indices
        bits = max(1, math.ceil(math.log2(kh * kw)))
        ctx.save_for_backward(pack_bits(offset, bits))
        ctx.meta = (x.shape, out.shape, bits, kw, sh, sw, ph, pw, dh, dw)
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        shape, out_shape, bits, kw, sh, sw, ph, pw, dh, dw = ctx.meta
        n, c, oh, ow = out_shape
        offset = unpack_bits(packed, bits, math.prod(out_shape)).view(out_shape).long()
        rows = torch.arange(oh, device=grad.device).view(1, 1, oh, 1) * sh - ph
        cols = torch.arange(ow, device=grad.device).view(1, 1, 1, ow) * sw - pw
        indices = (rows + torch.div(offset, kw, rounding_mode="floor") * dh) * shape[-1] + cols + (offset % kw) * dw
        del offset
        grad_in = torch.zeros(n, c, shape[-2] * shape[-1], dtype=grad.dtype, device=grad.device)
        grad_in.scatter_add_(2, indices.reshape(n, c, -1), grad.reshape(n, c, -1))
        return grad_in.view(shape), None, None, None, None, None


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _tuple(v, n):
    return list(v) if isinstance(v, (tuple, list)) else [v] * n


@graph_leaf
def bn_act_stash(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, momentum: Optional[float],
                 eps: float, act: str, act_params: tuple, bits: int, need_y: bool = True, node: str = ""):
    """BatchNorm (training) [+ residual] -> activation ("identity" for none) with a K-bit stash; returns
    (y, codes, mask, affine, zero_code). ``need_y=False`` when no consumer rebuilds y."""
    return BNActStash.apply(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, momentum,
                            eps, act, act_params, bits, need_y, node)


@graph_leaf
def conv_from_stash(y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params, stride, padding,
                    dilation, groups):
    return ConvFromStash.apply(y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params,
                               stride, padding, dilation, groups)


@graph_leaf
def linear_from_stash(y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params):
    return LinearFromStash.apply(y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params)


@graph_leaf
def max_pool2d_indices_only(x, kernel_size, stride, padding, dilation, ceil_mode):
    return MaxPoolIndices.apply(x, kernel_size, stride, padding, dilation, ceil_mode)
