"""The stash pass, third part: which ops without a weight become coded ops (``memopt/stash/coded.py``).

A *call* is a node whose backward reads activations and that ``coded_call`` can run again from codes:
a training BatchNorm module that no stash chain took (followed by SiLU, hard-swish or
nothing a chain matches, BatchNorm3d; backward differentiates batch statistics without a second running-statistics
update), LayerNorm / GroupNorm / RMSNorm, scaled-dot-product attention, a product or quotient of tensors, a
matmul of two activations, ``pow``, a softmax (which codes its output instead), and an activation whose
only user is a product (``silu(g) * u``: one gated call that keeps g and u). Its unit is named after the node
that replaces it, ``<node>_coded`` (``call_unit``): the node's own name is already the name of the generic-stash
unit that codes its output for the weight ops reading it.

What a call codes is decided per storage, with the weight-op consumers of ``stash_generic.py``: an
argument is coded only when every node that keeps its storage is rewritten (a call or a weight-op
consumer), so the storage is freed; otherwise the call keeps it as it is, which costs nothing more. A
call that would free nothing, or free less than its codes cost, stays as it was, and the rewritten set
is settled by repeating that until nothing changes (dropping a call can leave another storage kept).
Only activations that require grad are coded: a mask, a position table or a model input stays exact.
"""
from __future__ import annotations

import math
import operator
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from memopt.capture.trace import has_hooks
from memopt.core.meta import DECISION_KEY, META_KEY, STATE_CATEGORIES
from memopt.cost_model.op_registry import op_kind
from memopt.stash.config import CODED_OPS
from memopt.stash.coded import CodedSpec, coded_call, name_of, softmax_coded

_GATE_ACTS = ("silu", "gelu")
_FLOATS = ("float32", "bfloat16", "float16")


class Call(NamedTuple):
    node: fx.Node  # the node replaced (a gated unit: the product)
    kind: str
    target: str  # the name memopt.stash.coded.resolve maps to the callable
    args: tuple  # with fx.Nodes, and ("get_attr", path) for a module's parameter
    kwargs: dict
    erase: Tuple[fx.Node, ...]  # nodes erased with it (a gated unit's activation)
    random: bool


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _cost(node):
    return node.meta.get(META_KEY) if isinstance(node, fx.Node) else None


def _float_tensor(node) -> bool:
    cost = _cost(node)
    return cost is not None and len(cost.dtypes) == 1 and cost.dtypes[0] in _FLOATS


def kept(node: fx.Node):
    """The non-state storages ``node`` keeps for backward (the cost model's record)."""
    cost = _cost(node)
    return [] if cost is None else [s for s in cost.saved if s.category not in STATE_CATEGORIES]


def _module_call(node: fx.Node, kind: str, module: nn.Module) -> Optional[Tuple[str, tuple, dict]]:
    """The functional form of a norm / softmax module call, its parameters as ("get_attr", path)."""
    if has_hooks(module) or len(node.args) != 1 or node.kwargs:
        return None
    x, path = node.args[0], node.target

    def param(name: str):
        return ("get_attr", f"{path}.{name}") if getattr(module, name, None) is not None else None

    if kind == "layer_norm" and type(module) is nn.LayerNorm:
        return "F.layer_norm", (x, tuple(module.normalized_shape), param("weight"), param("bias"), module.eps), {}
    if kind == "group_norm" and type(module) is nn.GroupNorm:
        return "F.group_norm", (x, module.num_groups, param("weight"), param("bias"), module.eps), {}
    if kind == "rms_norm" and type(module) is nn.RMSNorm:
        return "F.rms_norm", (x, tuple(module.normalized_shape), param("weight"), module.eps), {}
    if kind == "softmax" and type(module) is nn.Softmax and module.dim is not None:
        return "F.softmax", (x, module.dim), {}
    if kind == "batch_norm" and type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) and module.training \
            and module.affine and module.weight.requires_grad:
        return "memopt.batch_norm_module", (("get_attr", path), x, param("weight"), param("bias")), {}
    return None


def _gate(node: fx.Node, modules) -> Optional[Tuple[fx.Node, fx.Node, str, bool, str]]:
    """(activation node, u, act, act_first, approximate) when ``node`` is ``act(g) * u`` or ``u * act(g)``."""
    if len(node.args) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    for position, a in enumerate(node.args):
        kind = op_kind(a, modules)
        if kind not in _GATE_ACTS or len(a.users) != 1 or not _float_tensor(a):
            continue
        u = node.args[1 - position]
        if u is a or not _float_tensor(u):
            continue
        if a.op == "call_module":
            module = modules[a.target]
            if has_hooks(module) or type(module) not in (nn.SiLU, nn.GELU) or getattr(module, "inplace", False) \
                    or len(a.args) != 1 or a.kwargs:
                return None
            approximate = getattr(module, "approximate", "none")
        else:
            if len(a.args) != 1 or set(a.kwargs) - {"approximate", "inplace"} or a.kwargs.get("inplace") or \
                    a.target in (torch.ops.aten.silu_.default, torch.ops.aten.gelu_.default):
                return None
            approximate = a.kwargs.get("approximate", "none")
        if not isinstance(a.args[0], fx.Node):
            return None
        return a, u, kind, position == 0, approximate
    return None


