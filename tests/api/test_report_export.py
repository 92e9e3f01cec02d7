"""Report, plan JSON, export directory and re-loading an export."""
import json

import networkx as nx
import pytest
import torch

import memopt
from memopt.core.units import fmt_bytes
from memopt.record.plan import Plan
from memopt.testing.zoo import build


@pytest.fixture
def om():
    model, inputs = build("tiny_resnet")
    return memopt.optimize(model, example_inputs=inputs, optimizer="sgd")


def test_report_has_every_column_totals_and_groups_repeated_blocks(om, capsys):
    text = om.report(print=True)
    assert capsys.readouterr().out.strip() == text.strip()
    for column in ("node", "op", "output shape", "dtype", "saved before", "technique", "bits", "saved after"):
        assert column in text
    for line in ("saved activations (distinct storages)", "peak part: optimizer state",
                 "estimated peak of one training step", "budget"):
        assert line in text
    assert "(x" in text  # the repeated basic blocks are merged into one row with a count
    ungrouped = om.report(group=False)
    assert len(ungrouped.splitlines()) > len(text.splitlines())
    assert str(om) == text


def test_report_top_n_keeps_the_largest_consumers(om):
    text = om.report(top=3, group=False)
    assert "showing the top 3 rows" in text
    largest = max(om.plan.nodes, key=lambda n: n.saved_bytes_before)
    assert largest.name in text


def test_plan_is_json_and_round_trips(om):
    plan = om.plan
    data = json.loads(plan.to_json())
    assert data["estimated_saved_bytes"] == plan.estimated_saved_bytes == om.estimate.saved_bytes
    assert isinstance(plan.estimated_peak_bytes, int) and plan.budget_bytes is None
    assert {n["name"] for n in data["nodes"]} == {n.name for n in om.graph_module.graph.nodes}
    assert Plan.from_dict(data) == plan


@pytest.mark.slow
def test_export_writes_readable_files_and_reloads_the_same_module(om, tmp_path):
    model, inputs = om.original_module, torch.randn(4, 3, 32, 32)
    om.export(tmp_path)
    for name in ("graph.py", "graph.dot", "graph.graphml", "plan.json", "report.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "def forward" in (tmp_path / "graph.py").read_text()
    dot = (tmp_path / "graph.dot").read_text()
    assert dot.startswith("digraph") and "fillcolor" in dot and "->" in dot
    g = nx.read_graphml(tmp_path / "graph.graphml")
    assert g.number_of_nodes() == len(om.graph_module.graph.nodes)
    assert "saved_bytes_before" in g.nodes["stem_0"]
    reloaded = memopt.load(model, tmp_path, example_inputs=inputs)
    assert reloaded.graph_module.code == om.graph_module.code
    assert reloaded.plan.nodes == om.plan.nodes


def test_reloading_an_export_of_another_model_is_refused(om, tmp_path):
    om.export(tmp_path)
    other, inputs = build("cnn")
    with pytest.raises(memopt.MemoptError, match="differs from|cannot be applied"):
        memopt.load(other, tmp_path, example_inputs=inputs)


def test_the_report_leads_with_the_step_peak_and_what_no_rewrite_removes():
    model, x = build("tiny_resnet")
    om = memopt.optimize(model, example_inputs=x, optimizer="adam")
    plan, headline = om.plan, om.report().splitlines()[1]
    fixed = sum(plan.estimated_breakdown[p] for p in ("parameters_and_buffers", "optimizer_state", "inputs",
                                                      "all_gradients"))
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert plan.estimated_breakdown["all_gradients"] == grads  # every gradient of the step, tied weights once
    assert fixed > 0 and plan.estimated_peak_bytes < plan.baseline_peak_bytes
    assert headline == (f"estimated peak of one training step {fmt_bytes(plan.baseline_peak_bytes)} -> "
                        f"{fmt_bytes(plan.estimated_peak_bytes)} "
                        f"({plan.baseline_peak_bytes / plan.estimated_peak_bytes:.2f}x), of which {fmt_bytes(fixed)} "
                        f"parameters, buffers, gradients, optimizer state and inputs no rewrite removes; saved activations "
                        f"{fmt_bytes(plan.baseline_saved_bytes)} -> {fmt_bytes(plan.estimated_saved_bytes)}")
