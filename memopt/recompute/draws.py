"""A recomputed block's random draws kept as one bit per element, so that its backward can run over batch ranges.

A block with dropout cannot run its backward over ranges of the batch by replaying the random generator: a range
drawn again gets other masks than its rows of the batch's draw (the generator walks the batch's elements in one
sequence). So a block whose backward runs in chunks records what it drew instead: its forward draws as the block's
own does (the same generator calls in the same order, so the forward and the user's random stream are eager's),
and each draw's mask is kept, one bit per element, rows of the batch first (``ctx.save_for_backward``: the cost
model and ``memopt.measure`` see it). Each range's second forward then gets its rows of each mask, in the order the
block drew them, and draws nothing; an op inside that replays its draws in its own backward (a coded attention
with dropout saves the generator's state for it) is given the same rows again there, from the position it saved
in place of the state (``memopt.runtime.rng``); any other draw in the backward is refused.

Only draws whose values are 0 or 1 are kept (``bernoulli`` in its forms, which CPU dropout draws its noise with,
and ``native_dropout``, CUDA's fused dropout, whose mask is returned); any other seeded op (``rand``, ``normal_``)
makes the block refuse chunks, naming the op. A draw whose first dimension is not the batch cannot be cut by rows
and refuses too.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memopt.runtime.bitpack import pack_bits, unpack_bits
from memopt.runtime.rng import drawing_from

aten = torch.ops.aten
# seeded ops whose result (for native_dropout: its mask, the second output) holds only 0 and 1
_BERNOULLI = (aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.bernoulli.p, aten.bernoulli.default)
_DROPOUT = aten.native_dropout.default


class DrawError(RuntimeError):
    """A draw that cannot be kept as bits or cut by the batch's rows; ``reason`` says why, as
    ``memopt.recompute.chunks.separable`` reports it."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"memopt: the recomputed block {where} {reason}, so its backward cannot run over batch "
                         f"chunks; build its RecomputeSpec with chunks=1")
        self.reason = reason


