"""The fidelity gate under a budget: a plan whose crushed bits miss the gate is repaired, the bytes the repair
gives back are found again by exact recomputation, a budget the repairs cannot meet is met by the default plan where
that fits it, and one neither meets at the gate's cosine raises BudgetError with the least peak that can."""
import copy

import pytest
import torch
from torch import nn

import memopt


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, width=32, depth=6):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


ONE_BIT = memopt.FewBitConfig(plan_bits=(1,))  # the planner can only crush; the gate can only make exact
NO_STASH = None  # few-bit is the only lossy technique here (the generic stash would offer its own units)


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(256, 32)
    baseline = memopt.estimate(model, x, optimizer="sgd").peak_bytes
    with pytest.raises(memopt.BudgetError) as least:
        memopt.optimize(copy.deepcopy(model), 0.1, example_inputs=x, optimizer="sgd",
                        config=memopt.Config(stash=NO_STASH, fewbit=ONE_BIT, recompute=None, fidelity=None))
    return model, x, (baseline + least.value.minimum_bytes) / 2 / 2 ** 20


@pytest.fixture(scope="module")
def default_peak(case):
    """The estimated peak of the default plan (no budget) under the refusal tests' config, gated."""
    model, x, _ = case
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x, optimizer="sgd",
                         config=memopt.Config(stash=NO_STASH, fewbit=ONE_BIT, recompute=None))
    assert om.plan.fidelity["passed"]
    return om.plan.estimated_peak_bytes


def test_a_budget_plan_that_misses_the_gate_is_repaired_by_recomputation_within_the_budget(case):
    model, x, budget = case
    ungated = memopt.optimize(copy.deepcopy(model), budget, example_inputs=x, optimizer="sgd",
                              config=memopt.Config(stash=NO_STASH, fewbit=ONE_BIT, fidelity=None))
    assert {u["chosen"]["technique"] for u in ungated.plan.units} >= {"fewbit"}
    om = memopt.optimize(copy.deepcopy(model), budget, example_inputs=x, optimizer="sgd",
                         config=memopt.Config(stash=NO_STASH, fewbit=ONE_BIT))
    report = om.plan.fidelity
    assert report["passed"] and report["worst"]["cosine"] >= 0.99
    assert report["before"]["cosine"] < 0.99  # the planner's plan missed
    assert any(c.startswith("fewbit, every unit one level up") and "1 bits -> exact" in c for c in report["changes"])
    assert any(c.startswith("recompute blocks_") for c in report["changes"]), report["changes"]
    chosen = {u["chosen"]["technique"] for u in om.plan.units}
    assert "recompute" in chosen and "fewbit" not in chosen
    assert om.plan.estimated_peak_bytes <= budget * 2 ** 20
    assert memopt.measure(om, x, optimizer="sgd").peak_bytes == om.plan.estimated_peak_bytes


def test_a_budget_the_repairs_cannot_meet_is_met_by_the_default_plan_where_it_fits(case, default_peak, caplog):
    model, x, budget = case  # the budget planner crushes to 1 bit and cannot recompute; the default's bits pass
    assert default_peak <= budget * 2 ** 20
    with caplog.at_level("INFO", logger="memopt"):
        om = memopt.optimize(copy.deepcopy(model), budget, example_inputs=x, optimizer="sgd",
                             config=memopt.Config(stash=NO_STASH, fewbit=ONE_BIT, recompute=None))
    assert om.plan.fidelity["passed"] and om.plan.estimated_peak_bytes == default_peak
    assert om.plan.budget_bytes == int(budget * 2 ** 20)
    assert any("is met by the default plan" in r.getMessage() for r in caplog.records)
    assert memopt.measure(om, x, optimizer="sgd").peak_bytes == om.plan.estimated_peak_bytes


def test_a_budget_the_gate_cannot_meet_raises_with_the_least_peak_that_can(case, default_peak):
    model, x, budget = case
    budget = min(budget, (default_peak - 2 ** 10) / 2 ** 20)  # below the default plan's peak too
    with pytest.raises(memopt.BudgetError, match=r"cannot be met for Net with every parameter's gradient at cosine "
                                                 r">= 0.99 \(Config.fidelity\): the planner's plan reaches .* but its "
                                                 r"gradients miss \(worst blocks\.\d\.fc\d\.(weight|bias) at cosine "
                                                 r"0\.\d+\), and with the gate's repairs \(recomputation is off\) the "
                                                 r"least estimated peak is .*Raise the budget to at least [\d.]+ MiB, "
                                                 r"lower FidelityConfig.min_cosine, or accept the approximate "
                                                 r"gradients with Config\(fidelity=None\)") as error:
        memopt.optimize(copy.deepcopy(model), budget, example_inputs=x, optimizer="sgd",
                        config=memopt.Config(stash=NO_STASH, fewbit=ONE_BIT, recompute=None))
    assert error.value.minimum_bytes > budget * 2 ** 20
