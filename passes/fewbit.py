"""The few-bit pass: pointwise activations keep a b-bit code instead of a full tensor.

A node is rewritten only where the cost model (``node.meta["memopt_cost"]``) shows that the
storage it keeps is kept by nobody else, so the rewrite really frees it: a ReLU whose output the
next conv keeps anyway frees nothing and stays exact, and the report says so. Every other node
left exact gets its reason too.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
from torch import fx, nn

from memopt.core.meta import META_KEY
from memopt.core.meta import HISTOGRAM_KEY
from memopt.cost_model.op_registry import op_kind
from memopt.capture.trace import has_hooks
from memopt.fewbit.activations import ACTIVATIONS, Params
from memopt.fewbit.config import FewBitConfig
from memopt.fewbit.tables import fewbit_table, table_error
from memopt.cost_model.analysis import Estimate
from memopt.fewbit.ops import SUPPORTED_DTYPES, FewBitSpec, fewbit_activation
from memopt.core.meta import DECISION_KEY
from memopt.passes.base import PassContext, PassResult, PlannerHooks, node_numel, register_pass


# kind -> hyper-parameters as (name, positional index after the input or None for keyword-only);
# modules carry them as attributes of the same name.
_HYPER: Dict[str, Tuple[Tuple[str, Optional[int]], ...]] = {
    "gelu": (("approximate", None),), "elu": (("alpha", 1),), "celu": (("alpha", 1),),
    "softplus": (("beta", 1), ("threshold", 2)), "leaky_relu": (("negative_slope", 1),),
    "hardtanh": (("min_val", 1), ("max_val", 2)), "threshold": (("threshold", 1), ("value", 2)),
}
_DTYPE_NAMES = {str(d).replace("torch.", "") for d in SUPPORTED_DTYPES}


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _hyper_parameters(node: fx.Node, kind: str, module: Optional[nn.Module]) -> Union[Params, str]:
    """The node's activation hyper-parameters, or the reason they cannot be read."""
    spec = _HYPER.get(kind, ())
    given = {}
    for name, index in spec:
        if module is not None:
            given[name] = getattr(module, name)
        elif name in node.kwargs:
            given[name] = node.kwargs[name]
        elif index is not None and len(node.args) > index:
            given[name] = node.args[index]
    if node.op == "call_function" and _target_name(node) in ("elu", "elu_") and len(node.args) > 2:
        if any(a != 1 for a in node.args[2:4]):
            return f"aten elu with scale/input_scale {node.args[2:4]} (not the plain elu)"
    for value in given.values():
        if isinstance(value, fx.Node):
            return "a hyper-parameter is computed in the graph, not a constant"
    return ACTIVATIONS[kind].params({k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                                     for k, v in given.items()})


def _is_inplace(node: fx.Node, kind: str, module: Optional[nn.Module]) -> bool:
    if module is not None:
        return bool(getattr(module, "inplace", False))
    if node.kwargs.get("inplace"):
        return True
    positional = 1 + len(_HYPER.get(kind, ()))
    if node.op == "call_function" and len(node.args) > positional and node.args[positional] is True:
        return True
    return _target_name(node).endswith("_")


def _input(node: fx.Node) -> Optional[fx.Node]:
    value = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    return value if isinstance(value, fx.Node) else None


# A table node keeping less than this fraction of the graph's largest kept tensor stays exact: it frees next to
# nothing, and over so few elements (a squeeze-excitation gate's N x C/r x 1 x 1) the table's per-element error
# does not average out: on EfficientNet-B0 it alone took the SE weights' gradient cosine to about 0.8.
NEGLIGIBLE = 1 / 256


def largest_kept(gm: fx.GraphModule) -> int:
    """Bytes of the largest storage any node of ``gm`` keeps for backward (activations, inputs, extras)."""
    return max((s.nbytes for n in gm.graph.nodes if META_KEY in n.meta for s in n.meta[META_KEY].saved
                if s.category in ("activation", "input", "extra")), default=0)


