"""Optimizer descriptions for budget accounting: a name, a class or an instance -> (class, kwargs)."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple, Type

import torch

_BY_NAME = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
}


def resolve_optimizer(optimizer: Any) -> Optional[Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]]:
    """``None``, "sgd" (momentum 0.9), "adam", "adamw", an Optimizer class or an Optimizer instance."""
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _BY_NAME:
            raise ValueError(f"optimizer={optimizer!r} is not known; use one of {sorted(_BY_NAME)}, "
                             f"a torch.optim.Optimizer class or an optimizer instance")
        return _BY_NAME[key]
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer), _constructor_kwargs(type(optimizer), optimizer.defaults)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, {"lr": 1e-3}
    raise TypeError(f"optimizer must be None, a name, an Optimizer class or instance, got "
                    f"{type(optimizer).__name__}: {optimizer!r:.80}")


def _constructor_kwargs(cls: Type[torch.optim.Optimizer], defaults: Dict[str, Any]) -> Dict[str, Any]:
    """``defaults`` limited to what ``cls(params, **kwargs)`` accepts: torch 2.14's AdamW keeps
    ``decoupled_weight_decay`` in its defaults but its constructor does not take it."""
    accepted = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}
