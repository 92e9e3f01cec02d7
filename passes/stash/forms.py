"""The spellings of a stash chain's BatchNorm and of its consumers, so ``passes/stash/chains.py`` matches every capture.

A BatchNorm reaches the stash pass in one of three forms:
- a module call (``torch.fx``): ``nn.BatchNorm1d/2d/3d``, or the stock twin ``memopt/capture/fused_norms.py`` puts in
  place of a fused norm-act module's traced ``F.batch_norm`` (timm's ``BatchNormAct2d``);
- ``aten.batch_norm.default`` with ``training=True`` (``torch.export``'s training IR: Hugging Face models that
  symbolic tracing cannot capture). Its weight, bias and running statistics are ``get_attr`` arguments; the batch
  counter is a separate node before it, ``aten.add_.Tensor(num_batches_tracked, 1)``, with no users;
- ``F.batch_norm(..., training=True)`` left in an fx graph (a model's own functional call that canonical could not
  give a module): no counter, as ``F.batch_norm`` updates none.
``BNForm`` hides the difference: the chain's Function (``bn_act_stash``) updates the running statistics and the
counter itself with stock's kernel (``memopt.stash.stats.batch_norm_train``), so a rewrite of the export form erases
the counter node with the BatchNorm: the counter still moves once per step, the running statistics are the same
values, and the forward output is the same kernel's.

A chain's consumers likewise: a conv / linear module or its functional / ATen call (rebuilt from the stash for
the weight gradient; the input gradient needs only the weight), and 2-d max pooling in any spelling.
"""
from __future__ import annotations

import operator
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from memopt.capture.trace import has_hooks
from memopt.core.meta import META_KEY
from memopt.passes.stash.extras import _max_pool_args
from memopt.passes.stash.generic import _arg, _parameter

