"""Which parameters have an exact gradient of zero by construction, read off the captured graph.

Any approximation of the backward leaves a gradient of the approximation's error's size where the exact one is
rounding, so a cosine between the two is noise; the fidelity gate and the sweeps list these parameters apart with
the reason instead of chasing them. Two constructions are recognised:

- a per-channel shift cancelled by a training-mode BatchNorm's batch mean, through sums of branches and unpadded
  convs (``_shift_cancelled``), and a per-channel scale its normalisation cancels;
- a shift of the attention keys, constant over the keys, cancelled by the softmax over the keys
  (``_softmax_cancelled``): ``q · (k_j + b) = q · k_j + q · b`` is the same added number for every key ``j``.
  The shift is followed through reshapes, permutes, scalings, sums with values it does not reach, per-position
  (1x1) convs that mix heads ("talking heads") and the key side of ``matmul`` / ``scaled_dot_product_attention``,
  tracking which dimensions it may vary along; any other reader, or a softmax over a dimension it varies along,
  and the parameter is not listed.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import fx, nn

from memopt.capture.fused_norms import OWNER_ATTRIBUTE
from memopt.cost_model.op_registry import op_kind
from memopt.fidelity.degenerate_norms import eps_only_parameters
from memopt.fidelity.graph_reads import output_shape, reads_metadata, training_batch_norm


def _weight_and_bias(node: fx.Node, modules: Dict[str, nn.Module]) -> Tuple[Optional[Tuple[str, torch.Tensor]], ...]:
    """((name, tensor) of the weight, of the bias) of a conv / linear node, either missing as None."""
    if node.op == "call_module":
        module = modules.get(node.target)
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)):
            return None, None
        path = getattr(module, OWNER_ATTRIBUTE, node.target)  # a fused module's twin: the model's own names
        return tuple((f"{path}.{a}", getattr(module, a)) if getattr(module, a, None) is not None else None
                     for a in ("weight", "bias"))
    name = getattr(node.target, "__name__", str(node.target))
    if node.op != "call_function" or not any(k in name for k in ("conv", "linear")):
        return None, None
    out = []
    for arg in (node.args[1:3] if len(node.args) >= 2 else ()):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            out.append((arg.target, _get_attr(node.graph.owning_module, arg.target)))
        else:
            out.append(None)
    return (tuple(out) + (None, None))[:2]


def _get_attr(root: nn.Module, target: str) -> Optional[torch.Tensor]:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def invariant_parameters(gm: fx.GraphModule, scale: float = 1.0) -> Dict[str, str]:
    """{parameter: why} for the parameters whose exact gradient is zero by construction, up to BatchNorm's eps and
    rounding: the bias of a conv / linear / BatchNorm whose every path reaches a training-mode BatchNorm through
    only sums of branches and unpadded convs (the batch mean takes any per-channel shift out, and an unpadded conv
    turns a per-channel shift into another), and a weight with one element per output channel read directly by
    one (a depthwise 1x1 conv, a BatchNorm weight: the normalisation takes its scale out). Any approximation of the
    backward leaves a gradient of the approximation's error's size where the exact one is rounding; a cosine
    between the two is noise (timm RepViT's RepVggDw 1x1 branch: -0.94 with an 8-bit stash; timm FastViT's
    ReparamLargeKernelConv, whose summed branches feed both an identity BatchNorm and a 1x1 conv's: 0.03, the
    float64 gradient there is 1e-16), so the gate lists these apart with the reason instead of chasing them.
    Also the parameters that reach the loss only through a training BatchNorm over 2 values per channel, run on
    ``scale`` times the recorded shapes' batch, whose gradient is eps's (``degenerate_norms``)."""
    modules = dict(gm.named_modules())
    memo: Dict[str, Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]]] = {}
    out: Dict[str, str] = {}
    for node in gm.graph.nodes:
        weight, bias = _weight_and_bias(node, modules)
        if weight is None and bias is None:
            continue
        found = _shift_cancelled(node, modules, memo)
        if found is None:
            keys = None if bias is None else _key_shift(node, modules)
            if keys:
                out[bias[0]] = (f"{node.name}'s bias adds the same number to every key's attention score before the "
                                f"softmax over the keys ({', '.join(keys)}), which cancels it")
            continue
        norms, via = found
        where = f"the training-mode BatchNorm{'s' * (len(norms) > 1)} {', '.join(norms)}"
        through = f" (through {' and '.join(via)})" if via else ""
        if bias is not None:
            out[bias[0]] = (f"{node.name}'s bias before {where}{through}: the batch mean cancels it")
        readers = [u for u in node.users if not reads_metadata(u)]
        direct = len(readers) == 1 and training_batch_norm(readers[0], modules) and readers[0].args[0] is node
        if direct and weight is not None and weight[1].dim() >= 1 and weight[1][0].numel() == 1:
            out[weight[0]] = (f"{node.name}'s per-channel scale before {where}: the normalisation cancels it (its "
                              f"exact gradient is BatchNorm's eps term)")
    for name, why in eps_only_parameters(gm, scale).items():
        out.setdefault(name, why)
    return out


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add)
            and not node.kwargs) or (node.op == "call_method" and node.target in ("add", "add_") and not node.kwargs)


def _unpadded_conv(node: fx.Node, value: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """A (not transposed) conv reading ``value`` as its input with no padding: a per-channel constant in, a
    per-channel constant out (zero padding would make the border differ)."""
    if node.op == "call_module":
        module = modules.get(node.target)
        return (isinstance(module, nn.modules.conv._ConvNd) and not module.transposed and bool(node.args)
                and node.args[0] is value and (module.padding == "valid" or
                                               (not isinstance(module.padding, str) and not any(module.padding))))
    name = getattr(node.target, "__name__", str(node.target))
    if node.op != "call_function" or not name.startswith("conv") or "transpose" in name or not node.args:
        return False
    padding = node.kwargs.get("padding", node.args[4] if len(node.args) > 4 else 0)
    transposed = name.startswith("convolution") and (node.args[6] if len(node.args) > 6 else True)
    flat = [padding] if isinstance(padding, (int, str)) else list(padding)
    return node.args[0] is value and not transposed and all(p in (0, "valid") for p in flat)


def _shift_cancelled(value: fx.Node, modules: Dict[str, nn.Module],
                     memo: Dict[str, Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]]],
                     depth: int = 0) -> Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
    """(the training-mode BatchNorms that cancel it, what it passes on the way) when a per-channel shift of
    ``value``'s output reaches nothing but training-mode BatchNorms' inputs, directly or through sums of branches
    and unpadded convs; None when some path escapes (an activation, an output, a padded conv, ...)."""
    if value.name in memo:
        return memo[value.name]
    memo[value.name] = None  # a cycle cannot occur in a graph; this also bounds the work
    readers = [u for u in value.users if not reads_metadata(u)]
    if not readers or depth > 16:
        return None
    norms: List[str] = []
    via: List[str] = []
    for reader in readers:
        if training_batch_norm(reader, modules) and reader.args and reader.args[0] is value:
            norms.append(reader.name)
            continue
        step = "a sum" if _is_add(reader) else "an unpadded conv" if _unpadded_conv(reader, value, modules) else None
        further = None if step is None else _shift_cancelled(reader, modules, memo, depth + 1)
        if further is None:
            return None
        norms += further[0]
        via += [step] + list(further[1])
    memo[value.name] = (tuple(dict.fromkeys(norms)), tuple(dict.fromkeys(via)))
    return memo[value.name]


_MATMUL = {torch.matmul, operator.matmul, torch.bmm, torch.ops.aten.matmul.default, torch.ops.aten.bmm.default}
_VIEWS = {torch.reshape, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default}
_PERMUTES = {torch.permute, torch.ops.aten.permute.default}
_TRANSPOSES = {torch.transpose, torch.ops.aten.transpose.int}
_SAME = {"contiguous", "clone", "float", "to", "type_as"}  # value-preserving (up to a cast) methods
_SCALES = {operator.mul, operator.truediv, torch.mul, torch.div, operator.imul, operator.itruediv}
_SUMS = {operator.add, operator.iadd, operator.sub, torch.add, torch.sub}


def _is(node: fx.Node, functions: Set[Any], methods: Tuple[str, ...] = ()) -> bool:
    return (node.op == "call_function" and node.target in functions) or (node.op == "call_method" and
                                                                         node.target in methods)


def _descendants(node: fx.Node) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _key_shift(node: fx.Node, modules: Dict[str, nn.Module]) -> Optional[List[str]]:
    """The softmaxes that cancel a shift of ``node``'s output by its bias (per channel: dim 1 of a conv or
    BatchNorm output, the last dim of a linear's), or None when some path of it escapes."""
    shape = output_shape(node)
    if shape is None or not shape:
        return None
    linear = (node.op == "call_module" and isinstance(modules.get(node.target), nn.Linear)) or (
        node.op == "call_function" and "linear" in getattr(node.target, "__name__", ""))
    channel = len(shape) - 1 if linear else 1
    if channel >= len(shape):
        return None
    found: Set[str] = set()
    ok = _softmax_cancelled(node, frozenset({channel}), modules, _descendants(node), found, {}, 0)
    return sorted(found) if ok and found else None


