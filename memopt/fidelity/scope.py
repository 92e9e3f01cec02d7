"""Which lossy units can change a parameter's gradient: the fidelity gate's scope for its repairs.

A parameter's gradient is computed from the backward of the nodes that use it and of everything after them in the
forward; a unit whose nodes all run before them cannot change it. Among those after them, a unit that approximates
weight gradients only (the generic stash's conv / linear / matmul consumers: their input gradient needs only the
weight, exact) changes no gradient but its own ops' weights': raising it for another parameter spends a gate round
for nothing (HF MambaOut's fc1.bias at 8 bits: the rounds went to the codes of fc1's input while the approximate
input gradients of the gated units after it were the cause).
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Set, Tuple

from torch import fx

from memopt.capture.fused_norms import proxy_name
from memopt.core.meta import DECISION_KEY

# rewritten ops whose approximation reaches only the weight gradients of the arguments at these positions
# (their input gradients are exact; ``generic_encode`` only makes the codes those ops read)
_WEIGHT_ONLY = {"generic_encode": (), "linear_from_codes": (1,), "conv_from_codes": (1,), "matmul_from_codes": (1,),
                "weight_op_from_rebuild": (2,), "weight_op_recomputed": (slice(6, None),)}


def weight_only_units(rewritten: fx.GraphModule) -> Dict[Tuple[str, str], Set[str]]:
    """(technique, unit) -> the parameters whose gradients it can change, for every unit of ``rewritten`` (a graph
    the passes rewrote) all of whose nodes approximate weight gradients only; other units are not listed."""
    found: Dict[Tuple[str, str], Optional[Set[str]]] = {}
    for node in rewritten.graph.nodes:
        decision = node.meta.get(DECISION_KEY) or {}
        if decision.get("technique") in (None, "exact") or decision.get("unit") is None:
            continue
        key = (decision["technique"], decision["unit"])
        name = getattr(node.target, "__name__", "")
        if name not in _WEIGHT_ONLY or found.get(key, set()) is None:
            found[key] = None  # some node of the unit approximates input gradients too
            continue
        weights = found.setdefault(key, set())
        for position in _WEIGHT_ONLY[name]:
            picked = node.args[position] if isinstance(position, int) else node.args[position]
            for arg in (picked if isinstance(picked, (tuple, list)) else (picked,)):
                if not isinstance(arg, fx.Node) or arg.op != "get_attr":
                    found[key] = None  # a weight that is not a parameter: keep the unit in every scope
                    break
                weights.add(arg.target)
            if found[key] is None:
                break
    return {key: params for key, params in found.items() if params is not None}


def within_reach(lossy: Dict[Tuple[str, str], Set[str]], weight_only: Dict[Tuple[str, str], Set[str]],
                 parameter: str) -> Dict[Tuple[str, str], Set[str]]:
    """``lossy`` less the weight-only units that cannot change ``parameter``'s gradient."""
    module, _, attr = parameter.rpartition(".")
    names = {parameter, f"{proxy_name(module)}.{attr}"}
    return {key: nodes for key, nodes in lossy.items() if key not in weight_only or weight_only[key] & names}


def _consumers(graph: fx.Graph, parameter: str) -> List[fx.Node]:
    """The nodes that use ``parameter``: its module's calls, or its get_attr (functional and export graphs)."""
    module, _, attr = parameter.rpartition(".")
    modules = (module, proxy_name(module))  # a fused norm-act module's BatchNorm runs as its stock twin
    return [n for n in graph.nodes if (n.op == "call_module" and n.target in modules) or
            (n.op == "get_attr" and n.target in (parameter, f"{modules[1]}.{attr}"))]


def _distances(start: List[fx.Node], radius: int) -> Dict[str, int]:
    """Forward distance of every node within ``radius`` users of ``start``. A parameter's gradient is computed
    from the backward of its consumers and of everything after them in the forward: a unit before them (an
    input's producer) runs its backward later and cannot change that gradient, so only descendants count."""
    seen = {n.name: 0 for n in start}
    queue = deque(start)
    while queue:
        node = queue.popleft()
        if seen[node.name] >= radius:
            continue
        for other in node.users:
            if other.name not in seen:
                seen[other.name] = seen[node.name] + 1
                queue.append(other)
    return seen


def responsible(graph: fx.Graph, parameter: str, lossy: Dict[Tuple[str, str], Set[str]],
                 weights: Dict[Tuple[str, str], float], radius: int) -> List[Tuple[str, str]]:
    """The lossy unit to raise for ``parameter``: among those within ``radius`` users after its consumers (a
    unit whose nodes all run before them cannot change its gradient), the one of the largest fidelity proxy
    (``weights``: the planner's estimate of the squared error it adds, on one scale for every technique), the
    nearest on a tie. Not the nearest alone: a 4-bit chain three nodes on can outweigh an 8-bit code next to
    the parameter by orders of magnitude, and raising the code first only spends the gate's rounds."""
    distances = _distances(_consumers(graph, parameter), radius)
    scored = [(-weights.get(key, 0.0), min(distances[n] for n in nodes if n in distances), key)
              for key, nodes in lossy.items() if any(n in distances for n in nodes)]
    return [min(scored)[2]] if scored else []


def after(graph: fx.Graph, parameter: str, lossy: Dict[Tuple[str, str], Set[str]]) -> List[Tuple[str, str]]:
    """Every lossy unit with a node anywhere after ``parameter``'s consumers: all that can change its gradient."""
    distances = _distances(_consumers(graph, parameter), len(graph.nodes))
    return [key for key, nodes in lossy.items() if any(n in distances for n in nodes)]
