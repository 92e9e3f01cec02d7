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
