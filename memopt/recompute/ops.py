"""Recompute a block in backward: keep its inputs only, run its forward again when gradients come.

Unlike ``torch.utils.checkpoint`` this keeps the inputs through ``ctx.save_for_backward`` (so the
cost model and ``memopt.measure`` see exactly what is kept), replays the RNG state only for
blocks with random ops, and restores BatchNorm running statistics after the second forward, so
they are updated once per step as in the original model. The forward runs the same ops in the same
order under ``no_grad``: outputs are bit-identical; gradients are exact up to the determinism of
the kernels (CPU kernels are deterministic).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memopt.core.leaf import graph_leaf
from memopt.runtime.autocast import autocast_state, replayed_autocast
from memopt.runtime.rng import replayed_rng, rng_state

_BatchNorm = nn.modules.batchnorm._BatchNorm


def _merged(values: tuple, tensors) -> list:
    """The block's arguments: ``values`` (None where a tensor goes) with ``tensors`` filled in, in order."""
    tensors = iter(tensors)
    return [next(tensors) if v is None else v.value for v in values]


class _Value:
    """A block argument that is not a tensor (None, a size), held on ctx instead of saved."""

    def __init__(self, value: Any):
        self.value = value


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: nn.Module, values: tuple, random: bool, where: str, *tensors: torch.Tensor):
        n_inputs = sum(v is None for v in values)
        inputs = tensors[:n_inputs]
        ctx.block, ctx.n_inputs, ctx.values, ctx.random, ctx.where = block, n_inputs, values, random, where
        rng = rng_state(inputs) if random else []
        with torch.no_grad():
            out = block(*_merged(values, [t.detach() for t in inputs]))  # hooks must not see inputs needing grad
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"memopt recompute: block {where} returned {type(out).__name__}, expected one tensor")
        ctx.n_rng = len(rng)
        ctx.autocast = autocast_state()
        ctx.save_for_backward(*inputs, *rng)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: a second derivative was asked for
            raise RuntimeError(f"memopt: double backward through the recomputed block {ctx.where} is not "
                               f"supported; exclude it (RecomputeConfig(segments=...) without it, or "
                               f"Config(recompute=None)) to take second derivatives")
        saved = ctx.saved_tensors
        inputs, rng = saved[:ctx.n_inputs], list(saved[ctx.n_inputs:])
        params = [p for p in ctx.block.parameters() if p.requires_grad]
        detached = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        stats = [(b, b.clone()) for m in ctx.block.modules() if isinstance(m, _BatchNorm) and m.training
                 for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        with replayed_rng(rng if ctx.random else None, inputs):
            with torch.enable_grad(), replayed_autocast(ctx.autocast):  # the forward's precision, not fp32
                out = ctx.block(*_merged(ctx.values, detached))
        wanted = [t for t in detached if t.requires_grad] + params
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        del out
        with torch.no_grad():  # after the grads: BN backward reads the running stats' versions
            for buffer, before in stats:  # the first forward already updated them
                buffer.copy_(before)
        input_grads = [next(grads) if t.requires_grad else None for t in detached]
        param_grads = list(grads)
        return (None, None, None, None, *input_grads, *param_grads)


@graph_leaf
def recompute_block(block: nn.Module, random: bool, where: str, *inputs: Any) -> torch.Tensor:
    """Run ``block(*inputs)`` keeping only ``inputs`` for backward (``where`` names the block in errors)."""
    params = [p for p in block.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (params or any(isinstance(t, torch.Tensor) and t.requires_grad
                                                         for t in inputs)):
        return block(*inputs)
    values = tuple(None if isinstance(t, torch.Tensor) else _Value(t) for t in inputs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return _Recompute.apply(block, values, random, where, *tensors, *params)
