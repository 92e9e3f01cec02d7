"""Constants a trace builds once per call where the eager model builds them once.

Eager code often caches a tensor it derives from constants: HF BEiT's relative position index comes from an
``lru_cache``, so every attention layer gathers its bias with the same index tensor and autograd keeps that
index once. ``torch.export`` runs the cached function once per call site (the cache is off while tracing), so
the graph builds the index per layer and each gather keeps its own copy: the graph keeps more bytes than eager,
which the capture check rightly refuses, and the whole model fell back to per-submodule capture.

``share_repeated_constants`` finds the tensors of an export graph that depend on no graph input, parameter or
model buffer and no random op (in-place writes into them from constants included: BEiT fills its index with
``copy_`` and ``fill_``), evaluates them once, and where two that the model's differentiable computation reads
hold equal values, the later readers read the first: one storage, as in eager. The now unused constant chain is
removed. The capture check still compares the result with eager bit for bit.
"""
from __future__ import annotations

import logging
import operator
from typing import Dict, List, Optional, Set

import torch
from torch import fx, nn

from memopt.capture.attention_masks import _RANDOM, attribute

log = logging.getLogger("memopt")


def _writes(node: fx.Node) -> List[fx.Node]:
    """The tensor arguments ``node`` writes in place (its ATen schema says)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
            written.append(value)
    return written


def _aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s result may share its first argument's storage (a view, or an in-place op's return)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target is operator.getitem
    return bool(schema.returns) and schema.returns[0].alias_info is not None


class _Analysis:
    """Per node: whether its value may vary between steps, the storage it lives in, where it is written."""

    def __init__(self, gm: fx.GraphModule, model_state: Set[str]) -> None:
        self.root: Dict[fx.Node, fx.Node] = {}
        self.varying: Set[fx.Node] = set()  # nodes and storage roots
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.last_write: Dict[fx.Node, int] = {}
        for node in gm.graph.nodes:
            self._visit(gm, node, model_state)

    def root_of(self, node: fx.Node) -> fx.Node:
        return self.root.get(node, node)

    def _visit(self, gm: fx.GraphModule, node: fx.Node, model_state: Set[str]) -> None:
        inputs = node.all_input_nodes
        if node.op == "get_attr":
            value = attribute(gm, node.target)
            varies = node.target in model_state or isinstance(value, nn.Parameter) or (
                isinstance(value, torch.Tensor) and value.requires_grad)
        elif node.op == "call_function" and (getattr(node.target, "_schema", None) is not None
                                             or node.target is operator.getitem):
            name = getattr(node.target, "__name__", str(node.target))
            varies = any(word in name for word in _RANDOM + ("empty",)) or any(  # random or uninitialised values
                self.root_of(i) in self.varying for i in inputs)
        else:  # placeholders, outputs, modules, methods, Python functions: assumed to vary and to write their inputs
            varies = True
            for i in inputs:
                self.varying.add(self.root_of(i))
        if inputs and _aliases_input(node) and node.args and isinstance(node.args[0], fx.Node):
            self.root[node] = self.root_of(node.args[0])
        for written in _writes(node):
            self.last_write[self.root_of(written)] = self.order[node]
            if varies:
                self.varying.add(self.root_of(written))
        if varies:
            self.varying.add(node)
            self.varying.add(self.root_of(node))

    def is_varying(self, node: fx.Node) -> bool:
        return node in self.varying or self.root_of(node) in self.varying


def _evaluate(gm: fx.GraphModule, analysis: _Analysis, wanted: Set[fx.Node]) -> Optional[Dict[fx.Node, torch.Tensor]]:
    """The values of the constant nodes ``wanted``, each as it is when its node runs; None if one cannot be
    evaluated."""
    interpreter = fx.Interpreter(gm)
    values: Dict[fx.Node, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for node in gm.graph.nodes:
                if analysis.is_varying(node):
                    continue
                interpreter.env[node] = interpreter.run_node(node)
                if node in wanted:
                    values[node] = interpreter.env[node].clone()
    except Exception:  # noqa: BLE001 - constants we cannot evaluate stay as traced
        return None
    return values


def share_repeated_constants(gm: fx.GraphModule, model: nn.Module) -> List[str]:
    """Let the readers of a repeated constant read its first copy (see the module docstring); the names of the
    constant nodes no longer read."""
    model_state = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
        n for n, _ in model.named_buffers(remove_duplicate=False)}
    analysis = _Analysis(gm, model_state)
    boundary = [n for n in gm.graph.nodes if not analysis.is_varying(n) and n.op != "output"
                and isinstance(n.meta.get("val"), torch.Tensor) and any(analysis.is_varying(u) for u in n.users)
                and analysis.last_write.get(analysis.root_of(n), -1) < analysis.order[n]]
    if len(boundary) < 2:
        return []
    values = _evaluate(gm, analysis, set(boundary))
    if values is None:
        return []
    firsts: List[fx.Node] = []
    replaced: List[str] = []
    for node in boundary:
        value = values[node]
        same = next((f for f in firsts if values[f].dtype == value.dtype and values[f].shape == value.shape
                     and values[f].stride() == value.stride() and torch.equal(values[f], value)), None)
        if same is None:
            firsts.append(node)
            continue
        for user in [u for u in node.users if u.op == "call_function" and analysis.is_varying(u)]:
            user.replace_input_with(node, same)
        replaced.append(node.name)
    if replaced:
        _remove_dead_constants(gm, analysis)
        log.info("memopt: %d constants the trace built again read from their first copy, as the eager model's "
                 "cache does: %s", len(replaced), ", ".join(replaced[:4]))
    return replaced


def _remove_dead_constants(gm: fx.GraphModule, analysis: _Analysis) -> None:
    """Erase the constant nodes nothing that varies depends on: those no longer read, and the in-place writes
    into storages no longer read."""
    nodes = list(gm.graph.nodes)
    live: Set[fx.Node] = set()
    stack = [i for n in nodes if analysis.is_varying(n) for i in n.all_input_nodes]
    while True:
        while stack:
            node = stack.pop()
            if node not in live:
                live.add(node)
                stack.extend(node.all_input_nodes)
        roots = {analysis.root_of(n) for n in live}
        stack = [n for n in nodes if n not in live and not analysis.is_varying(n)
                 and any(analysis.root_of(w) in roots for w in _writes(n))]
        if not stack:
            break
    for node in reversed(nodes):
        if not analysis.is_varying(node) and node not in live and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
