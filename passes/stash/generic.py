"""The stash pass, second part: a generic K-bit stash for weight-op inputs.

Generic stash (``StashConfig(generic=True)``): the inputs of conv, linear and matmul-with-a-parameter
nodes that no BatchNorm chain covers (transformer projections, LayerNorm outputs, first layers) are
coded once per tensor (``memopt.stash.generic``) and every consumer keeps the codes instead of the
tensor. A unit is one saved storage, named by the node that produced it, and is rewritten only when
every node that keeps that storage is such a consumer (the cost model's ``savers``): a LayerNorm
output feeding q, k and v frees only if all three are rewritten, and the report says which node blocked
it. An activation whose exact gradient is a 1-bit mask and that keeps the same tensor (a ReLU keeps its
output, the next conv its input) joins the unit and keeps its mask instead (``passes.fewbit.exact_masks``):
alone, neither the few-bit pass nor the stash would free that storage. Where every consumer reads the output
of a coded norm that codes its own input (a pre-norm block's q / k / v), the consumers keep no codes: they rebuild
their input as the norm of those codes (``memopt.stash.rebuild``); where a consumer's weight is computed from
parameters alone, it is recomputed in backward too (``passes/stash/weights.py``). Only weight gradients become
approximate. The exact extras (1-bit dropout masks, max-pool offsets) are ``passes/stash/extras.py``.
"""
from __future__ import annotations

import operator
import warnings
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from memopt.core.meta import META_KEY, STATE_CATEGORIES
from memopt.cost_model.op_registry import op_kind
from memopt.capture.trace import has_hooks
from memopt.runtime.bitpack import packed_nbytes
from memopt.stash.generic import (EncodeSpec, FromCodesSpec, conv_from_codes, generic_encode, linear_from_codes,
                                  matmul_from_codes, row_group)
from memopt.core.meta import DECISION_KEY
from memopt.stash.config import StashConfig
from memopt.stash.rebuild import RebuildSpec, weight_op_from_rebuild
from memopt.passes.base import PassContext
from memopt.passes.fewbit import exact_masks, replace_with_mask
from memopt.passes.stash.weights import Recipe, parameter_only, recipe_of, rewrite_with_recipe
from memopt.stash.weights import WeightOpSpec
from memopt.passes.stash.coded import (NORMS, Call, call_unit, find_call, live, members, norm_rows, rewrite_call,
                                       savers_by_storage, settle)

aten = torch.ops.aten
_FLOATS = ("float32", "bfloat16", "float16")
_CONV_DEFAULTS = (1, 0, 1, 1)  # stride, padding, dilation, groups


