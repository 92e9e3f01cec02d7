"""``memopt.ReversibleConfig``: rebuild exactly invertible segments' inputs from their outputs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from memopt.core.validation import normalise_node_names

MODES = ("safe", "aggressive")


@dataclass(frozen=True)
class ReversibleConfig:
    """Reversible segments: backward rebuilds each step's input from its output instead of keeping it.

    In ``safe`` mode (the default) a segment is a run of *coupling
    updates* ``u' = u + H(V)`` / ``u - H(V)`` -- ``H`` reads only the other streams ``V`` and
    parameters, every intermediate of ``H`` is used only inside ``H`` -- joined by glue that only
    moves elements (split/chunk into a partition, cat of all streams, reshape/view/permute/
    transpose/flatten, pixel (un)shuffle, flip). A RevNet block (``y1 = x1 + F(x2); y2 = x2 +
    G(y1)``) is two couplings; RevViT/Reformer-style blocks are the same. Plain residual blocks
    ``x + F(x)`` are not invertible and are left alone. A segment keeps its outputs only, so its
    activation memory does not grow with depth; backward costs one extra forward of each ``H``.

    ``aggressive`` mode also takes elementwise bijections on a stream into segments: LeakyReLU
    with slope >= 0.1, scaling / shifting by a constant (|scale| >= 1e-3), and train-mode
    BatchNorm and LayerNorm with every |gamma| >= 1e-3 (inverted from the mean and std they keep:
    per channel for BatchNorm, per row for LayerNorm), as in reversible CNN designs that reach a few hundred bytes per input pixel. Chains of
    such layer-wise inverses lose accuracy fast with depth; the check below cuts them into pieces.

    The gradient changes only by the floating-point error of the reconstruction ``u = u' - H(V)``
    (about one rounding of ``u'`` per step, growing with depth and with ``H``'s Lipschitz
    constant). Before a segment saves a byte, memopt checks it on the example inputs: ``H`` must be
    deterministic (two runs bitwise equal), every rebuilt stream state must be within
    ``tolerance / margin`` relative error of the true one, and the gradients within ``tolerance`` of
    plain autograd. A segment whose error grows past that is cut into pieces (each piece keeps its
    own outputs: an anchor); a step that fails on its own stays exact. The report gives the errors.

    Attributes:
        mode: "safe" (default) or "aggressive".
        segments: None (default): every segment found; a tuple: only segments (named by their first
            coupling node, e.g. ``reversible_add``) listed here.
        tolerance: largest relative error of rebuilt inputs and of gradients accepted (default 1e-3).
        margin: the plan-time check accepts only errors ``margin`` times below ``tolerance``
            (default 100: Lipschitz constants grow during training, so the error does too).
        anchor_every: cut segments after at most this many coupling steps (default None: only where
            the check asks for it). Each cut keeps one more stream state.
        check_every: every this many training steps a segment also keeps its inputs and compares
            the rebuilt ones against them in backward, warning when the error passes ``tolerance``
            (default None: off; the value of the last check is in ``segment.last_check``).
    """

    mode: str = "safe"
    segments: Optional[Tuple[str, ...]] = None
    tolerance: float = 1e-3
    margin: float = 100.0
    anchor_every: Optional[int] = None
    check_every: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ReversibleConfig.mode={self.mode!r} is not supported; use one of {list(MODES)}")
        normalise_node_names(self, "segments")
        for name in ("tolerance", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ReversibleConfig.{name} must be a positive finite number, got {value!r}")
        for name in ("anchor_every", "check_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ReversibleConfig.{name} must be None or a positive int, got {value!r}")

    @property
    def threshold(self) -> float:
        """The relative error the plan-time check accepts: ``tolerance / margin``."""
        return self.tolerance / self.margin
