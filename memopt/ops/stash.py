"""Exact forward with a K-bit stash for backward (Chakrabarti & Moseley, NeurIPS 2019).

A chain BatchNorm (training) -> [+ residual] -> [ReLU/ReLU6/LeakyReLU] runs in ``BNActStash``: the
forward is the original ops (same kernels, same order: bit-identical output, running statistics
updated once), and backward keeps, through ``ctx.save_for_backward``, only:
- a K-bit code of the normalised BN input x̂ (over its own standard deviation, 1 up to eps and 0 in
  a constant channel) on a fixed per-channel grid: 2^K bins over
  [-h, h] with h = WINDOWS[K] (3 at K = 4 as in the paper; x̂ has zero mean and unit variance per
  channel by construction, so no min/max reduction is needed), reconstructed at bin midpoints;
  values beyond ±h clip. Without a residual the exact 1-bit mask below is stored anyway and tells on
  which side of the activation's kink (x̂ = -β/γσ) an element lies, so the code is split there:
  2^K bins on each side, as fine as a (K+1)-bit grid for the same bytes, with h = WINDOWS[K+1]
  (ResNet-50 stem BN weight gradient at 4 bits: cosine 0.97 -> 0.99, tools/bench_stash_gradients.py);
- the activation's exact mask (1 bit) when there is no residual, or, after a residual add, a
  K-bit code of the activation input z whose zero lies exactly on a bin edge, so the ReLU mask read
  from it is exact (ReLU6 keeps its 1-bit mask too: the code does not know where it clips at 6).
  After ReLU / ReLU6 code 0 means z <= 0 (rebuilt as exactly 0) and the other 2^K - 1 bins cover
  (0, mean + WINDOWS[K+1] std]; LeakyReLU and identity keep a grid of 2h std around the mean. The
  x̂ code of a residual chain is split by that mask too, each side's window ending where its values
  end (a per-channel reduction, kept as 4 floats per channel: ``_overlap``);
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


def split_by_mask(act: str, has_residual: bool) -> bool:
    """Whether a chain's x̂ code is split by its exact activation mask. Without a residual the 1-bit mask tells
    on which side of the kink (x̂ = -β/γσ) each element lies, so each side gets its own 2^K bins and the
    code is as fine as a (K+1)-bit grid for the same bytes. With a residual (mask read from the z code) the
    sides overlap where the residual moved z across 0; each side's window ends where its values end
    (``_overlap``): after a ReLU residual (r >= 0) every z <= 0 has x̂ <= -β/γσ, so the mask-0 side is as
    fine as without a residual, and the mask-1 side, the only one the BN weight gradient reads, narrows too."""
    return act != "identity"


def positive_z_grid(act: str) -> bool:
    """Whether a residual chain codes z only on its positive side: after ReLU / ReLU6 every z <= 0 rebuilds
    as exactly 0, so one code says "z <= 0" and the other 2^K - 1 bins cover (0, top] (LeakyReLU and
    identity keep both sides: their negative z reach the consumers)."""
    return act in ("relu", "relu6")


def x_grid_half(bits: int, split: bool) -> float:
    """Half-width of the x̂ window: WINDOWS for the grid's effective bits (K + 1 when split by the mask)."""
    return WINDOWS[min(bits + 1, 8)] if split else WINDOWS[bits]


def _overlap(x, mean, invstd, xstd, mask, half: float) -> torch.Tensor:
    """Per channel (the least x̂/std where the mask is true, the largest where it is false), in [-h, h]: the
    inner ends of a residual chain's two x̂ windows (a reduction: with a residual the sides overlap by data)."""
    nd = x.dim()
    dims = [d for d in range(nd) if d != 1]
    u = (x - _per_channel(mean, nd)).float().mul_(_per_channel(invstd / xstd.clamp_min(1e-12), nd))
    lo1 = u.masked_fill(~mask, math.inf).amin(dims)
    hi0 = u.masked_fill_(mask, -math.inf).amax(dims)
    return torch.stack([lo1, hi0]).clamp_(-half, half)