class Consumer(NamedTuple):
    node: fx.Node
    kind: str  # conv | linear | matmul
    data: fx.Node  # the input whose copy it keeps
    weight: fx.Node  # a get_attr node (inserted for modules)
    bias: Optional[fx.Node]
    conv: Tuple  # stride, padding, dilation, groups (conv only)


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _parameter(gm: fx.GraphModule, node) -> Optional[torch.Tensor]:
    """The tensor a get_attr node reads, else None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _consumer(gm: fx.GraphModule, node: fx.Node, modules, kinds: Tuple[str, ...]) -> Optional[Tuple[str, str]]:
    """(kind, why not) for a node of a kind in ``kinds``: why not is "" when it can be rewritten."""
    kind = op_kind(node, modules)
    if kind not in kinds or kind not in ("conv", "linear", "matmul"):
        return None
    module = modules.get(node.target) if node.op == "call_module" else None
    if module is not None:
        if has_hooks(module):
            return kind, "its module has hooks, which a rewrite would skip"
        if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return kind, f"{type(module).__name__} has no generic stash form"
        if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and (
                module.padding_mode != "zeros" or isinstance(module.padding, str)):
            return kind, f"padding {module.padding!r} / mode {module.padding_mode!r} (zeros, numeric only)"
        return kind, ""
    if node.op != "call_function" or node.target not in (
            F.linear, aten.linear.default, F.conv1d, F.conv2d, F.conv3d, aten.conv1d.default, aten.conv2d.default,
            aten.conv3d.default, torch.matmul, operator.matmul, aten.matmul.default, aten.mm.default):
        return kind, f"{node.target} has no generic stash form"
    weight_node = _arg(node, 1, "weight", _arg(node, 1, "other"))
    weight = _parameter(gm, weight_node)
    shape = tuple(weight.shape) if weight is not None else _from_parameters(weight_node)
    if shape is None:
        return kind, "its weight is computed in the graph from the model's inputs (both operands are activations)"
    if kind == "conv" and isinstance(_arg(node, 4, "padding", 0), str):
        return kind, f"padding {_arg(node, 4, 'padding')!r} (numeric only)"
    if kind == "matmul" and len(shape) != 2:
        return kind, f"a matmul with a {len(shape)}-D parameter (2-D only)"
    return kind, ""


def _from_parameters(node) -> Optional[tuple]:
    """The shape of a weight the graph computes from parameters and constants alone (timm's weight-standardised
    convs, a reparameterised kernel), else None. Such a weight has no batch dimension and no gradient path back
    into the activations: the rewrite keeps it exactly as the op did, so only parameter gradients see the codes."""
    if not isinstance(node, fx.Node):
        return None
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return None
        stack.extend(n.all_input_nodes)
    cost = node.meta.get(META_KEY)
    return tuple(cost.shapes[0]) if cost is not None and len(cost.shapes) == 1 else None


def _storage(node) -> Optional[int]:
    cost = node.meta.get(META_KEY) if isinstance(node, fx.Node) else None
    return cost.storages[0][0] if cost is not None and len(cost.storages) == 1 else None


def _describe(node: fx.Node, kind: str, gm: fx.GraphModule, modules) -> Consumer:
    module = modules.get(node.target) if node.op == "call_module" else None
    graph = gm.graph
    if module is not None:
        with graph.inserting_before(node), warnings.catch_warnings():
            # a parametrised weight is a property, which fx reads at run time but warns about
            warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node with no underlying reference")
            weight = graph.get_attr(f"{node.target}.weight")
            bias = graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
        conv = (module.stride, module.padding, module.dilation, module.groups) if kind == "conv" else ()
        return Consumer(node, kind, node.args[0], weight, bias, conv)
    weight = _arg(node, 1, "weight", _arg(node, 1, "other"))
    bias = _arg(node, 2, "bias") if kind != "matmul" else None
    conv = tuple(_arg(node, 3 + i, n, d) for i, (n, d) in
                 enumerate(zip(("stride", "padding", "dilation", "groups"), _CONV_DEFAULTS))) if kind == "conv" else ()
    return Consumer(node, kind, _arg(node, 0, "input"), weight, bias, conv)


def _kept(node: fx.Node):
    cost = node.meta.get(META_KEY)
    return [] if cost is None else [s for s in cost.saved if s.category not in STATE_CATEGORIES]


def _decide(node: fx.Node, reason: str) -> None:
    node.meta[DECISION_KEY] = {"technique": "exact", "reason": f"stash: {reason}"}


def generic_stash(gm: fx.GraphModule, cfg: StashConfig, ctx: PassContext) -> bool:
    """Rewrite every eligible weight-op input and coded op (see the module docstring); True when anything
    changed."""
    modules = dict(gm.named_modules())
    units = _weight_units(gm, cfg, modules) if cfg.generic else {}
    calls: Dict[str, Call] = {}
    # x @ parameter is a weight op (its unit rewrites it); a matmul of two activations stays a coded call
    weight_ops = {c for _, _, consumers, _ in units.values() for c in consumers if len(c.args) > 1 and (
        _parameter(gm, c.args[1]) is not None or _from_parameters(c.args[1]) is not None)}
    weights = parameter_only(gm)  # a weight's recipe (kept whole: recomputed, or kept as eager keeps it)
    for node in list(gm.graph.nodes):
        call = find_call(node, modules, cfg.coded_ops, cfg.min_per_channel) \
            if cfg.coded_ops and node not in weights else None
        if call is None or node in weight_ops:
            continue
        reason = _excluded(ctx, cfg, call_unit(node)) or (f"the node {node.name} is excluded by StashConfig deny"
                                                          if node.name in cfg.deny else "")
        if reason:
            _decide(node, f"coded {call.kind}: {reason}")
        else:
            calls[node.name] = call
    rewritten = set().union(set(), *(members(c) for c in calls.values()))
    blocked: Dict[object, str] = {}
    for key, (unit, _, consumers, reason) in units.items():
        reason = reason or _excluded(ctx, cfg, unit)
        if reason:
            blocked[key] = reason
        else:
            rewritten.update(c.name for c in consumers)
    savers = savers_by_storage(gm)
    absorbed = _absorb(units, blocked, exact_masks(gm, modules) if units else {}, rewritten)
    while True:  # a weight unit or a call dropped can leave another's storage kept: settle both
        coded = settle(calls, rewritten, savers, lambda n: stash_nbytes(n, cfg.generic_bits, cfg.group_size))
        changed = False
        for key, (unit, unit_savers, consumers, _) in units.items():
            if key not in blocked and not set(unit_savers) <= rewritten:
                others = sorted(set(unit_savers) - rewritten)
                blocked[key] = f"the tensor it keeps is also kept by {', '.join(others[:3])}, which stay exact"
                rewritten.difference_update(c.name for c in consumers)
                rewritten.difference_update(m[0].name for m in absorbed.pop(key, []))
                changed = True
        if not changed:
            break
    replaced: Dict[fx.Node, fx.Node] = {}
    encode = _Encoder(gm, cfg, replaced, norm_rows({n: c for n, c in calls.items() if n in rewritten}))
    taken = set()
    for key, (unit, _, consumers, _) in units.items():
        reason = blocked.get(key) or (f"another storage of {unit} is already a unit" if unit in taken else None)
        if reason is not None:
            for c in consumers:
                _decide(c, f"generic stash: {reason}")
            continue
        taken.add(unit)
        for node, kind, params in absorbed.get(key, []):
            replaced[node] = replace_with_mask(gm, node, kind, params, unit,
                                               f"with it the generic stash of {unit} frees this output")
        source = _norm_source(consumers, calls, coded, rewritten)
        if source is not None:
            norm_unit = call_unit(source[0].node)
            bits = max(ctx.bits("stash", norm_unit, cfg.generic_bits_for(norm_unit)),  # codes shared by both:
                       ctx.bits("stash", unit, cfg.generic_bits_for(unit)))  # a raise of either one counts
            _rewrite_rebuilt(gm, modules, unit, consumers, *source, bits, encode, replaced)
            continue
        _rewrite_unit(gm, modules, unit, consumers, ctx.bits("stash", unit, cfg.generic_bits_for(unit)), encode,
                      replaced, cfg.recompute_weights)
    for name, call in calls.items():
        if name not in rewritten:
            _decide(call.node, f"coded {call.kind}: it would free no more than its codes cost (what it keeps is "
                               f"kept by nodes that stay exact too)")
            continue
        unit = call_unit(call.node)
        group = encode.group(coded[name][0]) if call.kind in NORMS and len(coded[name]) == 1 else cfg.group_size
        rewrite_call(gm, call, coded[name], ctx.bits("stash", unit, cfg.generic_bits_for(unit)), group,
                     lambda data, bits, unit=unit, group=group: encode(data, bits, unit, group), replaced)
    return bool(taken) or any(name in rewritten for name in calls)


def _absorb(units, blocked, masks, rewritten: Set[str]) -> Dict[object, list]:
    """storage key -> the exact-mask activations (``masks``) among that unit's savers that keep nothing but
    its storage: they join the unit (added to ``rewritten``, in place) and keep their 1-bit masks."""
    absorbed: Dict[object, list] = {}
    for key, (_, unit_savers, _, _) in units.items():
        if key in blocked:
            continue
        take = [m for m in _keeping_only(key, unit_savers, masks) if m[0].name not in rewritten]
        if take:
            absorbed[key] = take
            rewritten.update(m[0].name for m in take)
    return absorbed


def _keeping_only(key, savers, masks) -> list:
    """The exact-mask activations (``masks``) among ``savers`` that keep nothing but the storage ``key``."""
    return [masks[n] for n in savers if n in masks and all(s.key == key for s in _kept(masks[n][0]))]


def _excluded(ctx: PassContext, cfg: StashConfig, unit: str) -> str:
    chosen = ctx.chosen("stash", unit)
    if chosen is False:
        return f"the unit {unit} was {ctx.unchosen('stash', unit)}"
    if (chosen is None and cfg.allow is not None and unit not in cfg.allow) or unit in cfg.deny:
        return f"the unit {unit} is excluded by StashConfig allow/deny"
    return ""


def _weight_units(gm: fx.GraphModule, cfg: StashConfig, modules) -> Dict[object, Tuple[str, List[str], List[fx.Node], str]]:
    """storage key -> (unit, savers, weight-op consumers keeping it, why not ("" when it can be rewritten))."""
    units: Dict[object, Tuple[str, List[str], List[fx.Node], str]] = {}
    for node in list(gm.graph.nodes):
        found = _consumer(gm, node, modules, cfg.consumers)
        if found is None:
            continue
        kind, why = found
        kept = _kept(node)
        if not kept:
            continue  # keeps nothing: nothing to free
        data = _arg(node, 0, "input")
        if not why and _dtype(data) not in _FLOATS:
            why = f"its input's dtype {_dtype(data)} is not one of {list(_FLOATS)}"
        # what it keeps besides copies it made itself (autocast's low-precision copies of its input and weight,
        # a transposed input made contiguous): those the rewrite drops, keeping the codes and the weight instead
        # and the weight when the graph computes it (it stays kept as it is)
        weight = _storage(_arg(node, 1, "weight", _arg(node, 1, "other"))) if node.op == "call_function" else None
        own = [r for r in kept if r.category != "extra" and (r.key != weight or weight is None)]
        if not why and len(own) > 1:
            why = "it keeps more than its input"
        if not why and own and own[0].category == "input":
            why = ("its input is a model input, which stays alive outside the step: coding it would add bytes, "
                   "not free them")
        if own:
            key, name, ref_savers = own[0].key, own[0].source, list(own[0].savers)
        else:  # only copies of its own: every consumer of that input joins one unit named after it
            key = ("copy of", data.name if isinstance(data, fx.Node) else "")
            name, ref_savers = key[1], [node.name]
        unit, savers, consumers, reason = units.get(key, (name, [], [], ""))
        units[key] = (unit, savers + [s for s in ref_savers if s not in savers], consumers + [node],
                      reason or (f"{node.name} ({kind}): {why}" if why else ""))
    return units


class _Encoder:
    """One generic_encode per (tensor, bits), shared by every consumer and coded op reading it; a coded norm's
    input is grouped within its normalised blocks (``rows``), every other tensor in groups of ``group_size``."""

    def __init__(self, gm: fx.GraphModule, cfg: StashConfig, replaced: Dict[fx.Node, fx.Node],
                 rows: Optional[Dict[fx.Node, int]] = None) -> None:
        self.graph, self.cfg, self.done, self.replaced, self.rows = gm.graph, cfg, {}, replaced, rows or {}

    def group(self, data: fx.Node) -> int:
        row = self.rows.get(data, self.rows.get(live(self.replaced, data)))
        return self.cfg.group_size if row is None else row_group(row, self.cfg.group_size)

    def __call__(self, data: fx.Node, bits: int, unit: str, group: Optional[int] = None) -> Tuple[fx.Node, fx.Node]:
        group = group or self.group(data)
        data = live(self.replaced, data)
        key = (data, bits, group)
        if key not in self.done:
            graph = self.graph
            with graph.inserting_after(data):
                enc = graph.create_node("call_function", generic_encode,
                                        (data, EncodeSpec(bits, group, self.cfg.stochastic)), name=f"{data.name}_codes")
            with graph.inserting_after(enc):
                packed = graph.call_function(operator.getitem, (enc, 0))
            with graph.inserting_after(packed):
                params = graph.call_function(operator.getitem, (enc, 1))
            enc.meta[DECISION_KEY] = {
                "technique": "stash", "bits": bits, "replaces": [], "unit": unit,
                "reason": f"generic stash of {data.name}: {bits}-bit codes in groups of {group} (min and step per "
                          f"group, float32), {'stochastic' if self.cfg.stochastic else 'nearest'} rounding"}
            self.done[key] = (packed, params)
        return self.done[key]


def _rewrite_unit(gm: fx.GraphModule, modules, unit: str, consumers: List[fx.Node], bits: int,
                  encode: _Encoder, replaced: Dict[fx.Node, fx.Node], reweight: bool) -> None:
    graph = gm.graph
    for node in consumers:
        c = _describe(node, op_kind(node, modules), gm, modules)
        packed, params = encode(c.data, bits, unit)
        group = encode.group(c.data)
        label = node.format_node()
        recipe = recipe_of(gm, node, modules) if reweight and c.kind != "matmul" else None
        if isinstance(recipe, Recipe):  # a weight computed from parameters: recomputed, not kept
            if not c.weight.users and c.weight is not _arg(node, 1, "weight"):
                graph.erase_node(c.weight)  # the module's weight read _describe made
            new = rewrite_with_recipe(gm, node, recipe, WeightOpSpec(c.kind, c.conv, bits, group, label), c.data,
                                      c.bias, packed, params)
            new.meta[DECISION_KEY] = {
                "technique": "stash", "bits": bits, "replaces": [node.name], "unit": unit,
                "reason": f"input rebuilt from the generic stash of {unit} for the weight gradient; its weight, "
                          f"computed from parameters, recomputed in backward; the input gradient stays exact"}
            replaced[node] = new
            continue
        with graph.inserting_before(node):
            spec = FromCodesSpec(bits, group, label, tuple(c.conv))
            if c.kind == "linear":
                new = graph.create_node("call_function", linear_from_codes,
                                        (c.data, c.weight, c.bias, packed, params, spec), name=f"{node.name}_stash")
            elif c.kind == "conv":
                new = graph.create_node("call_function", conv_from_codes,
                                        (c.data, c.weight, c.bias, packed, params, spec), name=f"{node.name}_stash")
            else:
                new = graph.create_node("call_function", matmul_from_codes, (c.data, c.weight, packed, params, spec),
                                        name=f"{node.name}_stash")
        new.meta[DECISION_KEY] = {"technique": "stash", "bits": bits, "replaces": [node.name], "unit": unit,
                                  "reason": f"input rebuilt from the generic stash of {unit} for the weight "
                                            f"gradient; the input gradient stays exact"}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced[node] = new


# the norms whose output a weight op can rebuild, with their parameters in order (kwargs become positional)
_REBUILT_NORMS = {"layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
                  "group_norm": ("input", "num_groups", "weight", "bias", "eps"),
                  "rms_norm": ("input", "normalized_shape", "weight", "eps")}


def _norm_source(consumers: List[fx.Node], calls: Dict[str, Call], coded: Dict[str, List[fx.Node]],
                 rewritten: Set[str]) -> Optional[Tuple[Call, list]]:
    """(the coded norm whose output every consumer reads and whose input it codes, its arguments in order), so
    that the consumers can rebuild their input from those codes (``memopt.stash.rebuild``); else None."""
    data = {_arg(c, 0, "input") for c in consumers}
    node = next(iter(data)) if len(data) == 1 else None
    call = calls.get(node.name) if isinstance(node, fx.Node) else None
    if call is None or call.kind not in _REBUILT_NORMS or node.name not in rewritten:
        return None
    names = _REBUILT_NORMS[call.kind]
    if len(call.args) > len(names) or set(call.kwargs) - set(names[len(call.args):]):
        return None
    args = list(call.args) + [call.kwargs.get(n) for n in names[len(call.args):]]
    if not isinstance(args[0], fx.Node) or args[0] not in coded.get(node.name, ()):
        return None
    nested = [leaf for a in args[1:] if isinstance(a, (tuple, list)) and a[:1] != ("get_attr",) for leaf in a]
    if any(isinstance(leaf, fx.Node) for leaf in nested):
        return None  # a shape computed in the graph: not a constant the rebuild can carry
    return call, args


def _rewrite_rebuilt(gm: fx.GraphModule, modules, unit: str, consumers: List[fx.Node], norm: Call, norm_args: list,
                     bits: int, encode: _Encoder, replaced: Dict[fx.Node, fx.Node]) -> None:
    """Rewrite ``consumers`` of ``norm``'s output to rebuild their input as the norm of its input's codes."""
    graph, src = gm.graph, norm_args[0]
    marks, tensors = [], []
    with graph.inserting_before(consumers[0]):
        for a in norm_args:
            if a is src:
                marks.append(("src", None))
            elif isinstance(a, tuple) and len(a) == 2 and a[0] == "get_attr":
                marks.append(("tensor", None))
                tensors.append(graph.get_attr(a[1]))
            elif isinstance(a, fx.Node):
                marks.append(("tensor", None))
                tensors.append(live(replaced, a))
            else:
                marks.append(("value", tuple(a) if isinstance(a, list) else a))
    for node in consumers:
        c = _describe(node, op_kind(node, modules), gm, modules)
        packed, params = encode(src, bits, call_unit(norm.node))  # the norm unit owns these codes and their bits
        spec = RebuildSpec(c.kind, tuple(c.conv), bits, encode.group(src), node.format_node(), norm.target,
                           tuple(marks))
        with graph.inserting_before(node):
            new = graph.create_node("call_function", weight_op_from_rebuild,
                                    (c.data, live(replaced, src), c.weight, c.bias, packed, params, spec,
                                     tuple(tensors)), name=f"{node.name}_stash")
        new.meta[DECISION_KEY] = {
            "technique": "stash", "bits": bits, "replaces": [node.name], "unit": unit,
            "reason": f"input rebuilt in backward as {norm.kind} of the {bits}-bit codes of {src.name} that "
                      f"{norm.node.name} keeps: no codes of its own; the input gradient stays exact"}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced[node] = new


def stash_nbytes(numel: int, bits: int, group: int) -> int:
    """Bytes the generic stash keeps for ``numel`` elements: codes plus 8 bytes (min, step) per group."""
    return packed_nbytes(numel, bits) + 8 * -(-numel // group)


def _dtype(node) -> Optional[str]:
    cost = node.meta.get(META_KEY) if isinstance(node, fx.Node) else None
    return cost.dtypes[0] if cost is not None and cost.dtypes else None
