"""The reversible pass: checked pieces of reversible segments become one call that keeps its outputs.

Segments come from ``passes/reversible/find.py``; each is turned into a ``ReversibleSegment``
(memopt/reversible/ops.py: one sub-graph per step, H for a coupling, the op for glue), checked on
the example inputs (memopt/reversible/check.py) and cut into pieces; every piece with a coupling is
replaced in the graph by one ``reversible_segment`` call. Steps that fail the check, and whole
candidates that break a rule, stay exact with the reason in ``node.meta["memopt_decision"]``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from torch import fx, nn

from memopt.cost_model.analysis import Estimate, annotate
from memopt.core.meta import META_KEY
from memopt.reversible.ops import ReversibleSegment, StepSpec, reversible_segment
from memopt.core.meta import DECISION_KEY
from memopt.reversible.check import check_segment, sub_segment, true_values
from memopt.reversible.config import ReversibleConfig
from memopt.passes.base import PassContext, PassResult, PlannerHooks, node_numel, register_pass
from memopt.passes.reversible.find import CATS, SPLITS, FoundStep, Segment, find_segments, is_random, op_key

aten = torch.ops.aten


def boundaries(segment: Segment) -> List[List[fx.Node]]:
    """The streams before each step and after the last."""
    streams = list(segment.inputs)
    out = [list(streams)]
    for step in segment.steps:
        at = min(streams.index(r) for r in step.reads if r in streams) if step.kind != "coupling" else \
            streams.index(step.reads[0])
        if step.kind == "coupling":
            streams[at] = step.node
        else:
            streams = [s for s in streams[:at] if s not in step.reads] + list(step.writes) + \
                      [s for s in streams[at:] if s not in step.reads]
        out.append(list(streams))
    return out


def _step_module(gm: fx.GraphModule, step: FoundStep, k: int) -> fx.GraphModule:
    """H (sources -> h) for a coupling; the op itself (reads -> writes) for glue and bijections."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    reads = step.reads[1:] if step.kind == "coupling" else step.reads
    for node in reads:
        env[node] = graph.placeholder(node.name)
    body = step.cone if step.kind == "coupling" else [step.node] + [w for w in step.writes if w is not step.node]
    for node in body:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.get_attr(arg.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    if step.kind == "coupling":
        u = step.reads[0]
        h = step.node.args[1] if step.node.args[0] is u else step.node.args[0]
        graph.output(env[h])
    else:
        outs = [env[w] for w in step.writes]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    return fx.GraphModule(gm, graph, class_name=f"ReversibleStep{k}")


_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", torch.flatten, torch.reshape,
             torch.squeeze, torch.unsqueeze, aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
             aten.squeeze, aten.unsqueeze}


def glue_inverse(node: fx.Node, modules: Dict[str, nn.Module]) -> Tuple[str, tuple]:
    """(inverse kind, constant params) of a glue node for ``memopt.reversible.ops``; ("vjp", ())
    when its arguments are not constants or the op has no explicit inverse here."""
    if node.op == "call_module":
        module = modules.get(node.target)
        if isinstance(module, (nn.Flatten, nn.Unflatten)):
            return "reshape", ()
        if isinstance(module, nn.PixelUnshuffle):
            return "pixel_shuffle", (module.downscale_factor,)
        if isinstance(module, nn.PixelShuffle):
            return "pixel_unshuffle", (module.upscale_factor,)
        return "vjp", ()
    key = op_key(node)
    args, kwargs = node.args, node.kwargs

    def arg(i: int, name: str, default: Any) -> Any:
        return kwargs.get(name, args[i] if len(args) > i else default)

    try:
        if key in CATS:
            found = "split", (arg(1, "dim", 0),)
        elif key in SPLITS:
            found = "cat", (arg(2, "dim", 0),)
        elif key in _RESHAPES:
            found = "reshape", ()
        elif key in ("contiguous", aten.clone, aten.alias):
            found = "identity", ()
        elif key in ("permute", torch.permute, aten.permute):
            dims = args[1:] if node.op == "call_method" and len(args) > 2 else arg(1, "dims", None)
            found = "permute", (tuple(dims),)
        elif key in ("transpose", torch.transpose, aten.transpose):
            found = "transpose", (arg(1, "dim0", None), arg(2, "dim1", None))
        elif key in ("t", aten.t):
            found = "transpose", (0, 1)
        elif key in ("flip", torch.flip, aten.flip):
            found = "flip", (tuple(arg(1, "dims", None)),)
        elif key in (F.pixel_unshuffle, torch.pixel_unshuffle, aten.pixel_unshuffle):
            found = "pixel_shuffle", (arg(1, "downscale_factor", None),)
        elif key in (F.pixel_shuffle, torch.pixel_shuffle, aten.pixel_shuffle):
            found = "pixel_unshuffle", (arg(1, "upscale_factor", None),)
        else:
            return "vjp", ()
    except TypeError:  # unhashable target, or dims not a sequence
        return "vjp", ()
    flat = [v for p in found[1] for v in (p if isinstance(p, tuple) else (p,))]
    return found if all(isinstance(v, int) and not isinstance(v, bool) for v in flat) else ("vjp", ())


