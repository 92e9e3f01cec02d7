"""``memopt.RecomputeConfig``: recompute whole blocks in backward (activation checkpointing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from memopt.core.validation import normalise_node_names


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

    Attributes:
        segments: the blocks to recompute. ``()`` (default): none unless the planner picks some;
            None: every eligible block (checkpoint everything); a tuple: exactly those.
    """

    segments: Optional[Tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        normalise_node_names(self, "segments")
