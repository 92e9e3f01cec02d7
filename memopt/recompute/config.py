"""``memopt.RecomputeConfig``: recompute whole blocks in backward (activation checkpointing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from memopt.core.validation import check_bits, normalise_node_names


@dataclass(frozen=True)
class RecomputeConfig:
    """Recomputation of blocks: a block keeps only its inputs; backward runs its forward again.

    The budget planner uses it only as a last resort, when few-bit and stash at their fewest bits
    still do not fit: it is exact (same ops, same order, RNG replayed, BatchNorm running statistics
    restored after the second forward) but costs one extra forward of the block.

    A block is a module held in an ``nn.Sequential`` / ``nn.ModuleList`` (``layer1.0``,
    ``blocks.3``, ``features.5``) that is not a leaf, whose captured nodes form one contiguous run
    with tensor inputs and a single tensor output used outside. Blocks are named by their module
    path with dots as underscores (``layer1_0``).

    Recompute from codes: with ``bits`` a recomputed block keeps its inputs that carry gradient (its stream)
    as the generic stash's ``bits``-bit group codes, not as they are (a quarter of float32's bytes at 8 bits, a
    half of bf16's); backward runs the block again from the rebuilt input, so its gradients are approximate and
    the fidelity gate checks them. The forward is the block's own, bit for bit.

    Attributes:
        segments: the blocks to recompute. ``()`` (default): none unless a planner picks some (the budget
            planner, or the default plan's peak-first step below); None: every eligible block (checkpoint
            everything); a tuple: exactly those.
        bits: code width of the inputs of the blocks ``segments`` names, 1..8 (None, the default: kept as they
            are, exact).
        peak_first_bits: without a budget and with ``segments=()``, the default plan also tries recomputing
            blocks from ``peak_first_bits``-bit codes on top of the other techniques, and keeps that where the
            cost model's estimated peak of the training step falls by at least ``peak_first_gain`` (8, the
            default; None: the default plan never recomputes). Under a budget the planner cannot meet, every
            block recomputed from ``peak_first_bits``-bit codes is tried before refusing (None: not tried).
        peak_first_gain: the least fraction of the estimated peak the peak-first step must free, in (0, 1)
            (default 0.05): recomputation costs a block's forward again, worth it only for a real fall.
        time_allowance: the estimated step time the peak-first step may reach, in stock steps, >= 1 (default
            1.25): blocks are taken by bytes freed per recomputed FLOP until the cost model's FLOPs of a step
            (forward, twice the forward for backward, and the forwards recomputed) would pass it.
        codes_inside: a block recomputed from codes also keeps codes while backward runs it again: the other
            techniques (stash, few-bit, at their configs) rewrite the block's own graph as they would have in
            place (default True). Without it the second forward keeps what eager keeps, as checkpointing does,
            and that, the block's saved tensors, is what sits at the peak of a step whose blocks are all
            recomputed. Exact recomputation (``bits`` None) never codes inside. The peak-first step and a
            budget's fallback (every block from codes) try without it first, the blocks' backward in batch
            chunks, and code inside only where the estimated peak then still falls inside a recomputed block's
            backward (peak-first) or misses the budget (fallback): the codes cost an encode and a decode of each
            tensor every step. False: never.
    """

    segments: Optional[Tuple[str, ...]] = ()
    bits: Optional[int] = None
    peak_first_bits: Optional[int] = 8
    peak_first_gain: float = 0.05
    time_allowance: float = 1.25
    codes_inside: bool = True

    def __post_init__(self) -> None:
        normalise_node_names(self, "segments")
        for name in ("bits", "peak_first_bits"):
            if getattr(self, name) is not None:
                check_bits(getattr(self, name), f"RecomputeConfig.{name}")
        gain = self.peak_first_gain
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 < gain < 1:
            raise ValueError(f"RecomputeConfig.peak_first_gain must be a fraction in (0, 1), got {gain!r}")
        if not isinstance(self.codes_inside, bool):
            raise ValueError(f"RecomputeConfig.codes_inside must be True or False, got {self.codes_inside!r}")
        allowance = self.time_allowance
        if isinstance(allowance, bool) or not isinstance(allowance, (int, float)) or not 1 <= allowance < float("inf"):
            raise ValueError(f"RecomputeConfig.time_allowance must be a finite number of stock steps >= 1, got "
                             f"{allowance!r}")
