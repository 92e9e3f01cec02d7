"""An attention with dropout on the CPU, run over ranges of its batch in the forward, bit for bit.

Why: ATen's fused CPU attention has no dropout, so an attention with dropout on the CPU takes the math path, which
makes the scores, their softmax, the dropout noise and the dropped product of the whole batch at once, in float32
even under bf16 autocast (the math path computes reduced precision in float32), beside float32 copies of q, k and
v. That is the forward's peak of a BERT-shaped encoder once memopt keeps little else, and it is where eager's and
checkpointing's forwards peak too. Samples do not mix in attention, so each range of the batch gives its rows of
the output through the same kernels: one range's scores are at most ``PIECE_BYTES`` in float32.

Draws: the math path draws its noise with one ``bernoulli_`` of the scores' shape from the default generator. The
CPU generator draws such a tensor's elements one after the other, and a value does not depend on the tensor's
dtype, so the batch's draw made first as a bool tensor holds eager's values and leaves the generator where eager
leaves it; it is kept as bits (``memopt.recompute.draws``'s rows), and each range's run gets its rows of it from a
``Replayer``. Both properties are checked once per process on a private generator (``draws_split``); where they do
not hold the attention stays one call. The ranges' outputs equal the one call's bit for bit (the same kernels on
the same rows: tests/recompute/test_attention_rows.py checks shapes, masks, autocast and thread counts).

Where: a coded attention's forward (``memopt.stash.coded``, whose backward already runs over ranges from those
bits), and a recomputed block's first forward (``RowAttention``, a torch-function mode that reroutes its
attention calls). Only without autograd recording (no ``requires_grad`` graph is cut), only on the CPU with
dropout, and not while a draw source serves the draws already (a recomputed block's range in backward).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from memopt.recompute.draws import Replayer, pack_rows
from memopt.runtime.rng import drawing
from memopt.stash.grads import PIECE_BYTES, row_ranges

ATTENTION = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


def dropout_p(args: tuple, kwargs: dict) -> float:
    """``scaled_dot_product_attention``'s dropout probability in this call (positional after the mask); 1.0 where it
    is not a number (a symbolic one: no ranges)."""
    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return float(p) if isinstance(p, (int, float)) else 1.0


def _qkv(args: tuple, kwargs: dict) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    named = ("query", "key", "value")
    found = [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(named)]
    return tuple(found) if all(isinstance(t, torch.Tensor) for t in found) else None


def pieces_of(args: tuple, kwargs: dict) -> int:
    """How many batch ranges an attention call with these arguments runs over: enough that one range's float32
    scores (batch x heads x queries x keys) are at most ``PIECE_BYTES``; 1 off the CPU, without dropout (the fused
    kernel makes no score matrix), for nested or under-3-d inputs, for a batch of one, under a draw source, and
    where this build's generator cannot draw by rows (``draws_split``)."""
    p = dropout_p(args, kwargs)
    qkv = _qkv(args, kwargs)
    if qkv is None or not 0 < p < 1 or drawing():
        return 1
    q, k, v = qkv
    if any(t.is_nested or t.device.type != "cpu" or t.dim() != q.dim() for t in qkv) or q.dim() < 3:
        return 1
    if q.shape[0] < 2 or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        return 1
    scores = math.prod(q.shape[:-1]) * k.shape[-2] * 4
    pieces = max(1, min(q.shape[0], -(-scores // PIECE_BYTES)))
    return pieces if pieces > 1 and draws_split() else 1


@functools.lru_cache(maxsize=None)
def draws_split() -> bool:
    """Whether this build's CPU ``bernoulli_`` draws, in pieces of rows and as bool, the values and the generator
    state of one float32 draw (measured once, on a private generator, outside any mode)."""
    with _disable_current_modes(), torch.no_grad():
        generator = torch.Generator().manual_seed(20261206)
        whole = torch.empty(4, 3, 5, 7).bernoulli_(0.7, generator=generator)
        after = generator.get_state()
        generator.manual_seed(20261206)
        parts = [torch.empty(n, 3, 5, 7, dtype=torch.bool).bernoulli_(0.7, generator=generator) for n in (1, 3)]
        return bool(torch.equal(whole.bool(), torch.cat(parts)) and torch.equal(after, generator.get_state()))


def _cut(leaves: List[Any], batch: int, dims: int, start: int, stop: int) -> List[Any]:
    """The leaves with rows ``start:stop`` of every tensor whose first dimension is the batch and whose rank is
    q's (a mask of the scores' rank per sample; a broadcast mask goes whole)."""
    return [t[start:stop] if isinstance(t, torch.Tensor) and t.dim() == dims and t.shape[0] == batch else t
            for t in leaves]


def by_rows(fn: Callable, args: tuple, kwargs: dict, pieces: int, where: str = ""
            ) -> Tuple[torch.Tensor, List[torch.Tensor], List[Tuple[int, ...]]]:
    """``fn(*args, **kwargs)`` (an attention with dropout) over ``pieces`` ranges of the batch, with
    ``([kept], [shape])``: the batch's dropout draw as ``memopt.recompute.draws`` keeps it (rows of bits) and its
    shape, for a backward that replays it by rows (``Replayer``)."""
    q, k, _ = _qkv(args, kwargs)
    shape = (*q.shape[:-1], k.shape[-2])
    # eager's one draw, as bool (the generator's values and state as its float32 noise's: draws_split)
    drawn = torch.empty(shape, dtype=torch.bool, device=q.device).bernoulli_(1 - dropout_p(args, kwargs))
    kept = [pack_rows(drawn, q.shape[0], torch.ops.aten.bernoulli_.float, where)]
    del drawn
    leaves, treedef = tree_flatten((tuple(args), dict(kwargs)))
    out: Optional[torch.Tensor] = None  # contiguous, as the math path's output is
    for start, stop in row_ranges(q.shape[0], pieces):
        part_args, part_kwargs = tree_unflatten(_cut(leaves, q.shape[0], q.dim(), start, stop), treedef)
        replayer = Replayer(kept, [shape], start, stop, where)
        with replayer:
            part = fn(*part_args, **part_kwargs)
        replayer.finish()
        if out is None:
            out = part.new_empty((q.shape[0], *part.shape[1:]))
        out[start:stop] = part
    return out, kept, [shape]


class RowAttention(TorchFunctionMode):
    """Runs the attention calls inside it over batch ranges where ``pieces_of`` says so (not recording autograd,
    and ``draws_split``), bit for bit; every other call as it is. A recomputed block's first forward runs under it
    (``memopt.recompute.ops``)."""

    def __init__(self, where: str = "") -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args: Sequence = (), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION and not torch.is_grad_enabled():
            pieces = pieces_of(tuple(args), kwargs)
            if pieces > 1:
                return by_rows(func, tuple(args), kwargs, pieces, self.where)[0]
        return func(*args, **kwargs)