aten = torch.ops.aten
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_CALLS = (F.conv1d, F.conv2d, F.conv3d, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
_LINEAR_CALLS = (F.linear, aten.linear.default)
_CONV_DEFAULTS = (1, 0, 1, 1)  # stride, padding, dilation, groups
# F.batch_norm's and aten.batch_norm's argument names, in order
_F_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_ATEN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled")
_PARAMS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class BNForm(NamedTuple):
    """A training-mode BatchNorm in any form. ``module``/``path``: the module form; ``params``: the other forms'
    (weight, bias, running_mean, running_var, num_batches_tracked) graph nodes, None where absent;
    ``counter``: the export form's separate ``num_batches_tracked.add_(1)``, erased with the BatchNorm."""

    node: fx.Node
    input: fx.Node
    momentum: Optional[float]
    eps: float
    dims: Optional[int]  # of the input (None where the cost model has not annotated it)
    module: Optional[nn.Module] = None
    params: Tuple[Optional[fx.Node], ...] = ()
    counter: Optional[fx.Node] = None

    def attrs(self, graph: fx.Graph) -> List[Optional[fx.Node]]:
        """The five tensors as graph nodes (call inside ``graph.inserting_before``): new get_attr nodes for a
        module, the call's own arguments otherwise."""
        if self.module is None:
            return list(self.params)
        return [graph.get_attr(f"{self.node.target}.{n}") if getattr(self.module, n, None) is not None else None
                for n in _PARAMS]

    def replaced(self) -> List[fx.Node]:
        """The baseline nodes a rewrite of this BatchNorm removes: the call and, for the export form, its counter."""
        return [self.node] + ([self.counter] if self.counter is not None else [])

    def erase(self, graph: fx.Graph) -> None:
        for node in self.replaced():
            graph.erase_node(node)


def _dims(node: fx.Node) -> Optional[int]:
    cost = node.meta.get(META_KEY) if isinstance(node, fx.Node) else None
    return len(cost.shapes[0]) if cost is not None and cost.shapes else None


def _get_attr(value) -> bool:
    return isinstance(value, fx.Node) and value.op == "get_attr"


def _is_counter(node: fx.Node, attr: fx.Node) -> bool:
    """``attr.add_(1)`` (method or ATen spelling), its result unused."""
    if node.users or node.kwargs or node.args != (attr, 1):
        return False
    return (node.op == "call_function" and node.target is aten.add_.Tensor) or \
        (node.op == "call_method" and node.target == "add_")


def _counter(node: fx.Node, running_mean: fx.Node) -> Union[str, Tuple[Optional[fx.Node], Optional[fx.Node]]]:
    """(the counter's get_attr, its update) of the BatchNorm whose running mean is ``running_mean``: the
    ``num_batches_tracked`` next to it, updated once before ``node`` by a lone ``add_(1)`` and read by nothing
    else; (None, None) when the graph never reads one; else why not."""
    path = f"{running_mean.target.rpartition('.')[0]}.num_batches_tracked".lstrip(".")
    attrs = [n for n in node.graph.nodes if n.op == "get_attr" and n.target == path]
    updates = [u for a in attrs for u in a.users]
    if not updates:  # the graph never counts (a functional call): neither does the chain
        return None, None
    if len(updates) != 1 or not _is_counter(updates[0], updates[0].args[0]):
        return (f"its counter {path} is read or updated by {', '.join(u.name for u in updates)}, not by one lone "
                f"add_(1) as stock's forward does: it stays exact (a rewrite would count the batch itself)")
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    if order[updates[0]] > order[node]:
        return f"its counter {path} is updated after it, by {updates[0].name}: it stays exact (stock counts first)"
    return updates[0].args[0], updates[0]


def _module_form(node: fx.Node, module: nn.Module) -> Union[str, BNForm]:
    if has_hooks(module):
        return "the BatchNorm has hooks, which a rewrite would skip"
    if not module.track_running_stats or module.momentum is None:
        return "BatchNorm without running statistics or with cumulative momentum (momentum=None)"
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return f"{node.name} is called with {len(node.args)} arguments / keywords {sorted(node.kwargs)}"
    return BNForm(node, node.args[0], module.momentum, module.eps, _dims(node.args[0]), module=module)


def _call_form(node: fx.Node) -> Union[str, BNForm]:
    names = _ATEN_ARGS if node.target is aten.batch_norm.default else _F_ARGS
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return f"{node.name} has arguments {node.args!r:.80} / {sorted(node.kwargs)} beyond {node.target}'s"
    values = dict(zip(names, node.args), **node.kwargs)
    defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    get = lambda key: values.get(key, defaults.get(key))  # noqa: E731
    if get("training") is not True:
        return f"{node.name} normalises with running statistics (training={get('training')!r}), not batch ones"
    if not isinstance(get("input"), fx.Node):
        return f"{node.name}'s input is not a graph value"
    if not (_get_attr(get("running_mean")) and _get_attr(get("running_var"))):
        return "BatchNorm without running statistics as attributes (running_mean / running_var are not get_attr)"
    if not isinstance(get("momentum"), float) or not isinstance(get("eps"), float):
        return f"{node.name} has momentum {get('momentum')!r} / eps {get('eps')!r} (floats only)"
    if any(get(k) is not None and not _get_attr(get(k)) for k in ("weight", "bias")):
        return f"{node.name}'s weight or bias is computed in the graph, not a parameter"
    attr, counter = (None, None)
    if node.target is aten.batch_norm.default:  # F.batch_norm updates no counter
        found = _counter(node, get("running_mean"))
        if isinstance(found, str):
            return found
        attr, counter = found
    params = (get("weight"), get("bias"), get("running_mean"), get("running_var"), attr)
    return BNForm(node, get("input"), get("momentum"), get("eps"), _dims(get("input")), params=params,
                  counter=counter)


def bn_form(node: fx.Node, modules) -> Union[None, str, BNForm]:
    """The BatchNorm ``node`` is, in any form; a string saying why a BatchNorm cannot head a chain; None for any
    other node."""
    if node.op == "call_module":
        module = modules.get(node.target)
        return _module_form(node, module) if isinstance(module, BATCH_NORMS) else None
    if node.op == "call_function" and node.target in (aten.batch_norm.default, F.batch_norm):
        return _call_form(node)
    return None


# ---------------------------------------------------------------------------------------------- consumers
class Consumer(NamedTuple):
    """A conv / linear reading the chain's output: its weight and bias nodes and the conv's parameters."""

    kind: str  # "conv" or "linear"
    weight: fx.Node
    bias: Optional[fx.Node]
    conv: Tuple  # stride, padding, dilation, groups (conv only)


def rebuild_kind(user: fx.Node, modules) -> Optional[str]:
    """"conv" / "linear" for a user that can rebuild its input from the stash (any spelling), else None."""
    module = modules.get(user.target) if user.op == "call_module" else None
    if module is not None:
        return "conv" if isinstance(module, CONVS) else "linear" if isinstance(module, nn.Linear) else None
    if user.op != "call_function":
        return None
    return "conv" if user.target in _CONV_CALLS else "linear" if user.target in _LINEAR_CALLS else None


def consumer_reason(user: fx.Node, kind: str, modules) -> Optional[str]:
    """Why a conv / linear user (``rebuild_kind``) cannot take its input from the stash, else None."""
    module = modules.get(user.target) if user.op == "call_module" else None
    if module is not None:
        if has_hooks(module):
            return f"{user.name} has hooks, which its rewrite would skip"
        if kind == "conv" and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
            return f"{user.name} has padding {module.padding!r} / mode {module.padding_mode!r} (zeros, numeric only)"
        return None
    if not isinstance(_arg(user, 1, "weight"), fx.Node):
        return f"{user.name} has no weight tensor"
    if kind == "conv" and isinstance(_arg(user, 4, "padding", 0), str):
        return f"{user.name} has padding {_arg(user, 4, 'padding')!r} (numeric only)"
    return None


def consumer(graph: fx.Graph, user: fx.Node, kind: str, modules) -> Consumer:
    """The weight / bias nodes and conv parameters of a conv / linear user (call inside ``inserting_before``)."""
    module = modules.get(user.target) if user.op == "call_module" else None
    if module is not None:
        bias = graph.get_attr(f"{user.target}.bias") if module.bias is not None else None
        conv = (module.stride, module.padding, module.dilation, module.groups) if kind == "conv" else ()
        return Consumer(kind, graph.get_attr(f"{user.target}.weight"), bias, conv)
    conv = tuple(_arg(user, 3 + i, n, d) for i, (n, d) in
                 enumerate(zip(("stride", "padding", "dilation", "groups"), _CONV_DEFAULTS))) if kind == "conv" else ()
    return Consumer(kind, _arg(user, 1, "weight"), _arg(user, 2, "bias"), conv)


def trainable_weight(gm: fx.GraphModule, user: fx.Node, modules) -> bool:
    """A conv / linear (any spelling) whose weight is a parameter that requires grad, with no hooks: it keeps
    its input for its weight gradient."""
    kind = rebuild_kind(user, modules)
    if kind is None or consumer_reason(user, kind, modules) is not None:
        return False
    module = modules.get(user.target) if user.op == "call_module" else None
    weight = module.weight if module is not None else _parameter(gm, _arg(user, 1, "weight"))
    return weight is not None and weight.requires_grad


def max_pool(user: fx.Node, modules) -> Optional[Tuple]:
    """(kernel_size, stride, padding, dilation, ceil_mode) of a 2-d max pool returning no indices, any spelling."""
    return _max_pool_args(user, modules)


def in_place_add(node: fx.Node) -> bool:
    """An add that writes into its first operand (``x += y`` traced, ``aten.add_``, ``x.add_(y)``)."""
    return (node.op == "call_function" and node.target in (operator.iadd, aten.add_.Tensor)) or \
        (node.op == "call_method" and node.target == "add_")
