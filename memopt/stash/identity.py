"""The scale identity: exact BN weight gradients for chains that feed a depthwise conv into a training-mode BN.

Setting (MobileNetV2's stem and expand chains, and any BN -> activation -> depthwise conv -> BN): chain A is
y = γ x̂ + β (training-mode BN, no residual), z = act(y) with act ReLU, ReLU6, LeakyReLU or none; channel c of
z feeds only the groups of a conv u = W * z (+ bias) that read channel c alone (``groups == in_channels``),
and u feeds only chain B, a training-mode BN with u's batch statistics. Scaling γ_c and β_c by t scales
z_c by t (the activations are positively homogeneous) wherever ReLU6 does not clip, so with
g = dL/dz, mask the activation's pass mask and clip the elements where ReLU6 sits at 6:
    γ_c dL/dγ_c + β_c dL/dβ_c = Σ_mask g y = Σ g z − 6 Σ_clip g                     (per channel c)
    Σ g z = Σ (dL/du) u            (the conv is linear in z and its bias meets Σ dL/du = 0)
          = Σ_o γ_o dL/dγ_o · eps / (var_o + eps)                   (B's backward formula, o the
                                                                     output channels reading c)

The right-hand side needs no activation at all: B's weight gradient and batch statistics, and the output
gradient summed over the clipped elements, which A's exact mask and x̂ code tell apart. So A's weight
gradient is solved from it, dL/dγ = (R − β dL/dβ) / γ, instead of being the sum g x̂ over the rebuilt x̂.
Why it matters: such a γ is nearly scale-invariant, its true gradient is only the eps and clip terms
above (a tiny fraction of g x̂'s natural scale in MobileNetV2 at initialisation), while Σ g x̂ over a K-bit x̂
carries rounding noise of the natural scale times the step, so its cosine with the true gradient is poor even
at 8 bits (docs/results/stash/stash_invariance.md). The solved value inherits the error of B's own weight
gradient and the variance-term error of dL/dβ, and it also enters A's input gradient's variance term in place
of the noisy sum.

B passes R to A through autograd itself: A returns a zero tensor with one entry per channel (``link``),
B takes it as an input and returns R as its "gradient", which autograd delivers to A's backward after
B's and the conv's (each forward call has its own link; nothing is kept beside ``save_for_backward``).
A channel keeps the rebuilt-x̂ sum where the solve is not exact: ReLU6's clipped and non-clipped
elements closer on the code's false side than three bins, or γ = 0. When B itself stays exact (too few
elements per channel, ``deny``), it runs as ``bn_exact_link``: stock's kernels and saved tensors, stock's
gradients bit for bit, and the same R from its exact weight gradient.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from memopt.core.leaf import graph_leaf

from memopt.stash import grid as stash_grid
from memopt.runtime.bitpack import unpack_bits
from memopt.stash.grid import kinks, x_grid_half, x_grid_past, x_grid_reach
from memopt.stash.stats import _per_channel, batch_norm_train, batch_slices

__all__ = ["bn_exact_link", "link_term", "solve_rows", "solved_weight_grad"]

_TINY = torch.finfo(torch.float32).tiny


def link_term(weight: Optional[torch.Tensor], invstd: torch.Tensor, sum_gx: torch.Tensor, eps: float,
              groups: int) -> torch.Tensor:
    """B's side: Σ (dL/du) u per group of its input channels, γ_o dL/dγ_o · eps / (var_o + eps) summed over
    each group's output channels (eps / (var + eps) = eps · invstd²)."""
    gamma = weight.float() if weight is not None else torch.ones_like(invstd, dtype=torch.float32)
    per_channel = gamma * sum_gx.float() * (eps * invstd.float().square())
    return per_channel.view(groups, -1).sum(1)


