"""Attention masks that a trace materialises where the eager model passes none.

Hugging Face models (and others) skip the attention mask at run time when it would mask nothing, or pass
``is_causal=True`` instead of a causal mask, by looking at the mask's values; under ``torch.export`` or symbolic
tracing that check cannot run, so the traced graph builds the mask from constants and hands it to
``scaled_dot_product_attention``. The traced graph then differs from the eager model: SDPA keeps the
materialised mask for backward (one copy per call: HF ViT's two layers kept 4.5 KiB more than eager), which the
capture check rightly refuses, so the whole model fell back to per-submodule capture and lost most of its
savings; and SDPA may pick another kernel.

``drop_constant_masks`` evaluates every SDPA mask that depends on no graph input (only constants and
attributes, no random op) and, where it masks nothing, removes it; where it is exactly the causal mask of a
square score matrix, it replaces it with ``is_causal=True``: what the eager model runs; where a learned bias is
combined with such a mask (added to it, or selected by it in a ``where``), the bias alone is the mask, as eager
passes it; and where a dropped mask made the trace repeat grouped key/value heads per query head, SDPA gets them
as eager does, with ``enable_gqa=True``. Anything else stays as traced. The capture check still compares the result with the eager model bit for bit, so a model whose eager
code did pass the mask is refused there, not changed silently.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Set, Tuple

import torch
from torch import fx

from memopt.cost_model.op_registry import kind_of_target

log = logging.getLogger("memopt")

_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform")


def _mask(node: fx.Node) -> Any:
    return node.kwargs["attn_mask"] if "attn_mask" in node.kwargs else node.args[3] if len(node.args) > 3 else None


def _causal_flag(node: fx.Node) -> Any:
    return node.kwargs["is_causal"] if "is_causal" in node.kwargs else node.args[5] if len(node.args) > 5 else False


def _ancestors(node: fx.Node) -> Optional[List[fx.Node]]:
    """``node`` and everything it is computed from, in graph order; None when that reaches a graph input, a
    parameter (BEiT's relative position bias is a mask learned from a table initialised to zeros: all zero now,
    not after a step), a random op or an op that writes in place (the mask then is data, not a constant)."""
    seen: Set[fx.Node] = set()
    root = node.graph.owning_module
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op in ("placeholder", "output", "call_module") or _impure(current):
            return None
        if current.op == "get_attr" and _requires_grad(root, current.target):
            return None
        stack.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def attribute(root: Any, target: str) -> Any:
    """The value of a get_attr ``target`` (a dotted path) on ``root``; None where the path breaks."""
    value = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _requires_grad(root: Any, target: str) -> bool:
    value = attribute(root, target)
    return not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter) or value.requires_grad


def _impure(node: fx.Node) -> bool:
    """A random op, or one that writes to an input (an ATen op's schema says; a method named ``x_``)."""
    name = getattr(node.target, "__name__", str(node.target))
    if any(word in name for word in _RANDOM):
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    return node.op == "call_method" and name.endswith("_") and not name.endswith("__")


def _evaluate(gm: fx.GraphModule, nodes: List[fx.Node]) -> Any:
    interpreter = fx.Interpreter(gm)
    with torch.no_grad():
        for node in nodes:
            interpreter.env[node] = interpreter.run_node(node)
    return interpreter.env[nodes[-1]]


def _kind(value: Any) -> Optional[str]:
    """"none" when the mask masks nothing, "causal" when it is the lower-triangular mask of a square score
    matrix, else None."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.is_meta or value.numel() == 0:
        return None
    if type(value) is not torch.Tensor:  # a fake or subclass tensor: its values are unknown
        return None
    if value.dtype == torch.bool:
        keep = value
    elif value.is_floating_point():
        if not bool(((value == 0) | (value == float("-inf")) | (value == torch.finfo(value.dtype).min)).all()):
            return None
        keep = value == 0
    else:
        return None
    if bool(keep.all()):
        return "none"
    rows, cols = keep.shape[-2:]
    causal = torch.ones(rows, cols, dtype=torch.bool, device=keep.device).tril()
    if rows == cols and bool((keep == causal).all()):
        return "causal"
    return None


def drop_constant_masks(gm: fx.GraphModule) -> List[str]:
    """Remove the SDPA masks that mask nothing, and turn exact causal masks into ``is_causal=True`` (see the
    module docstring); the names of the SDPA nodes changed."""
    changed: List[str] = []
    dropped: List[fx.Node] = []  # sums and wheres whose constant term was dropped
    cache = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or kind_of_target(node.target) != "sdpa":
            continue
        mask = _mask(node)
        if not isinstance(mask, fx.Node) or _causal_flag(node) is not False:
            continue
        kind = _cached_kind(gm, mask, cache)
        if kind is None:
            inner, kept = _unmasked_term(gm, mask, cache)
            if kept is not None:  # a learned bias with a materialised mask that masks nothing: the bias alone
                if inner is mask:
                    node.args, node.kwargs = _with_mask(node, kept)
                else:  # under a contiguous(): keep it, eager calls it on the bias too
                    next(iter(inner.users)).replace_input_with(inner, kept)
                changed.append(node.name)
                dropped.append(inner)
            continue
        args, kwargs = _with_mask(node, None)
        args = list(args)
        if kind == "causal":
            if len(args) > 5:
                args[5] = True
            else:
                kwargs["is_causal"] = True
        node.args, node.kwargs = tuple(args), kwargs
        changed.append(node.name)
        dropped.extend(_grouped_heads(node))
    if changed:
        _remove_unused(gm, [m for m, kind in cache.items() if kind is not None], dropped)
        log.info("memopt: %d attention masks built from constants replaced by what the eager model passes "
                 "(none, or is_causal=True): %s", len(changed), ", ".join(changed[:4]))
    return changed


def _cached_kind(gm: fx.GraphModule, node: fx.Node, cache: dict) -> Optional[str]:
    """``_kind`` of the constant ``node`` evaluates to, once per node; None when it is not a constant or cannot be
    evaluated (it then stays as traced)."""
    if node not in cache:
        nodes = _ancestors(node)
        try:
            cache[node] = None if nodes is None else _kind(_evaluate(gm, nodes))
        except Exception:  # noqa: BLE001 - a mask we cannot evaluate stays as traced
            cache[node] = None
    return cache[node]


def _with_mask(node: fx.Node, mask: Any) -> tuple:
    """(args, kwargs) of the SDPA ``node`` with ``mask`` as its mask."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = mask
    else:
        args[3] = mask
    return tuple(args), kwargs


_ADDS = (torch.ops.aten.add.Tensor, torch.add, __import__("operator").add)
_WHERES = (torch.ops.aten.where.self, torch.ops.aten.where.ScalarOther, torch.where)
_CONTIGUOUS = (torch.ops.aten.contiguous.default, "contiguous")


def _unmasked_term(gm: fx.GraphModule, mask: fx.Node, cache: dict) -> Tuple[Optional[fx.Node], Optional[fx.Node]]:
    """(the node, the term eager passes) for a mask that combines a learned term with a constant that masks
    nothing, else (None, None); the mask may be that node under single-use ``contiguous()`` calls:
    - ``a + b`` whose one term is float zeros or boolean all-true (a padding mask a trace materialised where eager
      passes none, added to a learned position bias: HF BEiT adds its all-true boolean mask, +1 everywhere);
    - ``where(c, a, fill)`` whose condition is all-true (HF T5 superposes its materialised padding mask on the
      position bias so; eager passes the bias alone).
    SDPA broadcasts its mask, so the term in its own shape is what it gets."""
    inner = mask
    while (inner.op in ("call_function", "call_method") and inner.target in _CONTIGUOUS and len(inner.args) == 1
           and isinstance(inner.args[0], fx.Node) and len(inner.args[0].users) == 1):
        inner = inner.args[0]
    if inner.op != "call_function" or inner.kwargs or not inner.args:
        return None, None
    args = inner.args
    if inner.target in _ADDS and len(args) == 2:
        pairs = (args, args[::-1])
    elif inner.target in _WHERES and len(args) == 3:
        pairs = ((args[0], args[1]),)
    else:
        return None, None
    for constant, other in pairs:
        if isinstance(constant, fx.Node) and isinstance(other, fx.Node) \
                and _cached_kind(gm, constant, cache) == "none":  # float zeros or boolean all-true
            return inner, other
    return None, None


_A = torch.ops.aten


def _grouped_heads(node: fx.Node) -> List[fx.Node]:
    """Pass grouped-query attention's key and value heads to the unmasked SDPA ``node`` as they are, with
    ``enable_gqa=True``, where the trace repeated them per query head (HF's ``repeat_kv``: unsqueeze at dim 2,
    expand, reshape); the repeat nodes now unused. HF calls SDPA so when there is no mask (``use_gqa_in_sdpa``),
    which is what the eager model ran once the traced mask is gone: the repeated copies are what SDPA kept for
    backward in the graph but not in eager. The capture check still compares with eager bit for bit."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if kwargs.get("enable_gqa", False) or len(args) < 3:
        return []
    repeats = [_unrepeated(args[1]), _unrepeated(args[2])]
    if None in repeats:
        return []
    (key, key_chain), (value, value_chain) = repeats
    args[1], args[2] = key, value
    kwargs["enable_gqa"] = True
    node.args, node.kwargs = tuple(args), kwargs
    return key_chain + value_chain


def _unrepeated(node: Any) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """(x, the repeat nodes) for ``reshape(expand(unsqueeze(x, 2), (b, h, r, s, d)), (b, h * r, s, d))`` with r
    > 1, each used once, shapes read from the export graph's ``val`` metadata; else None."""
    chain = [node]
    for target in (_A.expand.default, _A.unsqueeze.default):
        last = chain[-1]
        if not isinstance(last, fx.Node) or last.op != "call_function" or len(last.users) != 1 \
                or not isinstance(last.args[0], fx.Node):
            return None
        chain.append(last.args[0])
        if chain[-1].target is not target:
            return None
    reshape, expand, unsqueeze = chain
    source = unsqueeze.args[0]
    if reshape.target not in (_A.reshape.default, _A.view.default) or unsqueeze.args[1:] != (2,) \
            or len(unsqueeze.users) != 1:
        return None
    shapes = [tuple(n.meta["val"].shape) if "val" in n.meta else None for n in (source, expand, reshape)]
    if None in shapes or len(shapes[0]) != 4:
        return None
    (b, h, s, d), repeated, out = shapes
    r = repeated[2] if len(repeated) == 5 else 0
    if r <= 1 or repeated != (b, h, r, s, d) or out != (b, h * r, s, d):
        return None
    return source, [reshape, expand, unsqueeze]


def _remove_unused(gm: fx.GraphModule, masks: List[fx.Node], sums: List[fx.Node]) -> None:
    """Erase the dropped masks, the sums and wheres that lost their constant term, and what only they used (pure ops on
    constants: see ``_ancestors``)."""
    candidates = {a for m in masks for a in (_ancestors(m) or [])} | set(sums)
    for node in reversed(list(gm.graph.nodes)):
        if node in candidates and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
