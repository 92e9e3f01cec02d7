"""Parameters whose gradient is BatchNorm's eps term: everything before a training-mode BatchNorm over 2 values.

A training-mode BatchNorm that normalises only two values per channel (batch 2 at a 1x1 map: the last stage of a
CNN at 32x32, a BatchNorm1d on a batch of 2) outputs ``±1`` times its weight plus its bias whatever its input is,
up to eps: ``(x1 - x2) / 2 / sqrt((x1 - x2)^2 / 4 + eps)`` is the sign of the difference, smoothed by eps. What
reaches the loss only through such an input has a gradient that is eps's sensitivity, not the model's (timm
MobileNetV3 at batch 2, 32x32, float64: every such gradient falls from O(1) to ~1e-13 with eps at 1e-12). Float32
may resolve it, but any approximation of the backward moves it by its own error's size, so a cosine against it
says nothing about the plan: the fidelity gate lists these parameters apart with the reason, as it does those a
BatchNorm cancels (``invariant_params``). Which parameters: those whose every path to the outputs enters such a
BatchNorm as its input; the BatchNorm's own weight and bias act after the normalisation and keep their gradients.
"""
from __future__ import annotations

import math
from typing import Dict, List, Set

from torch import fx, nn

from memopt.capture.fused_norms import OWNER_ATTRIBUTE
from memopt.fidelity.graph_reads import output_shape, reads_metadata, training_batch_norm

DEGENERATE = 2  # values per channel at or below which a training BatchNorm's output no longer depends on its input


def degenerate_norms(gm: fx.GraphModule, scale: float) -> Dict[fx.Node, int]:
    """{BatchNorm node: values per channel} for the training-mode BatchNorms of ``gm`` that normalise at most
    ``DEGENERATE`` values per channel when run on ``scale`` times the batch of the graph's recorded shapes (the
    fidelity gate runs a graph planned on the whole batch on a slice of it)."""
    modules = dict(gm.named_modules())
    out: Dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if not node.args or not isinstance(node.args[0], fx.Node) or not training_batch_norm(node, modules):
            continue
        found = output_shape(node.args[0])
        if not found or len(found) < 2:
            continue
        values = round(found[0] * scale) * math.prod(found[2:])
        if values <= DEGENERATE:
            out[node] = values
    return out


def _parameters(node: fx.Node, modules: Dict[str, nn.Module]) -> List[str]:
    """The model's names of the parameters ``node`` reads directly (a module's own, or a ``get_attr``'s)."""
    if node.op == "get_attr":
        return [node.target]
    if node.op != "call_module" or node.target not in modules:
        return []
    module = modules[node.target]
    path = getattr(module, OWNER_ATTRIBUTE, node.target)  # a fused module's twin: the model's own names
    return [f"{path}.{name}" for name, _ in module.named_parameters()]


def eps_only_parameters(gm: fx.GraphModule, scale: float) -> Dict[str, str]:
    """{parameter: why} for the parameters whose every path to the outputs enters a degenerate BatchNorm
    (``degenerate_norms``) as its input."""
    norms = degenerate_norms(gm, scale)
    if not norms:
        return {}
    live: Set[fx.Node] = set()  # nodes with a path to an output that does not enter a degenerate norm's input
    # roots: the outputs, and any node nothing reads (an in-place op carries its inputs on through the tensor it
    # mutates, which no graph edge shows: such a node's inputs are taken as reaching the loss)
    stack = [n for n in gm.graph.nodes if n.op == "output" or
             (not n.users and n.op in ("call_function", "call_method", "call_module"))]
    live.update(stack)
    while stack:
        node = stack.pop()
        if reads_metadata(node):  # a shape check (timm's _assert) reads no values: no gradient flows there
            continue
        for source in node.all_input_nodes:
            if node in norms and source is node.args[0]:
                continue
            if source not in live:
                live.add(source)
                stack.append(source)
    modules = dict(gm.named_modules())
    reads: Dict[str, List[fx.Node]] = {}
    for node in gm.graph.nodes:
        for name in _parameters(node, modules):
            reads.setdefault(name, []).append(node)
    out: Dict[str, str] = {}
    for name, nodes in reads.items():
        if any(n in live for n in nodes) or not any(True for n in nodes for _ in n.users):
            continue
        behind = _first_norms(nodes, norms)
        if not behind:  # not live, yet no degenerate norm after it: not this construction
            continue
        shown = ", ".join(_name(n, modules) for n in behind[:3]) + " ..." * (len(behind) > 3)
        values = max(norms[n] for n in behind)
        out[name] = (f"reaches the loss only through the input of the training-mode BatchNorm{'s' * (len(behind) > 1)} "
                     f"{shown}, over {values} value{'s' * (values != 1)} per channel: its output is then the sign "
                     f"of their difference, so this gradient is BatchNorm's eps term (a larger batch or input "
                     f"resolves it)")
    return out


def _name(node: fx.Node, modules: Dict[str, nn.Module]) -> str:
    """A BatchNorm node by the model's module path where it has one (a fused twin: its owner's)."""
    if node.op == "call_module" and node.target in modules:
        return getattr(modules[node.target], OWNER_ATTRIBUTE, node.target)
    return node.name


def _first_norms(nodes: List[fx.Node], norms: Dict[fx.Node, int]) -> List[fx.Node]:
    """The degenerate norms that the values of ``nodes`` enter first, in graph order."""
    seen: Set[fx.Node] = set(nodes)
    stack, found = list(nodes), []
    while stack:
        for user in stack.pop().users:
            if user in norms and user.args[0] in seen:
                found.append(user)
            elif user not in seen:
                seen.add(user)
                stack.append(user)
    order = {n: i for i, n in enumerate(next(iter(norms)).graph.nodes)}
    return sorted(set(found), key=order.get)
