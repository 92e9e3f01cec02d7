"""Audit of the runtime accounting rule: custom autograd Functions keep tensors only through
``ctx.save_for_backward``. A tensor kept as a ctx attribute is invisible to saved-tensor hooks,
so it would escape ``memopt.measure`` and users' own tools; this walker finds such tensors."""
from __future__ import annotations

from typing import Any, Iterator, List, Set

import torch
from torch.utils._pytree import tree_flatten


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 3:
        return False
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    return False


def autograd_nodes(output: Any) -> Iterator[Any]:
    """Every node of the autograd graph behind the tensors in ``output``, once each."""
    seen: Set[int] = set()
    stack = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        yield fn
        stack.extend(next_fn for next_fn, _ in fn.next_functions)


def custom_functions(output: Any) -> List[Any]:
    """The custom-Function nodes (``ctx`` objects) of the autograd graph behind ``output``."""
    return [fn for fn in autograd_nodes(output) if isinstance(fn, torch.autograd.function.BackwardCFunction)]


def hidden_ctx_tensors(output: Any) -> List[str]:
    """"Function.attribute" for every tensor a custom Function keeps as a ctx attribute."""
    return [f"{type(fn).__name__}.{name}" for fn in custom_functions(output)
            for name, value in vars(fn).items() if _holds_tensor(value)]
