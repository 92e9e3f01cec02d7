"""Per-node memory report (tabulate): node, op, shape, dtype, saved before/after, technique, bits."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from tabulate import tabulate

from memopt.core.units import fmt_bytes
from memopt.cost_model.analysis import FLOOR_PARTS
from memopt.record.plan import NodePlan, PartialPlan, Plan, option_label

def _group_key(n: NodePlan) -> Tuple:
    # repeated blocks differ only in the numbers of their names (layer1_0_conv1, layer1_1_conv1)
    return (re.sub(r"\d+", "#", n.name), n.op, n.shape, n.dtype, n.technique, n.bits,
            n.saved_bytes_before, n.saved_bytes_after)


def _rows(nodes: List[NodePlan], group: bool) -> List[Tuple[NodePlan, int]]:
    if not group:
        return [(n, 1) for n in nodes]
    groups: Dict[Tuple, List] = {}
    for n in nodes:
        groups.setdefault(_group_key(n), [n, 0])[1] += 1
    return [(first, count) for first, count in groups.values()]


def render(plan: Plan, *, top: Optional[int] = None, group: bool = True, fmt: str = "simple") -> str:
    """The report as text. ``top`` keeps the N largest consumers; ``group`` merges repeated blocks."""
    nodes = [n for n in plan.nodes if n.saved_bytes_before or n.saved_bytes_after or n.technique != "exact"]
    rows = _rows(nodes, group)
    if top is not None:
        rows = sorted(rows, key=lambda r: -r[0].saved_bytes_before * r[1])[:top]
    table = [[n.name if count == 1 else f"{n.name} (x{count}: {re.sub(r'[0-9]+', '#', n.name)})",
              n.op, n.shape, n.dtype, fmt_bytes(n.saved_bytes_before), n.technique,
              n.bits if n.bits is not None else "-", fmt_bytes(n.saved_bytes_after), _short(n.reason)]
             for n, count in rows]
    headers = ["node", "op", "output shape", "dtype", "saved before", "technique", "bits", "saved after", "why"]
    lines = [f"memopt report: {plan.model} (captured by {plan.capture}, planned for {plan.device})",
             headline(plan), tabulate(table, headers=headers, tablefmt=fmt)]
    if top is not None and len(nodes) > len(table):
        lines.append(f"(showing the top {len(table)} rows of {len(_rows(nodes, group))})")
    lines.append("")
    if plan.planner:
        lines += [_planner_table(plan, top, fmt), ""]
    if getattr(plan, "fidelity", None):
        lines += _fidelity_lines(plan.fidelity) + [""]
    if getattr(plan, "submodules", None):  # a model captured per submodule (memopt/builder/per_submodule.py)
        lines += ["captured per submodule: the whole model could not be captured; its other code runs exact",
                  tabulate(submodule_table(plan), headers=["submodule", "class", "captured by", "calls",
                                                           "saved before", "saved after", "why"], tablefmt=fmt),
                  f"totals {plan.totals}", ""]
    lines.append(_totals(plan, fmt))
    return "\n".join(lines)


def _option(o: Dict, unit: bool = False) -> str:
    return f"{option_label(o, unit)} {fmt_bytes(o['freed_bytes'])}/{o['fidelity']:.3g}"


def _planner_table(plan: Plan, top: Optional[int], fmt: str) -> str:
    """Per unit: the choice and the alternatives considered (bytes freed / fidelity cost)."""
    units = sorted(plan.units, key=lambda u: -u["chosen"]["freed_bytes"])
    shown = units if top is None else units[:top]
    table = [[u["name"], _option(u["chosen"], "+" in u["name"]),
              "; ".join(_option(o, "+" in u["name"]) for o in u["alternatives"] if o != u["chosen"])] for u in shown]
    p = plan.planner
    head = (f"planner: budget {fmt_bytes(plan.budget_bytes)}, estimated peak {fmt_bytes(plan.estimated_peak_bytes)} "
            f"({plan.estimated_peak_bytes / plan.budget_bytes:.0%} of it); freed {fmt_bytes(p['estimated_freed_bytes'])} "
            f"of saved activations (asked {fmt_bytes(p['required_bytes'])}), fidelity cost {p['cost']:.4g}, "
            f"{p['groups']} units, {p['rounds']} estimates, {p['seconds']:.1f} s")
    more = f"\n(showing {len(shown)} of {len(units)} units)" if len(shown) < len(units) else ""
    return head + "\n" + tabulate(table, headers=["unit", "chosen (freed/fidelity)", "alternatives (freed/fidelity)"],
                                   tablefmt=fmt) + more


def _short(reason: str, limit: int = 90) -> str:
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _fidelity_lines(gate: Dict[str, Any]) -> List[str]:
    """The fidelity gate's verdict, what it changed and why, and the parameters it listed apart."""
    worst = gate.get("worst") or {}
    verdict = "passed" if gate["passed"] else f"FAILED ({len(gate['below'])} parameters below)"
    projections = gate.get("projections", 1)
    losses = ("random projections of the outputs, their own direction and loss_fn" if gate.get("user_loss") else
              "random projections of the outputs and their own direction")
    lines = [f"fidelity gate ({gate['slice']}, {gate.get('steps', '?')} training steps, {projections} "
             f"loss{'es' * (projections > 1)}: {losses}): {verdict}; every parameter's gradient cosine against exact "
             f"autograd >= {gate['min_cosine']} under each is the bar; worst "
             f"{worst.get('parameter')} at {worst.get('cosine')}"]
    lines += [f"  changed: {change}" for change in gate["changes"]]
    lines += [f"  below the bar: {entry}" for entry in gate["below"][:10]]
    lines += [f"  listed apart: {p}: {why}"
              for p, why in gate.get("invariant", {}).items()]
    if gate.get("tiny"):
        lines.append(f"  listed apart, exact gradient below the tiny share of the median norm: "
                     f"{', '.join(gate['tiny'][:10])}{' ...' if len(gate['tiny']) > 10 else ''}")
    return lines


