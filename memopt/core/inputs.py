"""Example inputs in one shape: ``(args, kwargs)``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

Inputs = Tuple[Tuple[Any, ...], Dict[str, Any]]


def normalize_inputs(example_inputs: Any) -> Inputs:
    """Accept a tensor, a tuple/list of positional inputs or a dict of keyword inputs."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor, a tuple/list of positional inputs or a dict of keyword "
        f"inputs, got {type(example_inputs).__name__}: {example_inputs!r:.80}"
    )


@dataclass
class Examples:
    """A graph's real placeholder values, for plan-time numeric checks, and a cache the checks share
    across the pass runs of one plan (the planner runs each pass several times)."""

    inputs: List[Any]
    cache: Dict[Any, Any] = field(default_factory=dict)