def build_segment(gm: fx.GraphModule, segment: Segment, cfg: ReversibleConfig) -> ReversibleSegment:
    modules = dict(gm.named_modules())
    specs, children = [], {}
    for k, step in enumerate(segment.steps):
        key = f"step_{k}"
        children[key] = _step_module(gm, step, k)
        random = step.kind == "coupling" and any(is_random(n, modules) for n in step.cone)
        inverse, params = glue_inverse(step.node, modules) if step.kind == "glue" else (step.inverse, step.params)
        specs.append(StepSpec(step.kind, tuple(n.name for n in step.reads), tuple(n.name for n in step.writes), key,
                              step.node.format_node(), step.target, step.u_first, step.sign, random, inverse, params))
    return ReversibleSegment(segment.name, [n.name for n in segment.inputs], [n.name for n in segment.outputs],
                             specs, children, cfg.check_every, cfg.tolerance)


def _piece_name(segment: Segment, start: int, end: int) -> str:
    first = next(s.node for s in segment.steps[start:end] if s.kind == "coupling")
    return f"reversible_{first.name}"


def _install(gm: fx.GraphModule, segment: Segment, runtime: ReversibleSegment, start: int, end: int,
             bounds: List[List[fx.Node]], reason: str, grad_error: Optional[float]) -> bool:
    names = [[n.name for n in b] for b in bounds]
    name = _piece_name(segment, start, end)
    piece = sub_segment(runtime, start, end, names, name=name, check_every=runtime.check_every,
                        tolerance=runtime.tolerance)
    by_name = {n.name: n for b in bounds for n in b}
    inputs = [by_name[s] for s in piece.inputs]
    outputs = [by_name[s] for s in piece.outputs]
    steps = segment.steps[start:end]
    inside = [n for s in steps for n in (*s.cone, s.node, *[w for w in s.writes if w is not s.node])]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inside.sort(key=order.__getitem__)
    late = [n.name for n in inputs if order[n] > order[inside[0]]]
    if late:
        _mark([s.node for s in steps if s.kind == "coupling"],
              f"{inside[0].name} runs before {late[0]}, an input of the piece: the graph's order does not allow "
              f"one call")
        return False
    attr = f"memopt_{name}"
    gm.add_submodule(attr, piece)
    decision = {"technique": "reversible", "bits": None, "unit": name, "replaces": [n.name for n in inside],
                "reason": reason, "grad_error": grad_error}
    with gm.graph.inserting_before(inside[0]):
        module_node = gm.graph.get_attr(attr)
        call = gm.graph.create_node("call_function", reversible_segment, (module_node, *inputs), name=name)
        news = [call] if len(outputs) == 1 else [gm.graph.call_function(operator.getitem, (call, i))
                                                 for i in range(len(outputs))]
    call.meta[DECISION_KEY] = decision
    for old, new in zip(outputs, news):
        if new is not call:
            new.meta[DECISION_KEY] = dict(decision, replaces=[])
        if META_KEY in old.meta:  # shapes for later passes' checks (the re-annotation replaces it)
            new.meta[META_KEY] = dataclasses.replace(old.meta[META_KEY], name=new.name, saved=[], flops=0)
    for old, new in zip(outputs, news):
        if old not in inputs:
            old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for node in reversed(inside):
        if node not in inputs:
            gm.graph.erase_node(node)
    attributes = {a for n in inside for a in n.all_input_nodes if a.op == "get_attr"}
    for node in attributes:
        if node.graph is gm.graph and not node.users:
            gm.graph.erase_node(node)
    return True


