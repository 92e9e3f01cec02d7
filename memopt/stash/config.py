"""``memopt.StashConfig``: exact forward, K-bit stash for backward, for BN-activation chains."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

from memopt.validation import check_bits, check_bits_choices, normalise_node_bits, normalise_node_names


@dataclass(frozen=True)
class StashConfig:
    """Exact-forward K-bit stash (Chakrabarti & Moseley, NeurIPS 2019) for BatchNorm -> [+ residual]
    -> ReLU/ReLU6/LeakyReLU chains whose outputs feed conv, linear, pooling or add consumers.

    Attributes:
        bits: K, bits per element of each code, 1..8 (default 4; the paper uses 4 and 8).
        allow: if given, only chains whose BatchNorm node is named here are rewritten.
        deny: BatchNorm node names whose chains stay exact.
        min_per_channel: BatchNorms that normalise fewer elements per channel than this (batch x
            spatial size) stay exact (default 32). With few elements the BN input gradient is a
            near-total cancellation (with 2 it is exactly zero up to eps) that a quantized x̂
            cannot reproduce: DenseNet-121 at 32x32, batch 2 (2 elements per channel in its last
            block) got sign-flipped upstream gradients from them.
    """

    bits: int = 4
    allow: Optional[Tuple[str, ...]] = None
    deny: Tuple[str, ...] = ()
    min_per_channel: int = 32
    node_bits: Union[Tuple[Tuple[str, int], ...], Mapping[str, int]] = ()
    plan_bits: Tuple[int, ...] = (2, 3, 4, 8)

    def __post_init__(self) -> None:
        check_bits(self.bits, "StashConfig.bits")
        if not isinstance(self.min_per_channel, int) or self.min_per_channel < 1:
            raise ValueError(f"StashConfig.min_per_channel must be a positive int, got {self.min_per_channel!r}")
        normalise_node_names(self, "allow", "deny")
        normalise_node_bits(self, "node_bits")
        object.__setattr__(self, "plan_bits", check_bits_choices(self.plan_bits, "StashConfig.plan_bits"))

    def bits_for(self, bn_name: str) -> int:
        return dict(self.node_bits).get(bn_name, self.bits)
