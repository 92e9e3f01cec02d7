"""Recompute a block in backward: keep its inputs only, run its forward again when gradients come.

Unlike ``torch.utils.checkpoint`` this keeps the inputs through ``ctx.save_for_backward`` (so the
cost model and ``memopt.measure`` see exactly what is kept), replays the RNG state only for
blocks with random ops, and restores BatchNorm running statistics after the second forward, so
they are updated once per step as in the original model. The forward runs the same ops in the same
order under ``no_grad``: outputs are bit-identical; gradients are exact up to the determinism of
the kernels (CPU kernels are deterministic).

``recompute_from_codes`` keeps the block's inputs that carry gradient (its stream: the residual input of a
transformer layer or a ResNet stage's block) as the generic stash's K-bit group codes instead
(``memopt.stash.generic``: one byte per element at 8 bits, where checkpointing keeps two or four), and backward
runs the block again from the rebuilt input. Its forward is still the block's own, bit for bit; its gradients are
approximate (the second forward sees the rebuilt input), so the fidelity gate checks them. Inputs without
gradient (masks, rotary tables, shared by every block) are kept as they are: coding what other blocks keep
frees nothing and would only add error.

``RecomputeSpec.chunks`` > 1 runs that backward over ranges of the batch, one after the other (the block again on
each range, its gradients, then the next): what is alive while a block's backward runs, the peak of a model whose
blocks are recomputed, is then one range's. Only for blocks whose samples do not mix (``memopt.recompute.chunks.
separable``: a BatchNorm in training or a mean over the batch makes a range's run differ from the batch's); each
sample's gradients are the same computation, the parameters' summed over the ranges in turn. Such a block with
random ops (dropout) keeps its draws' masks as bits instead of the generator's state, and each range's second
forward gets its rows of them (``memopt.recompute.draws``).
"""
from __future__ import annotations

import contextlib
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from memopt.core import phase
from memopt.core.leaf import graph_leaf, spec_of
from memopt.recompute.attention_rows import RowAttention
from memopt.recompute.draws import Recorder, Replayer, batch_of
from memopt.runtime.autocast import autocast_state, replayed_autocast
from memopt.runtime.rng import replayed_rng, rng_state
from memopt.stash.generic import group_dequantize, group_quantize



def _merged(values: tuple, tensors) -> list:
    """The block's arguments: ``values`` (None where a tensor goes) with ``tensors`` filled in, in order."""
    tensors = iter(tensors)
    return [next(tensors) if v is None else v.value for v in values]


class _Value:
    """A block argument that is not a tensor (None, a size), held on ctx instead of saved."""

    def __init__(self, value: Any):
        self.value = value


class RecomputeSpec(NamedTuple):
    """What a coded recomputation needs besides its block and inputs (a graph constant, read by name).

    ``random``: the block has random ops (its RNG state is saved and replayed); ``where``: the block's module path,
    for errors; ``bits`` / ``group``: the generic stash's code width and group size for the inputs that carry
    gradient (None bits: every input kept as it is, ``recompute_block``'s behaviour); ``chunks``: ranges of the
    batch its backward runs over, one at a time (1: the whole batch at once; see the module's docstring)."""

    random: bool
    where: str
    bits: Optional[int] = None
    group: int = 256
    chunks: int = 1

    of = classmethod(spec_of)  # RecomputeSpec.of(node): a recompute_block / recompute_from_codes call's


_Layout = Optional[Tuple[torch.Size, Tuple[int, ...], torch.dtype]]


def _keep(ctx, spec: RecomputeSpec, inputs: Tuple[torch.Tensor, ...], first: int) -> List[torch.Tensor]:
    """What backward needs of ``inputs`` (``first``: the index of the first one among forward's arguments): the
    tensor itself, or, for a floating input that needs its gradient when ``spec.bits`` is set, its codes and group
    parameters; ``ctx.layouts`` says which (None: kept as it is)."""
    kept: List[torch.Tensor] = []
    ctx.layouts: List[_Layout] = []
    for i, t in enumerate(inputs):
        if spec.bits is not None and t.is_floating_point() and ctx.needs_input_grad[first + i]:
            kept.extend(group_quantize(t, spec.bits, spec.group, stochastic=False))
            ctx.layouts.append((t.shape, t.stride(), t.dtype))
        else:
            kept.append(t)
            ctx.layouts.append(None)
    return kept


