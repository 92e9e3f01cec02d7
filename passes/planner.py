"""The budget planner: the least harmful set of rewrites whose estimated peak fits the budget.

Given the groups of ``memopt.passes.candidates`` (each: exact, or one of its options), choose one option
per group so that the saved bytes freed reach ``required`` while the total cost

    cost(option) = fidelity + TIME_WEIGHT * time

is least: a multiple-choice knapsack, solved by dynamic programming over the freed bytes cut into
``resolution`` cells of ``required / resolution`` bytes. Each option's bytes are rounded *down* to
whole cells, so a DP-feasible choice frees at least ``required`` real bytes; the optimum is exact
for the rounded problem and loses at most one cell per chosen option against the real one (with the
default 2048 cells and ~100 rewritten units, at most ~5% of ``required``).

Fidelity is a per-element mean squared error times elements (few-bit: the table's ∫(f'−q)²w under
a standard normal; stash: the quantisation and clipping error of x̂ ~ N(0, 1)); time counts the
extra elementwise passes the rewrite adds. TIME_WEIGHT = 1e-3 makes time a tie-breaker: an exact
1-bit ReLU mask (no fidelity cost) is preferred to an 8-bit stash only when it frees as much.

The freed bytes of different groups add up (they are disjoint sets of storages), but the peak of a
training step is not just the saved bytes: when the peak falls inside backward, the last layers'
activations are already released by then. So the knapsack first counts each option's
``peak_freed_bytes`` (its freed bytes scaled by the share whose producer is alive at the baseline's
peak, from the cost model), the chosen plan is re-estimated with the full cost model, and if the
peak still exceeds the budget (the peak moved), the bytes to free are searched by false position
between that request and the maximum saving (``MAX_ROUNDS`` full estimates in all, or until known
within ``TOLERANCE``), keeping the cheapest plan that fits.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx

from memopt.cost_model.analysis import Estimate, annotate
from memopt.core.errors import MemoptError
from memopt.techniques import TECHNIQUES
from memopt.passes.base import Decision, PassContext, registered_pass
from memopt.passes.candidates import (Group, Option, candidates, copy_graph_module, make_option, rewritten_units,
                                      technique_passes)
from memopt.passes.manager import passes_for, run_passes

TIME_WEIGHT = 1e-3
DEFAULT_RESOLUTION = 2048
MAX_ROUNDS = 6
TOLERANCE = 0.03  # stop refining when the bytes asked for are known within 3%


def option_cost(option: Option) -> float:
    return option.fidelity + TIME_WEIGHT * option.time


@dataclass
class Solution:
    choice: List[int]  # option index per group
    freed_bytes: int
    cost: float


def max_saving(groups: Sequence[Group], weight: str = "freed_bytes") -> Solution:
    """Each group's option that frees the most ``weight`` (ties: the cheaper one)."""
    choice = [max(range(len(g.options)), key=lambda i: (getattr(g.options[i], weight), -option_cost(g.options[i])))
              for g in groups]
    return _solution(groups, choice)


def weighted(groups: Sequence[Group], choice: Sequence[int], weight: str) -> int:
    return sum(getattr(g.options[i], weight) for g, i in zip(groups, choice))


def _solution(groups: Sequence[Group], choice: List[int]) -> Solution:
    chosen = [g.options[i] for g, i in zip(groups, choice)]
    return Solution(choice, sum(o.freed_bytes for o in chosen), sum(option_cost(o) for o in chosen))


