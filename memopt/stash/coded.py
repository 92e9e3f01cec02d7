"""Coded recompute: ops whose backward reads activations keep them as generic-stash codes.

The generic stash (``generic.py``) covers ops with a weight, whose input is needed only for the weight
gradient. Most of what a transformer keeps is read by ops without one: a LayerNorm or RMSNorm keeps its
input, scaled-dot-product attention its q, k, v and output, a product of two activations (a gated MLP's
``act(g) * u``, RMSNorm's ``x * rsqrt(var)``) both factors, a softmax its output. ``coded_call`` runs
such an op exactly as the graph did (same function, same arguments, so the forward is bit-identical)
and keeps, through ``ctx.save_for_backward``, the K-bit group codes of the activations it reads (those
the pass chose: ``CodedSpec.coded``) and the other tensors as they are; backward rebuilds the coded ones
and runs the op again under autograd on them (the RNG replayed for attention dropout, autocast as in the
forward). Unlike the weight-op consumers, the input gradients are approximate too: the op's own
derivative is taken at the rebuilt point.

A softmax keeps only its output ``y`` (its gradient is ``y * (g - sum(g * y))``), which is the tensor
worth coding: its values lie in [0, 1] whatever the logits (masked scores of -inf included), so
``softmax_coded`` codes ``y`` and applies that formula to the rebuilt output instead of recomputing.

``gated`` is an activation and the product that follows it as one op (``silu(g) * u``, GELU likewise):
only g and u are kept, coded, where stock PyTorch keeps g, act(g) and u.

A ``CodedSpec`` names the op by a string (``resolve``), so the rewritten graph prints, pickles and
re-traces with plain constants.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from memopt.core.errors import MemoptError
from memopt.core.leaf import graph_leaf, spec_of
from memopt.recompute.attention_rows import by_rows, pieces_of
from memopt.recompute.draws import Replayer
from memopt.runtime.autocast import autocast_state, replayed_autocast
from memopt.runtime.layout import rebuilt_stride
from memopt.runtime.rng import replayed_rng, rng_state
from memopt.stash.generic import group_dequantize, group_quantize, own_output, rows_rebuild
from memopt.stash.grads import Rows, row_ranges


def gated(g: torch.Tensor, u: torch.Tensor, act: str, act_first: bool, approximate: str = "none") -> torch.Tensor:
    """``act(g) * u`` (``u * act(g)`` when not ``act_first``): the two ops the graph ran, in its order."""
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate=approximate)
    return a * u if act_first else u * a


def batch_norm_module(module: torch.nn.Module, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """A training BatchNorm module's own forward (its running statistics and batch counter updated as the graph
    did); ``weight`` and ``bias`` are the module's, passed so that backward can return their gradients."""
    return module(x)


def batch_norm_grad(module: torch.nn.Module, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """The function ``batch_norm_module`` computes, as backward differentiates it: batch statistics, no update."""
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, module.eps)