def headline(plan: Plan) -> str:
    """The step's estimated peak first (what decides whether a batch fits), what of it no activation rewrite can
    remove, then the saved bytes (what the rewrites shrink)."""
    e = plan.estimated_breakdown
    fixed = sum(e.get(p) or 0 for p in FLOOR_PARTS)  # a plan saved before all_gradients: 0
    ratio = plan.baseline_peak_bytes / plan.estimated_peak_bytes if plan.estimated_peak_bytes else float("inf")
    held = getattr(plan, "process_held_bytes", 0)  # a partial plan has none
    process = (f"; with what optimize() left held in this process ({fmt_bytes(held)}: buffer pools and caches of "
               f"its checks, measured), the process's resident peak is about "
               f"{fmt_bytes(plan.estimated_peak_bytes + held)}"
               if held else "")
    return (f"estimated peak of one training step {fmt_bytes(plan.baseline_peak_bytes)} -> "
            f"{fmt_bytes(plan.estimated_peak_bytes)} ({ratio:.2f}x), of which {fmt_bytes(fixed)} parameters, "
            f"buffers, gradients, optimizer state and inputs no rewrite removes; saved activations "
            f"{fmt_bytes(plan.baseline_saved_bytes)} -> {fmt_bytes(plan.estimated_saved_bytes)}{process}")


def _totals(plan: Plan, fmt: str) -> str:
    b, e = plan.baseline_breakdown, plan.estimated_breakdown
    parts = ["parameters_and_buffers", "optimizer_state", "inputs", "gradients", "activations",
             "transient"]
    table = [["saved activations (distinct storages)", fmt_bytes(plan.baseline_saved_bytes),
              fmt_bytes(plan.estimated_saved_bytes)]]
    table += [[f"  peak part: {p.replace('_', ' ')}", fmt_bytes(b.get(p)), fmt_bytes(e.get(p))] for p in parts]
    table += [["activations at forward/backward boundary", fmt_bytes(b.get("activations_at_boundary")),
               fmt_bytes(e.get("activations_at_boundary"))],
              ["estimated peak of one training step", fmt_bytes(plan.baseline_peak_bytes),
               fmt_bytes(plan.estimated_peak_bytes)],
              ["budget", "", fmt_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none"]]
    if plan.weight_grad_chunks > 1:  # the cost model found the peak inside a weight gradient from codes
        table.append(["weight gradients from codes in batch chunks", "", str(plan.weight_grad_chunks)])
    if plan.recompute_chunks > 1:  # ... inside a recomputed block's backward
        table.append(["recomputed blocks' backward in batch chunks", "", str(plan.recompute_chunks)])
    note = ("Per-node 'saved' counts every storage the node keeps; a storage kept by two nodes (a ReLU "
            "output that is also the next conv's input) shows in both rows and once in the totals.")
    return tabulate(table, headers=["total", "baseline", "optimized"], tablefmt=fmt) + "\n" + note


def submodule_table(plan: PartialPlan) -> List[List[Any]]:
    """Rows for the report: path, class, captured by / not captured, calls, saved before/after, why."""
    return [[r["path"] or "(whole model)", r["class"], r["method"] if r["captured"] else "not captured", r["calls"],
             fmt_bytes(r["saved_bytes_before"]), fmt_bytes(r["saved_bytes_after"]), r["why"]]
            for r in plan.submodules]
