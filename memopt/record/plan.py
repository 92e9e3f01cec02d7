"""``om.plan``: a JSON-serialisable record of every decision, with baseline and estimated bytes."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from memopt.cost_model.analysis import Estimate, NodeCost

# Passes write {"technique", "bits", "replaces", "reason"} into node.meta[DECISION_KEY]: on the
# nodes they create ("replaces": the baseline node name or names), and on the nodes they leave
# exact (with the reason).


# the layout of plan.json; 1: files written before the field existed (same layout)
PLAN_SCHEMA_VERSION = 2


@dataclass
class NodePlan:
    """The decision for one graph node."""

    name: str
    op: str
    target: str
    shape: str
    dtype: str
    flops: int
    saved_bytes_before: int
    technique: str = "exact"
    bits: Optional[int] = None
    saved_bytes_after: int = 0
    reason: str = ""


@dataclass
class Plan:
    """Every decision memopt made for one input signature. Bytes are ints.

    ``schema_version`` says which layout a saved plan.json has: files without one are version 1 (written
    before it existed, same layout) and load as they are; a newer version than this memopt knows is refused.
    """

    model: str
    capture: str
    device: str
    input_signature: List[str]
    torch_version: str
    config: Dict[str, Any]
    budget_bytes: Optional[int]
    baseline_saved_bytes: int
    estimated_saved_bytes: int
    baseline_peak_bytes: int
    estimated_peak_bytes: int
    baseline_breakdown: Dict[str, int]
    estimated_breakdown: Dict[str, int]
    passes: List[Dict[str, Any]] = field(default_factory=list)
    nodes: List[NodePlan] = field(default_factory=list)
    # One entry per rewritable unit (a stash chain, a few-bit activation): {"name", "nodes",
    # "chosen": option, "alternatives": [options]}, an option being {"technique", "bits", "unit",
    # "freed_bytes", "fidelity", "time"}. Editing "chosen" and re-applying the plan
    # (memopt.optimize(model, plan=...)) runs exactly those choices, without planning.
    units: List[Dict[str, Any]] = field(default_factory=list)
    # How the budget planner got here (empty without a budget to plan for).
    planner: Dict[str, Any] = field(default_factory=dict)
    # The capture check (memopt/capture/soundness.py): {"checked", "slice", "eager_saved_bytes", "captured_saved_bytes"}
    soundness: Dict[str, Any] = field(default_factory=dict)
    # The fidelity gate (memopt/fidelity/gate.py): per-parameter cosines, what it changed, on which slice
    fidelity: Dict[str, Any] = field(default_factory=dict)
    # What building this plan did (memopt/core/counters.py): {"traces", "cost_model_runs", "pass_runs", "real_steps",
    # "graph_copies", "seconds"}; what the build-cost benchmark reads. Not part of the decision: a re-applied plan
    # records its own build.
    build: Dict[str, Any] = field(default_factory=dict)
    # Batch chunks of the weight gradients read from rebuilt inputs (memopt.passes.stash_chunks; 1: one piece),
    # chosen where the cost model said they lower the peak; re-applied with the plan
    weight_grad_chunks: int = 1
    # Batch chunks of the recomputed blocks' backward (memopt.passes.recompute_chunks; 1: the whole batch at once),
    # set on the blocks whose samples do not mix where the cost model said they lower the peak; re-applied with the
    # plan
    recompute_chunks: int = 1
    # A CPU build's: the anonymous resident memory the build left held in its process (memopt.core.heap.
    # ResidentGrowth), which a budget's plan is fitted beside (unless Config.workspace_mb is set); 0: not measured
    process_held_bytes: int = 0
    schema_version: int = PLAN_SCHEMA_VERSION

    def chosen_units(self) -> Dict[str, Dict[str, int]]:
        """{technique: {unit: bits}} of every rewritten unit."""
        out: Dict[str, Dict[str, int]] = {}
        for entry in self.units:
            for technique, unit, bits in option_decisions(entry["chosen"]):
                out.setdefault(technique, {})[unit] = bits
        return out

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "the plan") -> "Plan":
        if not isinstance(data, dict):
            raise ValueError(f"{source} must hold a JSON object (a memopt plan), got {type(data).__name__}")
        data = dict(data)
        version = data.setdefault("schema_version", 1)
        if not isinstance(version, int) or not 1 <= version <= PLAN_SCHEMA_VERSION:
            raise ValueError(f"{source} has schema_version {version!r}; this memopt reads versions 1 to "
                             f"{PLAN_SCHEMA_VERSION}: re-plan with this memopt, or upgrade memopt")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - names), sorted(n for n in _REQUIRED if n not in data)
        if unknown or missing:
            raise ValueError(f"{source} is not a memopt plan of schema {version}: "
                             + (f"unknown keys {unknown}" if unknown else "")
                             + ("; " if unknown and missing else "") + (f"missing keys {missing}" if missing else ""))
        data["nodes"] = [NodePlan(**n) for n in data.get("nodes", [])]
        return cls(**data)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Plan":
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a plan "
                             f"file is what Plan.save / om.plan.save wrote") from None
        return cls.from_dict(data, source=str(path))


def node_plans(baseline: Estimate, after: Estimate, decisions: Dict[str, Dict[str, Any]]) -> List[NodePlan]:
    """One record per node of the rewritten graph, with the baseline bytes of the node it replaced."""
    plans = []
    for name, cost in after.nodes.items():
        decision = decisions.get(name, {})
        replaces = decision.get("replaces", name)
        replaces = [replaces] if isinstance(replaces, str) else replaces
        before = sum(baseline.nodes[r].saved_bytes for r in replaces if r in baseline.nodes)
        plans.append(NodePlan(
            name=name, op=cost.op, target=cost.target,
            shape=" ".join("x".join(map(str, s)) for s in cost.shapes) or "-",
            dtype=",".join(sorted(set(cost.dtypes))) or "-", flops=cost.flops,
            saved_bytes_before=before,
            technique=decision.get("technique", "exact"), bits=decision.get("bits"),
            saved_bytes_after=cost.saved_bytes,
            reason=decision.get("reason", _default_reason(cost)),
        ))
    return plans


def _default_reason(cost: NodeCost) -> str:
    if cost.saved_bytes == 0:
        return ""
    return "no enabled technique rewrites this op"


@dataclass
class PartialPlan(Plan):
    """A ``Plan`` for a model captured per submodule. Node and unit names carry the submodule path
    (``blocks.0/conv1``); ``submodules`` says which parts were captured, which not and why."""

    # {"path", "class", "captured": bool, "method", "calls", "saved_bytes_before", "saved_bytes_after", "why"}
    submodules: List[Dict[str, Any]] = field(default_factory=list)
    totals: str = ""  # where the whole-model totals come from


_REQUIRED = [f.name for f in dataclasses.fields(Plan) if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]


def option_decisions(option: Dict[str, Any]) -> List[Tuple[str, str, Optional[int]]]:
    """(technique, unit, bits) of every unit a ``Plan.units`` option rewrites: none for exact, each part of a joint
    option of coupled units (technique "joint")."""
    if option.get("parts"):
        return [d for part in option["parts"] for d in option_decisions(part)]
    return [] if option["technique"] == "exact" else [(option["technique"], option["unit"], option["bits"])]


def option_label(option: Dict[str, Any], unit: bool = False) -> str:
    """"stash@4" ("stash@4 bn1" with ``unit``, as in a group of several units), "exact", or a joint option's parts:
    "stash@4 bn1 + stash@8 bn2"."""
    if option.get("parts"):
        return " + ".join(option_label(p, unit=True) for p in option["parts"])
    if option["technique"] == "exact":
        return "exact"
    return f"{option['technique']}@{option['bits']}" + (f" {option['unit']}" if unit else "")
