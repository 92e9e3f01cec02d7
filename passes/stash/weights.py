"""The stash pass, third part: weights computed from parameters alone are recomputed in backward (exact).

A conv or linear whose weight the graph computes from parameters and constants only (timm's weight-standardised
convs, weight norm) keeps that weight-sized tensor for backward; ``memopt.stash.weights`` keeps the weight's
recipe instead (``StashConfig.recompute_weights``). The recipe is every node between the parameters and the
weight; it must be private to the op (no other node reads its values), pure (no random draw, no in-place update,
no module holding parameters or buffers of its own) and the op must keep the weight's storage (a parameter's view
costs nothing to keep). The generic stash uses the same recipe for a consumer whose input it codes; this part
rewrites the consumers left with their input exact.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Set, Tuple, Union

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from memopt.capture.trace import has_hooks

from memopt.core.meta import DECISION_KEY, META_KEY, STATE_CATEGORIES
from memopt.cost_model.op_registry import op_kind
from memopt.passes.stash.coded import _arg
from memopt.stash.weights import WeightOpSpec, weight_op_recomputed

aten = torch.ops.aten
_CONVS = (F.conv1d, F.conv2d, F.conv3d, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
_LINEARS = (F.linear, aten.linear.default)
_CONV_DEFAULTS = (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))
_RANDOM = ("normal", "multinomial", "poisson")  # the out-of-place draws not named rand* (in-place ones end in _)


class Recipe(NamedTuple):
    nodes: List[fx.Node]  # graph order, the weight last (none for a parametrised module's weight)
    leaves: List[fx.Node]  # the get_attr nodes it reads (parameters, buffers, constants)
    module: Optional[nn.Module] = None  # the recipe when it is not made of the graph's nodes


class ParametrizedWeight(nn.Module):
    """A module's parametrised weight (``torch.nn.utils.parametrize``: weight norm, spectral norm without its
    power iteration's buffers...) as a function of the parametrisation's original tensors."""

    def __init__(self, parametrizations: nn.Module, names: Tuple[str, ...]) -> None:
        super().__init__()
        self.parametrizations, self.names = parametrizations, names

    def forward(self, *originals: torch.Tensor) -> torch.Tensor:
        return functional_call(self.parametrizations, dict(zip(self.names, originals)), ())


def _module_recipe(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> Union[Recipe, str, None]:
    """The recipe of a conv / linear module's parametrised weight (inserting get_attr nodes for its originals), a
    reason it cannot be recomputed, or None when its weight is a plain parameter."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    if parametrize.is_parametrized(module, "bias"):
        return "its bias is parametrised too"
    plist = module.parametrizations["weight"]
    if any(True for _ in plist.buffers()):
        return f"the parametrisation of {node.target}.weight holds buffers (a power iteration's state)"
    names = tuple(name for name, _ in plist.named_parameters())
    if any("." in name for name in names):
        return f"the parametrisation of {node.target}.weight holds parameters of its own"
    with gm.graph.inserting_before(node):
        leaves = [gm.graph.get_attr(f"{node.target}.parametrizations.weight.{name}") for name in names]
    return Recipe([], leaves, ParametrizedWeight(plist, names))


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _impure(node: fx.Node, gm: fx.GraphModule, modules) -> str:
    """Why ``node`` cannot run twice with the same result ("" when it can)."""
    name = _name(node).lower()
    if node.op == "call_module":
        module = modules[node.target]
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            return f"{node.name} calls {type(module).__name__}, which holds parameters or buffers of its own"
    base = name.split(".")[0]
    if base.startswith("rand") or base in _RANDOM or "bernoulli" in base or "dropout" in base \
            or op_kind(node, modules) == "dropout":
        return f"{node.name} draws random numbers"
    if (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True:
        return f"{node.name} updates a tensor in place"
    return ""


def parameter_only(gm: fx.GraphModule) -> Set[fx.Node]:
    """The nodes computed from parameters and constants alone (no input upstream): weight-sized, no batch."""
    found: Set[fx.Node] = set()
    for node in gm.graph.nodes:  # graph order: inputs come first
        if node.op == "get_attr" or node.op in ("call_function", "call_method", "call_module") and all(
                a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def recipe_of(gm: fx.GraphModule, consumer: fx.Node, modules) -> Union[Recipe, str, None]:
    """The recipe of ``consumer``'s weight (a conv / linear call), a string saying why it cannot be recomputed,
    or None when there is nothing to recompute (a parameter, a view of one, or a weight read from the inputs)."""
    if consumer.op == "call_module":
        return _module_recipe(gm, consumer, modules[consumer.target])
    weight = _arg(consumer, 1, "weight")
    if not isinstance(weight, fx.Node) or weight.op != "call_function" and weight.op != "call_method" \
            and weight.op != "call_module":
        return None
    cost, own = weight.meta.get(META_KEY), consumer.meta.get(META_KEY)
    if cost is None or own is None or len(cost.storages) != 1:
        return None
    key = cost.storages[0][0]
    if not any(s.key == key and s.category not in STATE_CATEGORIES for s in own.saved):
        return None  # the op keeps no computed copy (a view of a parameter is the parameter)
    inside, leaves, stack = set(), [], [weight]
    while stack:
        node = stack.pop()
        if node in inside or node in leaves:
            continue
        if node.op == "placeholder":
            return None  # read from the model's inputs: an activation, not a weight
        if node.op == "get_attr":
            leaves.append(node)
            continue
        inside.add(node)
        stack.extend(node.all_input_nodes)
    if _arg(consumer, 0, "input") in inside:
        return "its input is computed by its weight's recipe"
    for node in inside:
        users = set(node.users) - inside
        if users and users != {consumer} or node is not weight and users:
            return f"{node.name}, a step of its weight's recipe, is also read by {sorted(u.name for u in users)[0]}"
        why = _impure(node, gm, modules)
        if why:
            return why
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return Recipe(sorted(inside, key=order.__getitem__), sorted(leaves, key=order.__getitem__))


def rewrite_with_recipe(gm: fx.GraphModule, consumer: fx.Node, recipe: Recipe, spec: WeightOpSpec, x, bias,
                        packed=None, params=None) -> fx.Node:
    """Replace ``consumer`` by ``weight_op_recomputed`` (its weight's recipe as a submodule); the recipe's nodes
    leave the graph. Returns the new node (its decision is the caller's)."""
    attr = f"memopt_weight_{consumer.name}"
    if recipe.module is not None:
        gm.add_submodule(attr, recipe.module)
    else:
        sub = fx.Graph()
        env = {leaf: sub.placeholder(f"leaf_{i}") for i, leaf in enumerate(recipe.leaves)}
        for node in recipe.nodes:
            env[node] = sub.node_copy(node, lambda n: env[n])
        sub.output(env[recipe.nodes[-1]])
        gm.add_submodule(attr, fx.GraphModule(gm, sub, class_name=f"WeightOf_{consumer.name}"))
    graph = gm.graph
    with graph.inserting_before(consumer):
        module_node = graph.get_attr(attr)
        new = graph.create_node("call_function", weight_op_recomputed,
                                (spec, module_node, x, bias, packed, params, *recipe.leaves),
                                name=f"{consumer.name}_reweight")
    consumer.replace_all_uses_with(new)
    graph.erase_node(consumer)
    for node in reversed(recipe.nodes):
        graph.erase_node(node)
    return new


def conv_args(node: fx.Node) -> tuple:
    """(stride, padding, dilation, groups) of a functional or ATen conv call."""
    return tuple(_arg(node, 3 + i, name, default) for i, (name, default) in enumerate(_CONV_DEFAULTS))


def recompute_weights(gm: fx.GraphModule) -> bool:
    """Rewrite every plain conv / linear call whose weight has a recipe (its input kept as it is); True when any
    was. A recipe that cannot be recomputed is said in the node's decision."""
    modules = dict(gm.named_modules())
    modified = False
    for node in list(gm.graph.nodes):
        found = _plain(node, modules)
        if found is None:
            continue
        kind, conv, bias = found
        found = recipe_of(gm, node, modules)
        if found is None:
            continue
        if isinstance(found, str):
            node.meta.setdefault(DECISION_KEY, {"technique": "exact",
                                                "reason": f"stash: its computed weight is kept: {found}"})
            continue
        if node.op == "call_module" and bias is not None:
            with gm.graph.inserting_before(node):
                bias = gm.graph.get_attr(bias)
        spec = WeightOpSpec(kind, conv, None, 0, node.format_node())
        new = rewrite_with_recipe(gm, node, found, spec, _arg(node, 0, "input"), bias)
        how = "its parametrisation" if found.module is not None else f"{len(found.nodes)} op(s)"
        new.meta[DECISION_KEY] = {"technique": "stash", "bits": None, "replaces": [node.name],
                                  "reason": f"its weight, computed from parameters by {how}, recomputed in "
                                            f"backward instead of kept (exact)"}
        modified = True
    return modified


def _plain(node: fx.Node, modules) -> Optional[Tuple[str, tuple, object]]:
    """(kind, conv arguments, bias: a node, or a module's bias attribute path) of a conv / linear call whose
    backward ``weight_op_recomputed`` reproduces, else None."""
    if node.op == "call_function" and node.target in _CONVS + _LINEARS:
        conv = node.target in _CONVS
        if conv and isinstance(conv_args(node)[1], str):
            return None  # padding="same": F.conv2d's own rule, not reproduced by conv_grads
        return ("conv", conv_args(node), _arg(node, 2, "bias")) if conv else ("linear", (), _arg(node, 2, "bias"))
    module = modules.get(node.target) if node.op == "call_module" else None
    cls = type(module).__bases__[0] if module is not None and parametrize.is_parametrized(module) else type(module)
    if cls not in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d) or has_hooks(module):
        return None
    bias = f"{node.target}.bias" if module.bias is not None else None
    if isinstance(module, nn.Linear):
        return "linear", (), bias
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None
    return "conv", (module.stride, module.padding, module.dilation, module.groups), bias
