"""The stash pass, a language model's head and loss as one op (``StashConfig.head_loss``): a linear whose output
reaches a cross-entropy only through views and one cast (``lm_head(h)``, ``.float()``, ``.view(-1, vocab)``:
Hugging Face's causal and masked LMs) becomes ``linear_cross_entropy_rows``, which computes the head's gradients
in the forward a chunk of rows at a time and keeps them and the head's input, not the logits
(``memopt/stash/loss.py``).

Why: the logits are the largest tensor of an LM's step (tokens x vocabulary). ``cross_entropy_rows`` alone keeps
them (not their log-softmax) and makes their whole gradient in backward; here neither exists after the forward
(the model's logits output is still produced, bit for bit, and freed when the caller drops it). The cost is a
weight gradient summed over row chunks (rounding-level, not bit-identical: the gate checks it) and the head's
gradient work done in the forward (wasted where no backward follows), so it applies only where the logits are larger than the head's input (more classes than
features) and the logits feed nothing but the loss and the model's output.
"""
from __future__ import annotations

import math
import operator
from typing import List, Optional, Set, Tuple

import torch
from torch import fx, nn

from memopt.capture.trace import has_hooks
from memopt.core.meta import DECISION_KEY, META_KEY
from memopt.cost_model.op_registry import op_kind
from memopt.passes.stash.generic import _dtype
from memopt.stash.loss import HeadLossSpec, linear_cross_entropy_rows

aten = torch.ops.aten
# single-input ops that only reshape or cast between the head and the loss
_STEPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype, aten._to_copy.default,
          aten.alias.default, torch.reshape, torch.flatten}
_METHODS = {"view", "reshape", "float", "to", "flatten"}
_ASSERT = aten._assert_tensor_metadata.default


def _shape(node) -> Optional[Tuple[int, ...]]:
    cost = node.meta.get(META_KEY) if isinstance(node, fx.Node) else None
    return tuple(cost.shapes[0]) if cost is not None and cost.shapes else None


def _is_step(node: fx.Node) -> bool:
    # a reshape's sizes may be nodes (``logits.shape[-1]``): the shapes in the meta are what the caller checks
    if node.op == "call_method":
        if node.target == "to":  # .to(dtype) only: no device, no copy flags
            return len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs
        return node.target in _METHODS and (node.target != "float" or len(node.args) == 1)
    if node.op != "call_function" or node.target not in _STEPS:
        return False
    if node.target is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype", "layout"} and node.kwargs.get("layout") in (None, torch.strided)
    if node.target in (aten.to.dtype, aten.alias.default):
        return not any(isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values()))
    return True


def _head(gm: fx.GraphModule, node: fx.Node, modules) -> Optional[Tuple[fx.Node, Optional[fx.Node], Optional[fx.Node]]]:
    """(x, weight, bias) of a linear node (aten / functional / ``nn.Linear`` without hooks); weight and bias are
    nodes (a module's read through new ``get_attr`` nodes); else None."""
    if op_kind(node, modules) != "linear":
        return None
    if node.op == "call_module":
        module = modules[node.target]
        if type(module) is not nn.Linear or has_hooks(module) or len(node.args) != 1 or node.kwargs:
            return None
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
        return node.args[0], weight, bias
    args = list(node.args) + [node.kwargs.get(k) for k in ("input", "weight", "bias") if k in node.kwargs]
    if not 2 <= len(args) <= 3 or not all(isinstance(a, fx.Node) or a is None for a in args):
        return None
    return args[0], args[1], args[2] if len(args) > 2 else None


def _chain(logits: fx.Node) -> Tuple[List[fx.Node], fx.Node]:
    """(the reshape / cast steps from the head's output to the loss's logits, head first; the head's node)."""
    steps = []
    node = logits
    while isinstance(node, fx.Node) and _is_step(node) and len(steps) < 4:
        steps.append(node)
        node = node.args[0]
    return steps[::-1], node


