"""The planner's solvers: pure functions on groups of options (numbers), no graph.

Given the groups of ``memopt.passes.planning.candidates`` (each: exact, or one of its options), choose one option
per group so that the saved bytes freed reach ``required`` while the total cost

    cost(option) = fidelity + time_weight * time

is least: a multiple-choice knapsack, solved by dynamic programming over the freed bytes cut into
``resolution`` cells of ``required / resolution`` bytes. Each option's bytes are rounded *down* to
whole cells, so a DP-feasible choice frees at least ``required`` real bytes; the optimum is exact
for the rounded problem and loses at most one cell per chosen option against the real one (with the
default 2048 cells and ~100 rewritten units, at most ~5% of ``required``).

Fidelity is a per-element mean squared error times elements (few-bit: the table's ∫(f'−q)²w under
a standard normal; stash: the quantisation and clipping error of x̂ ~ N(0, 1)); time counts the
extra elementwise passes the rewrite adds. TIME_WEIGHT = 1e-3 makes time a tie-breaker: an exact
1-bit ReLU mask (no fidelity cost) is preferred to an 8-bit stash only when it frees as much.

Policy (``Config.prefer``): ``cost = fidelity + time_weight * time``. "balanced" (default) is the cost above,
a FLOP counted as one element pass, blocks recomputed only as the planner's last resort. The others
count time in element passes (one per element of each pass a rewrite adds or a recomputed op writes) plus
recomputed FLOPs / ``FLOPS_PER_PASS``: comparable, as both are device time (an element pass is memory-bound,
a matmul / conv FLOP compute-bound; a device runs about FLOPS_PER_PASS FLOPs per element pass, fitted to
measured steps in docs/results/planner/budget_fidelity.md), and every recomputable block is an option too,
exclusive with the units it touches (``Nest``, ``solve_nested``). "fidelity" weighs time at 1e-9 (exact
recomputation first, lossy only where it cannot reach); "speed" at 1e-2, where an element pass outweighs the
error of a 3-bit code (codecs first, down to 3 bits, then whichever costs less time; not the fewest bits
everywhere, which the gate would give back through recomputation); a number w at w; "memory" asks every
lossy unit for its most bytes. No policy relaxes the fidelity gate.

The graph adapter (candidates, re-estimation, the search for the bytes to ask) is ``memopt.passes.planning.planner``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from memopt.passes.planning.options import Group, Option

TIME_WEIGHT = 1e-3
DEFAULT_RESOLUTION = 2048
# FLOPs of recomputed work that take the time of one element pass, per device type (see the docstring)
FLOPS_PER_PASS = {"cpu": 256.0, "cuda": 4096.0}


@dataclass(frozen=True)
class Policy:
    """What an option costs: ``fidelity + time_weight * time(option)``. ``flops_per_pass`` 1 keeps
    ``Option.time`` as it is (a FLOP = an element pass); ``joint``: recomputable blocks compete in the
    knapsack (else they are the last resort); ``crush``: ask for every byte the lossy techniques free."""

    time_weight: float
    flops_per_pass: float = 1.0
    joint: bool = False
    crush: bool = False

    def time(self, option: Option) -> float:
        rate = self.flops_per_pass
        return option.time if rate == 1.0 else option.time - option.flops + option.flops / rate

    def cost(self, option: Option) -> float:
        return option.fidelity + self.time_weight * self.time(option)


BALANCED = Policy(TIME_WEIGHT)
POLICIES = {"balanced": BALANCED, "fidelity": Policy(1e-9, joint=True), "speed": Policy(1e-2, joint=True),
            "memory": Policy(TIME_WEIGHT, crush=True)}


def policy_for(prefer: Any, device: str = "cpu") -> Policy:
    """``Config.prefer`` (a name of POLICIES or a time weight) as the Policy the planner uses on ``device``."""
    policy = POLICIES[prefer] if isinstance(prefer, str) else Policy(float(prefer), joint=True)
    if policy.joint:
        return dataclasses.replace(policy, flops_per_pass=FLOPS_PER_PASS.get(str(device).split(":")[0],
                                                                              FLOPS_PER_PASS["cpu"]))
    return policy


def option_cost(option: Option, policy: Policy = BALANCED) -> float:
    return policy.cost(option)


@dataclass
class Solution:
    choice: List[int]  # option index per group
    freed_bytes: int
    cost: float


def max_saving(groups: Sequence[Group], weight: str = "freed_bytes", policy: Policy = BALANCED) -> Solution:
    """Each group's option that frees the most ``weight`` (ties: the cheaper one)."""
    choice = [max(range(len(g.options)), key=lambda i: (getattr(g.options[i], weight), -policy.cost(g.options[i])))
              for g in groups]
    return _solution(groups, choice, policy)


