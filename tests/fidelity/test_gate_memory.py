"""What the fidelity gate keeps alive while it measures: optimize()'s own peak must not be a multiple of the
parameters' gradients above the training step's (issue 40: ResNet-50's optimize() peaked at 4.7x its step)."""
import gc

import torch
from torch import nn

import memopt
from memopt.fidelity import gate as fidelity


WIDTH, DEPTH = 96, 4  # no other tensor of the test has the (96, 96) shape of the layers' weights


def _mlp() -> nn.Module:
    """Linear layers with a GELU after each (few-bit GELU backward: a lossy plan the gate confirms on every loss)."""
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())], nn.Linear(WIDTH, 8))


def _weight_grads_alive() -> int:
    """Real tensors of the layers' weight shape alive now, parameters aside (gradients and their copies; the cost
    model's fake tensors hold no memory)."""
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == (WIDTH, WIDTH))


def test_the_gate_keeps_one_set_of_a_plans_gradients_beside_its_references(monkeypatch):
    """Every parameter_fidelity call of the gate sees the eager references of the first losses, the state
    ``preserved_state`` restores, and one set of the plan's gradients with, in a confirmation, the eager ones made
    beside them (``paired_grads``): not one set per loss on either side (each loss's are reduced to figures at once),
    and no float64 copy of the model kept between losses."""
    counts = []
    compare = fidelity.parameter_fidelity

    def counting(*args, **kwargs):
        counts.append(_weight_grads_alive())
        return compare(*args, **kwargs)

    monkeypatch.setattr(fidelity, "parameter_fidelity", counting)
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(16, WIDTH)
    om = memopt.optimize(model, example_inputs=x, config=memopt.Config(stash=None, reversible=None))
    report = om.plan.fidelity
    assert report["passed"] and report["projections"] == memopt.FidelityConfig().max_projections == 8
    # the first losses' references + the snapshot of the parameters + a pair (eager, plan) under one loss
    assert counts and max(counts) <= (fidelity.PROJECTIONS + 3) * DEPTH, counts
    assert min(counts) >= fidelity.PROJECTIONS * DEPTH  # the count sees the references


def test_references_stay_where_they_are_on_the_host():
    grads = [torch.ones(3), None]
    assert fidelity.on_host(grads)[0] is grads[0] and fidelity.on_host(grads)[1] is None
