"""The fidelity gate's repairs of a decision (``memopt/fidelity/gate.py``): raise a unit's bits or make it exact,
a technique's units all at once, coupled units together, and the last resort's fewest exact units. Pure
functions of decisions (``{technique: {unit: bits}}``) and numbers; measuring is the gate's."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from memopt.config import Config
from memopt.passes.base import Decision, planner_hooks

def _levels(config: Config, technique: str) -> Tuple[int, ...]:
    """The bit widths the gate may raise ``technique``'s units through, from its registered planner hooks (within
    the widths the planner may choose: ``plan_bits``, 8 included by default, since the error of 3-4-bit tables
    compounds with depth in SiLU / hard-swish CNNs where 8 bits, still a quarter of float32's bytes, do not); a
    technique without bit widths can only be made exact."""
    hooks, technique_config = planner_hooks(technique), getattr(config, technique, None)
    return hooks.bit_levels(technique_config) if hooks is not None and technique_config is not None else ()


def _raise(decision: Decision, config: Config, technique: str, unit: str,
           weights: Optional[Dict[Tuple[str, str], float]] = None) -> str:
    """Raise ``unit`` to its technique's next bit width, or drop it from the decision (exact); says which.
    ``weights`` (the fidelity proxies) follow: each extra bit quarters a code's squared error, exact is 0."""
    bits = decision[technique][unit]
    levels = [b for b in _levels(config, technique) if bits is not None and b > bits]
    if levels:
        decision[technique][unit] = levels[0]
        if weights is not None and (technique, unit) in weights:
            weights[(technique, unit)] /= 4.0 ** (levels[0] - bits)
        return f"{technique} {unit}: {bits} -> {levels[0]} bits"
    del decision[technique][unit]
    if weights is not None:
        weights.pop((technique, unit), None)
    return f"{technique} {unit}: {'' if bits is None else f'{bits} bits '}-> exact"


def _without(decision: Decision, keys: List[Tuple[str, str]]) -> Decision:
    trial = {t: dict(us) for t, us in decision.items()}
    for technique, unit in keys:
        del trial[technique][unit]
    return trial


def _fewest_exact(keys: List[Tuple[str, str]], decision: Decision, weights: Dict[Tuple[str, str], float],
                  passes: Any) -> List[Tuple[str, str]]:
    """Which of the lossy units ``keys`` to turn exact when the gate's rounds are spent: the largest fidelity
    proxies first, as few as pass. Where all of them exact does not pass, all of them (the caller goes on to the
    rest of the plan). Otherwise the shortest passing count is found by halving between none (the plan as it is,
    failing) and all (passing): about log2(len(keys)) trial plans, each a training step per projection, where
    turning every unit exact would throw away the savings of units that cost the gradients nothing (a failing
    SE bias early in EfficientNet-B2 took 223 units exact when few of them mattered). A count that passes is
    always what is kept; a shorter one between two failing ones may be missed, as halving assumes more exact
    units help."""
    ordered = sorted(keys, key=lambda k: (-weights.get(k, 0.0), k))
    if not passes(_without(decision, ordered)):
        return ordered
    return ordered[:shortest_passing(len(ordered), lambda k: passes(_without(decision, ordered[:k])))]


def shortest_passing(count: int, passes: Callable[[int], bool]) -> int:
    """The least ``k`` in 1..``count`` for which ``passes(k)``, by halving between 0 (known to fail) and ``count``
    (known to pass): about log2(count) calls. The ``k`` returned always passed; a shorter passing one between two
    failing ones may be missed, as halving assumes that a larger ``k`` does not fail where a smaller passes."""
    low, high = 0, count
    while high - low > 1:
        middle = (low + high) // 2
        if passes(middle):
            high = middle
        else:
            low = middle
    return high


def coupled(decision: Decision, couplings: List[Tuple[str, str]],
            weights: Optional[Dict[Tuple[str, str], float]] = None) -> List[str]:
    """Make exact, in place, every unit of ``decision`` whose needed unit (``couplings``: (needing, needed)
    "technique:unit" keys, ``Plan.units``' "couplings") is not rewritten: coupled units move together, so a repair
    that turns one exact cannot leave the other breaking its gradients. Says what it changed."""
    notes, changed = [], True
    while changed:
        changed = False
        for needing, needed in couplings:
            (technique, _, unit), (other, _, partner) = needing.partition(":"), needed.partition(":")
            if unit in decision.get(technique, {}) and partner not in decision.get(other, {}):
                del decision[technique][unit]
                if weights is not None:
                    weights.pop((technique, unit), None)
                notes.append(f"{technique} {unit} -> exact (coupled: it needs {other} {partner}, now exact)")
                changed = True
    return notes


def _key(decision: Decision) -> tuple:
    return tuple(sorted((t, tuple(sorted(us.items(), key=lambda kv: kv[0]))) for t, us in decision.items()))


def _raise_all(decision: Decision, config: Config, technique: str, lossy: Set[Tuple[str, str]],
               weights: Dict[Tuple[str, str], float],
               to_exact: bool = True) -> Tuple[Decision, str, Dict[Tuple[str, str], float]]:
    """A copy of ``decision`` with every lossy unit of ``technique`` one level up (or exact past the top; with
    ``to_exact`` False, units at the top stay), what changed ("5 units 3 -> 4 bits, 2 units 8 bits -> exact"; ""
    for nothing) and the fidelity proxies that follow; exact units (1-bit masks) stay."""
    raised, followed = {t: dict(us) for t, us in decision.items()}, dict(weights)
    moves: Dict[str, int] = {}
    top = max(_levels(config, technique), default=None)
    for unit in [u for u in raised.get(technique, {}) if (technique, u) in lossy]:
        bits = raised[technique][unit]
        if not to_exact and (top is None or bits is None or bits >= top):
            continue
        move = _raise(raised, config, technique, unit, followed).partition(": ")[2]
        moves[move] = moves.get(move, 0) + 1
    return raised, ", ".join(f"{n} unit{'s' * (n > 1)} {move}" for move, n in sorted(moves.items())), followed


def freed_table(units: List[Dict[str, Any]]) -> Dict[Tuple[str, str, Optional[int]], int]:
    """The planner's freed bytes of every (technique, unit, bits) among ``units``' options (``Plan.units``:
    chosen and alternatives, joint options by their parts)."""
    table: Dict[Tuple[str, str, Optional[int]], int] = {}

    def add(option: Dict[str, Any]) -> None:
        for part in option.get("parts") or []:
            add(part)
        if not option.get("parts") and option.get("technique") not in (None, "exact"):
            table[(option["technique"], option["unit"], option.get("bits"))] = int(option.get("freed_bytes") or 0)

    for unit in units:
        for option in [unit["chosen"], *unit.get("alternatives", [])]:
            add(option)
    return table


def freed_by(decision: Decision, table: Dict[Tuple[str, str, Optional[int]], int]) -> Optional[int]:
    """The bytes ``decision`` frees by the planner's options (``freed_table``), None where one of its units at its
    bits is not among them: two repaired decisions of one plan are compared by this, not measured."""
    total = 0
    for technique, units in decision.items():
        for unit, bits in units.items():
            if (technique, unit, bits) not in table:
                return None
            total += table[(technique, unit, bits)]
    return total
