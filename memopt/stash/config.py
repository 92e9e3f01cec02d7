"""``memopt.StashConfig``: exact forward, K-bit stash for backward, for BN-activation chains."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from memopt.validation import check_bits, normalise_node_names


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
        check_bits(self.bits, "StashConfig.bits")
        normalise_node_names(self, "allow", "deny")
