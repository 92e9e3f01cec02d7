"""Gradients of a conv / linear / matmul whose input is rebuilt from codes: the weight gradient first, then
the rebuilt input released, then the input gradient.

The input gradient of these ops needs the weight alone (exact); only the weight gradient reads the rebuilt
input. Computed in one call, the rebuilt input, the incoming gradient and the input gradient are all alive at
once, and the rebuilt input is as large as the input gradient: at the peak of a CNN's backward that is one
full-size activation more than needed. In this order the rebuilt input is gone before the input gradient is
allocated. Splitting the weight gradient over batch chunks would save nothing more: the input gradient,
allocated next, is as large as the whole rebuilt input.

``rebuild`` is a callable that returns the rebuilt input (a tensor is accepted too, which its caller then
still holds). The input gradient is bit-identical to the one-call result:
- linear / matmul: ``grad @ weight`` does not read the input at all;
- conv: ``aten.convolution_backward`` reads only the input's sizes for the input gradient, but picks its
  kernel (and the gradient's memory format) from the input's strides too. The input is replaced by a
  one-element tensor expanded to its sizes only where that selects the same backend and the input is
  contiguous (a channels-last or depthwise input may select another kernel with other rounding), and only on
  the CPU, where the equality is tested; elsewhere the one call stays.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

Rebuild = Union[torch.Tensor, Callable[[], torch.Tensor]]
_BACKWARD = torch.ops.aten.convolution_backward


def _tuple(v, n):
    return list(v) if isinstance(v, (tuple, list)) else [v] * n


def _rebuilt(rebuild: Rebuild) -> torch.Tensor:
    return rebuild() if callable(rebuild) else rebuild


def _shape_only(x_hat: torch.Tensor, weight: torch.Tensor, conv_args: tuple) -> Optional[torch.Tensor]:
    """A stand-in for ``x_hat`` that owns one element and selects the same input-gradient kernel, or None."""
    if x_hat.device.type != "cpu" or not x_hat.is_contiguous() or x_hat.numel() < 2:
        return None
    stand_in = x_hat.new_empty(1).expand(x_hat.shape)
    stride, padding, dilation, transposed, output_padding, groups = conv_args
    select = torch._C._select_conv_backend
    try:
        same = select(x_hat, weight, None, stride, padding, dilation, transposed, output_padding, groups, None) \
            == select(stand_in, weight, None, stride, padding, dilation, transposed, output_padding, groups, None)
    except (RuntimeError, TypeError):  # a build without the query: keep the one call
        return None
    return stand_in if same else None


def conv_grads(grad: torch.Tensor, rebuild: Rebuild, weight: torch.Tensor, stride, padding, dilation, groups,
               has_bias: bool, need_input: bool = True
               ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """(input, weight, bias) gradients of a conv whose input is rebuilt by ``rebuild``: the input gradient
    needs the weight only (exact), the weight gradient uses the rebuilt input (approximate). Under autocast
    the forward's conv ran in the gradient's dtype (bf16 input and weight copies); so does this."""
    x_hat = _rebuilt(rebuild).to(grad.dtype)
    weight = weight.to(grad.dtype)
    dims = x_hat.dim() - 2
    conv_args = (_tuple(stride, dims), _tuple(padding, dims), _tuple(dilation, dims), False, [0] * dims, groups)
    bias_sizes = [weight.shape[0]] if has_bias else None
    stand_in = _shape_only(x_hat, weight, conv_args) if need_input else None
    if need_input and stand_in is None:
        return _BACKWARD(grad, x_hat, weight, bias_sizes, *conv_args, [True, True, has_bias])
    _, grad_w, grad_b = _BACKWARD(grad, x_hat, weight, bias_sizes, *conv_args, [False, True, has_bias])
    del x_hat  # before the input gradient exists
    grad_in = _BACKWARD(grad, stand_in, weight, None, *conv_args, [True, False, False])[0] if need_input else None
    return grad_in, grad_w, grad_b


def linear_grads(grad: torch.Tensor, rebuild: Rebuild, weight: torch.Tensor, has_bias: bool,
                 need_input: bool = True) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """(input, weight, bias) gradients of ``F.linear`` with its input rebuilt by ``rebuild`` (see conv_grads)."""
    x_hat = _rebuilt(rebuild).to(grad.dtype)
    weight = weight.to(grad.dtype)
    grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x_hat.reshape(-1, x_hat.shape[-1]))
    del x_hat
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if has_bias else None
    grad_in = grad.matmul(weight) if need_input else None
    return grad_in, grad_w, grad_b


def matmul_grads(grad: torch.Tensor, rebuild: Rebuild, weight: torch.Tensor, need_input: bool = True
                 ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(input, weight) gradients of ``x @ weight`` (a 2-D weight) with ``x`` rebuilt by ``rebuild``."""
    x_hat = _rebuilt(rebuild).to(grad.dtype)
    weight = weight.to(grad.dtype)
    grad_w = x_hat.reshape(-1, weight.shape[0]).t().matmul(grad.reshape(-1, weight.shape[1]))
    del x_hat
    return (grad.matmul(weight.t()) if need_input else None), grad_w
