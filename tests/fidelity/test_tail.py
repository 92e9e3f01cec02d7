"""The predicted tail of a small parameter's cosine over fresh projections (memopt/fidelity/tail.py)."""
import math

import pytest
import torch

from memopt.fidelity.conditioning import gate_report, judged, parameter_fidelity, worst_over
from memopt.fidelity.tail import EXACT_DOF, f_quantile, tail_cosine, with_tails


def _linear_gradients(elements: int, outputs: int, error: float, seed: int):
    """A parameter's exact gradient map J (elements x outputs) and a rewritten one J + E, E an isotropic error of
    relative size ``error``: both gradients are linear in the output's cotangent, as every backward is."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(elements, outputs, generator=g, dtype=torch.float64)
    noise = torch.randn(elements, outputs, generator=g, dtype=torch.float64) * error
    return exact, exact + noise, g


def _cosines(exact, approx, cotangents):
    a, b = exact @ cotangents, approx @ cotangents
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0))


def test_f_quantile_falls_with_elements_and_joins_across_the_cube_approximation():
    values = [f_quantile(d) for d in (2, 3, 6, 16, 64, 256, 4096)]
    assert values == sorted(values, reverse=True)
    assert values[0] > 50 and values[-1] < 1.1  # two elements: a heavy tail; thousands: ~1
    assert f_quantile(EXACT_DOF) == pytest.approx(f_quantile(EXACT_DOF + 1), rel=0.03)
    with pytest.raises(ValueError, match="at least 2 elements, got 1"):
        f_quantile(1)


@pytest.mark.parametrize("elements", [3, 12, 48])
def test_tail_from_eight_losses_predicts_the_one_percent_tail_of_fresh_projections(elements):
    """From 8 projections' figures, the predicted cosine is what about 1 in 100 fresh projections falls below
    (the estimate of the error's size from 8 draws is itself noisy: the band is wide, the point is the order)."""
    exact, approx, g = _linear_gradients(elements, 64, 0.03, seed=elements)
    seen = torch.randn(64, 8, generator=g, dtype=torch.float64)
    figures = [parameter_fidelity(["p"], [exact @ seen[:, i]], [approx @ seen[:, i]], 0.0)["p"] for i in range(8)]
    predicted = tail_cosine(figures)
    fresh = _cosines(exact, approx, torch.randn(64, 20000, generator=g, dtype=torch.float64))
    below = float((fresh < predicted).double().mean())
    assert 0.001 < below < 0.05, (elements, predicted, below)
    # the per-loss worst of the 8 says less for few elements: the fresh tail goes below it
    if elements == 3:
        assert float((fresh < min(f["cosine"] for f in figures)).double().mean()) > below


def test_a_small_parameter_passing_every_loss_is_judged_by_its_tail():
    """A 3-element gradient whose 4 losses all pass 0.99 but whose error predicts a heavy tail fails the gate's
    judgement; a large one with the same per-loss cosines does not; the report says why."""
    base = torch.tensor([1.0, 0.2, -0.5], dtype=torch.float64)
    figures = []
    for i, turn in enumerate([0.08, -0.07, 0.09, -0.08]):
        exact = base.roll(i)
        approx = exact + turn * torch.tensor([0.3, -1.0, 0.4], dtype=torch.float64).roll(i)
        figures.append(parameter_fidelity(["small"], [exact.float()], [approx.float()], 1e-3))
    assert min(f["small"]["cosine"] for f in figures) > 0.99
    per = worst_over(figures)
    assert per["small"]["tail"] == 4 and judged(per["small"]) < 0.99
    report = gate_report(per, ["small"], {}, passed=False)
    assert "the 1% tail its 4 losses predict" in report["below"][0]
    assert report["parameters"]["small"]["tail"] == 4
    big = [{"big": {**f["small"], "numel": 100000}} for f in figures]  # the same figures, many elements
    assert "tail" not in worst_over(big)["big"]


def test_listed_apart_tiny_and_single_losses_predict_no_tail():
    exact, approx = torch.ones(3), torch.tensor([1.0, 1.3, 0.7])
    f = parameter_fidelity(["p"], [exact], [approx], 1e-3)
    assert with_tails({"p": f["p"]}, [f]) == {"p": f["p"]}  # one loss predicts nothing
    apart = parameter_fidelity(["p"], [exact], [approx], 1e-3, {"p": "invariant"})
    assert "tail" not in worst_over([apart, apart])["p"]
    one = parameter_fidelity(["p"], [torch.ones(1)], [torch.full((1,), 1.5)], 1e-3)
    assert tail_cosine([one["p"], one["p"]]) is None  # one element: only its sign, which each loss checks
    perpendicular = parameter_fidelity(["p"], [exact], [approx], 1e-3)["p"]["perpendicular_sq"]
    assert perpendicular == pytest.approx(float((approx - exact).pow(2).sum()), rel=1e-6)  # the error is all across
    assert math.isfinite(tail_cosine([f["p"], f["p"]]))
