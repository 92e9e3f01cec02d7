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


def normalise_node_bits(config: Any, field: str, choices: Any = None) -> None:
    """``field`` is a mapping or pairs {node name: bits}; it becomes sorted (name, bits) pairs (frozen
    configs must hold immutable values). Each bits value must be valid, and in ``choices`` if given."""
    value = getattr(config, field)
    where = f"{type(config).__name__}.{field}"
    try:
        pairs = tuple(sorted(dict(value).items()))
    except (TypeError, ValueError):
        raise ValueError(f"{where} must map node names to bits, e.g. {{'relu_1': 2}}, got {value!r:.80}") from None
    for name, bits in pairs:
        if not isinstance(name, str):
            raise ValueError(f"{where} keys must be node names (str), got {name!r}")
        check_bits(bits, f"{where}[{name!r}]")
        if choices is not None and bits not in choices:
            raise ValueError(f"{where}[{name!r}]={bits!r} is not supported; use one of {sorted(choices)}")
    object.__setattr__(config, field, pairs)


def check_bits_choices(value: Any, where: str) -> tuple:
    """A non-empty tuple of distinct valid bit widths, sorted."""
    if not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"{where} must be a non-empty tuple of bit widths, got {value!r}")
    for bits in value:
        check_bits(bits, f"{where} entry")
    return tuple(sorted(set(value)))
