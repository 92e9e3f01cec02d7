"""The fidelity gate: check a plan's gradients per parameter against exact autograd, and repair the plan.

The planner's fidelity proxies are models of the error; the gate measures it. On a slice of the example batch
(``soundness.batch_slice``, so the check fits where the plan does) it runs one training step of the eager model
(exact: the capture check showed the captured graph is bit-identical to it) and one of the graph rewritten by
the plan's decision, from the same state and RNG, and compares every parameter's gradient (cosine). Parameters
whose exact gradient is tiny beside the median (``FidelityConfig.tiny``) are listed apart: their direction is
rounding noise. For each parameter below ``min_cosine`` the lossy units nearest to it in the captured graph
(the nodes that use the parameter, then their neighbours, widening when the nearest are exact already) are
raised to their technique's next bit width, or made exact; the step is repeated until every parameter passes
or ``max_rounds`` is spent. The report records every change and the final per-parameter figures.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn

from memopt.capture import capture, flat_inputs
from memopt.config import Config
from memopt.core.meta import HISTOGRAM_KEY, META_KEY
from memopt.cost_model.step import default_loss, output_tensors
from memopt.passes.base import Decision, PassContext
from memopt.passes.planner import apply_decision
from memopt.reversible.check import real_examples
from memopt.soundness import batch_slice, training_step

log = logging.getLogger("memopt")

# techniques whose units have bit widths the gate can raise (the others can only be made exact)
_LEVELS = {"stash": lambda config: config.stash.plan_bits, "fewbit": lambda config: config.fewbit.plan_bits}


class RandomProjection:
    """The loss of the gate's steps: each floating output times fixed random weights, summed. A plain sum would
    hide errors (through a training-mode BatchNorm or a softmax its gradient is partly exactly zero); a real
    loss weighs outputs unevenly, as these weights do. The same weights serve the exact and rewritten steps."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.weights: List[torch.Tensor] = []

    def __call__(self, output: Any) -> torch.Tensor:
        terms = [t for t in output_tensors(output) if t.is_floating_point() and t.requires_grad]
        if not terms:
            return default_loss(output)  # says what is wrong
        while len(self.weights) < len(terms):
            t = terms[len(self.weights)]
            self.weights.append(torch.randn(t.shape, generator=self.generator, dtype=torch.float32).to(t))
        return sum((t * w).sum() for t, w in zip(terms, self.weights))


