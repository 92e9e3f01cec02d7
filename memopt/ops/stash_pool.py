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

import torch
import torch.nn.functional as F

from memopt.errors import MemoptError
from memopt.ops.bitpack import pack_bits, unpack_bits
from memopt.ops.stash import _bn_backward, pool_backward, pool_offsets
from memopt.ops.stash_grid import _per_channel, batch_norm_train, keep_where, x_code


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
        x_codes, grid, _, _, book = x_code(x, weight, bias, mean, invstd, eps, mask, bits, "relu", True, False,
                                           means=means)
        grid = grid if book is None else book  # what backward rebuilds x̂ from: rows or the bins' means
        mask_packed = pack_bits(mask, 1)
        del mask
        ctx.save_for_backward(x_codes, mask_packed, offsets, pooled, weight, bias, invstd, grid)
        ctx.shape, ctx.bits, ctx.eps, ctx.node = x.shape, bits, eps, node
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        return pooled

    @staticmethod
    def backward(ctx, grad_pool):
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through the stash node {ctx.node} is not "
                              f"supported; exclude it with memopt.StashConfig(deny=(...)) or set Config(stash=None)")
        x_codes, mask_packed, offsets, pooled, weight, bias, invstd, grid = ctx.saved_tensors
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
        grad_x, sum_gx = _bn_backward(g, sum_g, x_codes, mask, grid, weight, invstd, ctx.eps, ctx.bits, shape,
                                      (sum_gx, ok))
        del mask, g
        grad_w = sum_gx if ctx.has_weight else None
        grad_b = sum_g if ctx.has_bias else None
        return (grad_x.to(grad_pool.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype if weight is not None else grad_pool.dtype),
                None, None, None, None, None, None, None, None, None, None, None, None, None)
