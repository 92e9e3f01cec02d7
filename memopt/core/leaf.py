"""Runtime autograd ops used by rewritten graphs.

Functions that rewritten graphs call are registered with ``graph_leaf``: the fx tracer that
re-traces a pickled GraphModule (``torch.load``) must keep them as single call nodes instead of
tracing into their Python bodies.

They are also opaque to ``torch.compile`` (``torch.compiler.disable``): dynamo would otherwise
trace into their autograd Functions (whose packing kernels it cannot trace: it recompiled up to its
limit and fell back), and AOT autograd may re-partition what it traced and save full-precision
tensors again. Disabled, each op is one graph break that runs eagerly, as in an eager step, and
keeps only its codes; the code between the ops still compiles. Measured on a conv-BN-ReLU CNN,
TinyResNet, PreActResNet20 and a per-submodule model: the same saved bytes as eager memopt, and
outputs and gradients bit-identical under the ``aot_eager`` backend (``tests/api/test_compile.py``).
``torch.compiler.disable`` keeps the function's name, module and qualified name (``functools.wraps``),
so graph code and pickles still resolve ``memopt.<module>.<name>`` to this same object, the one the
tracer knows.
"""
from __future__ import annotations

from typing import Callable, List

import torch

LEAF_FUNCTIONS: List[Callable] = []

# dynamo prints the reason when it skips the op, and raises with it under torch.compile(fullgraph=True)
OPAQUE_REASON = ("memopt runtime op {name} runs eagerly under torch.compile (a graph break) so that its backward "
                 "keeps only its codes; torch.compile(fullgraph=True) cannot compile a memopt OptimizedModule: "
                 "compile it without fullgraph=True")


def graph_leaf(fn: Callable) -> Callable:
    """Register ``fn`` as a leaf of re-tracing and make it opaque to ``torch.compile``; returns the
    function to bind at module level (the disabled wrapper, which is what graphs then call)."""
    leaf = torch.compiler.disable(fn, reason=OPAQUE_REASON.format(name=f"{fn.__module__}.{fn.__qualname__}"))
    LEAF_FUNCTIONS.append(leaf)
    return leaf
