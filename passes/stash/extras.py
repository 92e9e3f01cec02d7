"""The stash pass, compact exact extras (``StashConfig(compact_extras=True)``): training dropout keeps a 1-bit
mask, ``torch.where`` a 1-bit condition, where the node alone keeps that tensor; a 2-d max pool keeps its window
offsets instead of its input and int64 indices (a ReLU keeping the same tensor joins it with its 1-bit mask); a
cross-entropy over 2-d logits keeps the logits instead of its log-softmax, and runs its backward in chunks of rows
(``memopt.stash.loss``); with ``StashConfig.head_loss`` a linear head before it joins it and the logits are not kept
at all (``head_loss.py``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from memopt.capture.trace import has_hooks
from memopt.core.meta import DECISION_KEY, META_KEY
from memopt.cost_model.op_registry import op_kind
from memopt.passes.fewbit import exact_masks, replace_with_mask
from memopt.passes.stash.generic import _arg, _dtype, _kept, _keeping_only
from memopt.passes.stash.head_loss import fuse_head_loss
from memopt.stash.config import StashConfig
from memopt.stash.generic import dropout_1bit, where_1bit
from memopt.stash.loss import REDUCTIONS, cross_entropy_rows
from memopt.stash.pool import max_pool2d_indices_only

aten = torch.ops.aten


def _dropout_args(node: fx.Node, modules) -> Optional[Tuple[float, bool, bool]]:
    """(p, training, inplace) of a plain element-wise dropout node, else None."""
    if node.op == "call_module":
        module = modules[node.target]
        if type(module) is not nn.Dropout or has_hooks(module):
            return None
        return float(module.p), module.training, module.inplace
    if node.target is F.dropout:
        return float(_arg(node, 1, "p", 0.5)), _arg(node, 2, "training", True), _arg(node, 3, "inplace", False)
    if node.target is aten.dropout.default:
        return float(_arg(node, 1, "p")), _arg(node, 2, "train"), False
    return None


def _max_pool_args(node: fx.Node, modules) -> Optional[Tuple]:
    """(kernel_size, stride, padding, dilation, ceil_mode) of a 2-d max pool of a 4-d input that returns no
    indices (a module, ``F.max_pool2d`` or ``aten.max_pool2d``), else None."""
    inp = _arg(node, 0, "input")
    cost = inp.meta.get(META_KEY) if isinstance(inp, fx.Node) else None
    if cost is None or len(cost.shapes) != 1 or len(cost.shapes[0]) != 4:
        return None
    if node.op == "call_module":
        m = modules[node.target]
        if type(m) is not nn.MaxPool2d or m.return_indices or has_hooks(m):
            return None
        return m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode
    names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
    if node.target is F.max_pool2d:
        if _arg(node, 6, "return_indices", False):
            return None
        values = [_arg(node, i + 1, n, d) for i, (n, d) in enumerate(zip(names, (None, None, 0, 1, False)))]
    elif node.target is aten.max_pool2d.default:
        values = [_arg(node, i + 1, n, d) for i, (n, d) in enumerate(zip(names, (None, [], 0, 1, False)))]
    else:
        return None
    if any(isinstance(v, fx.Node) for v in values) or values[0] is None:
        return None
    values[1] = values[1] or values[0]  # no stride: the kernel size
    return tuple(values)


def _cross_entropy_args(node: fx.Node, modules, autocast: bool = False
                        ) -> Optional[Tuple[fx.Node, fx.Node, int, int]]:
    """(logits, target, reduction as aten's enum, ignore_index) of a cross-entropy that ``cross_entropy_rows``
    computes exactly: 2-d float32 / float64 logits, 1-d int64 class targets, no class weights, no label smoothing,
    reduced by mean or sum; else None. ``autocast``: bf16 / fp16 logits too where the loss came out float32 (autocast
    up-cast them: ``linear_cross_entropy_rows`` does as autocast does at run time)."""
    if node.op == "call_module":
        module = modules[node.target]
        if type(module) is not nn.CrossEntropyLoss or has_hooks(module) or module.weight is not None:
            return None
        values = (node.args[0] if node.args else node.kwargs.get("input"),
                  node.args[1] if len(node.args) > 1 else node.kwargs.get("target"), module.reduction,
                  module.ignore_index, module.label_smoothing)
    elif node.target is F.cross_entropy:
        if _arg(node, 2, "weight") is not None or _arg(node, 3, "size_average") is not None or \
                _arg(node, 5, "reduce") is not None:
            return None
        values = (_arg(node, 0, "input"), _arg(node, 1, "target"), _arg(node, 6, "reduction", "mean"),
                  _arg(node, 4, "ignore_index", -100), _arg(node, 7, "label_smoothing", 0.0))
    elif node.target is aten.cross_entropy_loss.default:
        if _arg(node, 2, "weight") is not None:
            return None
        values = (_arg(node, 0, "self"), _arg(node, 1, "target"), _arg(node, 3, "reduction", 1),
                  _arg(node, 4, "ignore_index", -100), _arg(node, 5, "label_smoothing", 0.0))
    else:
        return None
    logits, target, reduction, ignore_index, smoothing = values
    reduction = REDUCTIONS.get(reduction, reduction)
    if reduction not in (1, 2) or smoothing != 0.0 or not isinstance(ignore_index, int) or \
            not isinstance(logits, fx.Node) or not isinstance(target, fx.Node):
        return None
    shapes = [n.meta[META_KEY].shapes[0] if n.meta.get(META_KEY) is not None and n.meta[META_KEY].shapes else None
              for n in (logits, target)]
    if shapes[0] is None or shapes[1] is None or len(shapes[0]) != 2 or len(shapes[1]) != 1 or \
            _dtype(logits) not in ("float32", "float64") + (("bfloat16", "float16") if autocast and
                                                             _dtype(node) == "float32" else ()) or \
            _dtype(target) != "int64":
        return None
    return logits, target, reduction, ignore_index


def head_losses(gm: fx.GraphModule, cfg: StashConfig) -> bool:
    """Each cross-entropy that keeps its own log-softmax, fed by a linear head, as one ``linear_cross_entropy_rows``
    (``head_loss.py``); before the generic stash, which would otherwise code the head's input; True when anything
    changed."""
    modules = dict(gm.named_modules())
    modified = False
    for node in list(gm.graph.nodes):
        if op_kind(node, modules) != "cross_entropy" or node.name in cfg.deny:
            continue
        loss = _cross_entropy_args(node, modules, autocast=True)
        if loss is not None and any(set(s.savers) == {node.name} and s.source in ("", node.name)
                                    for s in _kept(node)):
            modified |= fuse_head_loss(gm, node, loss, modules)
    return modified


def compact_extras(gm: fx.GraphModule, cfg: StashConfig) -> bool:
    """Dropout masks and ``torch.where`` conditions kept as 1 bit, max pools keeping window offsets (all
    exact); True when anything changed."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    modified = False
    masks = None  # exact_masks, found once at the first max pool
    for node in list(graph.nodes):
        kind = op_kind(node, modules)
        kept = _kept(node)
        if not kept or node.name in cfg.deny:
            continue
        pool = _max_pool_args(node, modules) if kind == "max_pool" else None
        if pool is not None and any(set(s.savers) == {node.name} for s in kept):
            # its int64 indices are its own: ceil(log2(kh*kw)) bits per output free them; a ReLU that keeps
            # the same input (its output) keeps its 1-bit mask instead, and the input is freed too
            masks = exact_masks(gm, modules) if masks is None else masks
            for s in kept:
                others = [n for n in s.savers if n != node.name]
                take = _keeping_only(s.key, others, masks)
                if others and len(take) == len(others):
                    for m in take:
                        replace_with_mask(gm, *m, None, f"with it {node.name} frees this output (its input)")
                        del masks[m[0].name]
            with graph.inserting_before(node):
                new = graph.create_node("call_function", max_pool2d_indices_only, (_arg(node, 0, "input"), *pool),
                                        name=f"{node.name}_indices")
            note = "keeps only where each maximum sat in its window (exact), not its input and int64 indices"
            new.meta[DECISION_KEY] = {"technique": "stash", "bits": None, "replaces": [node.name], "reason": note}
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            modified = True
            continue
        loss = _cross_entropy_args(node, modules) if kind == "cross_entropy" else None
        if loss is not None and any(set(s.savers) == {node.name} and s.source in ("", node.name) for s in kept):
            # its log-softmax is its own: the logits, which the step holds anyway, serve its backward instead
            with graph.inserting_before(node):
                new = graph.create_node("call_function", cross_entropy_rows, loss, name=f"{node.name}_rows")
            note = ("keeps its logits, not their log-softmax, and runs backward in chunks of rows with eager's "
                    "kernels (exact)")
            new.meta[DECISION_KEY] = {"technique": "stash", "bits": None, "replaces": [node.name], "reason": note}
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            modified = True
            continue
        if any(set(s.savers) != {node.name} for s in kept):
            continue  # shares what it keeps: a compact copy would free nothing
        if kind == "dropout":
            found = _dropout_args(node, modules)
            if found is None or found[1] is not True or found[2] or not 0.0 < found[0] < 1.0:
                continue
            with graph.inserting_before(node):
                new = graph.create_node("call_function", dropout_1bit, (_arg(node, 0, "input"), found[0]),
                                        name=f"{node.name}_1bit")
            note = "dropout mask kept as 1 bit per element (exact)"
        elif node.target in (torch.where, aten.where.self) and len(node.args) == 3 and not node.kwargs \
                and _dtype(node.args[0]) == "bool":
            with graph.inserting_before(node):
                new = graph.create_node("call_function", where_1bit, node.args, name=f"{node.name}_1bit")
            note = "boolean condition kept as 1 bit per element (exact)"
        else:
            continue
        new.meta[DECISION_KEY] = {"technique": "stash", "bits": 1, "replaces": [node.name], "reason": note}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        modified = True
    return modified
