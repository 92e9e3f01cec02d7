"""A model's module tree listed once for the checks around every training forward.

An optimized module checks around every training forward which objects sit where in the model and what plain
attributes its submodules hold (``memopt/builder/structure.py``, ``memopt.capture.soundness.attribute_fingerprint``).
Each check walked the tree with its own generator (modules, then parameters, then buffers, then the attributes);
``walk`` lists the modules once and the others read the same list.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

Walked = List[Tuple[str, nn.Module]]

_NAMED_PARAMETERS = nn.Module.named_parameters
_NAMED_BUFFERS = nn.Module.named_buffers


def walk(model: nn.Module) -> Walked:
    """``list(model.named_modules(remove_duplicate=False))``: a module reached twice is listed twice, in pre-order."""
    return list(model.named_modules(remove_duplicate=False))


def _members(model: nn.Module, walked: Walked, attribute: str) -> List[Tuple[str, torch.Tensor]]:
    return [(f"{prefix}.{name}" if prefix else name, value)
            for prefix, module in walked for name, value in getattr(module, attribute).items() if value is not None]


def named_parameters(model: nn.Module, walked: Walked) -> List[Tuple[str, torch.Tensor]]:
    """``list(model.named_parameters(remove_duplicate=False))`` from ``walked`` (``walk(model)``)."""
    if type(model).named_parameters is not _NAMED_PARAMETERS:
        return list(model.named_parameters(remove_duplicate=False))
    return _members(model, walked, "_parameters")


def named_buffers(model: nn.Module, walked: Walked) -> List[Tuple[str, torch.Tensor]]:
    """``list(model.named_buffers(remove_duplicate=False))`` from ``walked`` (``walk(model)``)."""
    if type(model).named_buffers is not _NAMED_BUFFERS:
        return list(model.named_buffers(remove_duplicate=False))
    return _members(model, walked, "_buffers")
