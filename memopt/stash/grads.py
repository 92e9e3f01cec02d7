"""Gradients of a conv / linear / matmul whose input is rebuilt from codes: the weight gradient first, then
the rebuilt input released, then the input gradient; the weight gradient optionally over batch chunks.

The input gradient of these ops needs the weight alone (exact); only the weight gradient reads the rebuilt
input. Computed in one call, the rebuilt input, the incoming gradient and the input gradient are all alive at
once, and the rebuilt input is as large as the input gradient: at the peak of a CNN's backward that is one
full-size activation more than needed. In this order the rebuilt input is gone before the input gradient is
allocated.

Chunks (``chunks`` > 1, with ``Rows``): the weight gradient is summed over ranges of the first dimension, each
range rebuilt from its own slice of the codes, so no full-size rebuilt input exists at all. The whole rebuilt
input costs as much as the input gradient allocated next, so chunks lower the op's moment only by what the
rebuild needs beyond its output: the float32 copy a bf16 / fp16 input is rebuilt through (autocast), and the
unpacked codes and mask of the plain-PyTorch decode (CUDA where the Triton kernels are not taken). The planner
(``memopt.passes.stash_chunks``) turns chunks on where the cost model's step says the peak falls. The
weight gradient's sum then runs in another order (chunked rounding, on an already approximate gradient); the
bias and input gradients are the unchunked ones.

CPU batch pieces (``input_pieces``): a conv's input gradient from codes, at a batch large enough, runs a piece
of the batch at a time, and its weight gradient in at least as many chunks, so that oneDNN's copies in its
blocked layout, which no tensor shows and which were the step's peak of a CNN, are a piece's. A piece may run
another of oneDNN's implementations than the whole batch, so such an input gradient can differ from the one
call's by rounding (the gradients of these plans are approximate and gated anyway).

``rebuild`` is a callable that returns the rebuilt input (a tensor is accepted too, which its caller then
still holds). Outside CPU batch pieces the input gradient is bit-identical to the one-call result:
- linear / matmul: ``grad @ weight`` does not read the input at all;
- conv: ``aten.convolution_backward`` reads only the input's sizes for the input gradient, but picks its
  kernel (and the gradient's memory format) from the input's strides too. The input is replaced by a
  one-element tensor expanded to its sizes only where that selects the same backend and the input is
  contiguous (a channels-last or depthwise input may select another kernel with other rounding), and only on
  the CPU, where the equality is tested; elsewhere the one call stays, and so do the chunks.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch

from memopt.core.phase import weight_grad_from_codes

_BACKWARD = torch.ops.aten.convolution_backward
# the most bytes of a CPU conv's input gradient (or incoming gradient) one piece of its batch computes (input_pieces)
PIECE_BYTES = 16 * 2 ** 20


class Rows(NamedTuple):
    """A rebuild that can also rebuild rows ``[start, stop)`` of the first dimension (``part``), each from its
    own slice of the codes; ``part`` is None where the codes cannot be sliced there (a row's codes do not end
    on a byte or group boundary)."""

    whole: Callable[[], torch.Tensor]
    part: Optional[Callable[[int, int], torch.Tensor]]


Rebuild = Union[torch.Tensor, Callable[[], torch.Tensor], Rows]


def _tuple(v, n):
    return list(v) if isinstance(v, (tuple, list)) else [v] * n


def _rebuilt(rebuild: Rebuild) -> torch.Tensor:
    if isinstance(rebuild, Rows):
        return rebuild.whole()
    return rebuild() if callable(rebuild) else rebuild


def _mark(rebuild: Rebuild):
    """The cost model's mark around a weight gradient that chunks could split (``memopt.core.phase``)."""
    return weight_grad_from_codes() if isinstance(rebuild, Rows) and rebuild.part is not None else nullcontext()


