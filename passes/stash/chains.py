"""The stash pass: BatchNorm -> [+ residual] -> activation chains keep K-bit codes for backward.

Pattern (module-level graphs): a training-mode BatchNorm1d/2d module, optionally followed by a
residual add (its only user), optionally followed by the activation (ReLU, ReLU6, LeakyReLU in any
spelling); without an activation the chain is "identity" (a ResNet downsample BN, a MobileNet
projection BN). When the residual add's other operand is a second training-mode BatchNorm used only
there (a ResNet downsample) and the chain has an activation, that BN joins the chain (one Function,
one unit named by the first BN in graph order; ``deny`` keeps it out): its gradient is zero wherever
the activation's mask is, so its x̂ code is split by that mask. Every user of the chain's output must
be able to drop its copy of it, or need no rewrite: Conv1d/Conv2d and Linear modules (rewritten to rebuild
their input from the stash), MaxPool2d (rewritten to keep only its indices), users that keep nothing (an add,
the model output, another chain's residual input, an adaptive average pool to size 1), and the other average
pools, which keep it (``pool_keeps_input``): the chain then frees its BatchNorm input only, and the planner,
whose freed bytes count a storage only when every node keeping it is in the unit, counts no more. Anything
else keeps the output, so the chain stays exact and the report says which consumer blocked it.

Then, in ``passes/stash/generic.py``: the generic stash of the remaining conv / linear / matmul inputs
(``StashConfig.generic``) and the exact 1-bit extras (``StashConfig.compact_extras``).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from statistics import NormalDist
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from memopt.core.meta import CHAIN_KEY, META_KEY
from memopt.cost_model.op_registry import op_kind
from memopt.capture.trace import has_hooks
from memopt.core.leaf import argument, arguments, set_argument
from memopt.stash.generic import EncodeSpec, generic_encode
from memopt.stash.grid import x_grid_half
from memopt.stash.ops import ChainSpec, FromStashSpec, bn_act_stash, conv_from_stash, linear_from_stash, split_by_mask
from memopt.stash.pool import max_pool2d_indices_only
from memopt.stash.rebuild import RebuildSpec, weight_op_from_rebuild
from memopt.stash.grid import MEAN_BITS, wants_means
from memopt.stash.identity import bn_exact_link
from memopt.core.meta import DECISION_KEY
from memopt.cost_model.analysis import Estimate
from memopt.stash.config import StashConfig
from memopt.passes.base import PassContext, PassResult, PlannerHooks, node_numel, register_pass
from memopt.passes.stash.extras import compact_extras, head_losses
from memopt.passes.stash.generic import generic_stash
from memopt.passes.stash.weights import recompute_weights
from memopt.passes.stash.forms import (BNForm, bn_form, consumer, consumer_reason, in_place_add, max_pool,
                                       rebuild_kind, trainable_weight)

_ACTS = ("relu", "relu6", "leaky_relu")
# bn_act_stash's BatchNorm tensors, before its residual
_BN_TENSORS = ("x", "weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _act_params(node: fx.Node, kind: str, modules) -> Tuple[float, ...]:
    if kind != "leaky_relu":
        return ()
    if node.op == "call_module":
        return (float(modules[node.target].negative_slope),)
    slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
    return (float(slope),)


def _single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _keeps_nothing(user: fx.Node, end: fx.Node, modules) -> bool:
    """Users that read the chain's output without keeping it for backward: an add, the model output, another
    chain's residual, an average pool that keeps no input (``pool_keeps_input``). A pool that keeps it is a
    user that needs no rewrite: the chain still frees its BatchNorm input, and the planner counts the output
    as kept (a storage is freed only when every node keeping it is in the unit: passes/planning/candidates.py)."""
    if user.op == "output" or op_kind(user, modules) == "add":
        return True
    if op_kind(user, modules) == "avg_pool":
        return not pool_keeps_input(user, modules)
    # another chain's stash that takes this output as its residual: used in its forward only
    if user.target is not bn_act_stash:
        return False
    given = arguments(user)
    return given["residual"] is end and not any(given[name] is end for name in _BN_TENSORS)


_MEAN_POOLS = (torch.ops.aten.adaptive_avg_pool1d.default, torch.ops.aten.adaptive_avg_pool2d.default,
               torch.ops.aten.adaptive_avg_pool3d.default)


def pool_keeps_input(user: fx.Node, modules) -> bool:
    """Whether an average pool (any spelling) keeps its input for backward, as PyTorch's autograd does it
    (saved_tensors_hooks, torch 2.x; tests/stash/test_stash_pools.py checks each spelling against it): every
    avg_poolNd saves its input (its backward kernel takes the input tensor), and so does every adaptive pool,
    except one to size 1 in every dimension through the composite op (the module, F.adaptive_avg_poolNd,
    aten.adaptive_avg_pool1d / 2d / 3d), which runs as a mean and keeps nothing (ResNet's head). The kernels
    aten._adaptive_avg_pool2d / 3d keep it at any size."""
    if user.op == "call_module":
        module = modules[user.target]
        if not isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
            return True
        size = module.output_size
    elif user.target in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d) or \
            user.target in _MEAN_POOLS:
        size = user.kwargs.get("output_size", user.args[1] if len(user.args) > 1 else None)
    else:
        return True
    sizes = size if isinstance(size, (tuple, list)) else (size,)
    return not all(isinstance(v, int) and v == 1 for v in sizes)


def _needs_rebuild(user: fx.Node, modules) -> bool:
    return rebuild_kind(user, modules) is not None


def _consumer_reason(user: fx.Node, act: fx.Node, modules) -> Optional[str]:
    """Why ``user`` (any spelling: module, functional, ATen) keeps the chain's output ``act`` with no stash form,
    else None: convs (1-3 d) and linears rebuild it, a 2-d max pool keeps only its window offsets."""
    if _keeps_nothing(user, act, modules) or op_kind(user, modules) == "avg_pool":
        return None  # a pool that keeps the output (``pool_keeps_input``) needs no rewrite: it stays as it is
    kind = rebuild_kind(user, modules)
    module = modules.get(user.target) if user.op == "call_module" else None
    if module is not None and has_hooks(module):
        return f"{user.name} has hooks, which its rewrite would skip"
    if kind is None and max_pool(user, modules) is None:
        return f"its output is also kept by {user.name} ({op_kind(user, modules) or user.op}), which has no stash form"
    if user.args[:1] != (act,) or any(a is act for a in list(user.args[1:]) + list(user.kwargs.values())):
        return f"{user.name} uses the activation in another position"
    return consumer_reason(user, kind, modules) if kind is not None else None


def _match(bn: fx.Node, modules) -> Union[str, Tuple[Optional[fx.Node], fx.Node, str]]:
    """(add node or None, the chain's last node, act kind) for a chain starting at ``bn`` (a ``BNForm``'s node),
    or the reason not. Without an activation the chain ends at the BatchNorm (or its residual add): kind
    "identity". An in-place add (``aten.add_``, ``x += y``) joins only when what it writes into is read by it
    alone (the BatchNorm's output, say): the chain computes the sum out of place."""
    end, add = bn, None
    nxt = _single_user(bn)
    if nxt is not None and op_kind(nxt, modules) == "add" and nxt.op != "call_module" and nxt.target is not bn_act_stash:
        operands = [a for a in nxt.args if isinstance(a, fx.Node)]
        if len(operands) == 2 and not nxt.kwargs and operands.count(bn) == 1 and \
                (not in_place_add(nxt) or set(nxt.args[0].users) == {nxt}):
            end, add = nxt, nxt
            nxt = _single_user(nxt)
    kind = op_kind(nxt, modules) if nxt is not None else None
    if kind in _ACTS and nxt.args[:1] == (end,):
        if nxt.op == "call_module" and has_hooks(modules[nxt.target]):
            return f"{nxt.name} has hooks, which a rewrite would skip"
        return add, nxt, kind
    return add, end, "identity"


def _per_channel_count(node: fx.Node) -> Optional[int]:
    cost = node.meta.get(META_KEY)
    return math.prod(cost.shapes[0]) // cost.shapes[0][1] if cost is not None and cost.shapes else None


def _second_bn(bn: fx.Node, add: Optional[fx.Node], kind: str, modules, cfg: StashConfig, order) -> Optional[BNForm]:
    """The residual add's other operand when it is a training-mode BatchNorm (any form; later in graph order, so
    not visited yet, used only by the add, not denied, of the same shape) that can join the chain: the downsample."""
    if add is None or kind == "identity":
        return None
    other = next(a for a in add.args if isinstance(a, fx.Node) and a is not bn)
    form = bn_form(other, modules)
    if not isinstance(form, BNForm) or order[other] < order[bn] or set(other.users) != {add} or \
            other.name in cfg.deny:
        return None
    shape, other_shape = (n.meta.get(META_KEY) for n in (bn, other))
    if shape is None or other_shape is None or shape.shapes[:1] != other_shape.shapes[:1] or \
            (_per_channel_count(other) or 0) < cfg.min_per_channel:
        return None
    return form


def _fusable_pool(gm: fx.GraphModule, form: BNForm, add, act: fx.Node, kind: str, modules,
                  cfg: StashConfig) -> Optional[Tuple[fx.Node, Tuple]]:
    """(pool node, its parameters) for BN -> ReLU -> 2-d max pool (the ResNet stem, any spelling) whose pooled
    output a consumer keeps anyway (a conv / linear with a trainable weight; not with the generic stash, which
    would drop its copy): one Function computes the BN weight gradient exactly from the pooled values, which it
    keeps for free."""
    pool = _single_user(act)
    if add is not None or kind != "relu" or pool is None or cfg.generic or form.dims != 4 or \
            (pool.op == "call_module" and has_hooks(modules[pool.target])):
        return None
    params = max_pool(pool, modules)
    if params is None or pool.args[:1] != (act,) or not pool.users or \
            any(a is act for a in list(pool.args[1:]) + list(pool.kwargs.values())):
        return None
    if not any(trainable_weight(gm, u, modules) for u in pool.users):
        return None
    return pool, params


def _means(bits: int, cfg: StashConfig) -> bool:
    """Whether a chain asks for its bins' means (``StashConfig.bin_means``); the op gives them to each code whose
    channels are large enough (``stash_grid.wants_means``)."""
    return cfg.bin_means and bits <= MEAN_BITS


def _codes_note(bits: int, means: bool, bn: fx.Node) -> str:
    """What the report says of a chain's codes: their bits and, where its x̂ code gets them, the bins' means."""
    cost = bn.meta.get(META_KEY)
    shape = cost.shapes[0] if cost is not None and cost.shapes else None
    per_channel = math.prod(shape) // max(1, shape[1]) if shape is not None and len(shape) > 1 else 0
    at_means = shape is not None and wants_means(means, bits, 2, per_channel)
    return f"{bits}-bit codes{' (bins rebuilt at their means)' if at_means else ''} for backward"


def _rewrite_pool(gm: fx.GraphModule, form: BNForm, act: fx.Node, pool: fx.Node, params: Tuple, bits: int,
                  means: bool) -> None:
    graph, bn = gm.graph, form.node
    with graph.inserting_before(pool):
        attrs = form.attrs(graph)
        spec = ChainSpec("relu", bits, form.momentum, form.eps, need_y=False, node=bn.format_node(),
                         pool=tuple(params), means=means)
        stash = graph.create_node("call_function", bn_act_stash, (form.input, *attrs, None, spec),
                                  name=f"{bn.name}_stash")
        stash.meta[CHAIN_KEY] = spec
        new = graph.call_function(operator.getitem, (stash, 0))
    replaced = [n.name for n in form.replaced()] + [act.name, pool.name]
    stash.meta[DECISION_KEY] = {"technique": "stash", "bits": bits, "replaces": replaced,
                                "unit": bn.name, "reason": f"BN + relu + max-pool: exact forward, "
                                                           f"{_codes_note(bits, means, bn)}, exact BN weight gradient "
                                                           f"from the pooled output"}
    pool.replace_all_uses_with(new)
    for node in (pool, act):
        graph.erase_node(node)
    form.erase(graph)


def _stash_fidelity(new: fx.Node, baseline: Estimate, unit: str) -> float:
    """Mean squared error of the stashed x̂ ~ N(0, 1) on its K-bit grid (bin width 2h/2^K, clipping at
    ±h; 2h/2^(K+1) when the mask splits it), times the elements of the BN output: (width²/12)·P(|z|<h) + E[(|z|−h)²; |z|>h];
    twice that when a second BatchNorm (a downsample, split by the same mask) joined the chain."""
    if new.target is generic_encode:
        return _generic_fidelity(new)
    if new.target is weight_op_from_rebuild:
        return _rebuild_fidelity(new)
    if new.target is not bn_act_stash:
        return 0.0  # its consumers reuse the same codes
    bits = new.meta[DECISION_KEY]["bits"]
    spec = new.meta[CHAIN_KEY]
    split = split_by_mask(spec.act, spec.residual)  # then a (K+1)-bit grid
    joined = spec.joined  # a second BatchNorm (a downsample) coded with the same mask
    half = x_grid_half(bits, split)
    width = 2 * half / (1 << (bits + split))
    tail = math.erfc(half / math.sqrt(2))  # P(|z| > h)
    pdf = math.exp(-half * half / 2) / math.sqrt(2 * math.pi)
    clip = (1 + half * half) * tail - 2 * half * pdf
    return (width * width / 12 * (1 - tail) + clip) * node_numel(baseline, unit) * (2 if joined else 1)


def _generic_fidelity(new: fx.Node) -> float:
    """The generic stash on the same scale as the chains' (a unit-variance input): per group of G normal
    values the range is about 2·Φ⁻¹((G − 3/8)/(G + 1/4)) (Blom; 5.6 for G = 256), the step that over
    2^K − 1, the mean squared error step²/12 (nearest) or step²/6 (stochastic), times the elements."""
    spec = EncodeSpec.of(new)
    return code_error(argument(new, "x"), spec.bits, spec.group, 6 if spec.stochastic else 12)


def _rebuild_fidelity(new: fx.Node) -> float:
    """A weight op whose input is rebuilt as the norm of the norm input's codes keeps no codes of its own, but
    its weight gradient sees the rebuilt input: priced as a nearest-rounded code of that (normalised) input at
    the rebuild's bits, so that the planner and the fidelity gate never take it for exact."""
    spec = RebuildSpec.of(new)
    return code_error(argument(new, "x"), spec.bits, spec.group, 12)


def code_error(data: fx.Node, bits: int, group: int, divisor: int) -> float:
    cost = data.meta.get(META_KEY) if isinstance(data, fx.Node) else None
    numel = math.prod(cost.shapes[0]) if cost is not None and cost.shapes else 0
    span = 2 * NormalDist().inv_cdf((group - 0.375) / (group + 0.25)) if group > 1 else 0.0
    step = span / ((1 << bits) - 1)
    return step * step / divisor * numel


_PLANNER = PlannerHooks(
    fidelity=_stash_fidelity, extra_passes=3.0)  # encode, decode, the rebuilt input's read


@register_pass(StashConfig, planner=_PLANNER)
def stash_pass(gm: fx.GraphModule, cfg: StashConfig, ctx: PassContext) -> PassResult:
    modules = dict(gm.named_modules())
    graph = gm.graph
    modified = False
    order = {n: i for i, n in enumerate(graph.nodes)}
    joined = set()
    for bn in list(graph.nodes):
        form = bn_form(bn, modules) if bn not in joined else None  # a BatchNorm in any form (passes/stash/forms.py)
        if form is None:
            continue
        chosen = ctx.chosen("stash", bn.name)  # a unit left out of a decision says why only if it could be rewritten
        if (chosen is None and cfg.allow is not None and bn.name not in cfg.allow) or bn.name in cfg.deny:
            bn.meta[DECISION_KEY] = {"technique": "exact", "reason": "stash: excluded by StashConfig allow/deny"}
            continue
        if ctx.foreign_inputs and isinstance(form, BNForm) and form.input.op == "placeholder":
            bn.meta[DECISION_KEY] = {"technique": "exact", "reason": "stash: its input is an input of this separately "
                                                                     "captured submodule, which the code around it may "
                                                                     "keep too: codes could add bytes"}
            continue
        found = form if isinstance(form, str) else _match(bn, modules)
        per_channel = _per_channel_count(bn) or 0
        if not isinstance(found, str) and per_channel < cfg.min_per_channel:
            found = (f"it normalises {per_channel} elements per channel, fewer than "
                     f"StashConfig.min_per_channel={cfg.min_per_channel}")
        reason = found if isinstance(found, str) else next(
            (r for r in (_consumer_reason(u, found[1], modules) for u in found[1].users) if r), None)
        if reason is not None or chosen is False:
            why = reason if reason is not None else ctx.unchosen("stash", bn.name)
            bn.meta[DECISION_KEY] = {"technique": "exact", "reason": f"stash: {why}"}
            continue
        add, end, kind = found
        pool = _fusable_pool(gm, form, add, end, kind, modules, cfg)
        if pool is not None:
            level = ctx.bits("stash", bn.name, cfg.bits_for(bn.name))
            _rewrite_pool(gm, form, end, *pool, level, _means(level, cfg))
            modified = True
            continue
        second = _second_bn(bn, add, kind, modules, cfg, order)
        if second is not None:
            joined.add(second.node)
        level = ctx.bits("stash", bn.name, cfg.bits_for(bn.name))
        # no activation, no mask: its codes get the bit an activation chain's mask gives (StashConfig.identity_extra_bit)
        bits = min(level + 1, 8) if kind == "identity" and cfg.identity_extra_bit else level
        _rewrite(gm, modules, form, add, end, kind, bits, second, level, _means(bits, cfg))
        modified = True
    if cfg.scale_identity:
        for first, conv, following in _identity_links(gm, modules):
            _link(gm, modules, first, conv, following)
    if cfg.compact_extras and cfg.head_loss:  # before the generic stash, which would code the head's input
        modified |= head_losses(gm, cfg)
    if cfg.generic or cfg.coded_ops:  # after the chains: what they cover is no longer a plain conv / linear input
        modified |= generic_stash(gm, cfg, ctx)
    if cfg.compact_extras:
        modified |= compact_extras(gm, cfg)
    if cfg.recompute_weights:  # the consumers the generic stash left with their input exact
        modified |= recompute_weights(gm)
    return PassResult(gm, modified)


def _stash_output(node: fx.Node, index: int) -> Optional[fx.Node]:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def _identity_links(gm: fx.GraphModule, modules) -> List[Tuple[fx.Node, fx.Node, fx.Node]]:
    """(A, conv, B) where the scale identity of ``memopt/stash/identity.py`` holds: chain A (weight, no
    residual, not pooled) feeds only a depthwise conv (one input channel per group) read from its stash, whose
    output feeds only B: another chain's BatchNorm input, or a training-mode BatchNorm module left exact."""
    links = []
    for first in gm.graph.nodes:
        if not _chain_without_residual(first) or argument(first, "weight") is None:
            continue
        y = _stash_output(first, 0)
        conv = _single_user(y) if y is not None else None
        if conv is None or conv.target is not conv_from_stash or argument(conv, "y") is not y:
            continue
        if gm.get_parameter(argument(conv, "weight").target).shape[1] != 1:  # not depthwise: channels mix in each group
            continue
        following = _single_user(conv)
        if following is None or following.args[:1] != (conv,) or \
                conv in list(following.args[1:]) + list(following.kwargs.values()):
            continue
        form = bn_form(following, modules)  # a training-mode BatchNorm with weight and bias, in any form
        affine = isinstance(form, BNForm) and (form.module.training and form.module.affine if form.module is not None
                                               else None not in form.params[:2])
        exact_bn = affine and form.input is conv
        if exact_bn or _chain_without_residual(following):
            links.append((first, conv, following))
    return links


def _chain_without_residual(node: fx.Node) -> bool:
    """A rewritten chain (not the pooled stem form) whose BatchNorm output is not added to a residual."""
    if node.target is not bn_act_stash:
        return False
    spec = node.meta.get(CHAIN_KEY)
    return spec is not None and not spec.residual and not spec.joined and spec.pool is None


def _link(gm: fx.GraphModule, modules, first: fx.Node, conv: fx.Node, following: fx.Node) -> None:
    graph = gm.graph
    # groups = the conv's input channels = A's
    spec = first.meta[CHAIN_KEY]._replace(link_groups=FromStashSpec.of(conv).groups)
    set_argument(first, "spec", spec)
    first.meta[CHAIN_KEY] = spec
    with graph.inserting_after(first):
        link = graph.call_function(operator.getitem, (first, 5))
    if following.target is bn_act_stash:
        following.kwargs = {**following.kwargs, "link": link}
        source = following.meta[DECISION_KEY]["unit"]
    else:  # a BatchNorm left exact: stock's kernels and saved tensors in a Function that also returns R
        form, source = bn_form(following, modules), following.name
        with graph.inserting_before(following):
            exact = graph.call_function(bn_exact_link, (conv, *form.attrs(graph), form.momentum, form.eps, link))
        why = following.meta.get(DECISION_KEY, {}).get("reason", "left exact")
        exact.meta[DECISION_KEY] = {"technique": "exact", "reason": f"{why}; stock's BatchNorm kernels, its weight "
                                                                    f"gradient also passed to {first.name} (scale "
                                                                    f"identity)"}
        following.replace_all_uses_with(exact)
        form.erase(graph)  # with the export form's counter: bn_exact_link counts the batch
    note = f"BN weight gradient solved by the scale identity from {source}"
    first.meta[DECISION_KEY] = {**first.meta[DECISION_KEY], "reason": f"{first.meta[DECISION_KEY]['reason']}; {note}"}
    if following.target is bn_act_stash:
        # B's codes make dL/dz approximate; A's BatchNorm weight, nearly scale-invariant through the depthwise conv
        # and B, is then only faithful through this link: B stashed needs A stashed (the planner's coupling)
        first.meta[DECISION_KEY]["needed_by"] = source


def _rewrite(gm: fx.GraphModule, modules, form: BNForm, add: Optional[fx.Node], act: fx.Node, kind: str,
             bits: int, second: Optional[BNForm] = None, level: Optional[int] = None, means: bool = False) -> None:
    """``act`` is the chain's last node: the activation, or the BatchNorm / add for "identity"; ``second``:
    the residual's BatchNorm when it joins the chain; ``level``: the bits asked for the unit (``bits`` are
    those its codes use)."""
    graph, bn = gm.graph, form.node
    residual = None if add is None else next(a for a in add.args if isinstance(a, fx.Node) and a is not bn)
    params = _act_params(act, kind, modules)
    forms = [form] + ([second] if second is not None else [])
    replaced: List[str] = list(dict.fromkeys([n.name for f in forms for n in f.replaced()] +
                                             ([add.name] if add is not None else []) + [act.name]))
    need_y = any(_needs_rebuild(u, modules) for u in act.users)
    with graph.inserting_before(act):
        attrs = form.attrs(graph)
        extra = ()
        if second is not None:
            extra = (second.input, *second.attrs(graph))
            residual = None
        spec = ChainSpec(kind, bits, form.momentum, form.eps, params, need_y, bn.format_node(),
                         residual=residual is not None, joined=second is not None,
                         momentum2=second.momentum if second is not None else None,
                         eps2=second.eps if second is not None else 1e-5, means=means,
                         residual_first=add is not None and add.args[0] is not bn,
                         add_in_place=add is not None and in_place_add(add))
        stash = graph.create_node("call_function", bn_act_stash, (form.input, *attrs, residual, spec, *extra),
                                  name=f"{bn.name}_stash")
        stash.meta[CHAIN_KEY] = spec
        y, codes, mask, affine, zero = (graph.call_function(operator.getitem, (stash, i)) for i in range(5))
    stash.meta[DECISION_KEY] = {"technique": "stash", "bits": bits, "level": bits if level is None else level,
                                "replaces": replaced, "unit": bn.name,
                                "reason": f"BN{' + BN ' + second.node.name if second is not None else ''}"
                                          f"{' + residual' if add is not None and second is None else ''} + {kind}: "
                                          f"exact forward, {_codes_note(bits, means, bn)}"}
    pools = {u: max_pool(u, modules) for u in act.users}  # read from the annotated input, before it is replaced
    act.replace_all_uses_with(y)
    for user in list(y.users):
        _rewrite_consumer(gm, modules, user, y, (codes, mask, affine, zero), bits, kind, params, bn.name,
                          pools.get(user))
    for node in dict.fromkeys(n for n in (act, add) if n is not None and n is not bn):
        graph.erase_node(node)
    for f in forms:
        f.erase(graph)


def _rewrite_consumer(gm, modules, user: fx.Node, y: fx.Node, stash_nodes, bits: int, kind: str, params,
                      source: str, pool: Optional[Tuple]) -> None:
    """Rewrite one user of the chain's output ``y`` (any spelling; ``_consumer_reason`` accepted it); ``pool``:
    its max-pool parameters when it is a 2-d max pool."""
    graph = gm.graph
    rebuild = rebuild_kind(user, modules)
    pool = pool if rebuild is None and user.args[:1] == (y,) else None
    with graph.inserting_before(user):
        if rebuild is not None:
            c = consumer(graph, user, rebuild, modules)
            target = conv_from_stash if rebuild == "conv" else linear_from_stash
            args = (y, c.weight, c.bias, *stash_nodes, FromStashSpec(bits, kind, params, tuple(c.conv)))
            new = graph.create_node("call_function", target, args, name=f"{user.name}_stash")
            note = f"input rebuilt from the stash of {source} for the weight gradient"
        elif pool is not None:
            new = graph.create_node("call_function", max_pool2d_indices_only, (y, *pool), name=f"{user.name}_indices")
            # the same output (shape, dtype, storage): the generic stash, which runs next, can code it for the conv
            # that keeps it (a ResNet's first block); what the new node keeps the cost model measures afresh
            if META_KEY in user.meta:
                new.meta[META_KEY] = dataclasses.replace(user.meta[META_KEY], name=new.name, saved=[], flops=0)
            note = "keeps only its argmax indices (exact)"
        else:
            return  # keeps nothing (add, output, another chain's residual, a pool to 1) or needs no rewrite: as it is
    new.meta[DECISION_KEY] = {"technique": "stash", "bits": None if pool is not None else bits,
                              "replaces": [user.name], "unit": source, "reason": note}
    user.replace_all_uses_with(new)
    graph.erase_node(user)

