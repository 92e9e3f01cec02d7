"""What a pass is, and the registry of techniques' handlers.

A pass is a function ``(GraphModule, its config, PassContext) -> PassResult``. As in torchao
(``transform_module.py``: one dict from config type to handler), each technique registers its pass and
its planner hooks against its config type, once, with ``register_pass``; the technique list itself
(Config's fields and the order passes run in) is ``memopt.techniques.TECHNIQUES``. The pass manager and
the planner read both, so no third list exists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple, Type

from torch import fx

from memopt.core.inputs import Examples
from memopt.cost_model.analysis import Estimate, annotate
from memopt.techniques import TECHNIQUES, technique_for


# the planner's choice: {technique: {unit: bits}} (bits None for techniques without a bit width)
Decision = Dict[str, Dict[str, Optional[int]]]


class PassResult(NamedTuple):
    graph_module: fx.GraphModule
    modified: bool


@dataclass
class PassContext:
    """What a pass may know besides its graph and config, passed explicitly (never through globals).

    Attributes:
        args, kwargs: the model-level example inputs (real, fake or meta), to re-annotate a graph.
        device: the device the cost model plans for (``Config.device``; None: the inputs' own).
        examples: the graph's real placeholder values for plan-time numeric checks (reversible segments), with
            a cache shared by every pass run of one plan; None on fake or meta inputs (checks are skipped).
        decision: the planner's choice, {technique: {unit: bits}}: each pass rewrites exactly those units at
            those bits (a plan re-applied with ``plan=`` gives the same). None: the config decides (its
            allow / deny / node_bits / segments). The user's config objects are never edited to carry it.
        explore: the planner's candidate runs: every unit the config does not deny, at ``level`` bits (None:
            the technique has no bit width), so the planner sees every option.
        gate_exact: the (technique, unit) pairs the fidelity gate took out of the decision, so that the report
            says the gate, not the budget planner, left them exact.
        foreign_inputs: the graph is a submodule captured on its own (per-submodule capture): its inputs come
            from code around it, which may keep them anyway, so a rewrite that only frees an input frees nothing
            and its codes would be extra bytes.
        optimizer, loss_fn: what the training step around the graph runs (``memopt.optimize``'s arguments), so
            that every estimate of one build (``annotate``) counts the same whole step: the optimizer's state and
            step, and the loss computed from the outputs (None: the sum of the outputs).
        later: the passes ``run_passes`` runs after the current one, as (name, pass, config): a pass that moves
            nodes into a graph of their own (a block recomputed from codes) runs them on that graph, so what it
            moved is rewritten as it would have been where it was.
    """

    args: tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    device: Optional[str] = None
    examples: Optional[Examples] = None
    decision: Optional[Decision] = None
    gate_exact: FrozenSet[Tuple[str, str]] = frozenset()  # (technique, unit) the fidelity gate turned exact
    explore: bool = False
    level: Optional[int] = None
    foreign_inputs: bool = False
    optimizer: Any = None
    loss_fn: Optional[Callable[[Any], Any]] = None
    later: Tuple[Tuple[str, Any, Any], ...] = ()

    def annotate(self, gm: fx.GraphModule, simulate: bool = True) -> Estimate:
        """The cost model on ``gm`` for this context's inputs, device, optimizer and loss (``node.meta`` written)."""
        return annotate(gm, self.args, self.kwargs, device=self.device, optimizer=self.optimizer,
                        loss_fn=self.loss_fn, simulate=simulate)

    def unchosen(self, technique: str, unit: str) -> str:
        """Why a unit the decision leaves out stays exact: the fidelity gate's repair, or the budget planner."""
        if (technique, unit) in self.gate_exact:
            return "made exact by the fidelity gate (its gradients missed the bar; see the gate's changes)"
        return "not chosen by the budget planner"

    def chosen(self, technique: str, unit: str) -> Optional[bool]:
        """Whether the planner's decision rewrites ``unit``; None when there is no decision (the config says)."""
        return None if self.decision is None else unit in self.decision.get(technique, {})

    def selects(self, technique: str, unit: str, segments: Optional[Tuple[str, ...]]) -> bool:
        """For techniques whose config lists units by name (``segments``, None: all): the decision when there
        is one, every unit when exploring, else the config's list."""
        chosen = self.chosen(technique, unit)
        if chosen is not None:
            return chosen
        return self.explore or segments is None or unit in segments

    def bits(self, technique: str, unit: str, configured: Optional[int]) -> Optional[int]:
        """The bits ``unit`` is rewritten with: the decision's, the explored level, else the config's."""
        if self.decision is not None and unit in self.decision.get(technique, {}):
            return self.decision[technique][unit]
        return self.level if self.explore else configured


PassFn = Callable[[fx.GraphModule, Any, PassContext], PassResult]


@dataclass(frozen=True)
class PlannerHooks:
    """What the planner needs of one technique beyond its pass (which it drives through ``PassContext``:
    ``explore`` at each level, then ``decision``): a gradient-error proxy per new node (``fidelity``) and the
    bit widths it may use (``levels``). ``last_resort`` techniques are considered only when the others at
    their fewest bits do not fit."""

    fidelity: Callable[[fx.Node, Estimate, str], float]
    levels: Callable[[Any], Tuple[Optional[int], ...]] = lambda cfg: cfg.plan_bits
    last_resort: bool = False
    # the time proxy: extra element passes per element of the unit (encode + decode + the backward's reads), or, when
    # ``reruns_forward``, the unit's forward FLOPs again plus one pass over each output (recompute, reversible)
    extra_passes: float = 0.0
    reruns_forward: bool = False

    def bit_levels(self, technique_config: Any) -> Tuple[int, ...]:
        """The bit widths the gate's repair may raise a unit through (none: it can only be made exact)."""
        return tuple(sorted(b for b in self.levels(technique_config) if b is not None))


@dataclass(frozen=True)
class Handler:
    name: str  # the technique's name (its Config field)
    run: PassFn
    planner: Optional[PlannerHooks]


_HANDLERS: Dict[Type, Handler] = {}


def register_pass(config_type: Type, name: Optional[str] = None, *,
                  planner: Optional[PlannerHooks] = None) -> Callable[[PassFn], PassFn]:
    """Register ``fn`` as the pass run when a ``Config`` field holds a ``config_type`` instance (and, with
    ``planner``, the hooks the budget planner drives it with). ``name`` defaults to the technique's name in
    ``memopt.techniques.TECHNIQUES``; a config type outside it (a test's) must name its pass."""

    def decorate(fn: PassFn) -> PassFn:
        if config_type in _HANDLERS:
            raise ValueError(f"a pass is already registered for {config_type.__name__}: {_HANDLERS[config_type].name}")
        technique = technique_for(config_type)
        label = name or (technique.name if technique is not None else None)
        if label is None:
            raise ValueError(f"{config_type.__name__} is not a technique of memopt.techniques.TECHNIQUES: pass "
                             f"name= to register_pass")
        _HANDLERS[config_type] = Handler(label, fn, planner)
        return fn

    return decorate


def registered_pass(config_type: Type) -> Optional[Handler]:
    return _HANDLERS.get(config_type)


def planned_handlers() -> List[Handler]:
    """Every registered technique with planner hooks: ``TECHNIQUES``' order first, then the others (a technique
    registered by name outside the list, as a test's) in registration order. What reports and gates a plan's
    units reads, so no technique's rewrites go unlisted."""
    order = {t.config_type: i for i, t in enumerate(TECHNIQUES)}
    handlers = sorted(_HANDLERS.items(), key=lambda kv: order.get(kv[0], len(order)))
    return [h for _, h in handlers if h.planner is not None]


def planner_hooks(technique: str) -> Optional[PlannerHooks]:
    """The planner hooks registered under a technique's name (its Config field), None for none."""
    return next((h.planner for h in _HANDLERS.values() if h.name == technique), None)


def node_numel(baseline: Estimate, node: str) -> int:
    """Elements of ``node``'s first output in the baseline estimate (0 when unknown): the fidelity proxies'
    scale."""
    cost = baseline.nodes.get(node)
    return math.prod(cost.shapes[0]) if cost is not None and cost.shapes else 0
