"""Bad input gets a clear error that names the argument and the value, never a crash inside torch."""
import math

import pytest
import torch
from torch import nn

import memopt
from memopt.testing.zoo import build


def test_not_a_module():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got function"):
        memopt.optimize(lambda x: x)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        memopt.measure("resnet", torch.randn(1))


def test_already_optimized():
    model, inputs = build("mlp")
    om = memopt.optimize(model, example_inputs=inputs)
    with pytest.raises(TypeError, match="already a memopt.OptimizedModule"):
        memopt.optimize(om)


def test_wrong_arity_names_the_signature():
    model, inputs = build("mlp")
    with pytest.raises(TypeError, match=r"do not match MLP.forward\(x\).*too many positional"):
        memopt.optimize(model, example_inputs=(inputs, inputs))
    with pytest.raises(TypeError, match=r"do not match MultiIO.forward"):
        memopt.optimize(build("multi_io")[0], example_inputs=torch.randn(4, 16))  # y missing
    with pytest.raises(TypeError, match="example_inputs must be a tensor, a tuple/list"):
        memopt.optimize(model, example_inputs=3.0)


def test_inputs_on_the_wrong_device():
    # Inputs on "meta" are allowed (shapes only); any other device than the parameters' is not.
    # Without a GPU, a model on "meta" and a CPU input stand in for a CUDA/CPU mix-up.
    with pytest.raises(ValueError, match=r"example input \[0\]\[0\] is on cpu but Linear's parameters are "
                                         r"on \['meta'\]; move the inputs or the model"):
        memopt.optimize(nn.Linear(2, 2, device="meta"), example_inputs=torch.randn(1, 2))


@pytest.mark.parametrize("budget, error, text", [
    (0, ValueError, "positive finite number"), (-5, ValueError, "got -5"),
    (math.nan, ValueError, "got nan"), (math.inf, ValueError, "got inf"),
    ("4000", TypeError, "got str: '4000'"), (True, TypeError, "got bool"),
])
def test_bad_budgets(budget, error, text):
    model, _ = build("mlp")
    with pytest.raises(error, match="budget_mb") as info:
        memopt.optimize(model, budget)
    assert text in str(info.value)


def test_budget_below_what_the_config_can_reach():
    model, inputs = build("tiny_resnet")
    with pytest.raises(memopt.BudgetError) as info:
        memopt.optimize(model, 0.5, example_inputs=inputs)
    message = str(info.value)
    assert "budget_mb=0.5" in message and "smallest estimated peak" in message
    assert "Largest remaining consumers" in message
    assert len([line for line in message.splitlines() if line.startswith("  ")]) == 5
    assert isinstance(info.value, memopt.MemoptError)


def test_a_budget_above_the_baseline_changes_nothing():
    model, inputs = build("tiny_resnet")
    om = memopt.optimize(model, 10_000, example_inputs=inputs)
    assert om.plan.budget_bytes == 10_000 * 2**20
    assert om.plan.estimated_peak_bytes == om.plan.baseline_peak_bytes


def test_bad_config_and_optimizer():
    with pytest.raises(ValueError, match=r"Config.device='tpu' is not supported"):
        memopt.Config(device="tpu")
    with pytest.raises(TypeError, match="config must be a memopt.Config or None, got dict"):
        memopt.optimize(nn.Linear(2, 2), config={"device": "cpu"})
    with pytest.raises(ValueError, match=r"optimizer='lion' is not known"):
        memopt.optimize(nn.Linear(2, 2), optimizer="lion")
    with pytest.raises(ValueError, match=r"unknown Config fields \['nope'\]"):
        memopt.Config.from_dict({"nope": 1})


def test_loss_without_grad_is_explained():
    class NoGrad(nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(ValueError, match=r"nothing to train; memopt.optimize plans a step on the sum of the floating "
                                         r"outputs: return the logits or the loss from forward \(memopt.estimate and "
                                         r"memopt.measure also take loss_fn=\.\.\. returning a scalar\)"):
        memopt.estimate(NoGrad(), torch.randn(2))
