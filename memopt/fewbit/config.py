"""``memopt.FewBitConfig``: few-bit backward for pointwise activations."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

from memopt.fewbit.activations import ACTIVATIONS
from memopt.core.validation import check_bits, check_bits_choices, normalise_node_bits, normalise_node_names

WEIGHTS = ("uniform", "normal", "data")


@dataclass(frozen=True)
class FewBitConfig:
    """Few-bit backward (Novikov et al., ICML 2023) for pointwise activations.

    Attributes:
        bits: bits per element for table activations (gelu, silu, tanh, ...), 1..8. Default 3.
            Piecewise-linear ops (relu, leaky_relu, hardtanh, relu6, hardsigmoid, threshold) always
            use an exact 1-bit mask.
        bits_by_kind: per-op-kind overrides, e.g. {"gelu": 4}; stored as sorted (kind, bits) pairs.
        weight: the weight of the table fit: "normal" (default): a Gaussian with standard deviation
            ``scale`` (1.0), the typical scale of normalised pre-activations; "uniform" on ``domain``
            (the paper's choice); or "data": one table per node, fitted to the histogram of that
            node's pre-activations on the example inputs (plus a 0.1% uniform floor). "normal" is the
            default because it trains as well as "uniform" with better gradients at initialisation,
            while "data", best at initialisation, has tables that go stale as training moves the
            pre-activations (see docs/results/fewbit/fewbit_gradients.md and fewbit_mnist1d_*.md).
            Without real example values (meta inputs) "data" falls back to "uniform".
        domain, grid, scale: the table fit's domain (default (-10, 10)), grid cells (default
            4096) and the normal weight's scale (default 1.0).
        allow: if given, only these node names are rewritten. deny: node names never rewritten.
        exact_masks: rewrite the piecewise-linear ops with their exact 1-bit masks (default True).
        node_bits: per-node overrides {node name: bits} for table activations, ahead of
            ``bits_by_kind``; the budget planner's
            choices do not go here but to the pass (``PassContext.decision``).
        plan_bits: the bits the budget planner and the fidelity gate may choose from for table activations
            (default (1, 2, 3, 4, 8): 8 is the gate's last lossy step before exact, for deep SiLU / hard-swish
            networks where the error of 3-4-bit tables compounds with depth).
    """

    bits: int = 3
    bits_by_kind: Union[Tuple[Tuple[str, int], ...], Mapping[str, int]] = ()
    weight: str = "normal"
    domain: Tuple[float, float] = (-10.0, 10.0)
    grid: int = 4096
    scale: float = 1.0
    allow: Optional[Tuple[str, ...]] = None
    deny: Tuple[str, ...] = ()
    exact_masks: bool = True
    node_bits: Union[Tuple[Tuple[str, int], ...], Mapping[str, int]] = ()
    plan_bits: Tuple[int, ...] = (1, 2, 3, 4, 8)

    def __post_init__(self) -> None:
        check_bits(self.bits, "FewBitConfig.bits")
        pairs = tuple(sorted(dict(self.bits_by_kind).items()))
        for kind, bits in pairs:
            if kind not in ACTIVATIONS:
                raise ValueError(f"FewBitConfig.bits_by_kind has unknown op kind {kind!r}; known: {sorted(ACTIVATIONS)}")
            check_bits(bits, f"FewBitConfig.bits_by_kind[{kind!r}]")
        object.__setattr__(self, "bits_by_kind", pairs)
        if self.weight not in WEIGHTS:
            raise ValueError(f"FewBitConfig.weight={self.weight!r} is not known; use one of {list(WEIGHTS)}")
        lo, hi = self.domain
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"FewBitConfig.domain must be finite (low, high) with low < high, got {self.domain!r}")
        object.__setattr__(self, "domain", (float(lo), float(hi)))
        if not isinstance(self.grid, int) or self.grid < 256:
            raise ValueError(f"FewBitConfig.grid must be an int >= 256, got {self.grid!r}")
        if not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise ValueError(f"FewBitConfig.scale must be a positive number, got {self.scale!r}")
        normalise_node_names(self, "allow", "deny")
        normalise_node_bits(self, "node_bits")
        object.__setattr__(self, "plan_bits", check_bits_choices(self.plan_bits, "FewBitConfig.plan_bits"))

    def bits_for(self, kind: str, node: str = "") -> int:
        """Bits for a table activation: the node's override, else its kind's, else ``bits``."""
        return dict(self.node_bits).get(node, dict(self.bits_by_kind).get(kind, self.bits))