def _grid(weight, bias, xstd: torch.Tensor, bits: int, act: str, split: bool,
          sides: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-channel bins of the x̂ code, in units of x̂'s std: rows (lo, width), 2^K bins from lo; when
    ``split``, rows (lo, width) for the elements whose mask is false, then for those where it is true.
    The two sides meet at τ = -β/(γσ), the kink, clamped to the window [-h, h]; ReLU6's true side ends
    where z = 6, its false side (below 0 or above 6) keeps the whole window. A channel with γσ = 0
    (or NaN statistics) keeps the whole window on both sides. ``sides`` (a residual chain, from
    ``_overlap``): the false side is [-h, its largest value], the true side [its least value, h]."""
    bins, half = 1 << bits, x_grid_half(bits, split)
    lo, hi = torch.full_like(xstd, -half), torch.full_like(xstd, half)
    if not split:
        return torch.stack([lo, (hi - lo) / bins])
    if sides is not None:
        return torch.stack([lo, (sides[1] - lo) / bins, sides[0], (hi - sides[0]) / bins])
    gamma = weight.float() if weight is not None else torch.ones_like(xstd)
    beta = bias.float() if bias is not None else torch.zeros_like(xstd)
    scale = gamma * xstd
    ok = scale.abs() > torch.finfo(torch.float32).tiny  # False for NaN too
    safe = torch.where(ok, scale, torch.ones_like(scale))
    tau = torch.where(ok, -beta / safe, lo).clamp(-half, half)
    if act == "relu6":
        tau6 = torch.where(ok, (6 - beta) / safe, hi).clamp(-half, half)
        lo1, hi1, lo0, hi0 = torch.minimum(tau, tau6), torch.maximum(tau, tau6), lo, hi
    else:
        pos = scale > 0
        lo1, hi1 = torch.where(pos, tau, lo), torch.where(pos, hi, tau)
        lo0, hi0 = torch.where(pos, lo, tau), torch.where(pos, tau, hi)
    lo1, hi1, lo0, hi0 = (torch.where(ok, v, d) for v, d in ((lo1, lo), (hi1, hi), (lo0, lo), (hi0, hi)))
    return torch.stack([lo0, (hi0 - lo0) / bins, lo1, (hi1 - lo1) / bins])


def _from_codes(codes: torch.Tensor, mask: Optional[torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    """Bin midpoints lo + (k + ½)·width, per channel (rows of ``grid`` as in ``_grid``), in one float
    buffer; with four rows each element takes its side's grid by ``mask``, a slice of the batch at a
    time (so the per-element grids never cost a full-size temporary)."""
    nd = codes.dim()
    out = codes.to(torch.float32).add_(0.5)
    if grid.shape[0] == 2:
        return out.mul_(_per_channel(grid[1], nd)).add_(_per_channel(grid[0], nd))
    lo0, w0, lo1, w1 = (_per_channel(g, nd) for g in grid)
    step = max(1, (1 << 20) // max(1, out[0].numel()))
    for i in range(0, out.shape[0], step):
        m = mask[i:i + step]
        out[i:i + step].mul_(torch.where(m, w1, w0)).add_(torch.where(m, lo1, lo0))
    return out


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


def _x_codes(x, mean, invstd, xstd, grid, mask, bins: int) -> torch.Tensor:
    """Codes of x̂ / its std (float32, as the statistics are) on ``grid``; a constant channel codes noise
    that rebuilds times 0. A split grid codes each side and keeps the side the mask says."""
    nd = x.dim()
    scale = _per_channel(invstd / xstd.clamp_min(1e-12), nd)
    tiny = torch.finfo(torch.float32).tiny

    def code(lo, width):
        return _code_((x - _per_channel(mean, nd)).mul_(scale), _per_channel(lo, nd),
                      _per_channel(width.clamp_min(tiny), nd), bins)

    if grid.shape[0] == 2:
        return code(grid[0], grid[1])
    return torch.where(mask, code(grid[2], grid[3]), code(grid[0], grid[1]))


class _Stash:
    """What a chain hands to its consumers: enough to rebuild the activation for a weight gradient."""

    @staticmethod
    def rebuild(packed: torch.Tensor, mask_packed: torch.Tensor, affine: torch.Tensor, zero_code: torch.Tensor,
                bits: int, shape: torch.Size, act: str, params: Tuple[float, ...]) -> torch.Tensor:
        """act(z) at the bin midpoints, built in place in one float buffer (backward peaks matter)."""
        codes = unpack_bits(packed, bits, shape.numel()).view(shape)
        if act == "identity":
            return _from_codes(codes, None, affine)
        mask = _decode_mask(mask_packed, codes, zero_code, shape)
        z = _from_codes(codes, mask, affine)
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
        xstd = _xhat_std(invstd, eps)
        mask = _mask(z, act, act_params)
        split = split_by_mask(act, residual is not None)
        sides = _overlap(x, mean, invstd, xstd, mask, x_grid_half(bits, True)) if split and residual is not None \
            else None
        grid = _grid(weight, bias, xstd, bits, act, split, sides)
        xgrid = grid if sides is not None else torch.zeros(0, device=x.device)  # data-dependent: kept
        x_codes = pack_bits(_x_codes(x, mean, invstd, xstd, grid, mask, bins), bits)
        gamma = weight if weight is not None else torch.ones_like(mean)
        beta = bias if bias is not None else torch.zeros_like(mean)
        empty_u8 = torch.zeros(0, dtype=torch.uint8, device=x.device)
        zero_code = torch.zeros(0, dtype=torch.int32, device=x.device)
        mask_packed = pack_bits(mask, 1) if mask is not None else empty_u8
        if residual is None:
            # consumers rebuild z = γ σ x̂ + β from the x̂ code (σ = xstd): per side lo_z = β + γσ·lo, w_z = γσ·w
            gs, b = gamma.float() * xstd, beta.float()
            affine = torch.stack([b + gs * grid[0], gs * grid[1]] + ([b + gs * grid[2], gs * grid[3]] if len(grid) == 4
                                                                     else []))
            y_codes = x_codes
        elif not need_y:  # nobody rebuilds y (e.g. it only feeds a pooling or an add): the mask is enough
            affine = torch.zeros(2, 0, device=x.device)
            y_codes = empty_u8
        else:
            dims = [d for d in range(nd) if d != 1]
            std, mu = torch.std_mean(z, dim=dims, correction=0)
            std, mu = std.float().clamp_min(torch.finfo(torch.float32).tiny), mu.float()
            if positive_z_grid(act):
                # code 0 is "z <= 0" (rebuilt as exactly 0); bins 1..2^K-1 cover (0, top], the positive part of a
                # (K+1)-bit grid over mu ± h' std (h' = WINDOWS[K+1]); ReLU6 stops at 6
                top = (mu + WINDOWS[min(bits + 1, 8)] * std).clamp_min(half * std / bins)
                zwidth = (top.clamp_max(6.0) if act == "relu6" else top) / (bins - 1)
                j = torch.ones_like(mu)
            else:
                zwidth = (2 * half / bins) * std
                # the zero of z on an edge strictly inside the window: origin = -j*w with 1 <= j <= bins-1
                j = torch.clamp(torch.round(-mu / zwidth) + bins // 2, 1, bins - 1)
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
            affine = torch.stack([origin, zwidth])
            if act != "relu6":  # the code knows the sign of z exactly (not where ReLU6 clips at 6)
                mask_packed = empty_u8
        del mask
        ctx.save_for_backward(x_codes, y_codes, mask_packed, zero_code, weight, bias, mean, invstd, xgrid)
        ctx.shape, ctx.bits, ctx.act, ctx.act_params, ctx.node, ctx.eps = x.shape, bits, act, act_params, node, eps
        ctx.has_residual, ctx.has_weight, ctx.has_bias = residual is not None, weight is not None, bias is not None
        ctx.mark_non_differentiable(y_codes, mask_packed, affine, zero_code)
        return y, y_codes, mask_packed, affine, zero_code

    @staticmethod
    def backward(ctx, grad_y, *_):
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through the stash node {ctx.node} is not "
                              f"supported; exclude it with memopt.StashConfig(deny=(...)) or set Config(stash=None)")
        x_codes, y_codes, mask_packed, zero_code, weight, bias, mean, invstd, xgrid = ctx.saved_tensors
        shape, nd = ctx.shape, len(ctx.shape)
        n = shape.numel()
        if ctx.act == "identity":
            mask = None
        else:
            codes = None if mask_packed.numel() else unpack_bits(y_codes, ctx.bits, n).view(shape)
            mask = _decode_mask(mask_packed, codes, zero_code, shape)
        grad_z = _act_backward(grad_y, mask, ctx.act, ctx.act_params)
        xstd = _xhat_std(invstd, ctx.eps)
        grid = xgrid if xgrid.numel() else _grid(weight, bias, xstd, ctx.bits, ctx.act,
                                                 split_by_mask(ctx.act, ctx.has_residual))
        # x̂ at the bin midpoints, then reused in place for grad_x: at most two full-size temporaries
        xhat = _from_codes(unpack_bits(x_codes, ctx.bits, n).view(shape), mask, grid).mul_(_per_channel(xstd, nd))
        del mask
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