def _why_not(node: fx.Node, kind: str, module: Optional[nn.Module], cfg: FewBitConfig, ctx: PassContext,
             largest: int) -> Optional[str]:
    """None when the node can be rewritten, else the reason it stays exact."""
    if module is not None and has_hooks(module):
        return "its module has hooks, which a rewrite would skip"
    chosen = ctx.chosen("fewbit", node.name)  # a unit left out of a decision says why only if it could be rewritten
    if chosen is None and cfg.allow is not None and node.name not in cfg.allow:
        return "not in FewBitConfig.allow"
    if node.name in cfg.deny:
        return "in FewBitConfig.deny"
    if ACTIVATIONS[kind].exact and not cfg.exact_masks:
        return "exact masks are turned off (FewBitConfig.exact_masks=False)"
    cost = node.meta.get(META_KEY)
    if cost is None:
        return "the cost model has no record of this node"
    if not cost.dtypes or cost.dtypes[0] not in _DTYPE_NAMES:
        return f"dtype {cost.dtypes[0] if cost.dtypes else '?'} is not supported (few-bit takes {sorted(_DTYPE_NAMES)})"
    inp = _input(node)
    if inp is None:
        return "its input is not a tensor node of the graph"
    kept = [s for s in cost.saved if s.category in ("activation", "input", "extra")]
    if not kept:
        return "it keeps nothing for backward here (its input does not require grad)"
    if ctx.foreign_inputs and any(s.category == "input" for s in kept):
        return ("it keeps an input of this separately captured submodule, which the code around it may keep too: "
                "few-bit codes could add bytes instead of freeing them")
    if all(set(s.savers) != {node.name} for s in kept):  # a storage frees only when all its savers go
        others = sorted({other for s in kept for other in s.savers if other != node.name})
        return (f"the tensor it keeps is also kept by {', '.join(others[:3])}, so few-bit alone frees nothing "
                f"(the conv stash can free the pair)")
    nbytes = sum(s.nbytes for s in kept)
    # a decision applies what it names: the rule picks candidates when planning (a plan re-applied at other sizes,
    # where this tensor's share of the largest kept one moved, keeps its units: memopt/builder/shape_reuse.py)
    if not ACTIVATIONS[kind].exact and nbytes < NEGLIGIBLE * largest and chosen is not True:
        return (f"it keeps {nbytes} bytes, under 1/{round(1 / NEGLIGIBLE)} of the graph's largest kept tensor "
                f"({largest} bytes): a table frees next to nothing there, and over so few elements (e.g. a "
                f"squeeze-excitation gate) its error does not average out")
    if _is_inplace(node, kind, module):
        if inp.op in ("placeholder", "get_attr"):
            return "in-place on a model input or attribute: rewriting would stop mutating it"
        if len(inp.users) > 1:
            return "in-place op whose input is read by other nodes too: rewriting would change what they see"
    return ctx.unchosen("fewbit", node.name) if chosen is False else None


_TABLE_ERRORS: Dict[Tuple, float] = {}


def _fewbit_fidelity(new: fx.Node, baseline: Estimate, unit: str) -> float:
    """The table's ∫(f'−q)² w (w: standard normal) times the elements; 0 for exact 1-bit masks."""
    if new.target is not fewbit_activation:
        return 0.0
    spec = FewBitSpec.of(new)
    if ACTIVATIONS[spec.name].exact:
        return 0.0
    key = (spec.name, tuple(spec.params), spec.borders, spec.levels)
    if key not in _TABLE_ERRORS:
        _TABLE_ERRORS[key] = table_error(spec.name, torch.tensor(spec.borders, dtype=torch.float64),
                                         torch.tensor(spec.levels, dtype=torch.float64), params=dict(spec.params),
                                         weight="normal")
    return _TABLE_ERRORS[key] * node_numel(baseline, unit)


_PLANNER = PlannerHooks(
    fidelity=_fewbit_fidelity, extra_passes=2.0)  # encode in forward, decode + multiply in backward


@register_pass(FewBitConfig, planner=_PLANNER)
def fewbit_pass(gm: fx.GraphModule, cfg: FewBitConfig, ctx: PassContext) -> PassResult:
    """Rewrite every eligible pointwise activation to ``memopt.fewbit.ops.fewbit_activation``."""
    modules = dict(gm.named_modules())
    modified = False
    largest = largest_kept(gm)
    for node in list(gm.graph.nodes):
        kind = op_kind(node, modules)
        if kind not in ACTIVATIONS:
            continue
        module = modules.get(node.target) if node.op == "call_module" else None
        params = _hyper_parameters(node, kind, module)
        reason = params if isinstance(params, str) else _why_not(node, kind, module, cfg, ctx, largest)
        if reason is not None:
            node.meta[DECISION_KEY] = {"technique": "exact", "reason": f"few-bit: {reason}"}
            continue
        act = ACTIVATIONS[kind]
        if act.exact:
            bits, borders, levels = 1, (), tuple(float(v) for v in act.mask_levels(dict(params)))
            note = "exact 1-bit mask"
        else:
            bits = ctx.bits("fewbit", node.name, cfg.bits_for(kind, node.name))
            weight, domain = _weight(node, cfg)
            b, lv = fewbit_table(kind, bits, domain=domain, weight=weight, grid=cfg.grid, params=dict(params),
                                 scale=cfg.scale)
            borders, levels = tuple(b.tolist()), tuple(lv.tolist())
            note = f"{2 ** bits}-level table ({weight if isinstance(weight, str) else 'data'} weight)"
        _replace(gm, node, kind, params, bits, borders, levels,
                 {"technique": "fewbit", "bits": bits, "replaces": node.name, "unit": node.name, "reason": note})
        modified = True
    return PassResult(gm, modified)