def _size_reads(chain: List[fx.Node]) -> Optional[Set[fx.Node]]:
    """The nodes that read a chain node's shape (``getattr(n, "shape")``, ``n.size()``, their items) and are read
    only by the chain's reshapes (so they go with it); None where such a read reaches anything else."""
    found: Set[fx.Node] = set()
    todo = [u for n in chain for u in n.users if (u.op == "call_function" and u.target is getattr and
                                                   u.args[1:] == ("shape",)) or
            (u.op == "call_method" and u.target in ("size", "dim"))]
    while todo:
        n = todo.pop()
        found.add(n)
        for user in n.users:
            if user in chain:
                continue
            if user.op == "call_function" and user.target is operator.getitem:
                todo.append(user)
                continue
            return None
    return found


def fuse_head_loss(gm: fx.GraphModule, loss: fx.Node, found, modules) -> bool:
    """Rewrite ``loss`` (a cross-entropy, ``found`` its (logits, target, reduction, ignore_index) from
    ``extras._cross_entropy_args``) and the linear head before it as one ``linear_cross_entropy_rows``; False
    (the graph unchanged) where the pattern does not hold (module docstring)."""
    logits, target, reduction, ignore_index = found
    steps, head = _chain(logits)
    if not isinstance(head, fx.Node) or head.op not in ("call_function", "call_module"):
        return False
    out_shape, flat_shape = _shape(head), _shape(logits)
    if out_shape is None or flat_shape is None or len(out_shape) < 2 or out_shape[-1] != flat_shape[-1] or \
            math.prod(out_shape[:-1]) != flat_shape[0]:
        return False
    dtypes = [_dtype(head)] + [_dtype(s) for s in steps]
    if None in dtypes or sum(a != b for a, b in zip(dtypes, dtypes[1:])) > 1:  # one cast at most
        return False
    up = dtypes[-1] if dtypes[-1] != dtypes[0] else ""
    if up and (up not in ("float32", "float64") or dtypes[0] not in ("bfloat16", "float16", "float32")):
        return False
    if dtypes[-1] in ("bfloat16", "float16"):  # the loss's float32 is autocast's (``_cross_entropy_args``)
        up = "autocast"
    # only the loss, export's metadata checks, the graph's output (of the head's own value) and shape reads for
    # the chain's own reshapes (``logits.view(-1, logits.shape[-1])``) read the chain
    chain = [head] + steps
    sizes = _size_reads(chain)
    if sizes is None:
        return False
    for i, n in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else loss
        for user in n.users:
            if user is nxt or user in sizes or (user.op == "call_function" and user.target is _ASSERT):
                continue
            if user.op == "output" and _shape(n) == out_shape and _dtype(n) == dtypes[0]:
                continue
            return False
    in_shape = _shape(head.args[0] if head.args else None)
    if in_shape is None or out_shape[-1] <= in_shape[-1]:
        return False  # logits no larger than the head's input: keeping the input would free nothing
    parts = _head(gm, head, modules)
    if parts is None:
        return False
    graph = gm.graph
    with graph.inserting_before(loss):
        fused = graph.create_node("call_function", linear_cross_entropy_rows,
                                  (*parts, target, HeadLossSpec(reduction, ignore_index, up)), name=f"{loss.name}_head")
        value = graph.call_function(operator.getitem, (fused, 0))
        out = graph.call_function(operator.getitem, (fused, 1))
    note = (f"the head {head.name} and this loss as one op: keeps the head's input, not the logits; its gradients "
            f"are made in the forward a chunk of rows at a time (weight gradient summed over the chunks)")
    fused.meta[DECISION_KEY] = {"technique": "stash", "bits": None, "replaces": [head.name, loss.name],
                                "reason": note}
    loss.replace_all_uses_with(value)
    graph.erase_node(loss)
    doomed = set(chain) | sizes
    for n in [n for n in reversed(graph.nodes) if n in doomed]:  # users before what they read
        for user in [u for u in n.users if u.op == "call_function" and u.target is _ASSERT]:
            graph.erase_node(user)
        if n in chain:
            n.replace_all_uses_with(out)  # the graph's output, where it returns the head's value
        graph.erase_node(n)
    return True
