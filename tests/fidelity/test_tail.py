"""The predicted tail of a small parameter's cosine over fresh projections (memopt/fidelity/tail.py)."""
import math

import pytest
import torch

from memopt.fidelity.conditioning import gate_report, judged, parameter_fidelity, worst_over
from memopt.fidelity.tail import EXACT_DOF, f_quantile, predictive_quantile, settled, tail_cosine, with_tails


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


def test_predictive_quantile_falls_with_losses_towards_the_known_ratio():
    for elements in (3, 16, 512):
        values = [predictive_quantile(elements, n) for n in (1, 2, 4, 8, 64)]
        assert values == sorted(values, reverse=True), (elements, values)
        assert values[-1] == pytest.approx(f_quantile(elements), rel=0.1)  # many losses: the ratio is known
    assert predictive_quantile(4096, 2) < 1.1 < predictive_quantile(16, 2)  # thousands of elements: two suffice
    assert predictive_quantile(1, 2) > predictive_quantile(1, 8) > 100  # one element: a sign, a heavy tail
    with pytest.raises(ValueError, match="elements >= 1 and losses >= 1, got 0 and 2"):
        predictive_quantile(0, 2)


def _figures(exact, approx, cotangents):
    return [parameter_fidelity(["p"], [exact @ cotangents[:, i]], [approx @ cotangents[:, i]], 0.0)
            for i in range(cotangents.shape[1])]


@pytest.mark.parametrize("elements", [16, 64, 2048])
def test_a_settled_plan_keeps_its_cosine_under_fresh_projections(elements):
    """Where ``settled`` accepts two or eight losses, at most about 1 in 100 fresh projections falls below the bar;
    where fresh ones fall below it more often, no number of losses settles it. Errors sized so that the fresh 1%
    tail lies just above or just below the bar."""
    bar = 0.99
    for error, expect in ((0.35, True), (1.6, False)):
        scale = error * math.sqrt((1 - bar ** 2) / bar ** 2) / math.sqrt(f_quantile(elements))  # tail ~ bar
        exact, approx, g = _linear_gradients(elements, 256, scale, seed=elements)
        fresh = _cosines(exact, approx, torch.randn(256, 20000, generator=g, dtype=torch.float64))
        below = float((fresh < bar).double().mean())
        seen = torch.randn(256, 8, generator=g, dtype=torch.float64)
        verdicts = [settled(_figures(exact, approx, seen[:, :n]), bar) for n in (2, 8)]
        if expect:
            assert below < 0.01 and verdicts[1], (elements, below, verdicts)
        else:
            assert below > 0.01 and not any(verdicts), (elements, below, verdicts)


def test_the_same_figures_settle_on_eight_losses_what_two_leave_open():
    """A 16-element gradient whose error ratio puts its predicted tail between the two-loss and the eight-loss
    predictive quantiles: eight losses of those figures settle it, two do not; 4096 elements settle on two."""
    bar = 0.99
    tangent_sq = (1 - bar ** 2) / bar ** 2
    for elements, two in ((16, False), (4096, True)):
        ratio = tangent_sq / ((predictive_quantile(elements, 2) + predictive_quantile(elements, 8)) / 2)
        if two:
            ratio = tangent_sq / predictive_quantile(elements, 2) * 0.9
        exact = torch.ones(elements, dtype=torch.float64)
        across = torch.zeros(elements, dtype=torch.float64)
        across[0], across[1] = 1.0, -1.0
        approx = exact + across / across.norm() * math.sqrt(ratio * (elements - 1))
        one = parameter_fidelity(["p"], [exact], [approx], 0.0)
        assert one["p"]["perpendicular_sq"] / (elements - 1) == pytest.approx(ratio, rel=1e-9)
        assert settled([one] * 8, bar) and settled([one] * 2, bar) == two, elements


def test_one_element_is_settled_only_while_its_error_cannot_flip_its_sign():
    """A one-element gradient: settled by its relative error against the sign-flip tail; never below the bar
    under a loss it was judged under; listed-apart figures are skipped."""
    small = [parameter_fidelity(["p"], [torch.full((1,), s)], [torch.full((1,), s * 1.001)], 0.0) for s in (1.0, -2.0)]
    large = [parameter_fidelity(["p"], [torch.full((1,), s)], [torch.full((1,), s * 1.3)], 0.0) for s in (1.0, -2.0)]
    assert settled(small, 0.99) and not settled(large, 0.99)
    flipped = small + [parameter_fidelity(["p"], [torch.ones(1)], [-torch.ones(1)], 0.0)]
    assert not settled(flipped, 0.99)
    apart = [parameter_fidelity(["p"], [torch.ones(1)], [-torch.ones(1)], 0.0, {"p": "invariant"})] * 2
    assert settled(apart, 0.99) and settled([], 0.99)
