"""The tail of a small parameter's gradient cosine over projections it was not checked under.

The gate checks every parameter under a handful of losses (random projections of the outputs, their own direction,
the user's loss). For a parameter of many elements the cosine hardly moves from one projection to the next; for one
of a few elements it sways widely: torchvision Swin V2's ``logit_scale`` (one element per head, 3 in the first
stage) passed six gate losses at >= 0.9927 and gave 0.9748 under an unseen one, with float32 eager at 1.0000 to
float64 (docs/results/fidelity/gate_miss.md). Both gradients are linear in the output's cotangent ``v``: the exact
one is ``J v`` and the rewritten graph's ``J v + E v``, so over random ``v`` the cosine is the angle between two
correlated Gaussian vectors of ``d`` elements, and the chance that ``J v`` comes out short beside ``E v`` grows
fast as ``d`` falls (the tangent's square goes as an F(d - 1, d) ratio for an isotropic error).

So the gate also judges each parameter by the cosine its losses predict at the ``QUANTILE`` tail: the error's
per-element variance across the losses (the part perpendicular to the exact gradient) over the exact gradient's,
times that quantile of the F ratio. With many elements the ratio is ~1 and the figure is the losses' pooled cosine
(the per-loss check stays); with few it is the heavy tail the per-loss draws may miss. One element has no angle but
its sign, which the per-loss check sees.

How many losses a passing plan needs (``settled``): the ratio is itself estimated from the losses, so a figure from
two of them is less sure than one from eight. A plan is settled once every parameter's cosine stays above the bar
at the 1% tail of the *predictive* distribution, the fresh projection's F ratio over the estimate's own (an F ratio
of ``n`` times as many degrees of freedom, for ``n`` losses): a parameter of thousands of elements is settled by
two losses, one of a few dozen near the bar asks for more, up to ``FidelityConfig.max_projections``.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Dict, List, Optional

import torch

# The tail a parameter is judged at: 1 in 100 fresh projections may fall below the figure.
QUANTILE = 0.99
# Monte-Carlo draws for the F ratio's quantile (a fixed generator: the same figure every run).
DRAWS = 20000
# Above this many elements a chi-square is drawn by the Wilson-Hilferty cube (a normal), below by its squares.
EXACT_DOF = 64


def _chi2_mean(dof: int, generator: torch.Generator) -> torch.Tensor:
    """DRAWS draws of chi-square(dof) / dof."""
    if dof <= EXACT_DOF:
        return torch.randn(DRAWS, dof, generator=generator, dtype=torch.float64).pow(2).mean(1)
    spread = 2.0 / (9.0 * dof)
    z = torch.randn(DRAWS, generator=generator, dtype=torch.float64)
    return (1.0 - spread + z * math.sqrt(spread)).clamp_min(0).pow(3)


@lru_cache(maxsize=None)
def f_quantile(elements: int, quantile: float = QUANTILE) -> float:
    """The ``quantile`` of (chi-square(d - 1) / (d - 1)) / (chi-square(d) / d) for ``d = elements`` >= 2: the
    squared tangent of a ``d``-element gradient's angle over its mean, under an isotropic error."""
    if elements < 2:
        raise ValueError(f"f_quantile needs a parameter of at least 2 elements, got {elements}")
    generator = torch.Generator().manual_seed(0)
    ratio = _chi2_mean(elements - 1, generator) / _chi2_mean(elements, generator)
    return float(torch.quantile(ratio, quantile))


