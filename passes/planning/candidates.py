"""Planner candidates: for every rewritable unit, what each option frees, costs in fidelity and in time.

A *unit* is what one technique rewrites as a whole: a stash chain (named by its BatchNorm node) or
one few-bit activation (named by its node). Candidates come from the passes themselves: each
technique's pass runs alone on a copy of the graph at each bit width it may use
(``plan_bits``), the copy is annotated by the cost model (attribution only, no step simulation),
and every new node's ``memopt_decision["unit"]`` ties it to its unit. So the options are exactly
what the rewrite will do, not a second model of it.

Bytes freed are storage-aware: a baseline storage counts for a unit only when every node that keeps
it is covered by the unit (a ReLU output that the next conv also keeps frees nothing unless the
unit covers the conv too), minus the storages the unit's new nodes keep.

Units that cover a common baseline node (a ReLU that is both a few-bit unit and the end of a stash
chain) form one *group* whose options exclude each other: exact, few-bit at b, or stash at K. Units
*coupled* by a pass (``needed_by`` in a node's decision: the chain whose BatchNorm weight gradient the
scale identity solves from the next chain's) merge their groups into one of joint options, none of which
rewrites the needing unit without the needed one.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from torch import fx

from memopt.cost_model.analysis import Estimate
from memopt.core.meta import DECISION_KEY, decided_nodes
from memopt.passes.base import Handler, PassContext, node_numel, planner_hooks, registered_pass
from memopt.passes.planning.options import Group, Option  # noqa: F401 (re-exported)
from memopt.core import counters

# Extra elementwise passes over a unit's activation that its rewrite adds (encode in forward, decode
# in backward): the time proxy. Stash also rebuilds the conv input from the codes.


@counters.counted("graph_copies")
def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node.meta copied shallowly) sharing its attributes,
    so a pass can rewrite the copy without touching ``gm``."""
    graph = copy.deepcopy(gm.graph)
    graph._tracer_cls = getattr(gm.graph, "_tracer_cls", None)
    graph._tracer_extras = getattr(gm.graph, "_tracer_extras", {})
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def technique_passes(config: Any, last_resort: Optional[bool] = None) -> List[Tuple[Handler, Any]]:
    """The enabled techniques the planner can drive (a registered pass with planner hooks), in ``Config``
    field order (``last_resort``: only those, or only the others; None: all)."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        handler = registered_pass(type(value)) if value is not None else None
        if handler is not None and handler.planner is not None:
            if last_resort is None or handler.planner.last_resort == last_resort:
                out.append((handler, value))
    return out


def candidates(gm: fx.GraphModule, args: tuple, kwargs: dict, config: Any, baseline: Estimate,
               last_resort: bool = False, ctx: Optional[PassContext] = None) -> List[Group]:
    """Every unit of every enabled technique (the last-resort ones, or the others) with its options,
    grouped into exclusive groups."""
    ctx = PassContext(args, kwargs, config.device) if ctx is None else ctx
    per_unit: Dict[str, List[Option]] = {}
    covered: Dict[str, Set[str]] = {}
    couplings: Set[Tuple[str, str]] = set()
    for technique, cfg in technique_passes(config, last_resort):
        for bits in technique.planner.levels(cfg):
            variant = copy_graph_module(gm)
            with counters.timed("pass_runs"):  # one technique's pass at one level
                technique.run(variant, cfg, dataclasses.replace(ctx, decision=None, explore=True, level=bits))
                variant.graph.lint()
                variant.recompile()
            after = ctx.annotate(variant, simulate=False)
            for unit, (nodes, new_nodes) in rewritten_units(variant, technique.name).items():
                key = f"{technique.name}:{unit}"
                covered.setdefault(key, set()).update(nodes)
                option = make_option(technique, unit, nodes, new_nodes, baseline, after)
                if option not in per_unit.setdefault(key, []):
                    per_unit[key].append(option)
            couplings.update(unit_couplings(variant, technique.name))
    return couple(_group(per_unit, covered), couplings)


def unit_couplings(gm: fx.GraphModule, technique: str) -> Set[Tuple[str, str]]:
    """(needing, needed) unit keys of a rewritten graph: a unit whose node says it is ``needed_by`` another unit
    of its technique (a chain whose BatchNorm weight gradient the scale identity solves from the next chain's: that
    chain stashed, this one must be too)."""
    found = set()
    for node in decided_nodes(gm):
        decision = node.meta.get(DECISION_KEY) or {}
        if decision.get("technique") == technique and decision.get("needed_by") and "unit" in decision:
            found.add((f"{technique}:{decision['needed_by']}", f"{technique}:{decision['unit']}"))
    return found


def make_option(technique: Handler, unit: str, nodes: Set[str], new_nodes: Sequence[fx.Node], baseline: Estimate,
                after: Estimate) -> Option:
    """The option a rewritten unit realises, with its bytes from the two estimates."""
    freed = int(freed_bytes(baseline, after, nodes, new_nodes))
    return Option(technique.name, bits_of(new_nodes), unit, freed,
                  float(sum(technique.planner.fidelity(n, baseline, unit) for n in new_nodes)),
                  _time(technique.name, unit, nodes, baseline), _peak_freed(baseline, nodes, freed),
                  _flops(technique.name, nodes, baseline))


def _peak_freed(baseline: Estimate, nodes: Set[str], freed: int) -> int:
    """``freed`` scaled by the share of the unit's storages whose producer is alive at the peak."""
    records = [r for r in baseline.storages.values() if r.savers and set(r.savers) <= nodes]
    total = sum(r.nbytes for r in records)
    alive = sum(r.nbytes for r in records if r.producer in baseline.alive_at_peak)
    return int(freed * alive / total) if total else 0


