"""Exact forward with a K-bit stash for backward (Chakrabarti & Moseley, NeurIPS 2019).

A chain BatchNorm (training) -> [+ residual] -> [ReLU/ReLU6/LeakyReLU] runs in ``BNActStash``: the
forward is the original ops (same kernels, same order: bit-identical output, running statistics
updated once), and backward keeps, through ``ctx.save_for_backward``, only:
- a K-bit code of the normalised BN input x̂ (over its own standard deviation, 1 up to eps and 0 in
  a constant channel) on a fixed per-channel grid: 2^K bins over
  [-h, h] with h = WINDOWS[K] (3 at K = 4 as in the paper; x̂ has zero mean and unit variance per
  channel by construction, so no min/max reduction is needed), reconstructed at bin midpoints (at K <= 4
  at the mean of the values each bin coded: ``stash_grid.MEAN_BITS``, ``StashConfig.bin_means``);
  values beyond ±h clip. Without a residual the exact 1-bit mask below is stored anyway and tells on
  which side of the activation's kink (x̂ = -β/γσ) an element lies, so the code is split there:
  2^K bins on each side, as fine as a (K+1)-bit grid for the same bytes, with h = WINDOWS[K+1]
  (ResNet-50 stem BN weight gradient at 4 bits: cosine 0.97 -> 0.99, tools/bench/stash/bench_stash_gradients.py);
- the activation's exact mask (1 bit) when there is no residual, or, after a residual add, a
  K-bit code of the activation input z whose zero lies exactly on a bin edge, so the ReLU mask read
  from it is exact (ReLU6 keeps its 1-bit mask too: the code does not know where it clips at 6).
  After ReLU / ReLU6 code 0 means z <= 0 (rebuilt as exactly 0) and the other 2^K - 1 bins cover
  (0, mean + WINDOWS[K+1] std]; LeakyReLU and identity keep a grid of 2h std around the mean. The
  x̂ code of a residual chain is split by that mask too, each side's window ending where its values
  end. In every split code each side's outer end is also where its values end when that is inside
  ±h (finer bins; a per-channel reduction, ``_ends``, kept as 4 floats per channel). At K = 8 the
  outer ends (and a one-window grid's edges, and the top of a z code) also follow the data out past
  the window, at most 4 times as far, at K = 4 twice as far where the data end beyond 1.3 windows
  (``stash_grid.REACH``, ``REACH_PAST``: trained activations grow tails the window would clip);
- when the residual is itself a training-mode BatchNorm's output (a ResNet downsample), that BN runs
  in the same Function (``x2`` ...): its gradient is the chain's, zero wherever the mask is 0, so its
  x̂ code is split by the same exact mask (the weight gradient reads only the mask-1 side), instead of
  one grid over ±WINDOWS[K] in a separate chain (ResNet-50 downsample BN weights at 4 bits: see
  docs/results/stash/stash_gradients.md);
- per-channel statistics (mean, inverse std, and the z grid) in float32.
BN backward uses x̂ only in its variance term: the mean term and σ are exact. The gradient flowing
to the previous layer is therefore exact up to that term, and errors do not compound over depth. The
rebuilt x̂ is centred per channel (the true one has zero mean), so that input gradient sums to zero per
channel as stock's does. A stem BN -> ReLU -> max-pool runs in ``memopt/stash/pool.py`` instead,
whose BN weight gradient is exact from the pooled output.

Consumers of the activation (conv, linear, max-pool) are rewritten to keep no copy of it: conv and
linear rebuild their input from the stash for the weight gradient only (the input gradient needs
the weight alone, so it stays exact), max-pool keeps only the window offset of each maximum
(4 bits for a 3x3 window instead of an int64 index).
The grids and codecs live in ``memopt/stash/grid.py``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from memopt.core.errors import MemoptError
from memopt.core.leaf import graph_leaf, spec_of
from memopt.runtime import kernels, native, triton_bn, triton_stash
from memopt.runtime.bitpack import pack_bits
from memopt.stash.grads import Rows, conv_grads, linear_grads
from memopt.stash.bn import bn_backward as _bn_backward, gamma_invstd as _gamma_invstd
from memopt.stash.pool import BNReLUMaxPoolStash
from memopt.stash.residual import owned_gradient, residual_sum
from memopt.stash.identity import link_term, solve_rows, solved_weight_grad
from memopt.stash.grid import (MEAN_STRIDE, REACH, WINDOWS, _act_backward, _activation, _code_, _grid, _mask,
                               add_bin_sums, code_book, exact_mask, new_bin_sums, plain_rebuild, wants_means, x_code,
                               x_grid_half, x_grid_past, x_grid_reach)
from memopt.stash.stats import _per_channel, batch_norm_train, batch_slices, channel_std_mean, select_u8, xhat_std

__all__ = ["WINDOWS", "BNActStash", "ChainSpec", "FromStashSpec", "bn_act_stash", "conv_from_stash", "conv_grads",
           "linear_from_stash", "linear_grads", "positive_z_grid", "split_by_mask", "x_grid_half"]


def split_by_mask(act: str, has_residual: bool) -> bool:
    """Whether a chain's x̂ code is split by its exact activation mask. Without a residual the 1-bit mask tells
    on which side of the kink (x̂ = -β/γσ) each element lies, so each side gets its own 2^K bins and the
    code is as fine as a (K+1)-bit grid for the same bytes. With a residual (mask read from the z code) the
    sides overlap where the residual moved z across 0; each side's window ends where its values end
    (``_ends``): after a ReLU residual (r >= 0) every z <= 0 has x̂ <= -β/γσ, so the mask-0 side is as
    fine as without a residual, and the mask-1 side, the only one the BN weight gradient reads, narrows too."""
    return act != "identity"


def positive_z_grid(act: str) -> bool:
    """Whether a residual chain codes z only on its positive side: after ReLU / ReLU6 every z <= 0 rebuilds
    as exactly 0, so one code says "z <= 0" and the other 2^K - 1 bins cover (0, top] (LeakyReLU and
    identity keep both sides: their negative z reach the consumers)."""
    return act in ("relu", "relu6")


class _Stash:
    """What a chain hands to its consumers: enough to rebuild the activation for a weight gradient."""

    @staticmethod
    def rebuild(packed: torch.Tensor, mask_packed: torch.Tensor, affine: torch.Tensor, zero_code: torch.Tensor,
                bits: int, shape: torch.Size, act: str, params: Tuple[float, ...],
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """act(z) from ``affine`` (rows of z's grid: the bin midpoints, or a code book of z: ``stash_grid.code_book``),
        built in place in one float buffer (backward peaks matter), in ``dtype``: the C kernel writes a bf16 one
        itself (no float32 copy beside it), other paths convert the float32 result."""
        if kernels.stash_triton(packed, "rebuild of a chain's activation"):  # one launch, the same values
            has_mask = act != "identity" and mask_packed.numel()
            return triton_stash.rebuild_act(packed, bits, shape, affine, act, params[0] if act == "leaky_relu" else
                                            0.0, mask=mask_packed if has_mask else None,
                                            zero_code=zero_code if act != "identity" and not has_mask else None
                                            ).to(dtype)
        if native.applies(packed):  # one fused pass, the same values
            has_mask = act != "identity" and mask_packed.numel()
            mask = native.PackedMask(mask_packed) if has_mask else None  # read a block at a time
            zero = zero_code if act != "identity" and not has_mask else None
            return native.rebuild(packed, bits, shape, affine, act, params[0] if act == "leaky_relu" else 0.0,
                                  mask=mask, zero_code=zero,
                                  out_dtype=dtype if dtype == torch.bfloat16 else torch.float32).to(dtype)
        return plain_rebuild(packed, mask_packed, affine, zero_code, bits, shape, act, params).to(dtype)


def _split_x_codes(x, weight, bias, mean, invstd, eps, mask, bits: int, act: str, means: bool):
    """A residual chain's x̂ code split by the exact mask, each side's window ending where its values end:
    (packed codes, the data-dependent grid: 4 rows per channel, saved; the code book with the bins' means, else
    an empty tensor; x̂'s std per channel, saved: ``stats.xhat_std``)."""
    xstd = xhat_std(x, invstd, eps)
    codes, grid, _, _, book = x_code(x, weight, bias, mean, invstd, eps, mask, bits, act, True, True, means=means,
                                     xstd=xstd)
    return codes, grid, _or_empty(book, x.device), xstd


def _or_empty(t: Optional[torch.Tensor], device) -> torch.Tensor:
    return t if t is not None else torch.zeros(0, device=device)


def _channel_max(z: torch.Tensor) -> torch.Tensor:
    """Per-channel greatest value (float32; NaN where the channel has one), in one pass on the CPU."""
    if native.applies(z, float_dtype=True, bf16=True):
        return native.channel_extremes(z)[3]
    return z.amax([d for d in range(z.dim()) if d != 1]).float()


class BNActStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, residual, momentum, eps,
                act, act_params, bits, need_y, node, x2=None, weight2=None, bias2=None, running_mean2=None,
                running_var2=None, num_batches_tracked2=None, momentum2=None, eps2=1e-5, link=None, link_groups=0,
                means=False, residual_first=False, add_in_place=False):
        out, mean, invstd, _, _ = batch_norm_train(x, weight, bias, running_mean, running_var, num_batches_tracked,
                                                   momentum, eps)
        if x2 is not None:  # the residual is a second BatchNorm's output (a downsample): its x̂ is split by our mask
            residual, mean2, invstd2, _, _ = batch_norm_train(x2, weight2, bias2, running_mean2, running_var2,
                                                              num_batches_tracked2, momentum2, eps2)
        residual_input, has_residual = residual is not None and x2 is None, residual is not None
        # out is our own temporary: the residual add and (where z is not coded afterwards) the activation
        # overwrite it, one full-size tensor fewer at the forward peak, same kernels and values, where the
        # graph's add gives z out's layout; else z is the graph's add as it ran (``residual_sum``)
        z = out if residual is None else residual_sum(out, residual, residual_first, add_in_place)
        del out, residual
        mask = _mask(z, act, act_params)
        # a residual chain whose z is coded applies its activation (in place) once the code is taken
        y = None if has_residual and need_y else _activation(z, act, act_params, inplace=True)
        nd, bins, half = x.dim(), 1 << bits, WINDOWS[bits]
        split = split_by_mask(act, has_residual)
        # x̂'s std, saved in the batch mean's place (backward never reads the mean): where var << eps it cannot be
        # recovered from invstd (``stats.xhat_std``)
        xstd = xhat_std(x, invstd, eps)
        x_codes, grid, data, affine, xbook = x_code(x, weight, bias, mean, invstd, eps, mask, bits, act, split,
                                                    split and has_residual, affine=not has_residual, means=means,
                                                    xstd=xstd)
        xgrid = grid if data else torch.zeros(0, device=x.device)  # a data-dependent grid is kept
        none = torch.zeros(0, device=x.device)
        x2_codes, grid2, book2, xstd2, invstd2 = (
            *_split_x_codes(x2, weight2, bias2, mean2, invstd2, eps2, mask, bits, act, means), invstd2) \
            if x2 is not None else (none, none, none, none, none)
        empty_u8 = torch.zeros(0, dtype=torch.uint8, device=x.device)
        zero_code = torch.zeros(0, dtype=torch.int32, device=x.device)
        mask_packed = pack_bits(mask, 1) if mask is not None else empty_u8
        if not has_residual:  # consumers rebuild z = γ σ x̂ + β from the x̂ code (affine: x_code's)
            y_codes = x_codes
        elif not need_y:  # nobody rebuilds y (e.g. it only feeds a pooling or an add): the mask is enough
            affine = torch.zeros(2, 0, device=x.device)
            y_codes = empty_u8
        else:
            std, mu = channel_std_mean(z)
            std = std.clamp_min(torch.finfo(torch.float32).tiny)
            if positive_z_grid(act):
                # code 0 is "z <= 0" (rebuilt as exactly 0); bins 1..2^K-1 cover (0, top], the positive part of a
                # (K+1)-bit grid over mu ± h' std (h' = WINDOWS[K+1]); ReLU6 stops at 6
                top = (mu + WINDOWS[min(bits + 1, 8)] * std).clamp_min(half * std / bins)
                if bits in REACH:  # the top follows the data out, at most to mu + reach std (stash_grid.REACH), where
                    # the data end past mu + past std (x_grid_past; a NaN maximum keeps NaN, as before)
                    zmax = _channel_max(z)
                    far = torch.maximum(top, torch.minimum(zmax, mu + x_grid_reach(bits, True) * std))
                    top = torch.where(zmax <= mu + x_grid_past(bits, True) * std, top, far)
                zwidth = (top.clamp_max(6.0) if act == "relu6" else top) / (bins - 1)
                j = torch.ones_like(mu)
            else:
                zwidth = (2 * half / bins) * std
                # the zero of z on an edge strictly inside the window: origin = -j*w with 1 <= j <= bins-1
                j = torch.clamp(torch.round(-mu / zwidth) + bins // 2, 1, bins - 1)
            origin = -j * zwidth
            # the sign as the activation's backward reads it: after ReLU / ReLU6 a NaN z passes the gradient, as in stock
            zero_code = j.to(torch.int32)
            relu_like = act in ("relu", "relu6")
            zsums = new_bin_sums(z.shape[1], 1, bits, z.device) \
                if wants_means(means, bits, 1, z.numel() // max(1, z.shape[1])) else None
            if kernels.stash_triton(z, "z code"):  # one launch, the same codes
                y_codes = triton_stash.encode(z, torch.stack([origin, zwidth]), bits, zero_code=zero_code,
                                              positive_not_le=relu_like, sums=zsums, sum_stride=MEAN_STRIDE)
            elif native.applies(z, float_dtype=True, bf16=True):  # one fused pass, the same codes
                y_codes = native.encode(z, torch.stack([origin, zwidth]), bits, zero_code=zero_code,
                                        positive_not_le=relu_like, sums=zsums, sum_stride=MEAN_STRIDE)
            else:
                # coded a batch slice at a time from float32 copies: no full-size temporary, z kept for the activation
                codes = torch.empty_like(z, dtype=torch.uint8)
                zc = _per_channel(zero_code, nd).to(torch.uint8)
                for s in batch_slices(z):
                    positive = ~(z[s] <= 0) if relu_like else z[s] > 0
                    code, r = _code_(z[s].to(torch.float32, copy=True), _per_channel(origin, nd),
                                     _per_channel(zwidth, nd), bins, keep_r=True)
                    # rounding must never flip a sign: positive z go to bins >= j, the rest below
                    codes[s] = select_u8(positive, torch.maximum(code, zc), torch.minimum(code, zc - 1))
                    if zsums is not None:
                        add_bin_sums(zsums, r, codes[s], None, bits, start=s.start * z[0].numel())
                y_codes = pack_bits(codes, bits)
            y = _activation(z, act, act_params, inplace=True)
            del z
            affine = torch.stack([origin, zwidth])
            if zsums is not None:  # consumers rebuild z from its bins' means
                affine = code_book(affine, bits, zsums)
            if act != "relu6":  # the code knows the sign of z exactly (not where ReLU6 clips at 6)
                mask_packed = empty_u8
        del mask
        ctx.save_for_backward(x_codes, y_codes, mask_packed, zero_code, weight, bias, xstd, invstd, xgrid,
                              _or_empty(xbook, x.device), x2_codes, weight2, grid2, book2, invstd2, xstd2)
        ctx.shape, ctx.bits, ctx.act, ctx.act_params, ctx.node, ctx.eps = x.shape, bits, act, act_params, node, eps
        ctx.has_residual, ctx.has_weight, ctx.has_bias = residual_input, weight is not None, bias is not None
        ctx.second = None if x2 is None else (x2.dtype, eps2, weight2 is not None, bias2 is not None)
        # the scale identity (memopt/stash/identity.py): as A, a zero per channel whose gradient brings R
        # from B; as B, the number of A's channels to reduce R to
        ctx.link_groups, ctx.link_in = link_groups, 0 if link is None else link.numel()
        ctx.mark_non_differentiable(y_codes, mask_packed, affine, zero_code)
        if link_groups:
            return y, y_codes, mask_packed, affine, zero_code, torch.zeros(link_groups, device=x.device)
        return y, y_codes, mask_packed, affine, zero_code

    @staticmethod
    def backward(ctx, grad_y, *rest):
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through the stash node {ctx.node} is not "
                              f"supported; exclude it with memopt.StashConfig(deny=(...)) or set Config(stash=None)")
        x_codes, y_codes, mask_packed, zero_code, weight, bias, xstd, invstd, xgrid, xbook, x2_codes, weight2, grid2, \
            book2, invstd2, xstd2 = ctx.saved_tensors
        shape, nd = ctx.shape, len(ctx.shape)
        dtype = grad_y.dtype
        # the fused kernels read the mask as its 1-bit stream; g is then a new tensor of ours (the downsample BN's
        # input gradient may overwrite it below)
        # (a bf16 / fp16 grad_y of autocast: g = grad_y * mask gives the values the plain path's bf16 where then
        # .float() gives; LeakyReLU's slope product would round differently. A bf16 one goes in as it is: the
        # kernel widens it, and writes g and grad_x as bf16, a block at a time: no full-size float32 tensor)
        fresh_g = ctx.act != "identity" and native.applies(grad_y, y_codes) and (dtype == torch.float32 or (
            dtype in (torch.bfloat16, torch.float16) and ctx.act in ("relu", "relu6")))
        keep_g = ctx.has_residual or ctx.second is not None  # g is the residual's gradient / the second BN's input
        # Triton: the activation's and the BN's backward in two launches that read grad_y, the mask (its 1-bit copy
        # as it is) and the x̂ code: no float32 copy of a bf16 grad_y, and a full-size g (in grad_y's dtype, written
        # by the first launch) only where the residual or the second BN needs it
        fused = not (fresh_g or ctx.link_groups) and kernels.stash_triton(grad_y, "BatchNorm + activation backward")
        if ctx.act == "identity":
            mask = None
        elif fused and mask_packed.numel():
            mask = native.PackedMask(mask_packed)
        else:
            mask = exact_mask(mask_packed, y_codes, zero_code, ctx.bits, shape, as_bits=fresh_g)
        split = split_by_mask(ctx.act, ctx.has_residual or ctx.second is not None)
        grid = xgrid if xgrid.numel() else _grid(weight, bias, xstd, ctx.bits, ctx.act, split)
        book = xbook if xbook.numel() else grid  # x̂ / std of each code: the bins' means, else the midpoints
        # the scale identity (A): the weight gradient solved from R (B's, in rest[4]) once dL/dβ is known, and used
        # in the variance term
        rows = solve_rows(rest[4], grid, weight, bias, xstd, ctx.act, ctx.bits) if ctx.link_groups else None
        if fresh_g:  # the activation's backward, its sum and the BN backward in two fused passes
            # g itself is needed only as the residual's gradient and by the downsample BN: else it is never
            # written at full size
            narrow = dtype == torch.bfloat16
            # g over grad_y where autograd handed grad_y to this backward alone: at a residual block's backward
            # (ResNet's layer1 at a large batch: the step's peak) one full-size tensor fewer
            into = grad_y if keep_g and rows is None and (narrow or dtype == torch.float32) and \
                owned_gradient(grad_y) else None
            grad_x, sum_gx, g, sum_g = native.bn_backward(
                x_codes, ctx.bits, shape, book, mask, xstd, _gamma_invstd(weight, invstd),
                grad=grad_y if narrow else grad_y.float(), act=ctx.act,
                slope=ctx.act_params[0] if ctx.act == "leaky_relu" else 0.0, solve=rows,
                top=6.0 if ctx.act == "relu6" else 0.0, keep_g=keep_g, out_dtype=dtype if narrow else torch.float32,
                g_into=into)
            grad_z = g
        elif fused:
            made = keep_g and ctx.act != "identity"  # an identity's g is grad_y itself
            grad_x, sum_gx, sum_g, *kept = triton_bn.bn_backward(
                grad_y, None, x_codes, ctx.bits, shape, book, mask, xstd, _gamma_invstd(weight, invstd),
                act=ctx.act, slope=ctx.act_params[0] if ctx.act == "leaky_relu" else 0.0, keep_g=made)
            grad_z = g = (kept[0] if made else grad_y) if keep_g else None
        else:
            grad_z = _act_backward(grad_y, mask, ctx.act, ctx.act_params)
            g = grad_z.float()
            sum_g = g.sum([d for d in range(nd) if d != 1])
            exact = None if rows is None else solved_weight_grad(rows, grad_y, mask, x_codes, sum_g, ctx.act,
                                                                 ctx.bits, shape)
            grad_x, sum_gx = _bn_backward(g, sum_g, x_codes, mask, book, weight, invstd, xstd, ctx.bits, shape,
                                          exact=exact)
        grads2 = (None,) * 3
        if ctx.second is not None:  # the downsample BN: same output gradient, its own x̂ code split by our mask
            dtype2, eps2, has_w2, has_b2 = ctx.second
            # g is read for the last time here: the fused kernel writes grad_x2 over it (elementwise), one full-size
            # tensor fewer at the backward peak (ResNet-50's downsample blocks hold it)
            into = None
            if fresh_g:  # g is ours: written over unless it is the residual's gradient too
                into = g if not ctx.has_residual else torch.empty(shape, dtype=g.dtype) if g.dtype == dtype2 else None
            grad_x2, sum_gx2 = _bn_backward(g, sum_g, x2_codes, mask, book2 if book2.numel() else grid2, weight2,
                                            invstd2, xstd2, ctx.bits, shape, out=into)
            grads2 = (grad_x2.to(dtype2), sum_gx2.to(weight2.dtype) if has_w2 else None,
                      sum_g.to(weight2.dtype if weight2 is not None else dtype) if has_b2 else None)
        del mask
        grad_w = sum_gx if ctx.has_weight else None
        grad_b = sum_g if ctx.has_bias else None
        grad_r = grad_z.to(dtype) if ctx.has_residual else None  # the residual input's
        grad_link = link_term(weight, invstd, sum_gx, ctx.eps, ctx.link_in) if ctx.link_in else None
        return (grad_x.to(dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype if weight is not None else dtype),
                None, None, None, grad_r, None, None, None, None, None, None, None, *grads2, None, None, None, None, None,
                grad_link, None, None, None, None)


_CONVS = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}  # by the input's dimensions (batched)


def _chain_rows(packed, mask_packed, affine, zero_code, bits: int, shape: torch.Size, act: str, act_params,
                dtype: torch.dtype) -> Rows:
    """A consumer's rebuild of the chain's output, whole or rows of its first dimension from their slice of the
    codes (``grads.Rows``; the codes and the 1-bit mask are in the output's logical order, a row's codes must
    end on a byte)."""
    whole = lambda: _Stash.rebuild(packed, mask_packed, affine, zero_code, bits, shape, act, act_params, dtype)
    m = shape[1:].numel()
    if (m * bits) % 8 or (mask_packed.numel() and m % 8):
        return Rows(whole, None)

    def part(a: int, b: int) -> torch.Tensor:
        mask = mask_packed[a * m // 8:b * m // 8] if mask_packed.numel() else mask_packed
        return _Stash.rebuild(packed[a * m * bits // 8:b * m * bits // 8], mask, affine, zero_code, bits,
                              torch.Size((b - a, *shape[1:])), act, act_params, dtype)
    return Rows(whole, part)


class ConvFromStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params, stride,
                padding, dilation, groups, chunks):
        # the conv the module (or the captured F.convNd / aten.convNd call) runs: same kernel, same output
        out = _CONVS[y.dim()](y, weight, bias, stride, padding, dilation, groups)
        ctx.save_for_backward(packed, mask_packed, affine, zero_code, weight)
        ctx.meta = (y.shape, y.dtype, bits, act, act_params, stride, padding, dilation, groups, bias is not None,
                    chunks)
        return out

    @staticmethod
    def backward(ctx, grad):
        packed, mask_packed, affine, zero_code, weight = ctx.saved_tensors
        shape, dtype, bits, act, act_params, stride, padding, dilation, groups, has_bias, chunks = ctx.meta
        y_hat = _chain_rows(packed, mask_packed, affine, zero_code, bits, shape, act, act_params, dtype)
        grad_in, grad_w, grad_b = conv_grads(grad, y_hat, weight, stride, padding, dilation, groups, has_bias,
                                             ctx.needs_input_grad[0], chunks)
        return grad_in, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None, None, None


class LinearFromStash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, packed, mask_packed, affine, zero_code, bits, act, act_params, chunks):
        ctx.save_for_backward(packed, mask_packed, affine, zero_code, weight)
        ctx.meta = (y.shape, y.dtype, bits, act, act_params, bias is not None, chunks)
        return F.linear(y, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        packed, mask_packed, affine, zero_code, weight = ctx.saved_tensors
        shape, dtype, bits, act, act_params, has_bias, chunks = ctx.meta
        y_hat = _chain_rows(packed, mask_packed, affine, zero_code, bits, shape, act, act_params, dtype)
        grads = linear_grads(grad, y_hat, weight, has_bias, ctx.needs_input_grad[0], chunks)
        return (*grads, None, None, None, None, None, None, None, None)


class ChainSpec(NamedTuple):
    """A chain's non-tensor parameters: one typed constant in the rewritten graph, and the record the planner
    reads (``node.meta[CHAIN_KEY]``), so no caller decodes positions. A NamedTuple because fx keeps it whole:
    its code generator imports the class, so printed, pickled and re-traced graphs re-create it.

    Attributes:
        act: "identity" (no activation), "relu", "relu6" or "leaky_relu".
        bits: K, the bits of the codes.
        momentum, eps: the BatchNorm's (momentum None: cumulative average, as ``nn.BatchNorm``).
        act_params: the activation's parameters (LeakyReLU: (negative_slope,)).
        need_y: False when no consumer rebuilds the output from the codes (only the mask is needed).
        node: the BatchNorm node's text, for error messages.
        residual: True when a residual tensor is added before the activation (the ``residual`` argument).
        joined: True when the residual is a second training-mode BatchNorm run here (``x2`` ... arguments).
        momentum2, eps2: that second BatchNorm's.
        pool: (kernel_size, stride, padding, dilation, ceil_mode): y is max_pool2d(relu(BN(x))) (``pool.py``).
        link_groups: > 0 when this chain's weight gradient is solved by the scale identity from the chain its
            depthwise conv feeds (``identity.py``): a sixth output, the link, of that many channels.
        means: rebuild each bin at the mean of the values it coded (``StashConfig.bin_means``).
        residual_first: the graph's residual add reads the residual (or the joined BatchNorm's output) first
            (``x + bn(y)``); add_in_place: it adds into its first operand (``x += y``, ``aten.add_``). The two
            decide the layout of the sum (``residual_sum``), not its values.
    """

    act: str
    bits: int
    momentum: Optional[float] = 0.1
    eps: float = 1e-5
    act_params: tuple = ()
    need_y: bool = True
    node: str = ""
    residual: bool = False
    joined: bool = False
    momentum2: Optional[float] = None
    eps2: float = 1e-5
    pool: Optional[tuple] = None
    link_groups: int = 0
    means: bool = False
    residual_first: bool = False
    add_in_place: bool = False

    of = classmethod(spec_of)  # ChainSpec.of(node): a bn_act_stash call's (as its node.meta[CHAIN_KEY])


@graph_leaf
def bn_act_stash(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, spec: ChainSpec, x2=None,
                 weight2=None, bias2=None, running_mean2=None, running_var2=None, num_batches_tracked2=None,
                 link=None):
    """BatchNorm (training) [+ residual] -> activation with a K-bit stash (``spec``: ``ChainSpec``); returns
    (y, codes, mask, affine, zero_code) and, with ``spec.link_groups``, the link. With ``x2`` (and no
    ``residual``) the residual is a second training-mode BatchNorm of ``x2`` (weight2 ...), run here. ``link``:
    the link of the chain whose weight gradient this chain's solves (``identity.py``)."""
    if not isinstance(spec, ChainSpec):
        raise MemoptError(f"bn_act_stash takes a memopt.stash.ops.ChainSpec after the residual, got "
                          f"{type(spec).__name__}: {spec!r:.80}; build the call with ChainSpec(act=..., bits=...)")
    if spec.residual != (residual is not None) or spec.joined != (x2 is not None):
        raise MemoptError(f"bn_act_stash at {spec.node or 'a chain'}: spec says residual={spec.residual}, "
                          f"joined={spec.joined} but the call passes residual={residual is not None}, "
                          f"x2={x2 is not None}; the spec must describe the tensors passed")
    if spec.pool is not None:
        pooled = BNReLUMaxPoolStash.apply(x, weight, bias, running_mean, running_var, num_batches_tracked,
                                          spec.momentum, spec.eps, spec.bits, *spec.pool, spec.node, spec.means)
        return (pooled, *(torch.zeros(0, device=x.device) for _ in range(4)))
    return BNActStash.apply(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, spec.momentum,
                            spec.eps, spec.act, spec.act_params, spec.bits, spec.need_y, spec.node, x2, weight2, bias2,
                            running_mean2, running_var2, num_batches_tracked2, spec.momentum2, spec.eps2, link,
                            spec.link_groups, spec.means, spec.residual_first, spec.add_in_place)


class FromStashSpec(NamedTuple):
    """A consumer's non-tensor parameters (``conv_from_stash``, ``linear_from_stash``): one typed constant in the
    graph, as ``ChainSpec`` (fx re-creates it in printed, pickled and re-traced graphs), read by name
    (``FromStashSpec.of(node)``).

    Attributes:
        bits: K, the bits of the chain's codes.
        act: the chain's activation ("identity", "relu", "relu6", "leaky_relu"): the rebuild applies it.
        act_params: its parameters (LeakyReLU: (negative_slope,)).
        conv: (stride, padding, dilation, groups) of a conv; () for a linear.
    """

    bits: int
    act: str
    act_params: tuple = ()
    conv: tuple = ()

    of = classmethod(spec_of)  # FromStashSpec.of(node): a conv_from_stash / linear_from_stash call's

    @property
    def groups(self) -> int:
        """A conv's groups (its input channels when depthwise)."""
        return self.conv[3]


@graph_leaf
def conv_from_stash(y, weight, bias, packed, mask_packed, affine, zero_code, spec: FromStashSpec, chunks: int = 1):
    """The conv of the chain's output ``y``, its weight gradient from the codes over ``chunks`` batch ranges."""
    return ConvFromStash.apply(y, weight, bias, packed, mask_packed, affine, zero_code, spec.bits, spec.act,
                               spec.act_params, *spec.conv, chunks)


@graph_leaf
def linear_from_stash(y, weight, bias, packed, mask_packed, affine, zero_code, spec: FromStashSpec, chunks: int = 1):
    """``F.linear`` of the chain's output ``y``, its weight gradient from the codes over ``chunks`` row ranges."""
    return LinearFromStash.apply(y, weight, bias, packed, mask_packed, affine, zero_code, spec.bits, spec.act,
                                 spec.act_params, chunks)
