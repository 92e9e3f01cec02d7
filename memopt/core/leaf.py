"""Runtime autograd ops used by rewritten graphs.

Functions that rewritten graphs call are registered with ``graph_leaf``: the fx tracer that
re-traces a pickled GraphModule (``torch.load``) must keep them as single call nodes instead of
tracing into their Python bodies.
"""
from __future__ import annotations

from typing import Callable, List

LEAF_FUNCTIONS: List[Callable] = []


def graph_leaf(fn: Callable) -> Callable:
    LEAF_FUNCTIONS.append(fn)
    return fn