def _rebuilt(ctx, spec: RecomputeSpec, saved: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
    """The block's inputs again: kept ones as they are, coded ones rebuilt at their levels, layout and dtype."""
    saved_iter, out = iter(saved), []
    for layout in ctx.layouts:
        if layout is None:
            out.append(next(saved_iter))
            continue
        packed, params = next(saved_iter), next(saved_iter)
        shape, stride, dtype = layout
        like = torch.empty_strided(shape, stride, dtype=dtype, device=packed.device)
        out.append(group_dequantize(packed, params, spec.bits, spec.group, like))
    return out


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _updated(block: nn.Module, versions: List[int]) -> List[torch.Tensor]:
    """The buffers the block's forward updates, which backward's second forward updates again and restores after:
    BatchNorm's running statistics, by name, whether a module or the functional ops of a rewritten or exported
    graph run them (a batch-norm kernel writes them without bumping their version counter), and any buffer whose
    version the forward moved (an in-place op in Python: an EMA)."""
    return [b for (name, b), v in zip(block.named_buffers(), versions)
            if b._version != v or name.rsplit(".", 1)[-1] in _STATISTICS]


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: nn.Module, values: tuple, spec: RecomputeSpec, *tensors: torch.Tensor):
        n_inputs = sum(v is None for v in values)
        inputs = tensors[:n_inputs]
        ctx.block, ctx.values, ctx.spec = block, values, spec
        # a random block whose backward runs in chunks keeps its draws (memopt.recompute.draws); others replay
        recorder = Recorder(batch_of(inputs), spec.where) if spec.random and spec.chunks > 1 else None
        rng = rng_state(inputs) if spec.random and recorder is None else []
        versions = [b._version for b in block.buffers()]
        rows = RowAttention(spec.where) if spec.random else contextlib.nullcontext()  # attention over batch ranges
        with torch.no_grad(), recorder if recorder is not None else contextlib.nullcontext(), rows:
            out = block(*_merged(values, [t.detach() for t in inputs]))  # hooks must not see inputs needing grad
        draws = recorder.kept if recorder is not None else []
        ctx.draw_shapes = recorder.shapes if recorder is not None else None
        ctx.draw_batch = recorder.batch if recorder is not None else None
        ctx.updated = _updated(block, versions)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"memopt recompute: block {spec.where} returned {type(out).__name__}, expected one "
                            f"tensor")
        kept = _keep(ctx, spec, inputs, 3)
        ctx.n_kept, ctx.n_inputs, ctx.n_rng = len(kept), n_inputs, len(rng)
        ctx.autocast = autocast_state()
        ctx.save_for_backward(*kept, *rng, *draws)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        if torch.is_grad_enabled():  # create_graph=True: a second derivative was asked for
            raise RuntimeError(f"memopt: double backward through the recomputed block {spec.where} is not "
                               f"supported; exclude it (RecomputeConfig(segments=...) without it, or "
                               f"Config(recompute=None)) to take second derivatives")
        saved = ctx.saved_tensors
        inputs, rng = _rebuilt(ctx, spec, saved[:ctx.n_kept]), list(saved[ctx.n_kept:ctx.n_kept + ctx.n_rng])
        draws = saved[ctx.n_kept + ctx.n_rng:]
        params = [p for p in ctx.block.parameters() if p.requires_grad]
        needs = ctx.needs_input_grad[3:3 + ctx.n_inputs]
        if spec.chunks > 1 and grad.dim() > 0 and grad.shape[0] > 1:
            if ctx.updated:
                raise RuntimeError(f"memopt: the recomputed block {spec.where} updates buffers in its forward "
                                   f"({len(ctx.updated)}: BatchNorm statistics or the like), so its samples mix and "
                                   f"its backward cannot run over batch chunks; build its RecomputeSpec with "
                                   f"chunks=1")
            with phase.recompute_backward():
                input_grads, param_grads = _chunked(ctx, inputs, needs, params, grad, draws)
            return (None, None, None, *input_grads, *param_grads)
        detached = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        stats = [(b, b.clone()) for b in ctx.updated]
        wanted = [t for t in detached if t.requires_grad] + params
        with phase.recompute_backward(), _replaying(ctx, draws, 0, ctx.draw_batch):
            with replayed_rng(rng if spec.random and ctx.draw_shapes is None else None, inputs):
                with torch.enable_grad(), replayed_autocast(ctx.autocast):  # the forward's precision, not fp32
                    out = ctx.block(*_merged(ctx.values, detached))
            del inputs
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
            del out
        with torch.no_grad():  # after the grads: BN backward reads the running stats' versions
            for buffer, before in stats:  # the first forward already updated them
                buffer.copy_(before)
        input_grads = [next(grads) if t.requires_grad else None for t in detached]
        param_grads = list(grads)
        return (None, None, None, *input_grads, *param_grads)