def _clip_thresholds(grid: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], xstd: torch.Tensor,
                     bits: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ReLU6: per channel (threshold, sign, exact): a mask-false element was clipped at 6 (y >= 6) iff
    sign * code >= threshold, wherever ``exact``. Clipped elements and those below 0 share the code's
    mask-false side (rows lo0, w0 of ``grid``, in units of x̂'s std), on either side of the kinks
    τ = -β/(γσ) and τ6 = (6 - β)/(γσ); where their bins are three or more apart the bin says which (a
    rounding-level slip of one bin either way cannot cross): up (γ > 0) codes >= k(τ) + 2, down codes <= k(τ) - 2.
    Where that side's window ends at the data's extreme (inside ±reach, so ``_grid`` moved it there) more than a
    bin short of τ6 nothing was clipped: the threshold is +inf there, and the fused backward skips the channel."""
    bins = 1 << bits
    scale, ok, tau, tau6 = kinks(weight, bias, xstd)
    lo0, w0 = grid[0], grid[1].clamp_min(_TINY)

    def bin_of(v):
        return (((v - lo0) / w0).ceil() - 1).clamp(0, bins - 1)

    k0, k6 = bin_of(tau), bin_of(tau6)
    up = scale > 0
    sign = torch.where(up, 1.0, -1.0)
    # the window's outer end is the data's own only where it lies strictly inside ±reach, and not at the window's
    # edge ±half where ends between the window and ±past stop (stash_grid.follow_ends; at the edge itself the
    # data may have been clipped)
    half = x_grid_half(bits, True)
    reach = (x_grid_reach(bits, True) if stash_grid.DATA_ENDS else half) * (1 - 1e-6)
    edge_lo, edge_hi = half * (1 - 1e-6), x_grid_past(bits, True) * (1 + 1e-6)
    top, bottom = lo0 + bins * w0, lo0
    own_top = (top < reach) & ((top < edge_lo) | (top > edge_hi))
    own_bottom = (bottom > -reach) & ((bottom > -edge_lo) | (bottom < -edge_hi))
    none = torch.where(up, own_top & (top < tau6 - w0), own_bottom & (bottom > tau6 + w0))
    threshold = (sign * (k0 + 2 * sign)).masked_fill(none, math.inf)
    return threshold, sign, ok & (none | torch.where(up, k6 - k0 >= 3, k0 - k6 >= 3))


def solve_rows(grad_link: torch.Tensor, grid: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               xstd: torch.Tensor, act: str, bits: int) -> torch.Tensor:
    """A's per-channel constants of the solve, rows (R's B part, β, γ, clip threshold, clip sign, where the
    solve applies as 0/1), for the fused backward (``native.bn_backward(solve=...)``) and the plain one."""
    gamma = weight.float()
    beta = bias.float() if bias is not None else torch.zeros_like(gamma)
    applies = gamma.abs() > _TINY
    if act == "relu6":
        threshold, sign, exact = _clip_thresholds(grid, weight, bias, xstd, bits)
        applies &= exact
    else:
        threshold, sign = torch.full_like(gamma, math.inf), torch.ones_like(gamma)
    return torch.stack([grad_link.float().reshape(-1), beta, torch.where(applies, gamma, torch.ones_like(gamma)),
                        threshold, sign, applies.float()])


def solved_weight_grad(rows: torch.Tensor, grad_y: torch.Tensor, mask: Optional[torch.Tensor],
                       x_codes: torch.Tensor, sum_g: torch.Tensor, act: str, bits: int, shape: torch.Size
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """A's side on the plain path: (dL/dγ solved from the identity, where it applies) per channel, for
    ``_bn_backward``'s ``exact``. ``rows``: ``solve_rows``; ``sum_g``: dL/dβ; ``mask``: the exact pass mask."""
    rhs, beta, gamma, threshold, sign, applies = rows
    if act == "relu6":
        nd = len(shape)
        codes = unpack_bits(x_codes, bits, shape.numel()).view(shape)
        dims = [d for d in range(nd) if d != 1]
        clipped = torch.zeros_like(rhs)
        threshold, sign = _per_channel(threshold, nd), _per_channel(sign, nd)
        for s in batch_slices(grad_y):
            where = (codes[s].to(torch.float32) * sign >= threshold) & ~mask[s]
            clipped += torch.where(where, grad_y[s].float(), 0.0).sum(dims)
        rhs = rhs - 6 * clipped
    solved = (rhs - beta * sum_g.float()) / gamma
    return solved, (applies != 0) & torch.isfinite(solved)


class BNExactLink(torch.autograd.Function):
    """A training-mode BatchNorm left exact that still hands R to the chain before its depthwise conv: the forward
    and backward are stock's own kernels (``_batch_norm_impl_index`` and its backward) on the tensors stock saves
    (the input, batch mean and inverse std), so outputs, running statistics and gradients are stock's."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, link):
        out, mean, invstd, reserve, index = batch_norm_train(x, weight, bias, running_mean, running_var,
                                                             num_batches_tracked, momentum, eps)
        ctx.save_for_backward(x, weight, running_mean, running_var, mean, invstd, reserve)
        ctx.eps, ctx.index, ctx.groups, ctx.has_bias = eps, index, link.numel(), bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, running_mean, running_var, mean, invstd, reserve = ctx.saved_tensors
        grad_x, grad_w, grad_b = torch.ops.aten._batch_norm_impl_index_backward(
            ctx.index, x, grad.contiguous(), weight, running_mean, running_var, mean, invstd, True, ctx.eps,
            [True, weight is not None, ctx.has_bias], reserve)
        grad_link = link_term(weight, invstd, grad_w, ctx.eps, ctx.groups)
        return grad_x, grad_w, grad_b if ctx.has_bias else None, None, None, None, None, None, grad_link


@graph_leaf
def bn_exact_link(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum: float, eps: float, link):
    """Training-mode BatchNorm exactly as stock runs it, passing the scale identity's R to ``link``'s chain."""
    return BNExactLink.apply(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, link)
