"""Reversible segments at run time: keep a segment's outputs, rebuild its inputs in backward.

A segment is a list of steps over named *streams* (tensors):

- a coupling step ``u' = u + H(V)`` (or ``u - H(V)``, or ``H(V) + u``) where ``H`` reads only the
  other streams ``V`` and parameters. Backward recomputes ``h = H(V)`` with grad, rebuilds
  ``u = u' - h`` (or ``u' + h``), passes ``grad_u = grad_u'`` and back-propagates ``grad_u'``
  through ``H`` into ``V`` and ``H``'s parameters: one extra forward of each ``H``;
- a glue step: an op that only moves elements (reshape, permute, chunk, cat of all streams, pixel
  (un)shuffle, flip, ...). Such an op is a permutation ``P``, so its vector-Jacobian product is
  ``P^T = P^-1``: backward rebuilds the inputs and their gradients through autograd of the op on a
  dummy input, bitwise exactly, without a table of inverses.

The forward runs the original ops in the original order under ``no_grad`` (outputs bit-identical)
and keeps, through ``ctx.save_for_backward``, only the segment outputs, the RNG states of steps
whose ``H`` is random (replayed in backward, never redrawn) and, on sentinel steps, the inputs to
compare the rebuilt ones against. BatchNorm running statistics inside ``H`` are restored after the
recomputation, so they are updated once per step as in the original model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from memopt.core.leaf import graph_leaf
from memopt.runtime.rng import replayed_rng, rng_state
from memopt.runtime.autocast import autocast_state, replayed_autocast

log = logging.getLogger("memopt")
_BatchNorm = nn.modules.batchnorm._BatchNorm


@dataclass(frozen=True)
class StepSpec:
    """One step. ``kind``: "coupling", "glue" or "bijection" (aggressive mode: an elementwise map
    with a closed-form inverse, see ``_invert``). For a coupling: ``reads`` = (u, *V), ``writes`` =
    (u',), ``target`` the original add/sub callable, ``u_first`` whether u is its first argument and
    ``sign`` +1 for ``u' = u + h`` / ``h + u``, -1 for ``u' = u - h``. ``module`` names the step's
    GraphModule child (H for a coupling, the op for glue); ``where`` is the node for messages."""

    kind: str
    reads: Tuple[str, ...]
    writes: Tuple[str, ...]
    module: str
    where: str
    target: Optional[Callable] = None
    u_first: bool = True
    sign: int = 1
    random: bool = False
    # glue: "split", "cat", "reshape", "identity", "permute", "transpose", "flip", "pixel_shuffle",
    # "pixel_unshuffle" (explicit inverse) or "" (inverted through autograd on a dummy input);
    # bijection: "leaky_relu", "affine", "batch_norm" or "layer_norm"
    inverse: str = ""
    params: Tuple[Any, ...] = ()  # bijection: (slope,), (op, constant) or (norm module path,)


class ReversibleSegment(nn.Module):
    """The steps of one segment and their sub-graphs (children ``step_0``, ``step_1``, ...)."""

    def __init__(self, name: str, inputs: Sequence[str], outputs: Sequence[str], steps: Sequence[StepSpec],
                 modules: Dict[str, nn.Module], check_every: Optional[int] = None, tolerance: float = 1e-3) -> None:
        super().__init__()
        self.name, self.inputs, self.outputs, self.steps = name, tuple(inputs), tuple(outputs), tuple(steps)
        for key, module in modules.items():
            self.add_module(key, module)
        self.check_every, self.tolerance = check_every, tolerance
        self.calls = 0
        self.last_check: Optional[float] = None  # relative error of the rebuilt inputs at the last sentinel

    def step_params(self, step: StepSpec) -> List[nn.Parameter]:
        return [p for p in getattr(self, step.module).parameters() if p.requires_grad]

    def params(self) -> List[nn.Parameter]:
        seen: Dict[int, nn.Parameter] = {}
        for step in self.steps:
            for p in self.step_params(step):
                seen.setdefault(id(p), p)
        return list(seen.values())

    def bn_buffers(self) -> List[torch.Tensor]:
        return [b for m in self.modules() if isinstance(m, _BatchNorm) and m.training
                for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


def _as_tuple(value: Any) -> Tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def run_forward(segment: ReversibleSegment, inputs: Sequence[torch.Tensor],
                on_step: Optional[Callable[[int, Dict[str, torch.Tensor]], None]] = None
                ) -> Tuple[List[torch.Tensor], Dict[int, List[torch.Tensor]], Dict[int, Tuple]]:
    """Run the steps (no autograd); returns the outputs, per step index the tensors backward needs
    besides the outputs (RNG states of random couplings, per-channel statistics of BatchNorm
    bijections), and the input shapes of glue steps. ``on_step(k, state)`` sees the streams before
    step k and after the last."""
    state = dict(zip(segment.inputs, inputs))
    extras: Dict[int, List[torch.Tensor]] = {}
    shapes: Dict[int, Tuple] = {}
    for k, step in enumerate(segment.steps):
        if on_step is not None:
            on_step(k, state)
        module = getattr(segment, step.module)
        if step.kind == "coupling":
            sources = [state[name] for name in step.reads[1:]]
            if step.random:
                extras[k] = rng_state(sources)
            h = module(*sources)
            u = state.pop(step.reads[0])
            state[step.writes[0]] = step.target(u, h) if step.u_first else step.target(h, u)
        else:
            reads = [state.pop(name) for name in step.reads]
            if step.kind == "bijection":
                side = _side_info(step, module, reads[0])
                if side:
                    extras[k] = side
            shapes[k] = tuple((t.shape, t.dtype) for t in reads)
            state.update(zip(step.writes, _as_tuple(module(*reads))))
    if on_step is not None:
        on_step(len(segment.steps), state)
    return [state[name] for name in segment.outputs], extras, shapes


def _batch_norm(module: nn.Module, step: StepSpec) -> nn.Module:
    return module.get_submodule(step.params[0])


def _norm_dims(step: StepSpec, norm: nn.Module, x: torch.Tensor) -> List[int]:
    """The dimensions a norm reduces over: all but channels (BatchNorm), the last ones (LayerNorm)."""
    if step.inverse == "batch_norm":
        return [d for d in range(x.dim()) if d != 1]
    return list(range(x.dim() - len(norm.normalized_shape), x.dim()))


def _side_info(step: StepSpec, module: nn.Module, x: torch.Tensor) -> List[torch.Tensor]:
    """What inverting the bijection needs besides its output: a norm's mean and std (per channel
    for BatchNorm, per row for LayerNorm), kept with their reduced dimensions."""
    if step.inverse not in ("batch_norm", "layer_norm"):
        return []
    norm = _batch_norm(module, step)
    var, mean = torch.var_mean(x.float(), dim=_norm_dims(step, norm, x), unbiased=False, keepdim=True)
    return [mean, torch.sqrt(var + norm.eps)]


def _invert(step: StepSpec, module: nn.Module, y: torch.Tensor, side: List[torch.Tensor]) -> torch.Tensor:
    """The input of a bijection from its output: LeakyReLU y<0 -> y/slope; affine with a constant;
    BatchNorm (train mode) / LayerNorm x = (y - beta) / gamma * std + mean with the statistics kept."""
    if step.inverse == "leaky_relu":
        return torch.where(y >= 0, y, y / step.params[0])
    if step.inverse == "affine":
        op, c = step.params
        return {"mul": y / c, "div": y * c, "add": y - c, "sub": y + c}[op]
    norm = _batch_norm(module, step)
    mean, std = side
    if step.inverse == "batch_norm":
        shape = [1, -1] + [1] * (y.dim() - 2)
        weight, bias = norm.weight.view(shape), norm.bias.view(shape)
    else:
        weight = norm.weight
        bias = norm.bias if norm.bias is not None else torch.zeros_like(weight)
    return ((y.float() - bias) / weight * std + mean).to(y.dtype)


def undo_steps(segment: ReversibleSegment, outputs: Sequence[torch.Tensor], extras: Dict[int, List[torch.Tensor]],
               shapes: Dict[int, Tuple], grads: Optional[Sequence[Optional[torch.Tensor]]] = None,
               on_step: Optional[Callable[[int, Dict[str, torch.Tensor]], None]] = None
               ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Optional[torch.Tensor]], Dict[int, torch.Tensor]]:
    """Walk the steps backwards from the outputs: rebuild every stream, and with ``grads`` also the
    gradients of the streams and of the parameters (by ``id``). ``on_step(k, state)`` sees the
    rebuilt streams before step k. Returns (input streams, their gradients, parameter gradients)."""
    state = {name: t.detach() for name, t in zip(segment.outputs, outputs)}
    stream_grads: Dict[str, Optional[torch.Tensor]] = dict(zip(segment.outputs, grads)) if grads is not None else {}
    param_grads: Dict[int, torch.Tensor] = {}
    for k in range(len(segment.steps) - 1, -1, -1):
        step = segment.steps[k]
        module = getattr(segment, step.module)
        wanted = stream_grads if grads is not None else None
        if step.kind == "coupling":
            _undo_coupling(segment, step, module, state, wanted, param_grads, extras.get(k))
        elif step.kind == "glue":
            _undo_glue(step, module, state, wanted, shapes[k])
        else:
            _undo_bijection(segment, step, module, state, wanted, param_grads, extras.get(k, []))
        if on_step is not None:
            on_step(k, state)
    return ({name: state[name] for name in segment.inputs},
            {name: stream_grads.get(name) for name in segment.inputs}, param_grads)


def _undo_bijection(segment: ReversibleSegment, step: StepSpec, module: nn.Module, state: Dict[str, torch.Tensor],
                    grads: Optional[Dict[str, Optional[torch.Tensor]]], param_grads: Dict[int, torch.Tensor],
                    side: List[torch.Tensor]) -> None:
    y = state.pop(step.writes[0])
    with torch.no_grad():
        x = _invert(step, module, y, side)
    state[step.reads[0]] = x
    g = grads.pop(step.writes[0], None) if grads is not None else None
    if grads is None:
        return
    grads[step.reads[0]] = None
    if g is None:
        return
    params = segment.step_params(step)
    x_d = x.detach().requires_grad_(True)
    with torch.enable_grad():
        again = module(x_d)  # a train-mode BatchNorm recomputes its statistics from the rebuilt input
    found = torch.autograd.grad(again, [x_d, *params], g, allow_unused=True)
    grads[step.reads[0]] = found[0]
    _accumulate(param_grads, params, found[1:])


def _accumulate(param_grads: Dict[int, torch.Tensor], params: Sequence[torch.Tensor],
                found: Sequence[Optional[torch.Tensor]]) -> None:
    for p, gp in zip(params, found):
        if gp is not None:
            param_grads[id(p)] = gp if id(p) not in param_grads else param_grads[id(p)] + gp


def _undo_coupling(segment: ReversibleSegment, step: StepSpec, module: nn.Module, state: Dict[str, torch.Tensor],
                   grads: Optional[Dict[str, Optional[torch.Tensor]]], param_grads: Dict[int, torch.Tensor],
                   rng: Optional[List[torch.Tensor]]) -> None:
    u_name, sources, out_name = step.reads[0], step.reads[1:], step.writes[0]
    values = [state[name] for name in sources]
    want = grads is not None and grads.get(out_name) is not None
    inputs = [v.detach().requires_grad_(want) for v in values]
    params = segment.step_params(step) if want else []
    with replayed_rng(rng, values):
        with torch.set_grad_enabled(want):
            h = module(*inputs)
    out = state.pop(out_name)
    with torch.no_grad():
        state[u_name] = (out - h if step.sign > 0 else out + h).to(out.dtype)
    del out  # u' is dead once u is rebuilt: not alive during H's backward
    if grads is None:
        return
    g = grads.pop(out_name, None)
    grads[u_name] = g
    if g is None:
        return
    wanted = inputs + params
    found = torch.autograd.grad(h, wanted, g if step.sign > 0 else -g, allow_unused=True)
    for name, gs in zip(sources, found[:len(inputs)]):
        if gs is not None:
            grads[name] = gs if grads.get(name) is None else grads[name] + gs
    _accumulate(param_grads, params, found[len(inputs):])


def _permutation_inverse(step: StepSpec, ys: Sequence[torch.Tensor], shapes: Tuple) -> List[torch.Tensor]:
    """The inverse of a glue op named by ``step.inverse`` (see passes/reversible/segments.py ``glue_inverse``).
    It is also the op's VJP (a permutation's transpose is its inverse), so it maps gradients too.
    Views where the layout allows (split, reshape, permute): no copy."""
    kind, params = step.inverse, step.params
    if kind == "split":
        dim = params[0]
        return list(torch.split(ys[0], [shape[dim] for shape, _ in shapes], dim))
    if kind == "cat":
        return [torch.cat(list(ys), params[0])]
    if kind == "reshape":
        return [ys[0].reshape(shapes[0][0])]
    if kind == "identity":
        return [ys[0]]
    if kind == "permute":
        dims = [d % ys[0].dim() for d in params[0]]
        return [ys[0].permute([dims.index(i) for i in range(len(dims))])]
    if kind == "transpose":
        return [ys[0].transpose(*params)]
    if kind == "flip":
        return [ys[0].flip(params[0])]
    if kind == "pixel_shuffle":
        return [F.pixel_shuffle(ys[0], params[0])]
    if kind == "pixel_unshuffle":
        return [F.pixel_unshuffle(ys[0], params[0])]
    raise ValueError(f"memopt: no inverse {kind!r} for glue step {step.where}")


def _undo_glue(step: StepSpec, module: nn.Module, state: Dict[str, torch.Tensor],
               grads: Optional[Dict[str, Optional[torch.Tensor]]], shapes: Tuple) -> None:
    outs = [state.pop(name) for name in step.writes]
    if step.inverse and step.inverse != "vjp":
        state.update(zip(step.reads, _permutation_inverse(step, outs, shapes)))
        if grads is not None:
            out_grads = [grads.pop(name, None) for name in step.writes]
            if all(g is None for g in out_grads):
                grads.update({name: None for name in step.reads})
            else:
                filled = [g if g is not None else torch.zeros_like(o) for g, o in zip(out_grads, outs)]
                grads.update(zip(step.reads, _permutation_inverse(step, filled, shapes)))
        return
    dummies = [torch.empty(shape, dtype=dtype, device=outs[0].device, requires_grad=True) for shape, dtype in shapes]
    with torch.enable_grad():
        ys = _as_tuple(module(*dummies))
    cotangents = list(outs)
    out_grads = [grads.pop(name, None) for name in step.writes] if grads is not None else []
    have_grads = grads is not None and any(g is not None for g in out_grads)
    if have_grads:
        cotangents += [g if g is not None else torch.zeros_like(o) for g, o in zip(out_grads, outs)]
    # one VJP of the stacked cotangents would need batching; two calls on one small graph are cheaper to read
    values = torch.autograd.grad(ys, dummies, cotangents[:len(outs)], retain_graph=have_grads)
    state.update(zip(step.reads, values))
    if grads is not None:
        rebuilt = torch.autograd.grad(ys, dummies, cotangents[len(outs):]) if have_grads else [None] * len(step.reads)
        grads.update(zip(step.reads, rebuilt))


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segment: ReversibleSegment, n_inputs: int, *tensors: torch.Tensor):
        inputs = tensors[:n_inputs]
        real = _is_real(inputs[0])  # the cost model runs this on fake tensors: no counting, no sentinel
        segment.calls += real
        # detached: views of inputs made here must not look differentiable to module hooks (no grad_fn)
        detached = [t.detach() for t in inputs]
        sentinel = real and bool(segment.check_every) and segment.calls % segment.check_every == 0
        with torch.no_grad():
            outputs, extras, shapes = run_forward(segment, detached)
        ctx.segment, ctx.n_inputs, ctx.shapes, ctx.sentinel = segment, n_inputs, shapes, sentinel
        ctx.autocast = autocast_state()
        ctx.extra_sizes = [(k, len(v)) for k, v in sorted(extras.items())]
        ctx.save_for_backward(*outputs, *[t for _, v in sorted(extras.items()) for t in v],
                              *(inputs if sentinel else ()))
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        segment: ReversibleSegment = ctx.segment
        if torch.is_grad_enabled():  # create_graph=True: a second derivative was asked for
            raise RuntimeError(f"memopt: double backward through the reversible segment {segment.name} is not "
                               f"supported; leave it exact (ReversibleConfig(segments=...) without it, or "
                               f"Config(reversible=None)) to take second derivatives")
        saved = ctx.saved_tensors
        n_out = len(segment.outputs)
        outputs, rest = saved[:n_out], saved[n_out:]
        extras, at = {}, 0
        for k, size in ctx.extra_sizes:
            extras[k] = list(rest[at:at + size])
            at += size
        stats = [(b, b.clone()) for b in segment.bn_buffers()]
        with replayed_autocast(ctx.autocast):  # H must run as it ran in forward, or u = u' - H(V) is off
            inputs, input_grads, param_grads = undo_steps(segment, outputs, extras, ctx.shapes, list(grads))
        with torch.no_grad():  # after every grad: BN backward reads the running stats' versions
            for buffer, before in stats:  # the forward already updated them once
                buffer.copy_(before)
        if ctx.sentinel:
            _sentinel(segment, [inputs[name] for name in segment.inputs], rest[at:])
        params = segment.params()
        return (None, None, *[input_grads[name] for name in segment.inputs],
                *[param_grads.get(id(p)) for p in params])


def _is_real(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not t.is_meta and not isinstance(t, FakeTensor)


def relative_error(rebuilt: Sequence[torch.Tensor], true: Sequence[torch.Tensor]) -> float:
    """max over tensors of ||rebuilt - true|| / ||true|| (in float64; 0 for two zero tensors)."""
    worst = 0.0
    for a, b in zip(rebuilt, true):
        norm = b.double().norm().item()
        diff = (a.double() - b.double()).norm().item()
        worst = max(worst, diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def _sentinel(segment: ReversibleSegment, rebuilt: Sequence[torch.Tensor], true: Sequence[torch.Tensor]) -> None:
    error = relative_error(rebuilt, true)
    segment.last_check = error
    if not error <= segment.tolerance:
        log.warning("memopt: reversible segment %s rebuilt its inputs with relative error %.3g at call %d, above "
                    "the tolerance %.3g: training has made the reconstruction inaccurate; re-optimize with "
                    "ReversibleConfig(anchor_every=...) or without this segment", segment.name, error,
                    segment.calls, segment.tolerance)


@graph_leaf
def reversible_segment(segment: ReversibleSegment, *inputs: torch.Tensor) -> Any:
    """Run ``segment`` on ``inputs`` keeping only its outputs for backward."""
    params = segment.params()
    if not torch.is_grad_enabled() or not (params or any(t.requires_grad for t in inputs)):
        with torch.no_grad():
            outputs, _, _ = run_forward(segment, inputs)
        return tuple(outputs) if len(outputs) > 1 else outputs[0]
    return _Reversible.apply(segment, len(inputs), *inputs, *params)