def _softmax_cancelled(value: fx.Node, varying: FrozenSet[int], modules: Dict[str, nn.Module],
                       carriers: Set[fx.Node], found: Set[str], memo: Dict[Tuple[str, FrozenSet[int]], bool],
                       depth: int) -> bool:
    """Whether a shift of ``value`` that may vary only along the dims ``varying`` (constant along the others)
    reaches nothing but softmaxes over a dim it is constant along (adding their names to ``found``). A shift is
    additive through every step followed, so the paths are followed one at a time; ``carriers``: the nodes the
    shift reaches (a matmul whose other side carries it too is not linear in it)."""
    key = (value.name, varying)
    if key in memo:
        return memo[key]
    memo[key] = False
    readers = [u for u in value.users if not reads_metadata(u)]
    if not readers or depth > 32:
        return False
    for reader in readers:
        following = _follow(reader, value, varying, modules, carriers, found)
        if following is None or (following is not True and
                                 not _softmax_cancelled(reader, following, modules, carriers, found, memo, depth + 1)):
            return False
    memo[key] = True
    return True


def _dim(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else default)


def _follow(reader: fx.Node, value: fx.Node, varying: FrozenSet[int], modules: Dict[str, nn.Module],
            carriers: Set[fx.Node], found: Set[str]) -> Any:
    """``True`` when ``reader`` cancels the shift, the dims the shift may vary along in ``reader``'s output when
    it passes it on, None when it escapes."""
    shape, out = output_shape(value), output_shape(reader)
    if shape is None:
        return None
    rank = len(shape)
    kind = op_kind(reader, modules) if reader.op != "call_module" else None  # a module's dim is not an argument
    if kind in ("softmax", "log_softmax") and reader.args[0] is value:
        dim = _dim(reader, 1, "dim")
        if isinstance(dim, int) and dim % rank not in varying:
            found.add(reader.name)
            return True
        return None
    if kind == "sdpa":
        key = _dim(reader, 1, "key")
        others = [reader.args[0] if reader.args else reader.kwargs.get("query"), _dim(reader, 2, "value")]
        if key is value and all(o is not value and o not in carriers for o in others) and rank >= 2 \
                and rank - 2 not in varying:
            found.add(reader.name)
            return True
        return None
    if out is None:
        return None
    if _is(reader, _VIEWS, ("view", "reshape")) and reader.args[0] is value:
        return _reshaped(shape, out, varying)
    if _is(reader, _PERMUTES, ("permute",)) and reader.args[0] is value:
        rest = reader.args[1:] or (reader.kwargs.get("dims"),)
        order = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        return frozenset(i for i, d in enumerate(order) if isinstance(d, int) and d % rank in varying)
    if _is(reader, _TRANSPOSES, ("transpose",)) and reader.args[0] is value:
        a, b = (d % rank for d in reader.args[1:3])
        return frozenset({a: b, b: a}.get(d, d) for d in varying)
    if _is(reader, set(), tuple(_SAME)) and reader.args[0] is value:
        return varying
    if _is(reader, _SCALES, ("mul", "div", "mul_", "div_")) and len(reader.args) == 2 and not reader.kwargs:
        other = reader.args[1] if reader.args[0] is value else reader.args[0]
        divided = reader.target in (operator.truediv, operator.itruediv, torch.div, "div", "div_")
        if isinstance(other, (int, float)) and not (divided and reader.args[1] is value):
            return frozenset(d + len(out) - rank for d in varying)
        return None
    if _is(reader, _SUMS, ("add", "sub", "add_", "sub_")) and not reader.kwargs:
        return frozenset(d + len(out) - rank for d in varying)  # sums are linear: the other side, shift or not
    if _is(reader, _MATMUL) and len(reader.args) == 2 and reader.args[1] is value and rank >= 2 \
            and reader.args[0] is not value and reader.args[0] not in carriers and rank - 1 not in varying:
        return frozenset(range(len(out) - 1))  # q @ (k + s): q·s, the same along the keys (the last dim)
    module = modules.get(reader.target) if reader.op == "call_module" else None
    if isinstance(module, nn.Conv2d) and reader.args[0] is value and set(module.kernel_size) == {1} \
            and set(module.stride) == {1} and module.padding in ((0, 0), "valid"):
        return varying | {1}  # a per-position channel mix (talking heads): constant along what was constant
    return None


def _reshaped(shape: Tuple[int, ...], out: Tuple[int, ...], varying: FrozenSet[int]) -> Optional[FrozenSet[int]]:
    """The dims of a reshape's output a shift may vary along, from its input's: the dims are matched in groups of
    equal products (C -> (heads, d) splits, (H, W) -> N merges); an output dim varies where its group did."""
    if 0 in shape or 0 in out or math.prod(shape) != math.prod(out):
        return None
    result: Set[int] = set()
    i = j = 0
    while i < len(shape) and j < len(out):
        group_in, group_out, a, b = [i], [j], shape[i], out[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(shape):
                a, i = a * shape[i], i + 1
                group_in.append(i - 1)
            elif b < a and j < len(out):
                b, j = b * out[j], j + 1
                group_out.append(j - 1)
            else:
                return None
        if any(d in varying and shape[d] > 1 for d in group_in):
            result.update(d for d in group_out if out[d] > 1)
    return frozenset(result)
