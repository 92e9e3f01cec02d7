"""The stash pass: BatchNorm -> [+ residual] -> activation chains keep K-bit codes for backward.

Pattern (module-level graphs): a training-mode BatchNorm1d/2d module whose only user is either the
activation or an add whose only user is the activation (ReLU, ReLU6, LeakyReLU in any spelling).
Every user of the activation must be able to drop its copy of it: Conv1d/Conv2d and Linear
modules (rewritten to rebuild their input from the stash), MaxPool2d (rewritten to keep only its
indices), and ops that keep nothing (average pooling, add). Anything else keeps the activation,
so the chain stays exact and the report says which consumer blocked it.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple, Union

from torch import fx, nn

from cost_model.op_registry import op_kind
from memopt.ops.stash import bn_act_stash, conv_from_stash, linear_from_stash, max_pool2d_indices_only
from memopt.plan import DECISION_KEY
from memopt.stash.config import StashConfig
from passes.base import PassResult, register_pass

_ACTS = ("relu", "relu6", "leaky_relu")
_KEEPS_NOTHING = ("avg_pool", "add")


def _act_params(node: fx.Node, kind: str, modules) -> Tuple[float, ...]:
    if kind != "leaky_relu":
        return ()
    if node.op == "call_module":
        return (float(modules[node.target].negative_slope),)
    slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
    return (float(slope),)


def _single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _consumer_reason(user: fx.Node, act: fx.Node, modules) -> Optional[str]:
    kind = op_kind(user, modules)
    if kind in _KEEPS_NOTHING:
        return None
    module = modules.get(user.target) if user.op == "call_module" else None
    supported = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Linear)) or (
        isinstance(module, nn.MaxPool2d) and not module.return_indices)
    if not supported:
        return f"its output is also kept by {user.name} ({kind or user.op}), which has no stash form"
    if user.args[:1] != (act,) or any(a is act for a in list(user.args[1:]) + list(user.kwargs.values())):
        return f"{user.name} uses the activation in another position"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
        return f"{user.name} has padding {module.padding!r} / mode {module.padding_mode!r} (zeros, numeric only)"
    return None


def _match(bn: fx.Node, modules) -> Union[str, Tuple[Optional[fx.Node], fx.Node, str]]:
    """(add node or None, activation node, act kind) for a chain starting at ``bn``, or the reason not."""
    module = modules[bn.target]
    if not module.track_running_stats or module.momentum is None:
        return "BatchNorm without running statistics or with cumulative momentum (momentum=None)"
    nxt = _single_user(bn)
    if nxt is None:
        return "the BatchNorm output has several users"
    add = None
    if op_kind(nxt, modules) == "add" and nxt.op != "call_module":
        operands = [a for a in nxt.args if isinstance(a, fx.Node)]
        if len(operands) != 2 or nxt.kwargs or operands.count(bn) != 1:
            return "the residual add is not a plain two-tensor add"
        add, nxt = nxt, _single_user(nxt)
        if nxt is None:
            return "the residual sum has several users"
    kind = op_kind(nxt, modules)
    if kind not in _ACTS:
        return f"BatchNorm is followed by {kind or nxt.op}, not by relu/relu6/leaky_relu"
    if nxt.args[:1] != (add or bn,):
        return "the activation does not take the BatchNorm output as its input"
    return add, nxt, kind


@register_pass(StashConfig, "stash")
def stash_pass(gm: fx.GraphModule, cfg: StashConfig) -> PassResult:
    modules = dict(gm.named_modules())
    graph = gm.graph
    modified = False
    for bn in list(graph.nodes):
        if bn.op != "call_module" or not isinstance(modules.get(bn.target), (nn.BatchNorm1d, nn.BatchNorm2d)):
            continue
        if (cfg.allow is not None and bn.name not in cfg.allow) or bn.name in cfg.deny:
            bn.meta[DECISION_KEY] = {"technique": "exact", "reason": "stash: excluded by StashConfig allow/deny"}
            continue
        found = _match(bn, modules)
        reason = found if isinstance(found, str) else next(
            (r for r in (_consumer_reason(u, found[1], modules) for u in found[1].users) if r), None)
        if reason is not None:
            bn.meta[DECISION_KEY] = {"technique": "exact", "reason": f"stash: {reason}"}
            continue
        add, act, kind = found
        _rewrite(gm, modules, bn, add, act, kind, cfg.bits)
        modified = True
    return PassResult(gm, modified)


def _attr(graph: fx.Graph, path: str, module: nn.Module, name: str) -> Optional[fx.Node]:
    return graph.get_attr(f"{path}.{name}") if getattr(module, name, None) is not None else None


def _rewrite(gm: fx.GraphModule, modules, bn: fx.Node, add: Optional[fx.Node], act: fx.Node, kind: str,
             bits: int) -> None:
    graph, module = gm.graph, modules[bn.target]
    residual = None if add is None else next(a for a in add.args if isinstance(a, fx.Node) and a is not bn)
    params = _act_params(act, kind, modules)
    replaced: List[str] = [bn.name] + ([add.name] if add is not None else []) + [act.name]
    with graph.inserting_before(act):
        attrs = [_attr(graph, bn.target, module, n) for n in
                 ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
        stash = graph.create_node("call_function", bn_act_stash,
                                  (bn.args[0], *attrs, residual, module.momentum, module.eps, kind, params, bits,
                                   bn.format_node()), name=f"{bn.name}_stash")
        y, codes, mask, affine, zero = (graph.call_function(operator.getitem, (stash, i)) for i in range(5))
    stash.meta[DECISION_KEY] = {"technique": "stash", "bits": bits, "replaces": replaced,
                                "reason": f"BN{' + residual' if add is not None else ''} + {kind}: exact forward, "
                                          f"{bits}-bit codes for backward"}
    act.replace_all_uses_with(y)
    for user in list(y.users):
        _rewrite_consumer(gm, modules, user, y, (codes, mask, affine, zero), bits, kind, params, bn.name)
    for node in (act, add, bn):
        if node is not None:
            graph.erase_node(node)


def _rewrite_consumer(gm, modules, user: fx.Node, y: fx.Node, stash_nodes, bits: int, kind: str, params,
                      source: str) -> None:
    module = modules.get(user.target) if user.op == "call_module" else None
    graph = gm.graph
    with graph.inserting_before(user):
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            args = (y, graph.get_attr(f"{user.target}.weight"), _attr(graph, user.target, module, "bias"),
                    *stash_nodes, bits, kind, params, module.stride, module.padding, module.dilation, module.groups)
            new = graph.create_node("call_function", conv_from_stash, args, name=f"{user.name}_stash")
            note = f"input rebuilt from the stash of {source} for the weight gradient"
        elif isinstance(module, nn.Linear):
            args = (y, graph.get_attr(f"{user.target}.weight"), _attr(graph, user.target, module, "bias"),
                    *stash_nodes, bits, kind, params)
            new = graph.create_node("call_function", linear_from_stash, args, name=f"{user.name}_stash")
            note = f"input rebuilt from the stash of {source} for the weight gradient"
        elif isinstance(module, nn.MaxPool2d):
            args = (y, module.kernel_size, module.stride, module.padding, module.dilation, module.ceil_mode)
            new = graph.create_node("call_function", max_pool2d_indices_only, args, name=f"{user.name}_indices")
            note = "keeps only its argmax indices (exact)"
        else:
            return  # keeps nothing: left as it is
    new.meta[DECISION_KEY] = {"technique": "stash", "bits": None if isinstance(module, nn.MaxPool2d) else bits,
                              "replaces": [user.name], "reason": note}
    user.replace_all_uses_with(new)
    graph.erase_node(user)