def _mark(nodes: Sequence[fx.Node], reason: str) -> None:
    for node in nodes:
        node.meta.setdefault(DECISION_KEY, {"technique": "exact", "reason": f"reversible: {reason}"})


def _reversible_fidelity(new: fx.Node, baseline: Estimate, unit: str) -> float:
    """The checked relative gradient error squared times the elements the piece replaces (an MSE
    on the same scale as the others'); unchecked pieces (fake inputs) count as exact."""
    decision = new.meta[DECISION_KEY]
    if new.target is not reversible_segment or not decision.get("grad_error"):
        return 0.0
    return decision["grad_error"] ** 2 * sum(node_numel(baseline, n) for n in decision["replaces"])


_PLANNER = PlannerHooks(
    fidelity=_reversible_fidelity,
    levels=lambda cfg: (None,), reruns_forward=True)


@register_pass(ReversibleConfig, planner=_PLANNER)
def reversible_pass(gm: fx.GraphModule, cfg: ReversibleConfig, ctx: PassContext) -> PassResult:
    segments, reasons = find_segments(gm, aggressive=cfg.mode == "aggressive")
    for node, why in reasons.items():
        _mark([node], why)
    examples = ctx.examples
    modified = False
    for segment in segments:
        bounds = boundaries(segment)
        runtime = build_segment(gm, segment, cfg)
        names = [[n.name for n in b] for b in bounds]
        coupling_nodes = [s.node for s in segment.steps if s.kind == "coupling"]
        grad_errors: Dict[tuple, Optional[float]] = {}
        if examples is None:
            result_pieces = [(0, len(segment.steps), "not checked: no real example inputs (estimate on fake or "
                                                     "meta tensors); the check runs when the model first trains")]
            if cfg.anchor_every is not None:
                result_pieces = _anchored(segment, cfg.anchor_every)
        else:
            key = ("check", tuple(s.node.name for s in segment.steps), cfg)
            if key not in examples.cache:
                wanted = list(segment.inputs) + list(segment.outputs)
                values = true_values(gm, examples, wanted)
                random = any(s.random for s in runtime.steps)
                true_out = None if random else [values[n.name] for n in segment.outputs]
                examples.cache[key] = check_segment(runtime, [values[n.name] for n in segment.inputs], true_out,
                                                    names, cfg.threshold, cfg.tolerance, cfg.anchor_every, gm)
            result = examples.cache[key]
            if not result.forward_ok:
                _mark(coupling_nodes, result.why)
                continue
            for k, why in result.dropped.items():
                _mark([segment.steps[k].node], why)
            result_pieces = []
            for piece in result.pieces:
                steps = segment.steps[piece.start:piece.end]
                if not any(s.kind == "coupling" for s in steps):
                    continue
                if piece.rejected:
                    _mark([s.node for s in steps if s.kind == "coupling"], piece.rejected)
                    continue
                grad_errors[(piece.start, piece.end)] = piece.grad_error
                result_pieces.append((piece.start, piece.end,
                                      f"reversible: {sum(s.kind == 'coupling' for s in steps)} couplings rebuilt "
                                      f"from the outputs; checked on the example inputs: rebuilt-input error "
                                      f"{piece.rebuild_error:.1e}, gradient error {piece.grad_error:.1e} (relative)"))
        for start, end, reason in reversed(result_pieces):
            if not any(s.kind == "coupling" for s in segment.steps[start:end]):
                continue
            name = _piece_name(segment, start, end)
            if not ctx.selects("reversible", name, cfg.segments):
                continue
            modified |= _install(gm, segment, runtime, start, end, bounds, reason, grad_errors.get((start, end)))
    if modified and (ctx.args or ctx.kwargs):
        # later passes read which nodes keep which storage: a segment input is no longer kept by the
        # ops now inside the segment (e.g. few-bit on the stem's ReLU frees its output now)
        gm.graph.lint()
        gm.recompile()
        annotate(gm, ctx.args, ctx.kwargs, device=ctx.device, simulate=False)
    return PassResult(gm, modified)


def _anchored(segment: Segment, every: int) -> List[tuple]:
    pieces, start, count = [], 0, 0
    for k, step in enumerate(segment.steps):
        if step.kind == "coupling":
            if count == every:
                pieces.append((start, k, "not checked: no real example inputs; anchored"))
                start, count = k, 0
            count += 1
    pieces.append((start, len(segment.steps), "not checked: no real example inputs; anchored"))
    return pieces
