"""Checks shared by the technique configs; messages name the field and quote the value."""
from __future__ import annotations

from typing import Any


def check_bits(value: Any, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 8:
        raise ValueError(f"{where} must be an int in 1..8, got {value!r}")


def normalise_node_names(config: Any, *fields: str) -> None:
    """Each field must be None or a tuple/list of node names; lists become tuples (frozen configs)."""
    for name in fields:
        value = getattr(config, name)
        if value is not None and not (isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{type(config).__name__}.{name} must be a tuple of node names, got {value!r}")
        if isinstance(value, list):
            object.__setattr__(config, name, tuple(value))
