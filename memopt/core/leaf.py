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

A call node of such a function is read by parameter name, never by position (``argument``, ``spec_of``,
``set_argument``): they bind the node's args and kwargs to the function's own signature, so a changed signature
cannot make a reader pick the wrong argument. Each op's non-tensor parameters travel as one typed spec (a
NamedTuple, ``memopt.stash.ops.ChainSpec`` and its siblings) whose ``of(node)`` reads it;
``tests/packaging/test_op_specs.py`` fails on positional reads of these nodes' args.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Type, TypeVar

import torch

from memopt.core.errors import MemoptError

LEAF_FUNCTIONS: List[Callable] = []
S = TypeVar("S")

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


@functools.lru_cache(maxsize=None)
def _signature(target: Callable) -> inspect.Signature:
    return inspect.signature(target)  # follows the disabled wrapper's __wrapped__ to the op's own parameters


def _bound(node) -> inspect.BoundArguments:
    if node.target not in LEAF_FUNCTIONS:
        raise MemoptError(f"node {node.name} calls {node.target!r}, not a memopt graph op (memopt.core.leaf."
                          f"graph_leaf); read an ATen or torch call's arguments from its own schema instead")
    bound = _signature(node.target).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound


def arguments(node) -> Dict[str, Any]:
    """{parameter name: value} of ``node``, a call of a memopt graph op, defaults included (a ``*inputs``
    parameter gives its tuple)."""
    return dict(_bound(node).arguments)


def argument(node, name: str) -> Any:
    """The value ``node`` (a call of a memopt graph op) passes for the op's parameter ``name``."""
    found = arguments(node)
    if name not in found:
        raise MemoptError(f"{getattr(node.target, '__name__', node.target)} has no parameter {name!r} (it takes "
                          f"{', '.join(found)}); node {node.name}")
    return found[name]


def spec_of(cls: Type[S], node) -> S:
    """``node``'s ``spec`` argument, checked to be a ``cls``. Each spec class binds it as its reader,
    ``of = classmethod(spec_of)``: ``ChainSpec.of(node)``."""
    spec = argument(node, "spec")
    if not isinstance(spec, cls):
        raise MemoptError(f"node {node.name} ({node.target.__name__}) passes {type(spec).__name__} {spec!r:.80} as "
                          f"its spec, not a {cls.__module__}.{cls.__qualname__}; build the call with one")
    return spec


def set_argument(node, name: str, value: Any) -> None:
    """Pass ``value`` for the op's parameter ``name`` in ``node``: in place of the positional argument where the
    node passes it positionally, else as a keyword."""
    parameters = list(_bound(node).signature.parameters.values())
    position = next((i for i, p in enumerate(parameters) if p.name == name), None)
    if position is None or parameters[position].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                             inspect.Parameter.KEYWORD_ONLY):
        raise MemoptError(f"{node.target.__name__} has no named parameter {name!r}; node {node.name}")
    if parameters[position].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and position < len(node.args):
        node.args = (*node.args[:position], value, *node.args[position + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}