def aten_batch_norm_grad(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """``aten.batch_norm`` in training (an export graph's BatchNorm) as backward differentiates it."""
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


# python callables a CodedSpec may name (aten overloads are named "aten.<packet>.<overload>", tensor
# methods "Tensor.<name>")
CALLABLES: Dict[str, Callable] = {
    "F.layer_norm": F.layer_norm, "F.group_norm": F.group_norm, "F.rms_norm": F.rms_norm,
    "F.scaled_dot_product_attention": F.scaled_dot_product_attention,
    "torch.matmul": torch.matmul, "operator.matmul": operator.matmul, "torch.bmm": torch.bmm,
    "torch.mul": torch.mul, "operator.mul": operator.mul, "torch.pow": torch.pow, "operator.pow": operator.pow,
    "torch.div": torch.div, "operator.truediv": operator.truediv,
    "F.softmax": F.softmax, "torch.softmax": torch.softmax, "memopt.gated": gated,
    "memopt.batch_norm_module": batch_norm_module, "memopt.batch_norm_grad": batch_norm_grad,
    "memopt.aten_batch_norm_grad": aten_batch_norm_grad,
}


def name_of(target: Any) -> str:
    """The name ``resolve`` maps back to ``target`` ("" when it has none)."""
    if isinstance(target, torch._ops.OpOverload):
        packet, _, overload = target.name().partition("::")[2].partition(".")
        return f"aten.{packet}.{overload or 'default'}" if target.namespace == "aten" else ""
    if isinstance(target, str):
        return f"Tensor.{target}" if hasattr(torch.Tensor, target) else ""
    return next((name for name, fn in CALLABLES.items() if fn is target), "")


@functools.lru_cache(maxsize=None)
def resolve(name: str) -> Callable:
    """The callable a spec names (cached: every coded op resolves its name in forward and backward)."""
    if name.startswith("aten."):
        _, packet, overload = name.split(".")
        return getattr(getattr(torch.ops.aten, packet), overload)
    if name.startswith("Tensor."):
        return getattr(torch.Tensor, name[len("Tensor."):])
    if name not in CALLABLES:
        raise MemoptError(f"coded recompute: unknown op {name!r} in a rewritten graph; it names one of "
                          f"{sorted(CALLABLES)}, an aten overload or a tensor method (re-run memopt.optimize)")
    return CALLABLES[name]


class CodedSpec(NamedTuple):
    """A coded op's constants. ``coded``: the indices, among the flattened (args, kwargs) leaves, of the
    tensors kept as codes; ``random``: the op draws random numbers (attention dropout), replayed in backward;
    ``node``: the original node's text, for messages; ``recompute``: the function backward differentiates
    when it is not ``target`` itself (a training BatchNorm: the same function without the running-statistics
    update, which the forward already made); ``unsaved``: leaf indices of tensors backward does not need (a
    BatchNorm's running statistics), not kept and passed to ``recompute`` as None."""

    target: str
    coded: Tuple[int, ...]
    bits: int
    group: int
    random: bool = False
    node: str = ""
    recompute: str = ""
    unsaved: Tuple[int, ...] = ()

    of = classmethod(spec_of)  # CodedSpec.of(node): a coded_call / softmax_coded call's


def _like(meta: Tuple[torch.Size, Tuple[int, ...], torch.dtype], device: torch.device) -> torch.Tensor:
    shape, stride, dtype = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _layout(x: torch.Tensor) -> Tuple[torch.Size, Tuple[int, ...], torch.dtype]:
    return x.shape, rebuilt_stride(x), x.dtype


SDPA = ("F.scaled_dot_product_attention", "aten.scaled_dot_product_attention.default")  # the same arguments


def attention_pieces(spec: CodedSpec, args: tuple, kwargs: dict) -> int:
    """Batch ranges a coded attention's forward and backward run over (``memopt.recompute.attention_rows``): on
    the CPU with dropout, enough that one range's score matrix (batch x heads x queries x keys, in float32) is at
    most ``PIECE_BYTES``. CPU attention with dropout takes the math path, which makes several score-sized tensors
    at once in its forward, and its backward runs that attention again under autograd (the step's peak of a
    BERT-shaped encoder); samples do not mix in attention, so each range gives its rows' outputs and gradients,
    and dropout's draws are kept as bits and served by rows (``memopt.recompute.draws``). 1 (one call, the
    generator's state replayed) off the CPU, without dropout (the fused kernel makes no score matrix), for other
    ops, inside a recomputed block's range (its draws are served already), for a batch of one, and where this
    build's generator cannot draw by rows (``draws_split``)."""
    return pieces_of(args, kwargs) if spec.target in SDPA and spec.random else 1


def _check_backward(node: str) -> None:
    if torch.is_grad_enabled():
        raise MemoptError(f"double backward (create_graph=True) through the coded op {node} is not supported; "
                          f"exclude it with memopt.StashConfig(deny=(...)) or set StashConfig(coded_ops=())")


class _CodedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: CodedSpec, treedef, leaves: List[Any], slots: Tuple[int, ...], *flat):
        tensors, codes = flat[:len(slots)], flat[len(slots):]
        full = list(leaves)
        for i, t in zip(slots, tensors):
            full[i] = t
        args, kwargs = tree_unflatten(full, treedef)
        pieces = attention_pieces(spec, args, kwargs)
        if pieces > 1:  # over ranges, bit for bit; the batch's draws kept as bits
            out, rng, ctx.draw_shapes = by_rows(resolve(spec.target), args, kwargs, pieces, spec.node)
        else:
            rng = rng_state(tensors) if spec.random else []
            out = resolve(spec.target)(*args, **kwargs)
        ctx.pieces = pieces
        coded, unsaved = set(spec.coded), set(spec.unsaved)
        exact = [t for i, t in zip(slots, tensors) if i not in coded and i not in unsaved]
        ctx.spec, ctx.treedef, ctx.leaves, ctx.slots = spec, treedef, leaves, slots
        ctx.layouts = [_layout(t) for i, t in zip(slots, tensors) if i in coded]
        ctx.counts = (len(exact), len(codes), len(rng))
        ctx.autocast = autocast_state()
        ctx.save_for_backward(*exact, *codes, *rng)
        return own_output(out) if isinstance(out, torch.Tensor) else out

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        _check_backward(spec.node)
        saved = ctx.saved_tensors
        n_exact, n_codes, _ = ctx.counts
        exact, codes, rng = saved[:n_exact], saved[n_exact:n_exact + n_codes], list(saved[n_exact + n_codes:])
        # over ranges, a coded input whose codes cut by rows is rebuilt a range at a time (RowsOf), else whole
        rebuilt = iter([_rebuilt(codes[2 * j], codes[2 * j + 1], spec, layout, ctx.pieces, grad.shape[0])
                        for j, layout in enumerate(ctx.layouts)])
        exact_it = iter(exact)
        full, wanted = list(ctx.leaves), []
        needs = ctx.needs_input_grad[4:4 + len(ctx.slots)]
        for i, need in zip(ctx.slots, needs):
            if i in spec.unsaved:  # not kept: backward's function does not read it
                continue
            t = next(rebuilt) if i in spec.coded else next(exact_it)
            t = RowsOf(t.part, need) if isinstance(t, Rows) else t.detach().requires_grad_(need)
            full[i] = t
            if need:
                wanted.append(t)
        if ctx.pieces > 1:
            grads = iter(_by_rows(ctx, full, len(wanted), grad, rng))
        else:
            args, kwargs = tree_unflatten(full, ctx.treedef)
            with replayed_rng(rng if spec.random else None, exact), torch.enable_grad(), \
                    replayed_autocast(ctx.autocast):
                out = resolve(spec.recompute or spec.target)(*args, **kwargs)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
            del out
        tensor_grads = [next(grads) if need and i not in spec.unsaved else None for i, need in zip(ctx.slots, needs)]
        return (None, None, None, None, *tensor_grads, *([None] * n_codes))


