"""The budget planner: the least harmful set of rewrites whose estimated peak fits the budget.

The graph adapter of the solvers in ``memopt.passes.planning.knapsack`` (which say what an option costs and how a
choice is found). The peak of a training step is not just the saved bytes: when the peak falls inside
backward, the last layers' activations are already released by then. So the knapsack first counts each
option's ``peak_freed_bytes`` (its freed bytes scaled by the share whose producer is alive at the
baseline's peak, from the cost model), the chosen plan is re-estimated with the full cost model, and if the
peak still exceeds the budget (the peak moved), the bytes to free are searched by false position between
that request and the maximum saving (``MAX_ROUNDS`` full estimates in all, or until known within
``TOLERANCE``), keeping the cheapest plan that fits. Under the "balanced" policy recomputable blocks are
the last resort (``_last_resort``); under the others they compete in the knapsack.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import fx

from memopt.cost_model.analysis import Estimate
from memopt.core.errors import MemoptError
from memopt.passes.base import Decision, PassContext, planned_handlers
from memopt.passes.planning.candidates import (Group, candidates, copy_graph_module, make_option, rewritten_units,
                                     unit_couplings)
from memopt.passes.planning.knapsack import (BALANCED, Policy, Solution, _solution, max_nested, max_saving, nesting,
                                    policy_for, solve_nested_or_max, solve_or_max, weighted)
from memopt.passes.manager import passes_for, run_passes
from memopt.passes.stash.chunks import chunk_to_fit

MAX_ROUNDS = 6
TOLERANCE = 0.03  # stop refining when the bytes asked for are known within 3%


# ---------------------------------------------------------------- applying a choice
def chosen_decision(groups: Sequence[Group], choice: Sequence[int]) -> Decision:
    """{technique: {unit: bits}} of the options ``choice`` picks (exact options rewrite nothing)."""
    chosen: Decision = {}
    for group, i in zip(groups, choice):
        for technique, unit, bits in group.options[i].decisions():
            chosen.setdefault(technique, {})[unit] = bits
    return chosen


def check_decision(config: Any, decision: Decision) -> None:
    """A decision (a saved plan's chosen units) may only use techniques the config turns on."""
    enabled = {name for name, _, _ in passes_for(config)}
    unknown = sorted(set(decision) - enabled)
    if unknown:
        raise MemoptError(f"the plan uses {unknown} but the config turns {'it' if len(unknown) == 1 else 'them'} "
                          f"off (Config.{unknown[0]}=None); enable it or drop those units from the plan")


def apply_decision(gm: fx.GraphModule, config: Any, decision: Decision,
                   ctx: Optional[PassContext] = None) -> Tuple[fx.GraphModule, list]:
    """Run ``config``'s passes on a copy of ``gm`` (``gm`` keeps the baseline graph), rewriting exactly the units
    of ``decision`` at their bits."""
    check_decision(config, decision)
    ctx = dataclasses.replace(ctx or PassContext(), decision=decision, explore=False, level=None)
    return run_passes(copy_graph_module(gm), passes_for(config), ctx)


@dataclass
class BudgetPlan:
    """What ``plan_for_budget`` found: the applied graph, its estimate, and how it got there."""

    decision: Decision
    groups: List[Group]
    solution: Solution
    graph_module: fx.GraphModule
    records: list
    estimate: Estimate
    required_bytes: int
    rounds: int
    seconds: float


def plan_for_budget(gm: fx.GraphModule, config: Any, baseline: Estimate, budget_bytes: int,
                    ctx: PassContext) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """(the least-cost plan that fits, or None; the maximum-saving plan, applied, for the error message).

    The second element is only computed when the first is None (otherwise it is the same plan). With blocks
    among the options (``Policy.joint``) the plan is also searched with them as the last resort, and the cheaper
    plan that fits wins: a recomputed block's activations come back in its backward, so where its bytes do not
    come off the peak, lossy options at more bits can be the cheaper way there.
    """
    start = time.perf_counter()
    policy = policy_for(getattr(config, "prefer", "balanced"), baseline.device)
    groups = candidates(gm, ctx.args, ctx.kwargs, config, baseline, ctx=ctx)
    required = baseline.peak_bytes - budget_bytes
    joint = None
    if policy.joint and config.recompute is not None:
        blocks = candidates(gm, ctx.args, ctx.kwargs, config, baseline, last_resort=True, ctx=ctx)
        if blocks:
            every = list(groups) + list(blocks)
            order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
            nest = nesting(every, range(len(groups), len(every)), order)
            joint, _ = _search(gm, ctx, config, baseline, budget_bytes, every, required,
                               lambda asked, weight: solve_nested_or_max(every, nest, asked, weight, policy),
                               lambda weight: max_nested(every, nest, weight, policy), start, bisect=True)
    if policy.crush:  # every byte the lossy techniques can free
        required = max(required, weighted(groups, max_saving(groups, "freed_bytes", policy).choice, "freed_bytes"))
    found, best = _search(gm, ctx, config, baseline, budget_bytes, groups, required,
                          lambda asked, weight: solve_or_max(groups, asked, weight, policy),
                          lambda weight: max_saving(groups, weight, policy), start)
    if found is None:
        found, best = _last_resort(gm, ctx, config, baseline, budget_bytes, groups, best,
                                   start, policy)
    if joint is not None and (found is None or joint.solution.cost <= found.solution.cost):
        found = best = joint
    return found, best


def _search(gm, ctx: PassContext, config, baseline: Estimate, budget_bytes: int, groups: List[Group], required: int,
            solver: Callable[[int, str], Optional[Solution]], most: Callable[[str], Solution], start: float,
            bisect: bool = False) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """(the cheapest plan found that fits, or None; the maximum saving, applied): ``solver(bytes, weight)`` the
    least-cost choice freeing ``bytes``, ``most(weight)`` the most it can; ``bisect``: halve the interval each
    round (recomputed blocks make the peak a step function of the bytes asked for)."""
    # Count only the bytes alive at the baseline's peak when they can cover the request: freeing the
    # last layers' activations does not lower a peak reached after backward released them.
    weight = "peak_freed_bytes"
    if weighted(groups, most(weight).choice, weight) < required:
        weight = "freed_bytes"
    rounds = 1
    solution = solver(required, weight)
    if solution is not None:
        found = _applied(gm, ctx, config, groups, solution, required, rounds, start,
                         budget_bytes)
        if found.estimate.peak_bytes <= budget_bytes:
            return found, found
    # Freed saved bytes did not all come off the peak (the peak moved, or decode temporaries add to
    # it): search the bytes to free between what failed and the maximum saving, keeping the
    # cheapest plan that fits.
    rounds += 1
    top = most("freed_bytes")
    best = _applied(gm, ctx, config, groups, top, top.freed_bytes, rounds, start,
                    budget_bytes)
    if best.estimate.peak_bytes > budget_bytes:
        return None, best
    # regula falsi on (bytes asked -> estimated peak), clipped away from the ends of the interval
    low, high = required, weighted(groups, best.solution.choice, weight)
    peak_low, peak_high = (found.estimate.peak_bytes if solution is not None else baseline.peak_bytes), \
        best.estimate.peak_bytes
    while rounds < MAX_ROUNDS and high - low > TOLERANCE * high:
        rounds += 1
        slope = 0.5 if bisect else (peak_low - budget_bytes) / max(peak_low - peak_high, 1)
        middle = int(low + (high - low) * min(max(slope, 0.1), 0.9))
        solution = solver(middle, weight)
        found = _applied(gm, ctx, config, groups, solution, middle, rounds, start,
                         budget_bytes)
        if found.estimate.peak_bytes <= budget_bytes:
            best, high, peak_high = found, middle, found.estimate.peak_bytes
        else:
            low, peak_low = middle, found.estimate.peak_bytes
    best.rounds, best.seconds = rounds, time.perf_counter() - start
    return best, best


def _last_resort(gm, ctx: PassContext, config, baseline: Estimate, budget_bytes: int, groups: List[Group],
                 best: BudgetPlan, start: float, policy: Policy = BALANCED) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """The maximum saving of the other techniques does not fit: recompute blocks on top of it.

    A recomputed block replaces every unit that touches its nodes, so its gain is the bytes it
    frees minus what those units freed at their maximum saving; blocks are added by gain per unit
    of extra work (the policy's time) until the predicted gain covers the shortfall, then re-estimated;
    when the peak still misses the budget, more blocks are asked for. A plan whose groups hold the blocks
    already (``Policy.joint``) adds those it left out. When none fits: (None, the least peak tried, ``best``
    included), which the refusal quotes.
    """
    joint = policy.joint and any(g.options[-1].technique == "recompute" for g in groups)
    blocks = [] if joint else candidates(gm, ctx.args, ctx.kwargs, config, baseline, last_resort=True, ctx=ctx)
    every = list(blocks) + list(groups)
    base = [0] * len(blocks) + list(best.solution.choice)
    is_block = [i < len(blocks) or (joint and g.options[-1].technique == "recompute") for i, g in enumerate(every)]
    owner: Dict[str, List[int]] = {}
    for index, group in enumerate(every):
        for node in group.nodes if index >= len(blocks) and not (joint and is_block[index]) else ():
            owner.setdefault(node, []).append(index)
    scored = []
    for b, block in enumerate(every):
        if not is_block[b] or base[b]:
            continue
        touching = sorted({i for node in block.nodes for i in owner.get(node, [])})
        option = block.options[-1]
        gain = option.freed_bytes - sum(every[i].options[base[i]].freed_bytes for i in touching)
        if gain > 0:
            scored.append((gain / max(policy.time(option), 1.0), gain, block, touching, b))
    scored.sort(key=lambda item: (-item[0], item[2].name))
    need, gained, taken, rounds = best.estimate.peak_bytes - budget_bytes, 0, 0, best.rounds
    least = best
    while taken < len(scored) and rounds < 2 * MAX_ROUNDS:
        while taken < len(scored) and gained < need:
            gained += scored[taken][1]
            taken += 1
        chosen_blocks = {item[4] for item in scored[:taken]}
        replaced = {i for item in scored[:taken] for i in item[3]}
        choice = [len(g.options) - 1 if i in chosen_blocks else 0 if i in replaced else base[i]
                  for i, g in enumerate(every)]
        rounds += 1
        best = _applied(gm, ctx, config, every, _solution(every, choice, policy),
                        best.required_bytes + gained, rounds, start, budget_bytes)
        if best.estimate.peak_bytes <= budget_bytes:
            return best, best
        least = best if best.estimate.peak_bytes < least.estimate.peak_bytes else least
        need = gained + best.estimate.peak_bytes - budget_bytes
    return None, least  # the least peak tried, for the refusal (more blocks can raise it: their backward)


def fit_decision(gm: fx.GraphModule, ctx: PassContext, config: Any, baseline: Estimate, budget_bytes: int,
                 planned: BudgetPlan, decision: Decision) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """(the plan of ``decision`` -- the fidelity gate's repair of ``planned.decision`` -- on ``planned``'s groups,
    with recomputed blocks on top where the raised bits no longer fit ``budget_bytes``, or None; the plan with the
    most recomputation, for the error message). Recomputation is exact: it trades the bytes the gate gave back
    for FLOPs, never for gradient error."""
    start = time.perf_counter()
    policy = policy_for(getattr(config, "prefer", "balanced"), baseline.device)
    groups = planned.groups
    choice = [_option_index(group, decision) for group in groups]
    best = _applied(gm, ctx, config, groups, _solution(groups, choice, policy),
                    planned.required_bytes, planned.rounds + 1, start, budget_bytes)
    if best.estimate.peak_bytes <= budget_bytes:
        return best, best
    found, most = _last_resort(gm, ctx, config, baseline, budget_bytes, groups, best, start,
                               policy)
    if found is None:  # the units the gate left alone give up bits instead (the caller gates that plan again)
        found = _around_repair(gm, ctx, config, baseline, budget_bytes, planned, choice,
                               policy, start)
    return found, most if found is None else found


def _around_repair(gm, ctx: PassContext, config, baseline: Estimate, budget_bytes: int, planned: BudgetPlan,
                   choice: List[int], policy: Policy, start: float) -> Optional[BudgetPlan]:
    """The planner's search once more with every group the gate repaired held at its repair (or exact) and the
    others free: a plan that gave spare bytes to more bits on units the gate never questioned can fit the budget
    with the repair at their expense, where recomputation cannot. None when nothing fits."""
    changed = {i for i, (now, before) in enumerate(zip(choice, planned.solution.choice)) if now != before}
    if not changed:
        return None
    pinned = [dataclasses.replace(g, options=[g.options[0]] + ([g.options[choice[i]]] if choice[i] else []))
              if i in changed else g for i, g in enumerate(planned.groups)]
    found, _ = _search(gm, ctx, config, baseline, budget_bytes, pinned,
                       baseline.peak_bytes - budget_bytes,
                       lambda asked, weight: solve_or_max(pinned, asked, weight, policy),
                       lambda weight: max_saving(pinned, weight, policy), start)
    return found


def _option_index(group: Group, decision: Decision) -> int:
    """The option of ``group`` that ``decision`` chose (0, exact, when it chose none of them)."""
    taken = {(t, u) for t, us in decision.items() for u in us}
    best, most = 0, 0
    for i, option in enumerate(group.options):
        parts = option.decisions()
        if parts and all(decision.get(t, {}).get(u, False) == b for t, u, b in parts) and len(parts) > most:
            best, most = i, len(parts)  # of a joint group: the option covering the most of the units chosen
    mine = {(t, u) for option in group.options for t, u, _ in option.decisions()}
    if most and len(mine & taken) > most:
        raise MemoptError(f"the decision {sorted(mine & taken)} for the coupled units of {group.name} is none of their "
                          f"joint options (a unit rewritten without one it needs); plan again")
    return best


def _applied(gm, ctx: PassContext, config, groups, solution, required, rounds, start, budget_bytes: int) -> BudgetPlan:
    """The decision of ``solution`` applied and estimated; its weight gradients over batch chunks where the
    estimate misses ``budget_bytes`` inside one and chunks lower it (``stash_chunks.chunk_to_fit``)."""
    chosen = chosen_decision(groups, solution.choice)
    applied, records = apply_decision(gm, config, chosen, ctx)
    estimate, _ = chunk_to_fit(applied, ctx.annotate(applied), budget_bytes, ctx.annotate)
    return BudgetPlan(chosen, list(groups), solution, applied, records, estimate, required, rounds,
                      time.perf_counter() - start)


def plan_units(gm: fx.GraphModule, baseline: Estimate, estimate: Estimate,
               planned: Optional[BudgetPlan]) -> List[Dict[str, Any]]:
    """``Plan.units``: every group with its choice and alternatives when planned; otherwise what the
    passes rewrote (no alternatives were considered)."""
    if planned is not None:
        return [{"name": g.name, "nodes": list(g.nodes), "chosen": g.options[i].to_dict(),
                 "alternatives": [o.to_dict() for o in g.options], "couplings": [list(c) for c in g.couplings]}
                for g, i in zip(planned.groups, planned.solution.choice)]
    entries = []
    for technique in planned_handlers():
        couplings = unit_couplings(gm, technique.name)
        for unit, (nodes, new) in sorted(rewritten_units(gm, technique.name).items()):
            option = make_option(technique, unit, nodes, new, baseline, estimate)
            if any(n.graph is not gm.graph for n in new):  # inside a recomputed block: its bytes are the block's
                option = dataclasses.replace(option, freed_bytes=0, peak_freed_bytes=0)
            key = f"{technique.name}:{unit}"
            entries.append({"name": key, "nodes": sorted(nodes), "chosen": option.to_dict(), "alternatives": [],
                            "couplings": [list(c) for c in sorted(couplings) if c[0] == key]})
    return entries
