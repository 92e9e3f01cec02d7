"""A budget whose own planning the fidelity gate refuses is met by the default plan where that fits it
(memopt/builder/pipeline.py ``_default_within``): a user asking for a budget is not refused one that the plan made
without asking meets; where the default plan does not fit either, the budget's own refusal stands."""
import logging

import pytest

import memopt
import memopt.builder.pipeline as pipeline
from memopt.core.errors import BudgetError
from memopt.testing.zoo import build

pytestmark = pytest.mark.slow  # five builds of a small ResNet, two of them gated

MiB = 2 ** 20
CONFIG = memopt.Config(workspace_mb=0)  # no measured process growth: the budget is the plan's


@pytest.fixture(scope="module")
def preact():
    model, x = build("preact_resnet20")
    default = memopt.optimize(model, example_inputs=x, optimizer="sgd", config=CONFIG).plan
    assert default.estimated_peak_bytes < default.baseline_peak_bytes
    return model, x, default


def _refuse_budgets(monkeypatch):
    """The gate refuses every plan made for a budget (as it refuses a plan whose bits it cannot repair within one),
    and gates the default plan as it does."""
    real = pipeline._gate
    calls = []

    def gate(session, built):
        calls.append(session.request.budget_bytes)
        if session.request.budget_bytes is not None:
            raise BudgetError("refused by the test's gate", session.request.budget_bytes, 0)
        return real(session, built)
    monkeypatch.setattr(pipeline, "_gate", gate)
    return calls


def test_the_default_plan_meets_a_budget_the_gate_refused(monkeypatch, caplog, preact):
    model, x, default = preact
    budget = (default.estimated_peak_bytes + default.baseline_peak_bytes) // 2
    calls = _refuse_budgets(monkeypatch)
    with caplog.at_level(logging.INFO, logger="memopt"):
        om = memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd", config=CONFIG)
    assert calls == [budget, None]  # the budget's plan refused, then the default plan gated
    plan = om.plan
    assert plan.budget_bytes == budget and plan.estimated_peak_bytes <= budget
    assert plan.chosen_units() == default.chosen_units()
    assert plan.estimated_peak_bytes == default.estimated_peak_bytes and plan.fidelity["passed"]
    assert any(f"budget_mb={budget / MiB:.1f} is met by the default plan" in r.getMessage() for r in caplog.records)


def test_a_budget_the_default_plan_misses_keeps_its_own_refusal(monkeypatch, preact):
    model, x, default = preact
    budget = default.estimated_peak_bytes - MiB // 4
    calls = _refuse_budgets(monkeypatch)
    with pytest.raises(BudgetError, match="refused by the test's gate"):
        memopt.optimize(model, budget / MiB, example_inputs=x, optimizer="sgd", config=CONFIG)
    assert calls == [budget, None]
