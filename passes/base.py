"""What a pass is: a function ``(GraphModule, its config) -> PassResult``, registered per config type.

As in torchao, each technique has one frozen config dataclass and a registry maps the config type
to its pass, so ``Config`` fields select passes without if-chains.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Tuple, Type

from torch import fx


class PassResult(NamedTuple):
    graph_module: fx.GraphModule
    modified: bool


PassFn = Callable[[fx.GraphModule, Any], PassResult]

_PASSES: Dict[Type, Tuple[str, PassFn]] = {}


def register_pass(config_type: Type, name: str) -> Callable[[PassFn], PassFn]:
    """Register ``fn`` as the pass run when a ``Config`` field holds a ``config_type`` instance."""

    def decorate(fn: PassFn) -> PassFn:
        if config_type in _PASSES:
            raise ValueError(f"a pass is already registered for {config_type.__name__}: {_PASSES[config_type][0]}")
        _PASSES[config_type] = (name, fn)
        return fn

    return decorate


def registered_pass(config_type: Type) -> Tuple[str, PassFn] | None:
    return _PASSES.get(config_type)