def solve(groups: Sequence[Group], required: int, resolution: int = DEFAULT_RESOLUTION,
          weight: str = "freed_bytes") -> Optional[Solution]:
    """The least-cost choice that frees at least ``required`` bytes of ``weight`` (an Option field:
    "freed_bytes", or "peak_freed_bytes" for those alive at the peak), or None when none does.

    dp[k] is the least cost of the groups so far freeing k cells (the last cell: k or more);
    per group and option the table shifts by the option's cells, so a group costs
    O(options x resolution) vectorised work.
    """
    if required <= 0:
        return _solution(groups, [0] * len(groups))
    best = max_saving(groups, weight)
    if weighted(groups, best.choice, weight) < required:
        return None
    cell = required / resolution
    size = resolution + 1
    inf = float("inf")
    dp = torch.full((size,), inf, dtype=torch.float64)
    dp[0] = 0.0
    choices, prevs = [], []
    index = torch.arange(size)
    for group in groups:
        best, best_choice, best_prev = dp.clone(), torch.zeros(size, dtype=torch.int16), index.clone()
        for i, option in enumerate(group.options[1:], start=1):
            cells = int(getattr(option, weight) // cell)
            if cells <= 0:
                continue  # frees nothing at this resolution: never better than exact
            cand, prev = torch.full((size,), inf, dtype=torch.float64), torch.zeros(size, dtype=torch.long)
            cost = option_cost(option)
            if cells < resolution:
                cand[cells:resolution] = dp[: resolution - cells] + cost
                prev[cells:resolution] = index[: resolution - cells]
            tail = dp[max(resolution - cells, 0):]
            j = int(torch.argmin(tail))
            cand[resolution] = tail[j] + cost
            prev[resolution] = max(resolution - cells, 0) + j
            better = cand < best
            best = torch.where(better, cand, best)
            best_choice[better] = i
            best_prev = torch.where(better, prev, best_prev)
        dp = best
        choices.append(best_choice)
        prevs.append(best_prev)
    if not torch.isfinite(dp[resolution]):
        return None  # rounding lost too much; the caller retries finer
    choice, k = [0] * len(groups), resolution
    for g in range(len(groups) - 1, -1, -1):
        choice[g] = int(choices[g][k])
        k = int(prevs[g][k])
    return _solution(groups, choice)


def solve_or_max(groups: Sequence[Group], required: int, weight: str = "freed_bytes") -> Optional[Solution]:
    """``solve`` at the default resolution, then 8x finer, then the maximum saving if it suffices."""
    for resolution in (DEFAULT_RESOLUTION, 8 * DEFAULT_RESOLUTION):
        found = solve(groups, required, resolution, weight)
        if found is not None:
            return found
    best = max_saving(groups, weight)
    return best if weighted(groups, best.choice, weight) >= required else None


# ---------------------------------------------------------------- applying a choice
def chosen_decision(groups: Sequence[Group], choice: Sequence[int]) -> Decision:
    """{technique: {unit: bits}} of the options ``choice`` picks (exact options rewrite nothing)."""
    chosen: Decision = {}
    for group, i in zip(groups, choice):
        option = group.options[i]
        if option.technique != "exact":
            chosen.setdefault(option.technique, {})[option.unit] = option.bits
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


def plan_for_budget(gm: fx.GraphModule, args: tuple, kwargs: dict, config: Any, baseline: Estimate,
                    budget_bytes: int, optimizer: Any = None, ctx: Optional[PassContext] = None) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """(the least-cost plan that fits, or None; the maximum-saving plan, applied, for the error message).

    The second element is only computed when the first is None (otherwise it is the same plan).
    """
    start = time.perf_counter()
    ctx = PassContext(args, kwargs, config.device) if ctx is None else ctx
    groups = candidates(gm, args, kwargs, config, baseline, optimizer, ctx=ctx)
    required = baseline.peak_bytes - budget_bytes
    # Count only the bytes alive at the baseline's peak when they can cover the request: freeing the
    # last layers' activations does not lower a peak reached after backward released them.
    weight = "peak_freed_bytes"
    if weighted(groups, max_saving(groups, weight).choice, weight) < required:
        weight = "freed_bytes"
    rounds = 1
    solution = solve_or_max(groups, required, weight)
    if solution is not None:
        found = _applied(gm, ctx, args, kwargs, config, groups, solution, optimizer, required, rounds, start)
        if found.estimate.peak_bytes <= budget_bytes:
            return found, found
    # Freed saved bytes did not all come off the peak (the peak moved, or decode temporaries add to
    # it): search the bytes to free between what failed and the maximum saving, keeping the
    # cheapest plan that fits.
    rounds += 1
    best = _applied(gm, ctx, args, kwargs, config, groups, max_saving(groups), optimizer, max_saving(groups).freed_bytes,
                    rounds, start)
    if best.estimate.peak_bytes > budget_bytes:
        return _last_resort(gm, ctx, args, kwargs, config, baseline, budget_bytes, optimizer, groups, best, start)
    # regula falsi on (bytes asked -> estimated peak), clipped away from the ends of the interval
    low, high = required, weighted(groups, best.solution.choice, weight)
    peak_low, peak_high = (found.estimate.peak_bytes if solution is not None else baseline.peak_bytes), \
        best.estimate.peak_bytes
    while rounds < MAX_ROUNDS and high - low > TOLERANCE * high:
        rounds += 1
        slope = (peak_low - budget_bytes) / max(peak_low - peak_high, 1)
        middle = int(low + (high - low) * min(max(slope, 0.1), 0.9))
        solution = solve_or_max(groups, middle, weight)
        found = _applied(gm, ctx, args, kwargs, config, groups, solution, optimizer, middle, rounds, start)
        if found.estimate.peak_bytes <= budget_bytes:
            best, high, peak_high = found, middle, found.estimate.peak_bytes
        else:
            low, peak_low = middle, found.estimate.peak_bytes
    best.rounds, best.seconds = rounds, time.perf_counter() - start
    return best, best


def _last_resort(gm, ctx: PassContext, args, kwargs, config, baseline: Estimate, budget_bytes: int, optimizer, groups: List[Group],
                 best: BudgetPlan, start: float) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """The maximum saving of the other techniques does not fit: recompute blocks on top of it.

    A recomputed block replaces every unit that touches its nodes, so its gain is the bytes it
    frees minus what those units freed at their maximum saving; blocks are added by gain per unit
    of extra work (FLOPs) until the predicted gain covers the shortfall, then re-estimated; when the
    peak still misses the budget, more blocks are asked for.
    """
    blocks = candidates(gm, args, kwargs, config, baseline, optimizer, last_resort=True, ctx=ctx)
    base = best.solution.choice
    owner: Dict[str, List[int]] = {}
    for index, group in enumerate(groups):
        for node in group.nodes:
            owner.setdefault(node, []).append(index)
    scored = []
    for block in blocks:
        touching = sorted({i for node in block.nodes for i in owner.get(node, [])})
        option = block.options[-1]
        gain = option.freed_bytes - sum(groups[i].options[base[i]].freed_bytes for i in touching)
        if gain > 0:
            scored.append((gain / max(option.time, 1.0), gain, block, touching))
    scored.sort(key=lambda item: (-item[0], item[2].name))
    every = list(blocks) + list(groups)
    need, gained, taken, rounds = best.estimate.peak_bytes - budget_bytes, 0, 0, best.rounds
    while taken < len(scored) and rounds < 2 * MAX_ROUNDS:
        while taken < len(scored) and gained < need:
            gained += scored[taken][1]
            taken += 1
        chosen_blocks = {id(item[2]) for item in scored[:taken]}
        replaced = {i for item in scored[:taken] for i in item[3]}
        choice = [len(b.options) - 1 if id(b) in chosen_blocks else 0 for b in blocks] + \
                 [0 if i in replaced else base[i] for i in range(len(groups))]
        rounds += 1
        best = _applied(gm, ctx, args, kwargs, config, every, _solution(every, choice), optimizer,
                        best.required_bytes + gained, rounds, start)
        if best.estimate.peak_bytes <= budget_bytes:
            return best, best
        need = gained + best.estimate.peak_bytes - budget_bytes
    return None, best


def fit_decision(gm: fx.GraphModule, ctx: PassContext, args: tuple, kwargs: dict, config: Any, baseline: Estimate,
                 budget_bytes: int, optimizer: Any, planned: BudgetPlan,
                 decision: Decision) -> Tuple[Optional[BudgetPlan], BudgetPlan]:
    """(the plan of ``decision`` -- the fidelity gate's repair of ``planned.decision`` -- on ``planned``'s groups,
    with recomputed blocks on top where the raised bits no longer fit ``budget_bytes``, or None; the plan with the
    most recomputation, for the error message). Recomputation is exact: it trades the bytes the gate gave back
    for FLOPs, never for gradient error."""
    start = time.perf_counter()
    groups = planned.groups
    choice = [_option_index(group, decision) for group in groups]
    best = _applied(gm, ctx, args, kwargs, config, groups, _solution(groups, choice), optimizer,
                    planned.required_bytes, planned.rounds + 1, start)
    if best.estimate.peak_bytes <= budget_bytes:
        return best, best
    return _last_resort(gm, ctx, args, kwargs, config, baseline, budget_bytes, optimizer, groups, best, start)


def _option_index(group: Group, decision: Decision) -> int:
    """The option of ``group`` that ``decision`` chose (0, exact, when it chose none of them)."""
    for i, option in enumerate(group.options):
        if option.technique != "exact" and decision.get(option.technique, {}).get(option.unit, False) == option.bits:
            return i
    return 0


def _applied(gm, ctx: PassContext, args, kwargs, config, groups, solution, optimizer, required, rounds,
             start) -> BudgetPlan:
    chosen = chosen_decision(groups, solution.choice)
    applied, records = apply_decision(gm, config, chosen, ctx)
    estimate = annotate(applied, args, kwargs, device=config.device, optimizer=optimizer)
    return BudgetPlan(chosen, list(groups), solution, applied, records, estimate, required, rounds,
                      time.perf_counter() - start)


def plan_units(gm: fx.GraphModule, baseline: Estimate, estimate: Estimate,
               planned: Optional[BudgetPlan]) -> List[Dict[str, Any]]:
    """``Plan.units``: every group with its choice and alternatives when planned; otherwise what the
    passes rewrote (no alternatives were considered)."""
    if planned is not None:
        return [{"name": g.name, "nodes": list(g.nodes), "chosen": g.options[i].to_dict(),
                 "alternatives": [o.to_dict() for o in g.options]}
                for g, i in zip(planned.groups, planned.solution.choice)]
    entries = []
    for entry in TECHNIQUES:
        technique = registered_pass(entry.config_type)
        if technique is None or technique.planner is None:
            continue
        for unit, (nodes, new) in sorted(rewritten_units(gm, technique.name).items()):
            option = make_option(technique, unit, nodes, new, baseline, estimate)
            entries.append({"name": f"{technique.name}:{unit}", "nodes": sorted(nodes), "chosen": option.to_dict(),
                            "alternatives": []})
    return entries