def ranges(batch: int, chunks: int) -> List[Tuple[int, int]]:
    """``min(chunks, batch)`` consecutive (start, stop) ranges covering ``batch``, the first ``batch % chunks`` one
    longer (``torch.tensor_split``'s), in Python numbers: a fake tensor's values cannot be read."""
    count = max(1, min(chunks, batch))
    size, extra = divmod(batch, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


@contextlib.contextmanager
def _replaying(ctx, draws: Tuple[torch.Tensor, ...], start: int, stop: int):
    """Where the first forward kept its draws: rows ``start:stop`` of them given to the block's second forward and
    its backward (an op inside that replays its draws in its own backward, as a coded attention with dropout does,
    is given the same rows there; any other draw in the backward is refused: ``Replayer``)."""
    if ctx.draw_shapes is None:
        yield
        return
    replayer = Replayer(draws, ctx.draw_shapes, start, stop, ctx.spec.where)
    with replayer:
        yield
    replayer.finish()


def _chunked(ctx, inputs: List[torch.Tensor], needs, params: List[torch.Tensor], grad: torch.Tensor,
             draws: Tuple[torch.Tensor, ...] = ()):
    """(input gradients, parameter gradients) of a separable block's backward over ``ctx.spec.chunks`` ranges of
    the batch (the inputs whose first dimension is the output's batch are cut; the others, as a rotary table, go
    whole to every range). Each range's input gradient lands in its rows of one tensor; a parameter's gradient
    is the sum over the ranges, as autograd's own accumulation would add them."""
    batch = grad.shape[0]
    cut = [t.dim() > 0 and t.shape[0] == batch for t in inputs]
    input_grads: List[Optional[torch.Tensor]] = [None] * len(inputs)
    param_grads: List[Optional[torch.Tensor]] = [None] * len(params)
    for start, stop in ranges(batch, ctx.spec.chunks):
        part = [(t[start:stop] if c else t).detach().requires_grad_(need) for t, c, need in zip(inputs, cut, needs)]
        wanted = [t for t in part if t.requires_grad] + params
        with _replaying(ctx, draws, start, stop):
            with torch.enable_grad(), replayed_autocast(ctx.autocast):
                out = ctx.block(*_merged(ctx.values, part))
            found = iter(torch.autograd.grad(out, wanted, grad[start:stop], allow_unused=True) if wanted else ())
            del out
        for i, t in enumerate(part):
            if not t.requires_grad:
                continue
            g = next(found)
            if not cut[i]:  # a whole input every range reads: its gradient sums over them
                if g is not None:
                    input_grads[i] = g if input_grads[i] is None else input_grads[i] + g
                continue
            if input_grads[i] is None:
                input_grads[i] = torch.zeros_like(inputs[i])
            if g is not None:
                input_grads[i][start:stop] = g
        for j, g in enumerate(found):
            if g is not None:
                param_grads[j] = g if param_grads[j] is None else param_grads[j].add_(g)
    return input_grads, param_grads


def _run(block: nn.Module, spec: RecomputeSpec, inputs: tuple) -> torch.Tensor:
    params = [p for p in block.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (params or any(isinstance(t, torch.Tensor) and t.requires_grad
                                                         for t in inputs)):
        return block(*inputs)
    values = tuple(None if isinstance(t, torch.Tensor) else _Value(t) for t in inputs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return _Recompute.apply(block, values, spec, *tensors, *params)


@graph_leaf
def recompute_block(block: nn.Module, spec: RecomputeSpec, *inputs: Any) -> torch.Tensor:
    """Run ``block(*inputs)`` keeping only ``inputs`` for backward (``spec.where`` names the block in errors;
    ``spec.bits`` is None)."""
    return _run(block, spec, inputs)


@graph_leaf
def recompute_from_codes(block: nn.Module, spec: RecomputeSpec, *inputs: Any) -> torch.Tensor:
    """Run ``block(*inputs)`` keeping its gradient-carrying inputs as ``spec.bits``-bit codes for backward, which
    runs the block again from them (approximate gradients; the forward is the block's own)."""
    return _run(block, spec, inputs)
