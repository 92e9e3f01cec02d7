"""Weights the graph computes from parameters alone, recomputed in backward instead of kept (exact).

timm's weight-standardised convs (NF-Net, NF-RegNet, BiT ResNetV2: ``StdConv2d`` / ``ScaledStdConv2d``), weight
norm and other parametrisations compute a conv's or a linear's weight in every forward. Autograd then keeps that
weight-sized tensor for the op's input gradient, once per op: at small batches it is most of what a network keeps.
``weight_op_recomputed`` runs the weight's recipe (a small graph of the parameters) and the op in one Function:
forward computes the weight under ``no_grad`` (the same ops on the same parameters: the same bits) and keeps only
the op's input, or its generic-stash codes, through ``ctx.save_for_backward``; backward runs the recipe again with
gradients on, under the forward's autocast state, takes the op's gradients and sends the weight's gradient back
through the recipe to the parameters. The recipe is pure (no random draw, no in-place update, no module with
state: ``passes/stash/weights.py`` checks), so the recomputed weight is the forward's to the bit.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from memopt.core.errors import MemoptError
from memopt.core.leaf import graph_leaf, spec_of
from memopt.runtime.autocast import autocast_state, replayed_autocast
from memopt.stash.generic import _keep, _rebuild, own_output
from memopt.stash.grads import conv_grads, linear_grads

_CONVS = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}


class WeightOpSpec(NamedTuple):
    """The op around a recomputed weight: a typed constant in the graph (fx re-creates NamedTuples).

    Attributes:
        kind: "conv" or "linear".
        conv: (stride, padding, dilation, groups) of a conv, () for a linear.
        bits: the generic stash's bits when the op keeps its input as codes, None when it keeps the input itself.
        group: elements per group of those codes.
        node: the original node's text, for error messages.
    """

    kind: str
    conv: Tuple
    bits: Optional[int]
    group: int
    node: str

    of = classmethod(spec_of)  # WeightOpSpec.of(node): a weight_op_recomputed call's


def _forward(spec: WeightOpSpec, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if spec.kind == "conv":
        return _CONVS[x.dim()](x, weight, bias, *spec.conv)
    return F.linear(x, weight, bias)


class _RecomputedWeightOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: WeightOpSpec, recipe: nn.Module, x, bias, packed, params, *leaves):
        with torch.no_grad():
            weight = recipe(*leaves)
        ctx.spec, ctx.recipe, ctx.has_bias, ctx.n_leaves = spec, recipe, bias is not None, len(leaves)
        ctx.autocast = autocast_state()
        if spec.bits is None:
            ctx.save_for_backward(x, *leaves)
        else:
            ctx.save_for_backward(packed, params, *leaves)
            _keep(ctx, x, spec.bits, spec.group, spec.node, 1)
        return own_output(_forward(spec, x, weight, bias))

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if torch.is_grad_enabled():
            raise MemoptError(f"double backward (create_graph=True) through {spec.node}, whose weight memopt "
                              f"recomputes in backward, is not supported; set memopt.StashConfig("
                              f"recompute_weights=False) to take second derivatives")
        saved = ctx.saved_tensors
        leaves = saved[-ctx.n_leaves:] if ctx.n_leaves else ()
        x = saved[0] if spec.bits is None else _rebuild(ctx, saved[0], saved[1], grad.dtype)
        with torch.enable_grad(), replayed_autocast(ctx.autocast):
            inputs = [leaf.detach().requires_grad_(leaf.requires_grad) for leaf in leaves]
            weight = ctx.recipe(*inputs)
        if spec.kind == "conv":
            grad_x, grad_w, grad_b = conv_grads(grad, x, weight.detach(), *spec.conv, ctx.has_bias,
                                                ctx.needs_input_grad[2])
        else:
            grad_x, grad_w, grad_b = linear_grads(grad, x, weight.detach(), ctx.has_bias, ctx.needs_input_grad[2])
        needed = [i for i, leaf in enumerate(inputs) if leaf.requires_grad]
        grads = [None] * len(inputs)
        if needed and weight.requires_grad:
            found = torch.autograd.grad(weight, [inputs[i] for i in needed], grad_w.to(weight.dtype),
                                        allow_unused=True)
            for i, g in zip(needed, found):
                grads[i] = g
        return (None, None, grad_x, grad_b, None, None, *grads)


@graph_leaf
def weight_op_recomputed(spec: WeightOpSpec, recipe: nn.Module, x, bias, packed, params, *leaves):
    """``op(x, recipe(*leaves), bias)`` (a conv or ``F.linear``, per ``spec``) keeping ``x`` (or its codes
    ``packed`` / ``params`` when ``spec.bits`` is set) and not the weight, which backward recomputes."""
    if not (torch.is_grad_enabled() and (x.requires_grad or any(leaf.requires_grad for leaf in leaves))):
        return _forward(spec, x, recipe(*leaves), bias)
    return _RecomputedWeightOp.apply(spec, recipe, x, bias, packed, params, *leaves)