def find_call(node: fx.Node, modules, kinds: Tuple[str, ...], min_per_channel: int = 0) -> Optional[Call]:
    """The call ``node`` can become, else None. A BatchNorm normalising fewer than ``min_per_channel`` elements
    per channel is left alone, as the stash's chains leave it (``StashConfig.min_per_channel``)."""
    kind = op_kind(node, modules)
    if kind not in CODED_OPS or kind not in kinds or not kept(node) or not _float_tensor(node):
        return None
    if kind == "batch_norm":
        shape = _cost(node).shapes[0]
        if len(shape) < 2 or math.prod(shape) // shape[1] < min_per_channel:
            return None
        if node.op == "call_function":  # an export graph's aten.batch_norm, training, all arguments positional
            if node.target is not torch.ops.aten.batch_norm.default or len(node.args) != 9 or node.kwargs or \
                    node.args[5] is not True or not isinstance(node.args[1], fx.Node):
                return None
            return Call(node, kind, "aten.batch_norm.default", tuple(node.args), {}, (), False)
        if node.op != "call_module":
            return None
    if kind == "mul" and "gated" in kinds:
        found = _gate(node, modules)
        if found is not None:
            act, u, act_kind, act_first, approximate = found
            return Call(node, "gated", "memopt.gated", (act.args[0], u, act_kind, act_first, approximate), {},
                        (act,), False)
    if kind == "gated":
        return None
    if node.op == "call_module":
        form = _module_call(node, kind, modules[node.target])
        if form is None:
            return None
        target, args, kwargs = form
        return Call(node, kind, target, args, kwargs, (), False)
    target = name_of(node.target)
    if not target or target.endswith("_") or node.target in (operator.imul, operator.iadd):
        return None  # in-place: the graph's own semantics would change
    random = False
    if kind == "sdpa":
        p = _arg(node, 4, "dropout_p", 0.0)
        random = not isinstance(p, (int, float)) or p > 0
    if kind in ("mul", "div", "matmul", "pow") and not any(_float_tensor(a) for a in node.args[:2]):
        return None
    return Call(node, kind, target, tuple(node.args), dict(node.kwargs), (), random)


def _storage(node) -> Optional[Tuple[int, str]]:
    cost = _cost(node)
    return cost.storages[0] if cost is not None and len(cost.storages) == 1 else None


def _codable_read(node) -> bool:
    """An activation that requires grad: a float output of a computing node."""
    cost = _cost(node)
    return (isinstance(node, fx.Node) and node.op in ("call_function", "call_method", "call_module")
            and cost is not None and len(cost.requires_grad) == 1 and cost.requires_grad[0] and _float_tensor(node))


def reads(call: Call) -> List[fx.Node]:
    """The tensors a call reads that it could code (its output, for a softmax)."""
    if call.kind == "softmax":
        return [call.node]
    leaves, _ = tree_flatten((call.args, call.kwargs))
    out: List[fx.Node] = []
    for leaf in leaves:
        if _codable_read(leaf) and leaf not in out:
            out.append(leaf)
    return out


def savers_by_storage(gm: fx.GraphModule) -> Dict[Tuple[int, str], Set[str]]:
    """(storage key, producer) -> the names of the nodes keeping it."""
    out: Dict[Tuple[int, str], Set[str]] = {}
    for node in gm.graph.nodes:
        for s in kept(node):
            out.setdefault((s.key, s.source), set()).add(node.name)
    return out


def _numel(node) -> int:
    cost = _cost(node)
    return sum(int(torch.Size(s).numel()) for s in cost.shapes) if cost is not None else 0


def call_unit(node: fx.Node) -> str:
    """The unit name of the call replacing ``node`` (the name its new node gets)."""
    return f"{node.name}_coded"


def members(call: Call) -> Set[str]:
    """The baseline nodes a call replaces: its node, and a gated unit's activation."""
    return {call.node.name, *(e.name for e in call.erase)}