class RowsOf(NamedTuple):
    """A coded input of a backward over ranges, rebuilt a range at a time: ``part(a, b)`` gives rows ``a:b``."""

    part: Callable[[int, int], torch.Tensor]
    requires_grad: bool


def _rebuilt(packed: torch.Tensor, params: torch.Tensor, spec: CodedSpec, layout, pieces: int, batch: int):
    """A coded input for backward: ``Rows`` whose ``part`` rebuilds rows of it, where the backward runs over
    ranges and the codes cut by the batch's rows (``rows_rebuild``); else the whole tensor."""
    shape, stride, dtype = layout
    rows = rows_rebuild(packed, params, spec.bits, spec.group, shape, stride, dtype)
    if pieces > 1 and rows.part is not None and len(shape) > 1 and shape[0] == batch:
        return rows
    return rows.whole()


def _by_rows(ctx, full: List[Any], wanted: int, grad: torch.Tensor, kept: List[torch.Tensor]
             ) -> List[Optional[torch.Tensor]]:
    """The gradients of the ``wanted`` leaves of ``full`` that need one (rebuilt or kept tensors, ``RowsOf``) from
    the op run again over ``ctx.pieces`` ranges of the batch (``attention_pieces``): tensors whose first dimension
    is the batch are cut by rows (a ``RowsOf`` rebuilds its rows), the others (a broadcast mask) go whole to every
    range and sum their gradients; dropout gets each range's rows of the forward's draws (``kept``)."""
    spec, batch = ctx.spec, grad.shape[0]
    fn = resolve(spec.recompute or spec.target)
    out_grads: List[Optional[torch.Tensor]] = [None] * wanted
    for a, b in row_ranges(batch, ctx.pieces):
        part, leaves = list(full), []
        for i, t in enumerate(full):
            if isinstance(t, RowsOf):
                part[i] = t.part(a, b).requires_grad_(t.requires_grad)
                if t.requires_grad:
                    leaves.append((part[i], True))
            elif isinstance(t, torch.Tensor):
                cut = t.dim() > 0 and t.shape[0] == batch
                part[i] = (t[a:b] if cut else t).detach().requires_grad_(t.requires_grad)
                if t.requires_grad:
                    leaves.append((part[i], cut))
        args, kwargs = tree_unflatten(part, ctx.treedef)
        replayer = Replayer(kept, ctx.draw_shapes, a, b, spec.node) if spec.random else contextlib.nullcontext()
        with replayer, torch.enable_grad(), replayed_autocast(ctx.autocast):
            out = fn(*args, **kwargs)
        if spec.random:
            replayer.finish()
        got = torch.autograd.grad(out, [t for t, _ in leaves], grad[a:b], allow_unused=True)
        del out
        for j, ((t, cut), g) in enumerate(zip(leaves, got)):
            if g is None:
                continue
            if not cut:
                out_grads[j] = g if out_grads[j] is None else out_grads[j].add_(g)
                continue
            if out_grads[j] is None:
                out_grads[j] = g.new_zeros((batch, *g.shape[1:])) if a else g.new_empty((batch, *g.shape[1:]))
            out_grads[j][a:b] = g
        del got
    return out_grads


