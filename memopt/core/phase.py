"""Which part of a backward is running, for the cost model's peak: inside a weight gradient computed from a
rebuilt input or not.

``memopt.stash.grads`` marks the stretch from a consumer's rebuild to the end of its weight gradient; the
step's storage tracker (``memopt.cost_model.storage.LiveStorageTracker``) notes whether its peak fell inside
one. Only then can computing that weight gradient over batch chunks lower the peak (``memopt.passes.
stash_chunks``), so the planner tries chunks only then. A counter, not a flag: backward runs on one thread per
device, and nested marks (none today) would stay correct.
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
