"""Custom autograd Functions kept whole under ``torch.export``, as the symbolic trace keeps them.

Non-strict export traces a ``Function.apply`` into the ops of its forward: autograd would then differentiate those
ops instead of running the Function's own backward (a straight-through estimator's gradient would be zero, Hugging
Face BLOOM's hand-written GeLU derivative replaced by autograd's), and the graph would keep what the forward's ops
keep rather than what the Function saves. So while export traces, each custom Function applied to tensors becomes
one call of an opaque operator made for it (``torch.library``, namespace ``memopt_functions``), whose fake kernel runs
the Function's forward on the fake inputs for the output shapes; after export, ``capture.export_capture`` replaces
each such call with a ``FunctionCall`` of the Function itself (its own forward and backward when the graph runs).
The capture check then verifies the graph against the eager model bit for bit, as for every capture.

A Function the operator cannot describe (an argument other than tensors, numbers, bools, strings, None or lists of
tensors; an output other than a tensor or a tuple of tensors; keyword arguments) is left to export, which inlines
it, and the capture is refused naming it, as before.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Dict, Optional, Tuple

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

NAMESPACE = "memopt_functions"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_COUNTER = itertools.count()
_LOCK = threading.Lock()
# (Function class, argument types, single output) -> operator name: one operator per signature, made once
_MADE: Dict[Tuple[type, Tuple[str, ...], bool], str] = {}
# operator name -> the Function class it stands for
FUNCTIONS: Dict[str, type] = {}


# torch's own Function.apply, taken when memopt is imported (capture patches it while it traces)
_APPLY = vars(next(k for k in torch.autograd.Function.__mro__ if "apply" in vars(k)))["apply"]


def _raw_apply(cls: type, args: tuple) -> Any:
    return _APPLY.__get__(None, cls)(*args)


def _type(value: Any) -> Optional[str]:
    """The operator schema type of one argument (None: not describable)."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if value is None:
        return "Tensor?"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "SymInt"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "Tensor[]"
    return None


def why_not(args: tuple, kwargs: dict) -> Optional[str]:
    """Why a Function applied to these arguments cannot be one operator (None: it can)."""
    if kwargs:
        return f"it is applied with keyword arguments ({', '.join(sorted(kwargs))})"
    bad = [f"argument {i} ({type(a).__name__})" for i, a in enumerate(args) if _type(a) is None]
    return f"its {', '.join(bad[:3])} cannot be an operator argument" if bad else None


def _structure(out: Any) -> Optional[bool]:
    """True for a single tensor output, False for a tuple of tensors, None otherwise."""
    if isinstance(out, torch.Tensor):
        return True
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return False
    return None


def _operator(cls: type, types: Tuple[str, ...], single: bool) -> str:
    key = (cls, types, single)
    with _LOCK:
        if key in _MADE:
            return _MADE[key]
        name = f"f{next(_COUNTER)}_" + "".join(c if c.isalnum() else "_" for c in cls.__qualname__)[:60]
        arguments = ", ".join(f"{t} a{i}" for i, t in enumerate(types))
        _LIBRARY.define(f"{name}({arguments}) -> {'Tensor' if single else 'Tensor[]'}")

        def kernel(*args: Any) -> Any:
            # what the opaque operator computes (it runs only under export's fake tensors: the captured graph
            # calls the Function itself); copies, as an operator's outputs may not alias its inputs
            with torch.no_grad():
                out = _raw_apply(cls, tuple(list(a) if isinstance(a, (list, tuple)) else a for a in args))
            return out.clone() if single else [t.clone() for t in out]

        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", kernel, lib=_LIBRARY)
        _MADE[key] = name
        FUNCTIONS[name] = cls
        return name


def as_operator(cls: type, args: tuple, kwargs: dict) -> Tuple[Any, Optional[str]]:
    """(the Function's output through its opaque operator, None), or (None, why it cannot be one)."""
    reason = why_not(args, kwargs)
    if reason is not None:
        return None, reason
    with disable_proxy_modes_tracing(), torch.no_grad():  # the output's structure, not recorded in the graph
        single = _structure(_raw_apply(cls, args))
    if single is None:
        return None, "its forward returns something other than a tensor or a tuple of tensors"
    name = _operator(cls, tuple(_type(a) for a in args), single)
    out = getattr(getattr(torch.ops, NAMESPACE), name)(*[list(a) if isinstance(a, tuple) else a for a in args])
    return (out if single else tuple(out)), None


def function_of(target: Any) -> Optional[type]:
    """The Function class an operator call of a captured graph stands for (None: not one of ours)."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE:
        return FUNCTIONS.get(target._schema.name.split("::", 1)[1])
    return None