def settle(calls: Dict[str, Call], rewritten: Set[str], savers: Dict[Tuple[int, str], Set[str]],
           code_bytes) -> Dict[str, List[fx.Node]]:
    """Drop from ``rewritten`` (in place) the calls that would free no more than their codes cost, until
    nothing changes; returns, per call left, the reads it codes. ``code_bytes(numel)`` prices one code."""
    while True:
        coded: Dict[str, List[fx.Node]] = {}
        dropped = False
        for name, call in calls.items():
            if name not in rewritten:
                continue
            mine = members(call)
            refs = {(s.key, s.source): s for m in (call.node, *call.erase) for s in kept(m)}
            freed = sum(s.nbytes for k, s in refs.items() if savers.get(k, mine) <= rewritten)
            codes = [r for r in reads(call) if savers.get(_storage(r), set()) <= rewritten]
            if freed <= sum(code_bytes(_numel(r)) for r in codes):
                rewritten.difference_update(mine)
                dropped = True
            else:
                coded[name] = codes
        if not dropped:
            return coded


def live(replaced: Dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    """The node that stands for ``node`` now that earlier rewrites replaced some."""
    while node in replaced:
        node = replaced[node]
    return node


def rewrite_call(gm: fx.GraphModule, call: Call, coded: List[fx.Node], bits: int, group: int, encode,
                 replaced: Dict[fx.Node, fx.Node]) -> fx.Node:
    """Replace ``call.node`` by a coded call keeping ``coded`` as codes (``encode(node, bits)`` gives the
    (packed, params) nodes of one tensor, shared with other consumers); ``replaced`` maps each node an earlier
    rewrite erased to its replacement, and gains this one."""
    graph = gm.graph
    node = call.node
    coded = [live(replaced, r) for r in coded]
    with graph.inserting_before(node):
        def attr(value):
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "get_attr":
                return graph.get_attr(value[1])
            return value
        args = fx.node.map_arg(tuple(attr(a) for a in call.args), lambda n: live(replaced, n))
    kwargs = fx.node.map_arg(call.kwargs, lambda n: live(replaced, n))
    label = node.format_node()
    if call.kind == "softmax":
        spec = CodedSpec(call.target, (), bits, group, False, label)
        dim = _arg(node, 1, "dim") if node.op != "call_module" else args[1]
        with graph.inserting_before(node):
            new = graph.create_node("call_function", softmax_coded, (spec, dim, args[0], args[1:], kwargs),
                                    name=f"{node.name}_coded")
    else:
        leaves, _ = tree_flatten((args, kwargs))
        indices = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node) and leaf in coded)
        codes = tuple(encode(leaves[i], bits) for i in indices)
        recompute, unsaved = "", ()
        if call.kind == "batch_norm":
            aten = call.target.startswith("aten.")
            recompute = "memopt.aten_batch_norm_grad" if aten else "memopt.batch_norm_grad"
            unsaved = (3, 4) if aten else ()  # the running statistics: updated in forward, unused by backward
        spec = CodedSpec(call.target, indices, bits, group, call.random, label, recompute, unsaved)
        with graph.inserting_before(node):
            new = graph.create_node("call_function", coded_call, (spec, args, kwargs, codes),
                                    name=f"{node.name}_coded")
    what = "its output" if call.kind == "softmax" else ", ".join(r.name for r in coded)
    keeps = (f"keeps {what} as {bits}-bit codes in groups of {group}" if what else
             "keeps its inputs as they are (nodes that stay exact keep them too), frees what it kept besides")
    again = "rebuilds its gradient from them" if call.kind == "softmax" else "runs again in backward"
    new.meta[DECISION_KEY] = {
        "technique": "stash", "bits": bits, "replaces": [node.name, *(e.name for e in call.erase)],
        "unit": call_unit(node),
        "reason": f"coded {call.kind}: {keeps} and {again}{' (dropout replayed)' if call.random else ''}; "
                  f"input gradients approximate"}
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    replaced[node] = new
    for e in call.erase:
        graph.erase_node(e)
    return new


# coded ops that normalise their input in blocks: its codes are grouped within a block (``row_group``)
NORMS = ("layer_norm", "rms_norm", "group_norm", "batch_norm")


def norm_rows(calls: Dict[str, Call]) -> Dict[fx.Node, int]:
    """{input of a coded norm: elements per normalised block contiguous in memory}: a layer / RMS norm's last
    dim, a batch / group norm's channel plane (the dims after the channel dim)."""
    rows: Dict[fx.Node, int] = {}
    for call in calls.values():
        data = call.args[0] if call.args else None
        cost = data.meta.get(META_KEY) if isinstance(data, fx.Node) else None
        if call.kind not in NORMS or cost is None or not cost.shapes or not cost.shapes[0]:
            continue
        shape = cost.shapes[0]
        row = shape[-1] if call.kind in ("layer_norm", "rms_norm") else int(torch.Size(shape[2:]).numel())
        rows[data] = min(rows.get(data, row), row)
    return rows
