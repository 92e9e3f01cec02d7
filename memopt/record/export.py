"""``om.export(dir)``: the rewritten graph as Python, DOT and GraphML, plus plan.json and report.md."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict

import networkx as nx
from torch import fx

from memopt.record.plan import NodePlan
from memopt.record.report import render
from memopt.core.units import fmt_bytes

if TYPE_CHECKING:
    from memopt.builder.optimized import OptimizedModule

GRAPH_HEADER = "# memopt: rewritten training graph of {model} (captured by {capture})\n"

# fill colours: exact nodes by saved bytes (white -> red), rewritten nodes by technique
_TECHNIQUE_COLOURS = {"fewbit": "#8fd18f", "stash": "#8fb8e8", "reversible": "#d2a8e8", "recompute": "#f0d080"}


def graph_code(gm: fx.GraphModule) -> str:
    return gm.code.strip() + "\n"


def to_networkx(gm: fx.GraphModule, nodes: Dict[str, NodePlan]) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        plan = nodes.get(node.name)
        attrs = {"op": node.op, "target": str(node.target)}
        if plan is not None:
            attrs.update(kind=plan.op, shape=plan.shape, dtype=plan.dtype, technique=plan.technique,
                         bits=-1 if plan.bits is None else plan.bits, flops=plan.flops,
                         saved_bytes_before=plan.saved_bytes_before, saved_bytes_after=plan.saved_bytes_after)
        g.add_node(node.name, **attrs)
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    return g


def _colour(plan: NodePlan | None, largest: int) -> str:
    if plan is None:
        return "#ffffff"
    if plan.technique in _TECHNIQUE_COLOURS:
        return _TECHNIQUE_COLOURS[plan.technique]
    share = plan.saved_bytes_after / largest if largest else 0.0
    level = int(255 - 155 * share)  # white for nothing saved, deep red for the largest consumer
    return f"#ff{level:02x}{level:02x}"


def to_dot(gm: fx.GraphModule, nodes: Dict[str, NodePlan], title: str) -> str:
    largest = max((n.saved_bytes_after for n in nodes.values()), default=0)
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [shape=box, style=filled, fontname="monospace"];']
    for node in gm.graph.nodes:
        plan = nodes.get(node.name)
        label = node.name
        if plan is not None:
            label += f"\\n{plan.op} {plan.shape}\\nkeeps {fmt_bytes(plan.saved_bytes_after)}"
            if plan.technique != "exact":
                label += f"\\n{plan.technique}" + (f" {plan.bits}-bit" if plan.bits else "")
        lines.append(f'  "{node.name}" [label="{label}", fillcolor="{_colour(plan, largest)}"];')
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            lines.append(f'  "{inp.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def export_directory(om: "OptimizedModule", directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    gm, plan = om.graph_module, om.plan
    nodes = {n.name: n for n in plan.nodes}
    (directory / "graph.py").write_text(GRAPH_HEADER.format(model=plan.model, capture=plan.capture) + graph_code(gm))
    (directory / "graph.dot").write_text(to_dot(gm, nodes, plan.model))
    nx.write_graphml(to_networkx(gm, nodes), directory / "graph.graphml")
    plan.save(directory / "plan.json")
    (directory / "report.md").write_text(f"# memopt report: {plan.model}\n\n" + render(plan, fmt="github") + "\n")
    return directory


def export_partial(om, directory):
    """``om.export`` for a model captured per submodule: plan.json, report.md, and graph.py / graph.dot
    per captured submodule (``graph_<path>.py``)."""
    plan = om.plan
    directory.mkdir(parents=True, exist_ok=True)
    for unit in om._last().units:
        prefix = unit.path + "/"
        nodes = {n.name[len(prefix):]: n for n in plan.nodes if n.name.startswith(prefix)}
        stem = "graph_" + unit.path.replace(".", "_")
        title = f"{plan.model}.{unit.path}"
        (directory / f"{stem}.py").write_text(GRAPH_HEADER.format(model=title, capture=unit.built.plan.capture)
                                             + graph_code(unit.built.graph_module))
        (directory / f"{stem}.dot").write_text(to_dot(unit.built.graph_module, nodes, title))
    plan.save(directory / "plan.json")
    (directory / "report.md").write_text(f"# memopt report: {plan.model}\n\n" + render(plan, fmt="github") + "\n")
    return directory
