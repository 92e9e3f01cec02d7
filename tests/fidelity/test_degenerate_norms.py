"""A training BatchNorm over 2 values per channel: what reaches the loss only through its input is listed apart."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

import memopt
from memopt.capture.trace import capture
from memopt.fidelity.invariant_params import invariant_parameters


class Tail(nn.Module):
    """A CNN whose last stage is at a 1x1 map (a stride-2 stem at 4x4, then a 2x2 pool): its BatchNorm ``bn2``
    normalises batch x 1 values per channel; ``skip`` optionally carries the stem's features around it."""

    def __init__(self, skip: str = "") -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.AvgPool2d(2)
        self.conv = nn.Conv2d(8, 8, 1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)
        self.skip = skip

    def forward(self, x):
        y = self.pool(torch.relu(self.bn1(self.stem(x))))
        if self.skip == "checked":
            torch._assert(y.dim() == 4, "a shape check reads no values")
        z = self.bn2(self.conv(y))
        if self.skip == "sum":
            z = z + y
        elif self.skip == "in place":
            z.add_(y)  # the result unused: the sum reaches the loss through z, which no graph edge shows
        return self.head(torch.relu(z).flatten(1))


def _listed(model, x, scale=1.0):
    gm = capture(model, (x,), {}).graph_module
    ShapeProp(gm).propagate(x)
    return invariant_parameters(gm, scale)


BEFORE = {"stem.weight", "stem.bias", "bn1.weight", "bn1.bias", "conv.weight", "conv.bias"}
CANCELLED = {"stem.bias", "conv.bias"}  # a batch mean cancels them anyway: listed with that reason first


def _eps_only(listed):
    return {p for p, why in listed.items() if "eps term" in why and "sign of their difference" in why}


def test_everything_before_a_batchnorm_over_two_values_is_listed_with_the_reason():
    listed = _listed(Tail().train(), torch.randn(2, 3, 4, 4))
    assert _eps_only(listed) == BEFORE - CANCELLED and BEFORE <= set(listed), listed
    assert "BatchNorm bn2, over 2 values per channel" in listed["stem.weight"]
    assert "bn2.weight" not in listed and "head.weight" not in listed  # they act after the normalisation


def test_a_batchnorm_over_more_values_or_a_path_around_it_lists_nothing():
    assert not _eps_only(_listed(Tail().train(), torch.randn(4, 3, 4, 4)))
    assert not _eps_only(_listed(Tail().eval(), torch.randn(2, 3, 4, 4)))
    for skip in ("sum", "in place"):
        listed = _listed(Tail(skip).train(), torch.randn(2, 3, 4, 4))
        assert _eps_only(listed) == {"conv.weight"} and "conv.bias" in listed, (skip, listed)


def test_a_shape_check_is_no_path_to_the_loss():
    assert _eps_only(_listed(Tail("checked").train(), torch.randn(2, 3, 4, 4))) == BEFORE - CANCELLED


def test_the_gate_slice_scale_counts_the_values_it_runs_on():
    # planned on a batch of 4 (4 values per channel: fine), gated on 2 of them: degenerate there
    assert _eps_only(_listed(Tail().train(), torch.randn(4, 3, 4, 4), 0.5)) == BEFORE - CANCELLED


def _grads(model, x, eps):
    model = copy.deepcopy(model).double()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = eps
    out = model(x.double())
    (out * torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).sum().backward()
    return {n: float(p.grad.norm()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("skip", ["", "sum", "in place"])
def test_the_listed_gradients_are_eps_terms_by_measurement(skip):
    """In float64, with BatchNorm's eps near zero, exactly the listed gradients vanish."""
    torch.manual_seed(0)
    model, x = Tail(skip).train(), torch.randn(2, 3, 4, 4)
    listed = _eps_only(_listed(model, x))
    small, usual = _grads(model, x, 1e-14), _grads(model, x, 1e-5)
    for name in usual:
        if name in listed:
            assert small[name] < 1e-6 * usual[name], (name, small[name], usual[name])
        elif name not in CANCELLED:  # zero either way
            assert small[name] > 1e-3 * usual[name], (name, small[name], usual[name])


def test_the_gate_lists_them_apart_and_checks_the_rest():
    torch.manual_seed(0)
    model, x = Tail().train(), torch.randn(2, 3, 4, 4)
    om = memopt.optimize(model, example_inputs=x)
    invariant = om.plan.fidelity["invariant"]
    assert BEFORE <= set(invariant), invariant
    assert "bn2.weight" not in invariant and om.plan.fidelity["passed"]
