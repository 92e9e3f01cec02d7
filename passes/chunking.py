"""The one rule both batch-chunk settings are chosen by (weight gradients from codes: ``memopt.passes.stash.chunks``;
recomputed blocks' backward: ``memopt.passes.recompute_chunks``): estimate the step at each level, fewest chunks
first, only while the estimated peak falls where that setting acts and is above the target; keep a level only
where it lowers the peak."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from torch import fx

from memopt.core.meta import META_KEY
from memopt.cost_model.analysis import Estimate


def fit_levels(gm: fx.GraphModule, estimate: Estimate, target: Optional[int], levels: Sequence[int], chosen: int,
               where: str, apply: Callable[[fx.GraphModule, int], int],
               annotate: Callable[[fx.GraphModule], Estimate]) -> Tuple[Estimate, int]:
    """(the estimate kept, the level set) for ``gm`` estimated at ``chosen`` (``estimate``). ``where``: the
    ``Estimate.breakdown`` flag saying the peak falls where the setting acts; ``apply(gm, level)`` sets a level and
    returns how many nodes took it (0: none can, stop). A level that does not lower the peak puts the graph and
    its annotation (``node.meta``) back to the level kept, without another estimate."""
    best = estimate
    for level in levels:
        if level <= chosen:
            continue
        if not best.breakdown.get(where) or (target is not None and best.peak_bytes <= target):
            break
        annotated = {n: n.meta[META_KEY] for n in gm.graph.nodes if META_KEY in n.meta}  # ``best``'s
        if not apply(gm, level):
            break
        trial = annotate(gm)
        if trial.peak_bytes >= best.peak_bytes:
            apply(gm, chosen)
            for node, cost in annotated.items():
                node.meta[META_KEY] = cost
            break
        best, chosen = trial, level
    return best, chosen
