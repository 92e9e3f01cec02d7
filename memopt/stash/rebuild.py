"""Weight ops whose input is a norm's output, rebuilt in backward by running the norm again on the codes of
the norm's own input: no codes of their own.

A pre-norm transformer block keeps ``x`` for its LayerNorm and ``layer_norm(x)`` for the q / k / v (or the
first MLP) projections. The coded LayerNorm (``memopt.stash.coded``) already keeps ``x`` as K-bit codes;
coding its output as well would keep a second code of the same size. Instead the projection keeps nothing
but a reference to those codes (and the norm's weight and bias, which are parameters): its weight gradient
is computed from ``layer_norm(decode(codes of x))``, the norm run again, which costs one elementwise pass.
The forward is the stock op on the stock input (bit-identical); the input gradient needs only the weight
(exact); the weight gradient sees the norm of the rebuilt input instead of the rebuilt norm output, an error
of the same order, which the fidelity gate checks like every other code.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from memopt.core.leaf import graph_leaf, spec_of
from memopt.runtime.layout import rebuilt_stride
from memopt.stash.coded import resolve
from memopt.stash.generic import _check_backward, group_dequantize, own_output
from memopt.stash.grads import conv_grads, linear_grads, matmul_grads

KINDS = ("linear", "conv", "matmul")
_CONVS = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}


def _forward(kind: str, x, weight, bias, conv):
    if kind == "linear":
        return F.linear(x, weight, bias)
    if kind == "conv":
        return _CONVS[x.dim()](x, weight, bias, *conv)
    return torch.matmul(x, weight)


class RebuildSpec(NamedTuple):
    """The constants of ``weight_op_from_rebuild``: a NamedTuple, which fx prints by importing the class, so
    printed, pickled and re-traced graphs re-create it. ``norm_args``: per positional argument of the norm,
    ("src", None) for the rebuilt input, ("tensor", None) for the next of ``norm_tensors``, ("value", v) for a
    constant."""

    kind: str  # linear | conv | matmul
    conv: tuple  # stride, padding, dilation, groups (conv only)
    bits: int
    group: int
    node: str  # the original node's text, for messages
    norm: str  # the norm's callable, as memopt.stash.coded.resolve names it
    norm_args: tuple

    of = classmethod(spec_of)  # RebuildSpec.of(node): a weight_op_from_rebuild call's


class WeightOpFromRebuild(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, weight, bias, packed, params, spec, *norm_tensors):
        ctx.save_for_backward(packed, params, weight, *norm_tensors)
        ctx.src = (src.shape, rebuilt_stride(src), src.dtype)
        ctx.x_dtype, ctx.spec, ctx.has_bias = x.dtype, spec, bias is not None
        return own_output(_forward(spec.kind, x, weight, bias, spec.conv))

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        _check_backward(spec.node)
        packed, params, weight, *norm_tensors = ctx.saved_tensors
        shape, stride, dtype = ctx.src

        def x_hat():
            src = group_dequantize(packed, params, spec.bits, spec.group,
                                   torch.empty_strided(shape, stride, dtype=dtype, device=packed.device))
            tensors = iter(norm_tensors)
            args = [src if what == "src" else (next(tensors) if what == "tensor" else value)
                    for what, value in spec.norm_args]
            return resolve(spec.norm)(*args).to(ctx.x_dtype)

        need = ctx.needs_input_grad[0]
        if spec.kind == "linear":
            grads = linear_grads(grad, x_hat, weight, ctx.has_bias, need)
        elif spec.kind == "conv":
            grads = conv_grads(grad, x_hat, weight, *spec.conv, ctx.has_bias, need)
        else:
            grads = (*matmul_grads(grad, x_hat, weight, need), None)
        return (grads[0], None, grads[1], grads[2], None, None, None, *([None] * len(norm_tensors)))


@graph_leaf
def weight_op_from_rebuild(x, src, weight, bias, packed, params, spec: RebuildSpec, norm_tensors):
    """``spec.kind`` (linear / conv / matmul) of ``x`` = ``norm(src)``, keeping only the codes of ``src`` (shared
    with the coded norm); ``norm_tensors``: the norm's tensor arguments other than ``src`` (weight, bias)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return _forward(spec.kind, x, weight, bias, spec.conv)
    return WeightOpFromRebuild.apply(x, src, weight, bias, packed, params, spec, *norm_tensors)
