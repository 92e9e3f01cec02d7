"""Memory-lean optimizers: ``Shampoo`` (4-bit Shampoo) and ``state_bytes`` (what an optimizer keeps)."""
from memopt.optim.shampoo import Shampoo, ShampooConfig, state_bytes

__all__ = ["Shampoo", "ShampooConfig", "state_bytes"]
