"""``memopt.StashConfig``: exact forward, K-bit stash for backward, for BN-activation chains."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class StashConfig:
    """Exact-forward K-bit stash (Chakrabarti & Moseley, NeurIPS 2019) for BatchNorm -> [+ residual]
    -> ReLU/ReLU6/LeakyReLU chains whose outputs feed conv, linear, pooling or add consumers.

    Attributes:
        bits: K, bits per element of each code, 1..8 (default 4; the paper uses 4 and 8).
        allow: if given, only chains whose BatchNorm node is named here are rewritten.
        deny: BatchNorm node names whose chains stay exact.
    """

    bits: int = 4
    allow: Optional[Tuple[str, ...]] = None
    deny: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 1 <= self.bits <= 8:
            raise ValueError(f"StashConfig.bits must be an int in 1..8, got {self.bits!r}")
        for name in ("allow", "deny"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"StashConfig.{name} must be a tuple of node names, got {value!r}")
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
