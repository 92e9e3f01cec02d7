"""Parameters float32 itself does not resolve are listed apart by measurement (memopt/fidelity/conditioning.py): the
eager step in float64 against float32's; never under a bar of 1 or autocast, never a change to the user's model."""
import copy

import torch
from torch import nn

import memopt
from memopt.fidelity.conditioning import float64_noise
from memopt.fidelity.gate import RandomProjection, parameter_fidelity
from memopt.capture.soundness import training_step

WHY = "float32 does not resolve it here"


class IllConditioned(nn.Module):
    """Centres its input after adding 1e7: float32 keeps none of the input's digits there, float64 all of them."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(16))
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)

    def forward(self, x):
        big = x + 1e7
        return self.fc2(self.act(self.fc1(self.s * (big - big.mean(0)))))


class WellConditioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _eager(cls):
    """(model, input, float64_noise's arguments up to the bar) of one eager float32 step under a projection."""
    torch.manual_seed(0)
    model, x = cls(), torch.randn(16, 16)
    rng = torch.Generator().manual_seed(0).get_state()
    loss = RandomProjection(0)
    names = [n for n, _ in model.named_parameters()]
    grads = training_step(model, model, (x,), {}, rng, loss).grads
    return model, x, (model, (x,), {}, rng, loss, names, grads, 1e-3)


def test_parameters_float32_cannot_resolve_are_listed_apart_with_the_figure():
    torch.manual_seed(0)
    model, x = IllConditioned(), torch.randn(16, 16)
    before = copy.deepcopy(model.state_dict())
    om = memopt.optimize(model, example_inputs=x)
    apart = om.plan.fidelity["invariant"]
    assert "s" in apart and apart["s"].startswith(WHY) and "to float64's on the same step" in apart["s"], apart
    assert om.plan.fidelity["passed"] and not om.plan.fidelity["changes"]  # nothing repaired for rounding
    assert f"listed apart: s: {WHY}" in om.report()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the float64 twin is a copy


def test_well_conditioned_parameters_stay_gated():
    model, x, args = _eager(WellConditioned)
    assert float64_noise(*args, 0.99, parameter_fidelity) == {}
    om = memopt.optimize(model, example_inputs=x)
    assert not any(why.startswith(WHY) for why in om.plan.fidelity["invariant"].values())


def test_not_under_an_exact_bar_autocast_or_another_dtype():
    model, x, args = _eager(IllConditioned)
    rng, loss, names, grads = args[3:7]
    assert float64_noise(*args, 0.99, parameter_fidelity).keys() >= {"s"}
    assert float64_noise(*args, 1.0, parameter_fidelity) is None  # a bar of 1 asks for float32 eager's own bits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float64_noise(*args, 0.99, parameter_fidelity) is None  # autocast_noise's case
    half = copy.deepcopy(model).bfloat16()
    assert float64_noise(half, (x.bfloat16(),), {}, rng, loss, names, grads, 1e-3, 0.99, parameter_fidelity) is None
