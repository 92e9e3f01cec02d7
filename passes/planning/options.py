"""What the planner's solvers work on: a unit's options (numbers) and exclusive groups of them; no graph types.

``candidates`` (the graph adapter) fills them in from the cost model; ``knapsack`` (pure solvers) chooses among them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Option:
    """One way to run a unit. ``freed_bytes`` is relative to exact; ``fidelity`` is a gradient-error
    proxy (mean squared error per element, times elements); ``time`` is extra work counted one per element
    of each extra elementwise pass plus one per recomputed FLOP; ``flops``, the recomputed FLOPs inside
    ``time`` (recompute and reversible: one more forward of the block), lets the planner's policy weigh a
    FLOP against an element pass (``memopt.passes.planning.knapsack.FLOPS_PER_PASS``)."""

    technique: str
    bits: Optional[int]
    unit: str
    freed_bytes: int
    fidelity: float
    time: float
    # the part of freed_bytes that is alive at the baseline's forward/backward peak (what lowers it)
    peak_freed_bytes: int = 0
    flops: float = 0.0
    # a joint option of coupled units (``technique`` "joint"): the units' own options, taken together
    parts: Tuple["Option", ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready record (lists, not tuples: it survives a plan's save and load unchanged)."""
        return {**dataclasses.asdict(self), "parts": [p.to_dict() for p in self.parts]}

    @staticmethod
    def from_dict(entry: Dict[str, Any]) -> "Option":
        return Option(**{**entry, "parts": tuple(Option.from_dict(p) for p in entry.get("parts", ()))})

    def label(self) -> str:
        if self.parts:
            return " + ".join(f"{p.label()} {p.unit}" for p in self.parts)
        return "exact" if self.technique == "exact" else f"{self.technique}@{self.bits}"

    def decisions(self) -> List[Tuple[str, str, Optional[int]]]:
        """(technique, unit, bits) of every unit this option rewrites (none for exact)."""
        if self.parts:
            return [d for p in self.parts for d in p.decisions()]
        return [] if self.technique == "exact" else [(self.technique, self.unit, self.bits)]


@dataclass
class Group:
    """Units that exclude each other, with every option; ``options[0]`` is exact."""

    name: str
    units: Tuple[str, ...]
    nodes: Tuple[str, ...]
    options: List[Option]
    # (needing, needed) "technique:unit" keys: an option that rewrites the first rewrites the second too
    couplings: Tuple[Tuple[str, str], ...] = ()
