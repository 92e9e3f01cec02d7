"""The registry is complete: a technique defined only here -- its config, op, pass and PlannerHooks -- goes
through ``memopt.optimize(budget_mb=...)``, the planner and the fidelity gate with no table elsewhere naming it."""
import dataclasses
from typing import NamedTuple, Optional, Tuple

import pytest
import torch
from torch import fx, nn

import memopt
from memopt.core.meta import DECISION_KEY
from memopt.passes.base import _HANDLERS, PassContext, PassResult, PlannerHooks, node_numel, register_pass


@dataclasses.dataclass(frozen=True)
class HalfTanhConfig:
    """Keep a tanh's output for backward in bfloat16 (lossy: half the bytes)."""

    plan_bits: Tuple[int, ...] = (16,)
    harsh: bool = False  # keep only the output's sign: a gradient the fidelity gate must refuse


class HalfTanhSpec(NamedTuple):
    node: str
    harsh: bool


class _HalfTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec):
        y = torch.tanh(x)
        ctx.save_for_backward((y.sign() if spec.harsh else y).to(torch.bfloat16))
        return y

    @staticmethod
    def backward(ctx, grad):
        (half,) = ctx.saved_tensors
        y = half.float()
        return grad * (1 - y * y), None


def half_tanh(x, spec: HalfTanhSpec):
    """Not registered with ``memopt.core.leaf.graph_leaf``: that registry is global, and the test would leave its
    op in it (tests/packaging/test_op_specs.py checks every registered op); the graph here is never re-traced."""
    return _HalfTanh.apply(x, spec)


def halftanh_pass(gm: fx.GraphModule, cfg: HalfTanhConfig, ctx: PassContext) -> PassResult:
    modules = dict(gm.named_modules())
    modified = False
    for node in list(gm.graph.nodes):
        if not (node.op == "call_module" and isinstance(modules.get(node.target), nn.Tanh)):
            continue
        if not ctx.selects("halftanh", node.name, None):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.create_node("call_function", half_tanh, (node.args[0], HalfTanhSpec(node.name, cfg.harsh)),
                                       name=f"{node.name}_half")
        new.meta[DECISION_KEY] = {"technique": "halftanh", "bits": 16, "replaces": node.name, "unit": node.name}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        modified = True
    return PassResult(gm, modified)


HOOKS = PlannerHooks(fidelity=lambda node, baseline, unit: 1e-4 * node_numel(baseline, unit), extra_passes=1.0)


@pytest.fixture
def toy_config(monkeypatch):
    """A Config with one more technique field, and the toy's pass registered (both undone after the test)."""
    monkeypatch.delitem(_HANDLERS, HalfTanhConfig, raising=False)
    register_pass(HalfTanhConfig, name="halftanh", planner=HOOKS)(halftanh_pass)
    yield dataclasses.make_dataclass(
        "ToyConfig", [("halftanh", Optional[HalfTanhConfig], dataclasses.field(default=HalfTanhConfig()))],
        bases=(memopt.Config,), frozen=True)
    _HANDLERS.pop(HalfTanhConfig, None)


class Half(nn.Module):
    def forward(self, x):
        return x * 0.5  # keeps nothing for backward: the tanh's output is kept by the tanh alone


class TanhMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(64, 64), nn.Tanh(), Half())])
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.layers(x))


def test_a_technique_defined_only_in_a_test_goes_through_the_budget_planner_and_the_gate(toy_config):
    torch.manual_seed(0)
    model, x = TanhMLP(), torch.randn(256, 64)
    config = toy_config(reversible=None, recompute=None, stash=None, fewbit=None)
    baseline = memopt.optimize(model, example_inputs=x, config=memopt.Config.exact()).plan.baseline_peak_bytes
    om = memopt.optimize(model, budget_mb=(baseline - 96 * 1024) / 2**20, example_inputs=x, config=config)
    chosen = om.plan.chosen_units()
    assert set(chosen) == {"halftanh"} and chosen["halftanh"], chosen
    assert all(bits == 16 for bits in chosen["halftanh"].values())
    assert om.plan.fidelity["passed"] and om.plan.fidelity["parameters"]
    assert om.plan.estimated_peak_bytes <= baseline - 96 * 1024
    real = memopt.measure(om, x)
    assert real.saved_bytes == om.plan.estimated_saved_bytes < om.plan.baseline_saved_bytes
    torch.manual_seed(1)
    assert torch.equal(om(x), model(x))  # the forward is exact; only what backward reads is halved


def test_the_gate_repairs_a_technique_defined_only_in_a_test_from_its_hooks(toy_config):
    """A lossy unit of the toy whose gradients miss the bar is made exact by the gate (its levels, from its
    PlannerHooks, have nothing above 16 bits): no table of the gate's names the toy."""
    torch.manual_seed(0)
    model, x = TanhMLP(), torch.randn(256, 64)
    om = memopt.optimize(model, example_inputs=x, config=toy_config(
        reversible=None, recompute=None, stash=None, fewbit=None, halftanh=HalfTanhConfig(harsh=True)))
    gate = om.plan.fidelity
    assert gate["passed"], gate["below"]
    assert any("halftanh" in change for change in gate["changes"]), gate["changes"]
    assert len(om.plan.chosen_units().get("halftanh", {})) < 12  # some made exact