def parameter_fidelity(names: List[str], exact: List[Optional[torch.Tensor]], approx: List[Optional[torch.Tensor]],
                       tiny: float) -> Dict[str, Dict[str, Any]]:
    """{parameter: {"cosine", "relative_error", "tiny"}} of the approximate gradients against the exact ones."""
    norms = [float(g.norm()) if g is not None else 0.0 for g in exact]
    positive = sorted(n for n in norms if n > 0)
    median = positive[len(positive) // 2] if positive else 0.0
    out = {}
    for name, g, a, norm in zip(names, exact, approx, norms):
        if g is None or a is None:
            continue
        g64, a64 = g.double().flatten(), a.double().flatten()
        denominator = float(g64.norm() * a64.norm())
        cosine = float(g64 @ a64) / denominator if denominator > 0 else (1.0 if float(a64.norm()) == norm else 0.0)
        relative = float((a64 - g64).norm()) / norm if norm > 0 else float(a64.norm() > 0)
        out[name] = {"cosine": cosine, "relative_error": relative, "tiny": norm <= tiny * median}
    return out


def _consumers(graph: fx.Graph, parameter: str) -> List[fx.Node]:
    """The nodes that use ``parameter``: its module's calls, or its get_attr (functional and export graphs)."""
    module = parameter.rpartition(".")[0]
    return [n for n in graph.nodes
            if (n.op == "call_module" and n.target == module) or (n.op == "get_attr" and n.target == parameter)]


def _distances(graph: fx.Graph, start: List[fx.Node], radius: int) -> Dict[str, int]:
    """Graph distance (ignoring direction) of every node within ``radius`` of ``start``."""
    seen = {n.name: 0 for n in start}
    queue = deque(start)
    while queue:
        node = queue.popleft()
        if seen[node.name] >= radius:
            continue
        for other in list(node.all_input_nodes) + list(node.users):
            if other.name not in seen:
                seen[other.name] = seen[node.name] + 1
                queue.append(other)
    return seen


def _responsible(graph: fx.Graph, parameter: str, lossy: Dict[Tuple[str, str], Set[str]],
                 radius: int) -> List[Tuple[str, str]]:
    """The lossy units nearest to ``parameter`` within ``radius`` (all those at the least distance)."""
    distances = _distances(graph, _consumers(graph, parameter), radius)
    scored = [(min(distances[n] for n in nodes if n in distances), key) for key, nodes in lossy.items()
              if any(n in distances for n in nodes)]
    if not scored:
        return []
    least = min(d for d, _ in scored)
    return sorted(key for d, key in scored if d == least)


def _raise(decision: Decision, config: Config, technique: str, unit: str) -> str:
    """Raise ``unit`` to its technique's next bit width, or drop it from the decision (exact); says which."""
    bits = decision[technique][unit]
    levels = sorted(b for b in _LEVELS[technique](config) if bits is not None and b > bits) \
        if technique in _LEVELS else []
    if levels:
        decision[technique][unit] = levels[0]
        return f"{technique} {unit}: {bits} -> {levels[0]} bits"
    del decision[technique][unit]
    return f"{technique} {unit}: {'' if bits is None else f'{bits} bits '}-> exact"


def fidelity_gate(model: nn.Module, args: tuple, kwargs: dict, config: Config, decision: Decision,
                  units: List[Dict[str, Any]], planned: fx.GraphModule) -> Tuple[Decision, Dict[str, Any]]:
    """(the repaired decision, the report) for ``decision`` on ``model`` (``units``: ``Plan.units``; ``planned``:
    the annotated, not yet rewritten graph the plan was made on)."""
    gate = config.fidelity
    start = time.perf_counter()
    sliced_args, sliced_kwargs, which = batch_slice(args, kwargs)
    base = capture(model, sliced_args, sliced_kwargs).graph_module
    # the passes decide from the planned graph's analysis (shapes, elements per channel, histograms): carried
    # over by node name, the slice's graph is rewritten exactly as the plan says, and only runs on fewer samples
    analysis = {n.name: {k: n.meta[k] for k in (META_KEY, HISTOGRAM_KEY) if k in n.meta} for n in planned.graph.nodes}
    for node in base.graph.nodes:
        node.meta.update(analysis.get(node.name, {}))
    ctx = PassContext(sliced_args, sliced_kwargs, config.device, real_examples(flat_inputs(base, sliced_args,
                                                                                         sliced_kwargs)))
    names = [n for n, _ in model.named_parameters()]
    rng = torch.Generator().manual_seed(0).get_state()  # a fixed draw (dropout): the same plan, the same report
    loss = RandomProjection()
    exact = training_step(model, model, sliced_args, sliced_kwargs, rng, loss).grads
    lossy_nodes = {(u["chosen"]["technique"], u["chosen"]["unit"]): set(u["nodes"]) for u in units if _lossy(u)}
    decision = {t: dict(us) for t, us in decision.items()}
    changes: List[str] = []
    radius = 2
    for round_ in range(gate.max_rounds + 1):
        rewritten, _ = apply_decision(base, config, decision, ctx)
        approx = training_step(rewritten, model, sliced_args, sliced_kwargs, rng, loss).grads
        per_parameter = parameter_fidelity(names, exact, approx, gate.tiny)
        failing = sorted((p for p, f in per_parameter.items() if not f["tiny"] and f["cosine"] < gate.min_cosine),
                         key=lambda p: per_parameter[p]["cosine"])
        if not failing or round_ == gate.max_rounds:
            break
        lossy = {k: v for k, v in lossy_nodes.items() if k[1] in decision.get(k[0], {})}
        touched = set()
        for parameter in failing:
            for key in _responsible(base.graph, parameter, lossy, radius):
                if key not in touched:
                    touched.add(key)
                    changes.append(f"{_raise(decision, config, *key)} (for {parameter}, cosine "
                                   f"{per_parameter[parameter]['cosine']:.4f})")
        if not touched:
            radius += 2  # every unit near the failing parameters is exact already: look further
    gated = {p: f for p, f in per_parameter.items() if not f["tiny"]}
    worst = min(gated.items(), key=lambda kv: kv[1]["cosine"]) if gated else None
    report = {
        "min_cosine": gate.min_cosine, "slice": which, "rounds": round_, "changes": changes,
        "passed": not failing,
        "worst": None if worst is None else {"parameter": worst[0], "cosine": round(worst[1]["cosine"], 6),
                                             "relative_error": round(worst[1]["relative_error"], 6)},
        "below": [f"{p} ({per_parameter[p]['cosine']:.4f})" for p in failing],
        "tiny": sorted(p for p, f in per_parameter.items() if f["tiny"]),
        "parameters": {p: {"cosine": round(f["cosine"], 6), "relative_error": round(f["relative_error"], 6)}
                       for p, f in per_parameter.items()},
    }
    log.info("memopt: fidelity gate on %s: %d rounds, %d changes, %.2f s", type(model).__name__, round_,
             len(changes), time.perf_counter() - start)
    return decision, report


def _lossy(unit: Dict[str, Any]) -> bool:
    """Whether a ``Plan.units`` entry's chosen option approximates a gradient (a fidelity proxy above zero)."""
    return unit["chosen"]["technique"] != "exact" and unit["chosen"]["fidelity"] > 0


def has_lossy_units(units: List[Dict[str, Any]]) -> bool:
    return any(_lossy(u) for u in units)
