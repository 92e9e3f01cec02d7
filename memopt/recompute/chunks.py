"""Whether a recomputed block's backward may run over ranges of the batch (``RecomputeSpec.chunks``).

A block's backward over ranges gives each sample the gradients of the whole batch's backward only where the block
does not mix samples: a BatchNorm in training (its batch statistics), a mean or a sort over the batch make a
range's run differ from the batch's. Random draws (dropout) are kept from the whole run and each range gets its
rows of them, as the chunked backward does (``memopt.recompute.draws``); a draw that cannot be kept so refuses.
Such ops are many and hide behind reshapes, so this is measured, not read off the graph: the block runs on made-up
inputs of its inputs' shapes and dtypes (a few samples), once whole and once range by range (with its backward,
where a draw refuses), and the ranges' outputs must be the whole run's rows up to rounding: within ``TOLERANCE`` of
the dtype's epsilon (at most ``MOST``) times the whole run's norm. A matrix product over fewer rows may take another
kernel and round differently (a 2-D input's at 2 rows against 4), where samples that mix change the output by its
own size (a BatchNorm over 2 samples against 4, another dropout mask). Everything the runs touch is put back: the
block's parameters, buffers (BatchNorm statistics) and training flags, and the random generators.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from memopt.core.state import preserved_state
from memopt.recompute.draws import DrawError, Recorder, Replayer
from memopt.recompute.ops import ranges


class Like:
    """A block input to make up: a tensor of ``shape`` and ``dtype`` (on ``device``)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: str = "cpu") -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device


TOLERANCE, MOST = 256, 1e-2  # ||ranges - whole|| <= min(TOLERANCE * eps, MOST) * ||whole||
CHECK_SAMPLES = 4  # samples of the made-up batch: two ranges of two, so a range's own statistics differ too


def separable(block: nn.Module, inputs: Sequence[Any], batch: int) -> Optional[str]:
    """None where ``block`` run on two ranges of a made-up batch gives the rows of its run on the whole batch up to
    rounding, else why not. ``inputs``: the block's arguments in order, ``Like`` where a tensor goes (those whose
    first dimension is ``batch`` are the batch's and get ``CHECK_SAMPLES`` rows), any other value as it is."""
    samples = min(batch, CHECK_SAMPLES)
    if samples < 2:
        return f"a batch of {batch} sample has no ranges"
    generator = torch.Generator().manual_seed(0)
    cut = [isinstance(x, Like) and len(x.shape) > 0 and x.shape[0] == batch for x in inputs]
    made = [_made_up(x, samples if c else None, generator) if isinstance(x, Like) else x for x, c in zip(inputs, cut)]
    try:
        with preserved_state(block), torch.no_grad():
            recorder = Recorder(samples, "")
            with recorder:
                whole = block(*made)
            parts = [_part(block, made, cut, recorder, start, stop) for start, stop in ranges(samples, 2)]
    except DrawError as error:
        return error.reason
    except Exception as error:  # noqa: BLE001 - a block that cannot run on fewer samples is not separable
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return f"it does not run on part of the batch ({type(error).__name__}: {first})"
    if not isinstance(whole, torch.Tensor) or whole.dim() == 0 or whole.shape[0] != samples:
        return "its output's first dimension is not the batch"
    if not all(isinstance(p, torch.Tensor) for p in parts) or not _same(torch.cat(parts), whole):
        return ("its samples mix: run on two ranges of the batch it gives other values than on the whole batch "
                "(a BatchNorm in training or a reduction over the batch)")
    return None


def _part(block: nn.Module, made: List[Any], cut: List[bool], recorder: Recorder, start: int, stop: int):
    """The block's output on rows ``start:stop`` of the made-up batch, given those rows of the whole run's draws,
    and its backward run, as a chunked backward runs both (a draw in the backward refuses: ``DrawError``)."""
    part = [x[start:stop].detach().requires_grad_(x.is_floating_point()) if c else x for x, c in zip(made, cut)]
    wanted = [x for x in part if isinstance(x, torch.Tensor) and x.requires_grad]
    wanted += [p for p in block.parameters() if p.requires_grad]
    replayer = Replayer(recorder.kept, recorder.shapes, start, stop, "")
    with replayer, torch.enable_grad():
        out = block(*part)
        if isinstance(out, torch.Tensor) and out.requires_grad and wanted:
            torch.autograd.grad(out.sum(), wanted, allow_unused=True)
    replayer.finish()
    return out.detach() if isinstance(out, torch.Tensor) else out


def _made_up(like: Like, rows: Optional[int], generator: torch.Generator) -> torch.Tensor:
    shape = (rows, *like.shape[1:]) if rows is not None else like.shape
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.randn(shape, generator=generator).to(like.dtype).to(like.device)
    if like.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool().to(like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)  # indices: 0 is valid wherever one is


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` up to rounding (``TOLERANCE``), NaN where NaN; integers exactly."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bound = min(TOLERANCE * torch.finfo(a.dtype).eps, MOST)
    a, b = a.masked_fill(nan, 0).double(), b.masked_fill(nan, 0).double()
    return bool(torch.linalg.vector_norm(a - b) <= bound * torch.linalg.vector_norm(b))


def recompute_inputs(values: List[Any]) -> List[Any]:
    """``values`` as ``separable`` takes them (tensors described by ``Like``), for a block built by hand."""
    return [Like(v.shape, v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else v for v in values]