@functools.lru_cache(maxsize=None)
def _seeded(func) -> bool:
    """Whether ``func`` may draw (asked of every op the modes see, so cached per op)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _drew(func, args, kwargs) -> bool:
    """Whether this call draws: native_dropout outside training or at p 0 or 1 returns without drawing, and a fused
    attention (seeded for its dropout) at ``dropout_p`` 0, as every attention without dropout calls it."""
    if func is _DROPOUT:
        p = args[1] if len(args) > 1 else kwargs.get("p")
        train = args[2] if len(args) > 2 else kwargs.get("train")
        return train is not False and 0 < p < 1
    arguments = func._schema.arguments
    index = next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None)
    if index is None:
        return True
    p = kwargs.get("dropout_p", args[index] if index < len(args) else arguments[index].default_value)
    return p != 0


class Recorder(TorchDispatchMode):
    """Records every draw of the ops run under it (``batch``: the rows each draw must have first); ``kept``: one
    uint8 tensor per draw, ``[batch, ceil(elements per row / 8)]``, and ``shapes`` the draws' shapes."""

    def __init__(self, batch: int, where: str) -> None:
        super().__init__()
        self.batch, self.where = batch, where
        self.kept: List[torch.Tensor] = []
        self.shapes: List[Tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _seeded(func) and _drew(func, args, kwargs):
            if func is not _DROPOUT and func not in _BERNOULLI:
                raise _unsupported(func, self.where)
            mask = out[1] if func is _DROPOUT else out
            self.kept.append(pack_rows(mask, self.batch, func, self.where))
            self.shapes.append(tuple(mask.shape))
        return out


class Replayer(TorchDispatchMode):
    """Gives each draw of the ops run under it rows ``start:stop`` of the ``Recorder``'s draw of the same rank,
    drawing nothing; ``finish()`` checks that every recorded draw was asked for. It is the draw source of those ops
    (``memopt.runtime.rng.drawing_from``): one that saves the generator's state to replay its draws in its own
    backward (a coded attention with dropout) saves this replayer's position instead, and its backward is given the
    same rows again from there (``from_position``); any other draw in the backward is refused."""

    def __init__(self, kept: Sequence[torch.Tensor], shapes: Sequence[Tuple[int, ...]], start: int, stop: int,
                 where: str) -> None:
        super().__init__()
        self.kept, self.shapes, self.start, self.stop, self.where = kept, shapes, start, stop, where
        self.used = 0
        self._source = None

    def __enter__(self):
        self._source = drawing_from(self)
        self._source.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._source.__exit__(*exc)

    def position(self) -> int:
        """The rank of the next draw."""
        return self.used

    @contextlib.contextmanager
    def from_position(self, position: int) -> Iterator[None]:
        """Serve draws from rank ``position`` on while the body runs (an op's backward drawing its forward's draws
        again), then go on from where the replayer was."""
        before, self.used = self.used, position
        try:
            yield
        finally:
            self.used = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (_seeded(func) and _drew(func, args, kwargs)):
            return func(*args, **kwargs)
        if func is not _DROPOUT and func not in _BERNOULLI:
            raise _unsupported(func, self.where)
        if self.used >= len(self.kept):
            raise DrawError(self.where, f"draws more often in a range's second forward and its backward ({func}) "
                                        f"than in its first forward ({len(self.kept)} draws)")
        like = args[0]
        shape = (self.stop - self.start, *self.shapes[self.used][1:])
        if tuple(like.shape) != shape:
            raise DrawError(self.where, f"draws {tuple(like.shape)} with {func} on rows {self.start}:{self.stop} "
                                        f"of the batch where its first forward drew {self.shapes[self.used]}")
        mask = _unpack_rows(self.kept[self.used], self.start, self.stop, shape)
        self.used += 1
        if func is _DROPOUT:
            p = args[1] if len(args) > 1 else kwargs["p"]
            return like * mask.to(like.dtype) * (1.0 / (1.0 - p)), mask
        if func in (aten.bernoulli_.float, aten.bernoulli_.Tensor):
            return like.copy_(mask)
        return mask.to(like.dtype)

    def finish(self) -> None:
        if self.used != len(self.kept):
            raise DrawError(self.where, f"draws {self.used} times in a range's second forward but "
                                        f"{len(self.kept)} times in its first")


def _unsupported(func, where: str) -> DrawError:
    return DrawError(where, f"draws with {func}, whose values are not only 0 and 1 (not kept as bits)")


def pack_rows(mask: torch.Tensor, batch: int, func, where: str) -> torch.Tensor:
    if mask.dim() == 0 or mask.shape[0] != batch:
        raise DrawError(where, f"draws {tuple(mask.shape)} with {func}, whose first dimension is not the batch "
                               f"({batch})")
    per_row = math.prod(mask.shape[1:])
    rows = (mask != 0).reshape(batch, per_row)
    padded = -(-per_row // 8) * 8
    if padded != per_row:
        rows = torch.nn.functional.pad(rows.to(torch.uint8), (0, padded - per_row))
    return pack_bits(rows.contiguous(), 1).view(batch, padded // 8)


def _unpack_rows(kept: torch.Tensor, start: int, stop: int, shape: Tuple[int, ...]) -> torch.Tensor:
    rows = kept[start:stop]
    per_row = math.prod(shape[1:])
    bits = unpack_bits(rows.reshape(-1), 1, rows.numel() * 8).view(stop - start, -1)[:, :per_row]
    return bits.bool().reshape(shape)


def batch_of(inputs: Sequence[torch.Tensor]) -> Optional[int]:
    """The batch a block's draws are cut by: its first floating input's first dimension (None: none)."""
    return next((t.shape[0] for t in inputs if t.is_floating_point() and t.dim() > 0), None)