@lru_cache(maxsize=None)
def predictive_quantile(elements: int, losses: int, quantile: float = QUANTILE) -> float:
    """The ``quantile`` of a fresh projection's squared tangent over the ratio estimated from ``losses`` losses
    (``tail_cosine``'s pooled one): the fresh F(d - 1, d) draw divided by the estimate's F(n (d - 1), n d). One
    element has no perpendicular part: there it is the squared error over the squared gradient, F(1, 1) over
    F(n, n), whose sign flips under half of the draws where the error is the larger, so its quantile is taken at
    twice the tail."""
    if elements < 1 or losses < 1:
        raise ValueError(f"predictive_quantile needs elements >= 1 and losses >= 1, got {elements} and {losses}")
    generator = torch.Generator().manual_seed(0)
    if elements == 1:
        fresh = _chi2_mean(1, generator) / _chi2_mean(1, generator)
        estimate = _chi2_mean(losses, generator) / _chi2_mean(losses, generator)
        return float(torch.quantile(fresh / estimate, 1.0 - 2.0 * (1.0 - quantile)))
    fresh = _chi2_mean(elements - 1, generator) / _chi2_mean(elements, generator)
    estimate = _chi2_mean(losses * (elements - 1), generator) / _chi2_mean(losses * elements, generator)
    return float(torch.quantile(fresh / estimate, quantile))


def settled(figures: List[Dict[str, Dict[str, Any]]], bar: float, quantile: float = QUANTILE) -> bool:
    """Whether a plan's figures (one dict per loss, ``parameter_fidelity``'s) settle it: every judged parameter is
    at or above ``bar`` under every loss and at the ``quantile`` tail of its predictive distribution
    (``predictive_quantile``); one of one element where its error is that unlikely to flip the gradient's sign.
    An unsettled plan that passes is confirmed on further losses (gate.py's ``confirm``)."""
    for name in figures[0] if figures else ():
        kept = [each[name] for each in figures if name in each and "numel" in each[name]]
        kept = [f for f in kept if not f["excluded"] and not f["negligible"] and not f["tiny"]]
        if not kept:
            continue
        if min(f["cosine"] for f in kept) < bar:
            return False
        elements, exact = kept[0]["numel"], sum(f["exact_sq"] for f in kept)
        if exact <= 0:
            continue
        if elements == 1:
            error = sum(f["relative_error"] ** 2 * f["exact_sq"] for f in kept)
            if error / exact * predictive_quantile(1, len(kept), quantile) > 1.0:
                return False
            continue
        ratio = sum(f["perpendicular_sq"] for f in kept) / (elements - 1) / (exact / elements)
        if 1.0 / math.sqrt(1.0 + ratio * predictive_quantile(elements, len(kept), quantile)) < bar:
            return False
    return True


def tail_cosine(figures: List[Dict[str, Any]], quantile: float = QUANTILE) -> Optional[float]:
    """The cosine one parameter's gradient is predicted to stay above under a fraction ``quantile`` of fresh
    projections, from its figures under the losses it was judged under (``parameter_fidelity``'s, with ``numel``,
    ``exact_sq`` and ``perpendicular_sq``); None where it has one element or no loss to judge it by."""
    kept = [f for f in figures if "numel" in f and not f["excluded"] and not f["negligible"] and not f["tiny"]]
    if not kept or kept[0]["numel"] < 2:
        return None
    elements = kept[0]["numel"]
    exact = sum(f["exact_sq"] for f in kept) / elements
    error = sum(f["perpendicular_sq"] for f in kept) / (elements - 1)
    if exact <= 0:
        return None
    tangent_sq = error / exact * f_quantile(elements, quantile)
    return 1.0 / math.sqrt(1.0 + tangent_sq)


def with_tails(per: Dict[str, Dict[str, Any]], figures: List[Dict[str, Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """``per`` (each parameter's worst figures over ``figures``, one dict per loss) with the figures of a parameter
    whose predicted tail (``tail_cosine``) is below its worst cosine replaced by a copy carrying that cosine and
    ``tail``: the number of losses it was predicted from. Listed-apart parameters stay as they are."""
    if len(figures) < 2:  # one loss predicts nothing about another
        return per
    out = dict(per)
    for p, worst in per.items():
        if worst["excluded"] or worst["negligible"]:
            continue
        mine = [each[p] for each in figures if p in each]
        tail = tail_cosine(mine)
        if tail is not None and tail < worst["cosine"]:
            out[p] = {**worst, "cosine": tail, "tail": len(mine)}
    return out