def _replace(gm: fx.GraphModule, node: fx.Node, kind: str, params: Params, bits: int, borders: tuple,
             levels: tuple, decision: dict) -> fx.Node:
    with gm.graph.inserting_before(node):
        new = gm.graph.create_node(
            "call_function", fewbit_activation,
            (_input(node), FewBitSpec(kind, params, bits, borders, levels, node.format_node())),
            name=f"{node.name}_fewbit")
    new.meta[DECISION_KEY] = decision
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _weight(node: fx.Node, cfg: FewBitConfig):
    if cfg.weight != "data":
        return cfg.weight, cfg.domain
    histogram = node.meta.get(HISTOGRAM_KEY)
    if histogram is None:  # no real values seen (meta example inputs): the generic table
        return "uniform", cfg.domain
    counts, edges = histogram
    return data_weight(counts, edges, cfg.domain), cfg.domain


def data_weight(counts: torch.Tensor, edges: torch.Tensor, domain: Tuple[float, float], floor: float = 1e-3):
    """A density from a pre-activation histogram, plus a small uniform floor over ``domain`` so
    that values outside the observed range still get a sensible end piece."""
    counts = counts.to(torch.float64)
    edges = edges.to(torch.float64)
    widths = (edges[1:] - edges[:-1]).clamp_min(1e-300)
    dens = counts / (counts.sum().clamp_min(1.0) * widths)
    uniform = floor / (domain[1] - domain[0])

    def weight(x: torch.Tensor) -> torch.Tensor:
        idx = torch.bucketize(x, edges, right=True) - 1
        inside = (idx >= 0) & (idx < counts.numel())
        return torch.where(inside, dens[idx.clamp(0, counts.numel() - 1)], torch.zeros_like(x)) + uniform

    return weight


def exact_masks(gm: fx.GraphModule, modules) -> Dict[str, Tuple[fx.Node, str, Params]]:
    """name -> (node, kind, hyper-parameters) of every activation whose exact gradient is a 1-bit mask and
    that can be rewritten to keep only that mask (no hooks, a supported dtype, not an in-place op whose
    rewrite would change what another reader or the caller sees). The generic stash takes these into its
    units where the activation keeps the very tensor a weight op keeps (a ReLU keeps its output, the next
    conv its input): neither rewrite frees that storage alone, both together do."""
    found: Dict[str, Tuple[fx.Node, str, Params]] = {}
    for node in gm.graph.nodes:
        kind = op_kind(node, modules)
        if kind not in ACTIVATIONS or not ACTIVATIONS[kind].exact:
            continue
        module = modules.get(node.target) if node.op == "call_module" else None
        params = _hyper_parameters(node, kind, module)
        cost, inp = node.meta.get(META_KEY), _input(node)
        if isinstance(params, str) or (module is not None and has_hooks(module)) or cost is None or inp is None:
            continue
        if not cost.dtypes or cost.dtypes[0] not in _DTYPE_NAMES:
            continue
        if _is_inplace(node, kind, module) and (inp.op in ("placeholder", "get_attr") or len(inp.users) > 1):
            continue
        found[node.name] = (node, kind, params)
    return found


def replace_with_mask(gm: fx.GraphModule, node: fx.Node, kind: str, params: Params, unit: Optional[str],
                      why: str) -> fx.Node:
    """Rewrite ``node`` (one of ``exact_masks``) to keep its 1-bit mask, as part of the stash ``unit`` (None:
    an always-on exact rewrite), ``why`` saying what that frees; the new node (forward bit-identical: it
    computes the same activation)."""
    levels = tuple(float(v) for v in ACTIVATIONS[kind].mask_levels(dict(params)))
    decision = {"technique": "stash", "replaces": node.name, "reason": f"exact 1-bit mask: {why}"}
    if unit is not None:
        decision["unit"] = unit
    return _replace(gm, node, kind, params, 1, (), levels, decision)