def weighted(groups: Sequence[Group], choice: Sequence[int], weight: str) -> int:
    return sum(getattr(g.options[i], weight) for g, i in zip(groups, choice))


def _solution(groups: Sequence[Group], choice: List[int], policy: Policy = BALANCED) -> Solution:
    chosen = [g.options[i] for g, i in zip(groups, choice)]
    return Solution(choice, sum(o.freed_bytes for o in chosen), sum(policy.cost(o) for o in chosen))


def _shift(dp: torch.Tensor, cells: int, cost: float, resolution: int,
           index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cost, previous cell) of taking an option of ``cells`` cells on top of table ``dp``."""
    size = resolution + 1
    cand, prev = torch.full((size,), float("inf"), dtype=torch.float64), torch.zeros(size, dtype=torch.long)
    if cells < resolution:
        cand[cells:resolution] = dp[: resolution - cells] + cost
        prev[cells:resolution] = index[: resolution - cells]
    tail = dp[max(resolution - cells, 0):]
    j = int(torch.argmin(tail))
    cand[resolution] = tail[j] + cost
    prev[resolution] = max(resolution - cells, 0) + j
    return cand, prev


def _advance(dp: torch.Tensor, group: Group, cell: float, weight: str, policy: Policy, resolution: int,
             index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The table after ``group`` (each cell: its cheapest option), the option and previous cell per cell."""
    best, best_choice, best_prev = dp.clone(), torch.zeros(resolution + 1, dtype=torch.int16), index.clone()
    for i, option in enumerate(group.options[1:], start=1):
        cells = int(getattr(option, weight) // cell)
        if cells <= 0:
            continue  # frees nothing at this resolution: never better than exact
        cand, prev = _shift(dp, cells, policy.cost(option), resolution, index)
        better = cand < best
        best = torch.where(better, cand, best)
        best_choice[better] = i
        best_prev = torch.where(better, prev, best_prev)
    return best, best_choice, best_prev


def _walk(dp: torch.Tensor, groups: Sequence[Group], members: Sequence[int], cell: float, weight: str,
          policy: Policy, resolution: int, index: torch.Tensor) -> Tuple[torch.Tensor, list]:
    """``_advance`` through ``members`` in order: the last table and the trail to backtrack."""
    trail = []
    for g in members:
        dp, options, prevs = _advance(dp, groups[g], cell, weight, policy, resolution, index)
        trail.append((g, options, prevs))
    return dp, trail


def _backtrack(choice: List[int], trail: Sequence[tuple], k: int) -> int:
    """Set ``choice`` along ``trail`` ((group, option per cell, previous cell per cell), ...) from cell ``k``."""
    for g, options, prevs in reversed(trail):
        choice[g] = int(options[k])
        k = int(prevs[k])
    return k


def solve(groups: Sequence[Group], required: int, resolution: int = DEFAULT_RESOLUTION,
          weight: str = "freed_bytes", policy: Policy = BALANCED) -> Optional[Solution]:
    """The least-cost choice that frees at least ``required`` bytes of ``weight`` (an Option field:
    "freed_bytes", or "peak_freed_bytes" for those alive at the peak), or None when none does.

    dp[k] is the least cost of the groups so far freeing k cells (the last cell: k or more);
    per group and option the table shifts by the option's cells, so a group costs
    O(options x resolution) vectorised work.
    """
    if required <= 0:
        return _solution(groups, [0] * len(groups), policy)
    best = max_saving(groups, weight, policy)
    if weighted(groups, best.choice, weight) < required:
        return None
    cell, index = required / resolution, torch.arange(resolution + 1)
    dp = torch.full((resolution + 1,), float("inf"), dtype=torch.float64)
    dp[0] = 0.0
    dp, trail = _walk(dp, groups, range(len(groups)), cell, weight, policy, resolution, index)
    if not torch.isfinite(dp[resolution]):
        return None  # rounding lost too much; the caller retries finer
    choice = [0] * len(groups)
    _backtrack(choice, trail, resolution)
    return _solution(groups, choice, policy)


def solve_or_max(groups: Sequence[Group], required: int, weight: str = "freed_bytes",
                 policy: Policy = BALANCED) -> Optional[Solution]:
    """``solve`` at the default resolution, then 8x finer, then the maximum saving if it suffices."""
    for resolution in (DEFAULT_RESOLUTION, 8 * DEFAULT_RESOLUTION):
        found = solve(groups, required, resolution, weight, policy)
        if found is not None:
            return found
    best = max_saving(groups, weight, policy)
    return best if weighted(groups, best.choice, weight) >= required else None


# ---------------------------------------------------------------- recomputed blocks as options
@dataclass(frozen=True)
class Nest:
    """Indices into one list of groups: the blocks in graph order, each with the groups inside it (exact when
    it is recomputed) and those it shares with the block before (exact when either is); the groups outside
    every block; every group each block touches (made exact after solving)."""

    free: Tuple[int, ...]
    blocks: Tuple[Tuple[int, Tuple[int, ...], Tuple[int, ...]], ...]  # (block, inner, border)
    touching: Tuple[Tuple[int, Tuple[int, ...]], ...]


def nesting(groups: Sequence[Group], blocks: Sequence[int], order: Dict[str, int]) -> Nest:
    """The ``Nest`` of ``groups`` whose ``blocks`` are recompute blocks; ``order``: node name -> graph position.
    A group touching two blocks or more borders the last of them."""
    blocks = sorted(blocks, key=lambda b: min(order.get(n, 0) for n in groups[b].nodes))  # graph order
    position = {n: i for i, b in enumerate(blocks) for n in groups[b].nodes}
    inner, border, touching, free = [[] for _ in blocks], [[] for _ in blocks], [[] for _ in blocks], []
    for g in sorted(set(range(len(groups))) - set(blocks)):
        hit = sorted({position[n] for n in groups[g].nodes if n in position})
        for i in hit:
            touching[i].append(g)
        (free if not hit else inner[hit[0]] if len(hit) == 1 else border[hit[-1]]).append(g)
    return Nest(tuple(free), tuple((b, tuple(i), tuple(o)) for b, i, o in zip(blocks, inner, border)),
                tuple((b, tuple(t)) for b, t in zip(blocks, touching)))


def _exclusive(groups: Sequence[Group], choice: List[int], nest: Nest, policy: Policy) -> Solution:
    """``choice`` with every group a recomputed block touches made exact, as a Solution."""
    for block, touching in nest.touching:
        if choice[block]:
            for g in touching:
                choice[g] = 0
    return _solution(groups, choice, policy)


def solve_nested(groups: Sequence[Group], nest: Nest, required: int, resolution: int = DEFAULT_RESOLUTION,
                 weight: str = "freed_bytes", policy: Policy = BALANCED) -> Optional[Solution]:
    """``solve`` with each block of ``nest`` one more option, exclusive with the groups it holds: two tables
    along the chain of blocks, the cheapest per cell with the last block kept and with it recomputed."""
    cell, index = required / resolution, torch.arange(resolution + 1)
    never = torch.full((resolution + 1,), float("inf"), dtype=torch.float64)
    step = (cell, weight, policy, resolution, index)
    dp, trail = _walk(torch.where(index == 0, 0.0, never), groups, nest.free, *step)
    kept, recomputed, steps = dp, never, []
    for block, inner, border in nest.blocks:  # this block kept, after the last one kept (a) / recomputed (b)
        (a, after_kept), (b, after_recomputed) = _walk(kept, groups, inner + border, *step), \
            _walk(recomputed, groups, inner, *step)
        from_recomputed, base_recomputed = b < a, recomputed < kept
        option = groups[block].options[-1]
        cells = int(getattr(option, weight) // cell)
        shifted = _shift(torch.where(base_recomputed, recomputed, kept), cells, policy.cost(option), resolution,
                         index) if cells > 0 else (never, index)
        steps.append((block, after_kept, after_recomputed, from_recomputed, base_recomputed, shifted[1]))
        kept, recomputed = torch.where(from_recomputed, b, a), shifted[0]
    if not torch.isfinite(torch.minimum(kept, recomputed)[resolution]):
        return None
    choice, k, state = [0] * len(groups), resolution, bool(recomputed[resolution] < kept[resolution])
    for block, after_kept, after_recomputed, from_recomputed, base_recomputed, prev in reversed(steps):
        if state:
            choice[block] = len(groups[block].options) - 1
            k = int(prev[k])
            state = bool(base_recomputed[k])
        else:
            state = bool(from_recomputed[k])
            k = _backtrack(choice, after_recomputed if state else after_kept, k)
    _backtrack(choice, trail, k)
    return _exclusive(groups, choice, nest, policy)


def max_nested(groups: Sequence[Group], nest: Nest, weight: str = "freed_bytes",
               policy: Policy = BALANCED) -> Solution:
    """The choice under ``nest``'s exclusions that frees the most ``weight`` (ties: the cheaper)."""
    top = max_saving(groups, weight, policy).choice

    def plus(a: Tuple[float, float], members: Sequence[int], chosen: Sequence[int] = top) -> Tuple[float, float]:
        options = [groups[g].options[chosen[g]] for g in members]  # (bytes, -cost) of a + the members' options
        return a[0] + sum(getattr(o, weight) for o in options), a[1] - sum(policy.cost(o) for o in options)

    kept, recomputed, steps = (0.0, 0.0), (-float("inf"), 0.0), []
    for block, inner, border in nest.blocks:
        a, b = plus(kept, inner + border), plus(recomputed, inner)
        steps.append((block, inner, border, b > a, recomputed > kept))
        kept, recomputed = max(a, b), plus(max(kept, recomputed), [block], {block: -1})
    choice, state = list(top), recomputed > kept
    for block, inner, border, from_recomputed, base_recomputed in reversed(steps):
        choice[block] = len(groups[block].options) - 1 if state else 0
        for g in (inner + border if state else border if from_recomputed else ()):
            choice[g] = 0
        state = base_recomputed if state else from_recomputed
    return _exclusive(groups, choice, nest, policy)


def solve_nested_or_max(groups: Sequence[Group], nest: Nest, required: int, weight: str = "freed_bytes",
                        policy: Policy = BALANCED) -> Optional[Solution]:
    """``solve_nested`` at the default resolution, then 8x finer, then the maximum saving if it suffices."""
    best = max_nested(groups, nest, weight, policy)
    if required <= 0 or weighted(groups, best.choice, weight) < required:
        return _solution(groups, [0] * len(groups), policy) if required <= 0 else None
    for resolution in (DEFAULT_RESOLUTION, 8 * DEFAULT_RESOLUTION):
        found = solve_nested(groups, nest, required, resolution, weight, policy)
        if found is not None and weighted(groups, found.choice, weight) >= required:
            return found
    return best