def row_ranges(rows: int, chunks: int) -> List[Tuple[int, int]]:
    """``chunks`` (at most ``rows``) ranges of near-equal length covering ``[0, rows)``."""
    chunks = max(1, min(chunks, rows))
    step = -(-rows // chunks)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _ranges(rebuild: Rebuild, grad: torch.Tensor, chunks: int) -> Optional[List[Tuple[int, int]]]:
    """The row ranges of a chunked weight gradient, or None for one piece."""
    if chunks <= 1 or not isinstance(rebuild, Rows) or rebuild.part is None or grad.dim() < 2 or grad.shape[0] < 2:
        return None
    return row_ranges(grad.shape[0], chunks)


def _shape_only(x_hat: torch.Tensor, weight: torch.Tensor, conv_args: tuple, shape=None) -> Optional[torch.Tensor]:
    """A stand-in of ``shape`` (default ``x_hat``'s) that owns one element and selects the same input-gradient
    kernel as ``x_hat`` (the whole rebuilt input, or its first chunk), or None."""
    if x_hat.device.type != "cpu" or not x_hat.is_contiguous() or x_hat.numel() < 2:
        return None
    stand_in = x_hat.new_empty(1).expand(x_hat.shape if shape is None else shape)
    return stand_in if _same_kernel(x_hat, stand_in, weight, conv_args) else None


def conv_grads(grad: torch.Tensor, rebuild: Rebuild, weight: torch.Tensor, stride, padding, dilation, groups,
               has_bias: bool, need_input: bool = True, chunks: int = 1
               ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """(input, weight, bias) gradients of a conv whose input is rebuilt by ``rebuild``: the input gradient
    needs the weight only (exact), the weight gradient uses the rebuilt input (approximate), over ``chunks``
    ranges of the batch where ``rebuild`` is ``Rows``; the input gradient over batch pieces on the CPU
    (``input_pieces``) where ``rebuild`` is not a tensor. Under autocast the forward's conv ran in the
    gradient's dtype (bf16 input and weight copies); so does this."""
    weight = weight.to(grad.dtype)
    dims = grad.dim() - 2
    conv_args = (_tuple(stride, dims), _tuple(padding, dims), _tuple(dilation, dims), False, [0] * dims, groups)
    bias_sizes = [weight.shape[0]] if has_bias else None
    pieces = not isinstance(rebuild, torch.Tensor)  # codes: a lossy plan, whose gradients the gate checks
    like = grad.new_empty(1).expand(_input_size(grad, weight, conv_args))
    ranges = _ranges(rebuild, grad, len(kernel_pieces(like, weight, conv_args,
                                                      max(chunks, input_pieces(grad, like.shape)))))
    del like  # so that only the stand-in's one element is alive beside the full-size tensors below
    if ranges is not None:
        first = rebuild.part(*ranges[0]).to(grad.dtype)
        shape = (grad.shape[0], *first.shape[1:])
        stand_in = _shape_only(first, weight, conv_args, shape) if need_input else None
        if stand_in is not None or not need_input:
            grad_w = None
            with _mark(rebuild):
                for a, b in ranges:
                    part = first if grad_w is None else rebuild.part(a, b).to(grad.dtype)
                    first = None
                    w = _BACKWARD(grad[a:b], part, weight, None, *conv_args, [False, True, False])[1]
                    del part
                    grad_w = w if grad_w is None else grad_w.add_(w)
            if not (need_input or has_bias):
                return None, grad_w, None
            grad_in, grad_b = _input_and_bias(grad, stand_in if need_input else grad.new_empty(1).expand(shape),
                                              weight, bias_sizes, conv_args, need_input, pieces)
            return grad_in, grad_w, grad_b
        del first
    # off the CPU the conv below is one call (no stand-in), which chunks would not change: no mark there
    with _mark(rebuild) if grad.device.type == "cpu" else nullcontext():
        x_hat = _rebuilt(rebuild).to(grad.dtype)
        stand_in = _shape_only(x_hat, weight, conv_args) if need_input else None
        if need_input and stand_in is None:  # one call: chunks would not apply here
            return _BACKWARD(grad, x_hat, weight, bias_sizes, *conv_args, [True, True, has_bias])
        _, grad_w, grad_b = _BACKWARD(grad, x_hat, weight, bias_sizes, *conv_args, [False, True, has_bias])
        del x_hat  # before the input gradient exists
    grad_in = _input_and_bias(grad, stand_in, weight, None, conv_args, True, pieces)[0] if need_input else None
    return grad_in, grad_w, grad_b


def input_pieces(grad: torch.Tensor, shape: torch.Size) -> int:
    """Batch pieces of a CPU conv's input gradient of ``shape``: enough that neither it nor ``grad`` is over
    ``PIECE_BYTES`` a piece. oneDNN computes a large batch's input and weight gradients in its blocked layout,
    through copies of the incoming gradient, of the input and of the result in that layout, none of them a
    tensor the dispatcher (or the cost model) sees: together several times the input gradient, inside one
    call, at a CNN's backward peak. Run a piece of the batch at a time, they are a piece's
    (docs/results/peak/conv_pieces.md). The weight gradient takes at least as many chunks (where its input is
    rebuilt by rows)."""
    if grad.device.type != "cpu" or grad.dim() < 3 or shape[0] < 2:
        return 1
    nbytes = max(grad.numel(), math.prod(shape)) * grad.element_size()
    return max(1, min(shape[0], -(-nbytes // PIECE_BYTES)))


def _input_size(grad: torch.Tensor, weight: torch.Tensor, conv_args: tuple) -> torch.Size:
    """The conv input's size as far as ``grad`` and the weight tell it (a strided conv's input may be up to a
    stride - 1 larger per side): enough to count ``input_pieces`` before anything is rebuilt."""
    stride, padding, dilation, _, _, groups = conv_args
    space = [(o - 1) * s - 2 * p + d * (k - 1) + 1 for o, s, p, d, k in
             zip(grad.shape[2:], stride, padding, dilation, weight.shape[2:])]
    return torch.Size((grad.shape[0], weight.shape[1] * groups, *space))


def _input_and_bias(grad: torch.Tensor, stand_in: torch.Tensor, weight: torch.Tensor, bias_sizes, conv_args: tuple,
                    need_input: bool, pieces: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The input gradient (from the shape-only ``stand_in``) and the bias gradient; the input gradient in batch
    pieces (``input_pieces``) where ``pieces`` allows and every piece selects the whole batch's kernel. A piece
    of the batch may still run another of that kernel's implementations (oneDNN picks one by the batch too):
    its samples' gradients may differ from the one call's by rounding, as a chunked weight gradient's sum does,
    so pieces are taken only from codes, in plans whose gradients the fidelity gate checks."""
    ranges = kernel_pieces(stand_in, weight, conv_args, input_pieces(grad, stand_in.shape)) \
        if need_input and pieces else []
    if len(ranges) < 2:
        grad_in, _, grad_b = _BACKWARD(grad, stand_in, weight, bias_sizes, *conv_args, [need_input, False,
                                                                                        bias_sizes is not None])
        return grad_in, grad_b
    grad_b = _BACKWARD(grad, stand_in, weight, bias_sizes, *conv_args, [False, False, True])[2] \
        if bias_sizes is not None else None
    grad_in = None
    for a, b in ranges:
        part = _BACKWARD(grad[a:b], stand_in[a:b], weight, None, *conv_args, [True, False, False])[0]
        if grad_in is None:
            grad_in = torch.empty((stand_in.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device,
                                  memory_format=_format(part))
        grad_in[a:b] = part
        del part
    return grad_in, grad_b


def kernel_pieces(like: torch.Tensor, weight: torch.Tensor, conv_args: tuple, pieces: int) -> List[Tuple[int, int]]:
    """Batch ranges of the most pieces up to ``pieces`` whose every piece selects the kernel ``like`` (the whole
    batch) selects, else the one range of the whole batch. A conv picks its kernel by the batch too (a
    single-threaded 1x1 conv takes oneDNN only from 16 samples up): a piece that picked another would round
    differently and, for a weight gradient, throw the chunks away."""
    for count in range(min(pieces, like.shape[0]), 1, -1):
        ranges = row_ranges(like.shape[0], count)
        if all(_same_kernel(like, like[a:b], weight, conv_args) for a, b in ranges):
            return ranges
    return [(0, like.shape[0])]


def _format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


def _same_kernel(whole: torch.Tensor, piece: torch.Tensor, weight: torch.Tensor, conv_args: tuple) -> bool:
    stride, padding, dilation, transposed, output_padding, groups = conv_args
    select = torch._C._select_conv_backend
    try:
        return select(whole, weight, None, stride, padding, dilation, transposed, output_padding, groups, None) \
            == select(piece, weight, None, stride, padding, dilation, transposed, output_padding, groups, None)
    except (RuntimeError, TypeError):
        return False


def _weight_grad_rows(grad: torch.Tensor, rebuild: Rows, ranges, dtype, rows_of, out_shape) -> torch.Tensor:
    """Σ over ``ranges`` of ``rows_of(grad part, rebuilt part)`` (a pair of 2-D matrices whose product is the
    weight gradient's share), accumulated in place into one tensor of ``out_shape``."""
    grad_w = None
    with _mark(rebuild):
        for a, b in ranges:
            left, right = rows_of(grad[a:b], rebuild.part(a, b).to(dtype))
            grad_w = left.matmul(right) if grad_w is None else grad_w.addmm_(left, right)
    return grad_w.view(out_shape)


def linear_grads(grad: torch.Tensor, rebuild: Rebuild, weight: torch.Tensor, has_bias: bool,
                 need_input: bool = True, chunks: int = 1
                 ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """(input, weight, bias) gradients of ``F.linear`` with its input rebuilt by ``rebuild`` (see conv_grads)."""
    weight = weight.to(grad.dtype)
    ranges = _ranges(rebuild, grad, chunks)
    if ranges is not None:
        grad_w = _weight_grad_rows(grad, rebuild, ranges, grad.dtype, lambda g, x: (
            g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1])), weight.shape)
    else:
        with _mark(rebuild):
            x_hat = _rebuilt(rebuild).to(grad.dtype)
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x_hat.reshape(-1, x_hat.shape[-1]))
            del x_hat
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if has_bias else None
    grad_in = grad.matmul(weight) if need_input else None
    return grad_in, grad_w, grad_b


def matmul_grads(grad: torch.Tensor, rebuild: Rebuild, weight: torch.Tensor, need_input: bool = True,
                 chunks: int = 1) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(input, weight) gradients of ``x @ weight`` (a 2-D weight) with ``x`` rebuilt by ``rebuild``."""
    weight = weight.to(grad.dtype)
    ranges = _ranges(rebuild, grad, chunks)
    if ranges is not None:
        grad_w = _weight_grad_rows(grad, rebuild, ranges, grad.dtype, lambda g, x: (
            x.reshape(-1, weight.shape[0]).t(), g.reshape(-1, weight.shape[1])), weight.shape)
    else:
        with _mark(rebuild):
            x_hat = _rebuilt(rebuild).to(grad.dtype)
            grad_w = x_hat.reshape(-1, weight.shape[0]).t().matmul(grad.reshape(-1, weight.shape[1]))
            del x_hat
    return (grad.matmul(weight.t()) if need_input else None), grad_w