def _time(technique: str, unit: str, nodes: Set[str], baseline: Estimate) -> float:
    """Extra work, in element passes (about one FLOP per element): a recomputed block repeats its
    forward FLOPs plus one pass over each of its outputs."""
    hooks = planner_hooks(technique)
    if hooks.reruns_forward:  # one extra forward of the block / of each H
        costs = [baseline.nodes[n] for n in nodes if n in baseline.nodes]
        return float(sum(c.flops for c in costs) + sum(math.prod(s) for c in costs for s in c.shapes))
    # a coded call's unit is named after its node ("<node>_coded"); else its storage's producer or its chain's BN
    numel = node_numel(baseline, unit) or node_numel(baseline, unit.removesuffix("_coded")) or \
        max((node_numel(baseline, n) for n in nodes), default=0)
    return hooks.extra_passes * numel


def _flops(technique: str, nodes: Set[str], baseline: Estimate) -> float:
    """The FLOPs (matmuls, convolutions, attention: the cost model's FLOP counter) a rewrite runs again."""
    if planner_hooks(technique).reruns_forward:
        return float(sum(baseline.nodes[n].flops for n in nodes if n in baseline.nodes))
    return 0.0


def rewritten_units(gm: fx.GraphModule, technique: str) -> Dict[str, Tuple[Set[str], List[fx.Node]]]:
    """unit -> (baseline nodes it covers, the new nodes the pass created for it), those inside a recomputed block's
    own graph included (``decided_nodes``; their new nodes are not ``gm``'s)."""
    units: Dict[str, Tuple[Set[str], List[fx.Node]]] = {}
    for node in decided_nodes(gm):
        decision = node.meta.get(DECISION_KEY)
        if not decision or decision.get("technique") != technique or "unit" not in decision:
            continue
        replaces = decision.get("replaces", [])
        replaces = [replaces] if isinstance(replaces, str) else list(replaces)
        nodes, new = units.setdefault(decision["unit"], (set(), []))
        nodes.update(replaces)
        new.append(node)
    return units


def bits_of(new_nodes: Sequence[fx.Node]) -> Optional[int]:
    """The bits a unit was asked for (``level``: a chain without an activation codes with one more)."""
    levels = [n.meta[DECISION_KEY]["level"] for n in new_nodes if "level" in n.meta[DECISION_KEY]]
    if levels:
        return levels[0]
    bits = [n.meta[DECISION_KEY].get("bits") for n in new_nodes if n.meta[DECISION_KEY].get("bits") is not None]
    return bits[0] if bits else None


def freed_bytes(baseline: Estimate, after: Estimate, nodes: Set[str], new_nodes: Sequence[fx.Node]) -> int:
    """Saved bytes a unit frees: what only its baseline ``nodes`` kept minus what its new nodes keep."""
    return _freed_before(baseline, nodes) - _kept_after(after, {n.name for n in new_nodes})


def _freed_before(baseline: Estimate, nodes: Set[str]) -> int:
    """Baseline storages that only ``nodes`` keep: rewriting all of them frees these."""
    return sum(r.nbytes for r in baseline.storages.values() if r.savers and set(r.savers) <= nodes)


