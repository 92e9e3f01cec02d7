"""Cross-entropy whose backward runs in chunks of rows: an exact rewrite of the language model's loss.

Stock cross-entropy over ``(rows, classes)`` logits keeps its log-softmax for backward (the logits' size: 128
MiB for 32 x 256 tokens of a 4096-token vocabulary in float32), and its backward makes two more tensors of that
size at once (the gradient of the log-softmax, then of the logits), so an LM's step peaks in its loss, with every
activation technique and with checkpointing alike. ``cross_entropy_rows`` computes the loss a chunk of rows at a
time with the kernels eager runs (``log_softmax`` per chunk, then one ``nll_loss_forward`` over the picked values:
the same value, bit for bit, ``_loss_in_chunks``; off the CPU eager's two calls as they are) and keeps the logits
instead, which the model's output holds anyway; backward recomputes the log-softmax a chunk of rows at a time
and runs eager's own backward kernels on each chunk (``nll_loss_backward`` with the whole batch's total weight,
``_log_softmax_backward_data``), which work row by row: the logits' gradient is eager's, bit for bit, and only one
full-size tensor (that gradient) is made in the whole loss. Applied where the cross-entropy takes 2-d float32 / float64 logits and
class-index targets, with no class weights and no label smoothing, reduced by mean or sum.

``linear_cross_entropy_rows`` goes one step further where a linear head makes the logits (an LM's ``lm_head``):
head and loss are one op. Its forward makes the logits (eager's call: the model's output, bit for bit), then a
chunk of rows at a time the loss's log-softmax (a bf16 head's ``.float()`` cast per chunk), the picked values
(the loss, bit for bit) and, from the same log-softmax, the loss's gradient to those logits, which becomes the
chunk's input gradient and a term of the weight gradient at once. It keeps those gradients (tokens x features and
the weight's size) and the head's input, not the logits (tokens x vocabulary); backward only scales them by the
loss's gradient (exactly them for ``loss.backward()``'s 1), so the logits are never recomputed and their gradient
is never whole. The weight and bias gradients are summed over the chunks (a bf16 / fp16 head's chunk products
summed in float32, rounded once), so they differ from eager's one GEMM by rounding; under another output gradient
than 1 the scaling comes after the GEMMs instead of before (rounding too). The price: a forward that will not be
followed by a backward (an evaluation with autograd on) still computes the head's gradients.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from memopt.core.errors import MemoptError
from memopt.core.leaf import graph_leaf, spec_of

aten = torch.ops.aten
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # aten's Reduction enum, as cross_entropy_loss takes it
CHUNK_BYTES = 16 << 20  # at most this many log-softmax bytes at once: a chunk's temporaries
MIN_CHUNKS = 8  # and at least this many chunks: a chunk's two temporaries beside the logits' whole gradient are
# then a quarter of the tensor that stock backward makes on top (its log-softmax's gradient), on small logits too


def _rows_per_chunk_of(rows: int, classes: int, element_size: int, chunk_bytes: int = 0) -> int:
    """``_rows_per_chunk`` for logits of ``rows`` x ``classes`` elements of ``element_size`` bytes (chunks of at
    most ``chunk_bytes``, default ``CHUNK_BYTES``)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    step = max(1, min(chunk_bytes // max(1, classes * element_size), -(-rows // MIN_CHUNKS)))
    return -(-step // 4) * 4


def _rows_per_chunk(logits: torch.Tensor) -> int:
    """Rows per chunk: a multiple of 4, so that each chunk's rows start at the same address modulo 16 bytes as in a
    whole-tensor call (GPU softmax kernels vectorise a row by its alignment, which can change its sum's order)."""
    return _rows_per_chunk_of(logits.shape[0], logits.shape[1], logits.element_size())


def _loss_in_chunks(logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int, up=None):
    """``nll_loss_forward(log_softmax(logits, 1), target, ...)`` without the whole log-softmax: each row's
    ``log_softmax(logits)[row, target]`` is taken a chunk of rows at a time (the same per-row kernel), and the one
    reduction runs over those picked values as a ``(rows, 1)`` input with targets 0 (ignored rows kept ignored; a
    second column when 0 is the ignored class):
    the CPU kernel sums the picked values in row order whatever the class count, so the loss and its total weight
    are eager's, bit for bit. ``up``: a dtype each chunk is cast to first (the cast eager makes of the whole
    logits before its loss, a chunk at a time)."""
    ignored = target == ignore_index
    index = target.masked_fill(ignored, 0).unsqueeze(1)
    column = int(ignore_index == 0)  # the picked values' class: never the ignored one
    up = up or logits.dtype
    picked = logits.new_zeros((logits.shape[0], column + 1), dtype=up)
    step = _rows_per_chunk_of(logits.shape[0], logits.shape[1], torch.empty((), dtype=up).element_size())
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        picked[rows, column:] = torch.log_softmax(logits[rows].to(up), 1).gather(1, index[rows])
    return aten.nll_loss_forward(picked, target.masked_fill(~ignored, column), None, reduction, ignore_index)


class _CrossEntropyRows(torch.autograd.Function):
    @staticmethod
    @torch.autocast("cpu", enabled=False)  # eager's cross_entropy_loss runs its parts without autocast too
    @torch.autocast("cuda", enabled=False)
    def forward(ctx, logits, target, reduction: int, ignore_index: int):
        if logits.device.type == "cpu":
            out, total_weight = _loss_in_chunks(logits, target, reduction, ignore_index)
        else:  # eager's own two calls: the reduction order of other devices' kernels is not checked here
            log_probs = torch.log_softmax(logits, 1)
            out, total_weight = aten.nll_loss_forward(log_probs, target, None, reduction, ignore_index)
            del log_probs
        ctx.reduction, ctx.ignore_index = reduction, ignore_index
        ctx.save_for_backward(logits, target, total_weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise MemoptError("double backward (create_graph=True) through memopt's cross_entropy_rows is not "
                              "supported; set StashConfig(compact_extras=False) to keep the stock cross-entropy")
        logits, target, total_weight = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        step = _rows_per_chunk(logits)
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            log_probs = torch.log_softmax(logits[rows], 1)
            grad_log_probs = aten.nll_loss_backward(grad, log_probs, target[rows], None, ctx.reduction,
                                                    ctx.ignore_index, total_weight)
            aten._log_softmax_backward_data.out(grad_log_probs, log_probs, 1, log_probs.dtype, out=grad_logits[rows])
            del log_probs, grad_log_probs
        return grad_logits, None, None, None


@graph_leaf
def cross_entropy_rows(logits, target, reduction: int = 1, ignore_index: int = -100):
    """``F.cross_entropy(logits, target, reduction=..., ignore_index=...)`` (``reduction`` as aten's enum: 1 mean,
    2 sum) for 2-d logits, keeping the logits for a backward in chunks of rows (module docstring)."""
    if not (torch.is_grad_enabled() and logits.requires_grad) or logits.dtype not in (torch.float32, torch.float64):
        return aten.cross_entropy_loss(logits, target, None, reduction, ignore_index, 0.0)
    return _CrossEntropyRows.apply(logits, target, reduction, ignore_index)


class HeadLossSpec(NamedTuple):
    """The non-tensor parameters of ``linear_cross_entropy_rows``: ``reduction`` (aten's enum: 1 mean, 2 sum) and
    ``ignore_index`` of the cross-entropy, ``up``: the dtype the logits are cast to before the loss ("" for none;
    Hugging Face's ``logits.float()`` under autocast; "autocast": float32 where autocast is on for the logits'
    device when the op runs, as autocast up-casts a cross-entropy's input, else none)."""

    reduction: int
    ignore_index: int
    up: str = ""

    of = classmethod(spec_of)  # HeadLossSpec.of(node)


HEAD_CHUNK_BYTES = 4 << 20  # the head's chunks: each makes about four such temporaries beside the logits output


class _LinearCrossEntropyRows(torch.autograd.Function):
    """Forward: the logits (eager's call), then per chunk of rows the loss's picked log-probabilities and, from
    the same log-softmax, the loss's gradient to the chunk's logits (eager's backward kernels with an output
    gradient of 1), turned at once into the chunk's input gradient and a term of the weight and bias gradients.
    Backward scales those by the loss's gradient (bit for bit the stored ones when it is 1, as a plain
    ``loss.backward()`` gives) and adds what a second use of the logits output sends; it recomputes nothing."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, reduction: int, ignore_index: int, up: str):
        logits = F.linear(x, weight, bias)  # under the caller's autocast, as eager's call: the same bits
        compute = logits.dtype  # the linear's dtype: autocast's (bf16 copies of x and weight), else x's
        rows_x = x.detach().to(compute).reshape(-1, x.shape[-1])  # what eager's linear keeps, as rows
        w = weight.detach().to(compute)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        # the weight gradient is summed over chunks: each chunk's GEMM in the linear's dtype, their sum in float32
        # where that dtype is narrower, rounded to it once at the end as eager's one GEMM rounds its output
        acc = torch.float32 if compute in (torch.bfloat16, torch.float16) else compute
        grad_x = torch.empty_like(rows_x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        flat = logits.detach().reshape(-1, logits.shape[-1])
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            up_dtype = getattr(torch, up) if up else compute
            ignored = target == ignore_index
            index = target.masked_fill(ignored, 0).unsqueeze(1)
            column = int(ignore_index == 0)  # as _loss_in_chunks: the picked values' class is never the ignored one
            picked = flat.new_zeros((flat.shape[0], column + 1), dtype=up_dtype)
            step = _rows_per_chunk_of(flat.shape[0], flat.shape[1], up_dtype.itemsize, HEAD_CHUNK_BYTES)
            # the loss's total weight first: the chunks' gradients divide by it (nll_loss's own count)
            total_weight = (~ignored).sum().to(up_dtype) if reduction == 1 else flat.new_ones((), dtype=up_dtype)
            one = flat.new_ones((), dtype=up_dtype)
            whole = _whole_loss(flat.device)
            for start in range(0, flat.shape[0], step):
                rows = slice(start, start + step)
                log_probs = torch.log_softmax(flat[rows].to(up_dtype), 1)
                if not whole:
                    picked[rows, column:] = log_probs.gather(1, index[rows])
                if need_x or need_w or need_b:
                    grad_log_probs = aten.nll_loss_backward(one, log_probs, target[rows], None, reduction,
                                                            ignore_index, total_weight)
                    g = aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, up_dtype).to(compute)
                    del grad_log_probs
                    if need_x:
                        torch.mm(g, w, out=grad_x[rows])
                    if need_w:
                        _add_mm(grad_w, g.t(), rows_x[rows], acc == compute)
                    if need_b:
                        grad_b.add_(g.sum(0, dtype=acc))
                    del g
                del log_probs
            if whole:  # eager's two calls: the reduction order of other devices' kernels is not checked here
                out = aten.nll_loss_forward(torch.log_softmax(flat.to(up_dtype), 1), target, None, reduction,
                                            ignore_index)[0]
            else:
                out = aten.nll_loss_forward(picked, target.masked_fill(~ignored, column), None, reduction,
                                            ignore_index)[0]
        ctx.save_for_backward(rows_x, w, grad_x, grad_w, grad_b)
        ctx.compute, ctx.x_shape, ctx.x_dtype = compute, x.shape, x.dtype
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, bias.dtype if bias is not None else None
        ctx.set_materialize_grads(False)
        return out, logits

    @staticmethod
    def backward(ctx, grad, grad_logits):
        if torch.is_grad_enabled():
            raise MemoptError("double backward (create_graph=True) through memopt's linear_cross_entropy_rows is "
                              "not supported; set StashConfig(head_loss=False) to keep the model's own head and loss")
        if grad is None and grad_logits is None:
            return None, None, None, None, None, None, None
        rows_x, w, grad_x, grad_w, grad_b = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        compute = ctx.compute
        if grad is not None:  # new tensors (a retained graph's next backward reads the stored ones again)
            grad_x = grad_x * grad.to(compute) if need_x else None
            grad_w = grad_w * grad.to(grad_w.dtype) if need_w else None
            grad_b = grad_b * grad.to(grad_b.dtype) if grad_b is not None else None
        else:
            grad_x = torch.zeros_like(rows_x) if need_x else None
            grad_w = torch.zeros_like(grad_w) if need_w else None
            grad_b = torch.zeros_like(grad_b) if grad_b is not None else None
        if grad_logits is not None:  # the logits output read by something else too: its gradient a chunk at a time
            flat = grad_logits.reshape(-1, grad_logits.shape[-1])
            step = _rows_per_chunk_of(flat.shape[0], flat.shape[1], flat.element_size(), HEAD_CHUNK_BYTES)
            for start in range(0, flat.shape[0], step):
                rows = slice(start, start + step)
                g = flat[rows].to(compute)
                if need_x:
                    grad_x[rows] += g @ w
                if need_w:
                    _add_mm(grad_w, g.t(), rows_x[rows], grad_w.dtype == compute)
                if grad_b is not None:
                    grad_b.add_(g.sum(0, dtype=grad_b.dtype))
        return (grad_x.view(ctx.x_shape).to(ctx.x_dtype) if need_x else None,
                grad_w.to(compute).to(ctx.weight_dtype) if need_w else None,
                grad_b.to(compute).to(ctx.bias_dtype) if grad_b is not None else None, None, None, None, None)


def _whole_loss(device: torch.device) -> bool:
    """Whether the head's loss value comes from eager's whole-tensor calls (off the CPU, as ``cross_entropy_rows``
    there) rather than from the picked values of each chunk (the CPU, whose bits ``_loss_in_chunks`` matches)."""
    return device.type != "cpu"


def _add_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, same_dtype: bool) -> None:
    """``out += a @ b``: in one ``addmm_`` where ``out`` has their dtype, else their product (in theirs) added."""
    if same_dtype:
        out.addmm_(a, b)
    else:
        out.add_(torch.mm(a, b))


@graph_leaf
def linear_cross_entropy_rows(x, weight, bias, target, spec: HeadLossSpec):
    """``(F.cross_entropy(F.linear(x, weight, bias).to(up).view(-1, classes), target, ...), the linear's output)``:
    a language model's head and loss, keeping the head's gradients (made in the forward, a chunk of rows at a time)
    and input instead of the logits (module docstring)."""
    if spec.up == "autocast":
        spec = spec._replace(up="float32" if torch.is_autocast_enabled(x.device.type) else "")
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        logits = F.linear(x, weight, bias)
        flat = logits.reshape(-1, logits.shape[-1])
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            flat = flat.to(getattr(torch, spec.up)) if spec.up else flat
            return aten.cross_entropy_loss(flat, target, None, spec.reduction, spec.ignore_index, 0.0), logits
    return _LinearCrossEntropyRows.apply(x, weight, bias, target, spec.reduction, spec.ignore_index, spec.up)
