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
"""
from __future__ import annotations

import torch

from memopt.core.errors import MemoptError
from memopt.core.leaf import graph_leaf

aten = torch.ops.aten
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # aten's Reduction enum, as cross_entropy_loss takes it
CHUNK_BYTES = 16 << 20  # at most this many log-softmax bytes at once: a chunk's temporaries
MIN_CHUNKS = 8  # and at least this many chunks: a chunk's two temporaries beside the logits' whole gradient are
# then a quarter of the tensor that stock backward makes on top (its log-softmax's gradient), on small logits too


def _rows_per_chunk(logits: torch.Tensor) -> int:
    """Rows per chunk: a multiple of 4, so that each chunk's rows start at the same address modulo 16 bytes as in a
    whole-tensor call (GPU softmax kernels vectorise a row by its alignment, which can change its sum's order)."""
    rows = logits.shape[0]
    step = max(1, min(CHUNK_BYTES // max(1, logits.shape[1] * logits.element_size()), -(-rows // MIN_CHUNKS)))
    return -(-step // 4) * 4


def _loss_in_chunks(logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int):
    """``nll_loss_forward(log_softmax(logits, 1), target, ...)`` without the whole log-softmax: each row's
    ``log_softmax(logits)[row, target]`` is taken a chunk of rows at a time (the same per-row kernel), and the one
    reduction runs over those picked values as a ``(rows, 1)`` input with targets 0 (ignored rows kept ignored; a
    second column when 0 is the ignored class):
    the CPU kernel sums the picked values in row order whatever the class count, so the loss and its total weight
    are eager's, bit for bit."""
    ignored = target == ignore_index
    index = target.masked_fill(ignored, 0).unsqueeze(1)
    column = int(ignore_index == 0)  # the picked values' class: never the ignored one
    picked = logits.new_zeros((logits.shape[0], column + 1))
    step = _rows_per_chunk(logits)
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        picked[rows, column:] = torch.log_softmax(logits[rows], 1).gather(1, index[rows])
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
