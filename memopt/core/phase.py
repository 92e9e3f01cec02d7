"""Which part of a backward is running, for the cost model's peak: inside a weight gradient computed from a
rebuilt input, inside a recomputed block's backward, or neither.

``memopt.stash.grads`` marks the stretch from a consumer's rebuild to the end of its weight gradient; the
step's storage tracker (``memopt.cost_model.storage.LiveStorageTracker``) notes whether its peak fell inside
one. Only then can computing that weight gradient over batch chunks lower the peak (``memopt.passes.
stash_chunks``), so the planner tries chunks only then. A counter, not a flag: backward runs on one thread per
device, and nested marks (a weight gradient inside a recomputed block's backward) stay correct. The same holds
for a recomputed block's backward (``recompute_backward``), where ranges of the batch can lower the peak.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

_depth = 0


@contextmanager
def weight_grad_from_codes() -> Iterator[None]:
    """Mark a rebuild of a coded input and the weight gradient that reads it."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def in_weight_grad_from_codes() -> bool:
    """Whether a weight gradient from a rebuilt input is running now."""
    return _depth > 0


_recomputing = 0


@contextmanager
def recompute_backward() -> Iterator[None]:
    """Mark a recomputed block's backward: its second forward and its gradients (``memopt.recompute.ops``). Where
    the step's peak falls inside one, running it over batch chunks can lower the peak (``RecomputeSpec.chunks``),
    so the planner tries chunks only then."""
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


def in_recompute_backward() -> bool:
    """Whether a recomputed block's backward is running now."""
    return _recomputing > 0