def _kept_after(after: Estimate, new_nodes: Set[str]) -> int:
    """Storages the unit's new nodes keep (and nobody else: anything shared was not freed before)."""
    return sum(r.nbytes for r in after.storages.values() if r.savers and set(r.savers) <= new_nodes)


def _group(per_unit: Dict[str, List[Option]], covered: Dict[str, Set[str]]) -> List[Group]:
    parent: Dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: Dict[str, str] = {}
    for key in sorted(covered):
        find(key)
        for node in sorted(covered[key]):
            if node in owner:
                parent[find(key)] = find(owner[node])
            else:
                owner[node] = key
    members: Dict[str, List[str]] = {}
    for key in sorted(covered):
        members.setdefault(find(key), []).append(key)
    groups = []
    for keys in members.values():
        options = [Option("exact", None, "", 0, 0.0, 0.0)]
        for key in keys:
            options.extend(sorted(per_unit.get(key, []), key=lambda o: (o.technique, o.bits or 0)))
        nodes = sorted(set().union(*(covered[k] for k in keys)))
        units = tuple(k.split(":", 1)[1] for k in keys)
        groups.append(Group("+".join(keys), units, tuple(nodes), options))
    return sorted(groups, key=lambda g: g.name)


# A joint group of coupled units takes every combination of its members' options that respects the couplings;
# past this many the members keep only their exact option and their own options taken alone or all at one level.
MAX_JOINT_OPTIONS = 512


def couple(groups: List[Group], couplings: Set[Tuple[str, str]]) -> List[Group]:
    """``groups`` with those holding the two units of a coupling merged into one group of joint options, none of
    which rewrites the needing unit without the needed one (units are planned together, not found broken by the
    fidelity gate: a depthwise block's BatchNorm stashed while the expand chain before it stays exact gives the
    expand BatchNorm's weight a gradient of cosine 0.2-0.6)."""
    owner = {key: i for i, g in enumerate(groups) for key in g.name.split("+")}
    parent = list(range(len(groups)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    kept = sorted(c for c in couplings if c[0] in owner and c[1] in owner)
    for needing, needed in kept:
        parent[find(owner[needing])] = find(owner[needed])
    members: Dict[int, List[int]] = {}
    for i in range(len(groups)):
        members.setdefault(find(i), []).append(i)
    out = []
    for ids in members.values():
        if len(ids) == 1:
            out.append(groups[ids[0]])
            continue
        parts = [groups[i] for i in ids]
        keys = [k for g in parts for k in g.name.split("+")]
        rules = tuple(c for c in kept if c[0] in keys)
        out.append(Group("+".join(keys), tuple(u for g in parts for u in g.units),
                         tuple(sorted(set().union(*(g.nodes for g in parts)))), _joint_options(parts, rules), rules))
    return sorted(out, key=lambda g: g.name)


def _joint_options(parts: List[Group], rules: Tuple[Tuple[str, str], ...]) -> List[Option]:
    """Exact first, then every allowed combination of the parts' options (or, past ``MAX_JOINT_OPTIONS``, each part's
    options alone and all parts at one level), each summed into one joint option."""
    def allowed(combo: Sequence[Option]) -> bool:
        taken = {f"{t}:{u}" for o in combo for t, u, _ in o.decisions()}
        return all(needed in taken for needing, needed in rules if needing in taken)

    if math.prod(len(g.options) for g in parts) <= MAX_JOINT_OPTIONS:
        combos = itertools.product(*(g.options for g in parts))
    else:
        exact = [g.options[0] for g in parts]
        alone = [exact[:i] + [o] + exact[i + 1:] for i, g in enumerate(parts) for o in g.options[1:]]
        levels = sorted({(o.technique, o.bits) for g in parts for o in g.options[1:]}, key=str)
        level = [[next((o for o in g.options if (o.technique, o.bits) == lv), g.options[0]) for g in parts]
                 for lv in levels]
        combos = [exact] + alone + level
    options = [Option("exact", None, "", 0, 0.0, 0.0)]
    for combo in combos:
        chosen = tuple(o for o in combo if o.technique != "exact")
        if not chosen or not allowed(chosen):
            continue
        option = chosen[0] if len(chosen) == 1 else Option(
            "joint", None, "+".join(o.unit for o in chosen), sum(o.freed_bytes for o in chosen),
            sum(o.fidelity for o in chosen), sum(o.time for o in chosen), sum(o.peak_freed_bytes for o in chosen),
            sum(o.flops for o in chosen), chosen)
        if option not in options:
            options.append(option)
    return options