def _split(args: tuple, kwargs: dict):
    """(leaves, leaves without their tensors, treedef, the tensors' leaf indices) of (args, kwargs)."""
    leaves, treedef = tree_flatten((tuple(args), dict(kwargs)))
    slots = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    shell = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    return leaves, shell, treedef, slots


@graph_leaf
def coded_call(spec: CodedSpec, args: tuple, kwargs: dict, codes: tuple):
    """``resolve(spec.target)(*args, **kwargs)``, keeping the tensors at ``spec.coded`` as ``codes`` (a flat
    tuple of packed codes and group parameters per coded tensor, in leaf order) for backward."""
    leaves, shell, treedef, slots = _split(args, kwargs)
    tensors = [leaves[i] for i in slots]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return resolve(spec.target)(*args, **kwargs)
    if any(not isinstance(leaves[i], torch.Tensor) for i in spec.coded):
        raise MemoptError(f"coded op {spec.node}: argument {spec.coded} is not a tensor at run time; the graph was "
                          f"planned for other inputs (re-run memopt.optimize)")
    flat_codes = [t for pair in codes for t in pair]
    return _CodedCall.apply(spec, treedef, shell, slots, *tensors, *flat_codes)


class _SoftmaxCoded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: CodedSpec, dim: int, x, args: tuple, kwargs: dict):
        out = resolve(spec.target)(x, *args, **kwargs)
        packed, params = group_quantize(out, spec.bits, spec.group, False)
        ctx.spec, ctx.dim, ctx.layout, ctx.in_dtype = spec, dim, _layout(out), x.dtype
        ctx.save_for_backward(packed, params)
        return out

    @staticmethod
    def backward(ctx, grad):
        _check_backward(ctx.spec.node)
        packed, params = ctx.saved_tensors
        y = group_dequantize(packed, params, ctx.spec.bits, ctx.spec.group, _like(ctx.layout, grad.device))
        grad_x = torch._softmax_backward_data(grad.to(y.dtype), y, ctx.dim, ctx.in_dtype)
        return None, None, grad_x, None, None


@graph_leaf
def softmax_coded(spec: CodedSpec, dim: int, x, args: tuple, kwargs: dict):
    """``resolve(spec.target)(x, *args, **kwargs)``, a softmax over ``dim``, keeping its output as codes."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return resolve(spec.target)(x, *args, **kwargs)
    return _SoftmaxCoded.apply(spec, dim, x, args, kwargs)
