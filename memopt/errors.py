"""Errors raised by memopt. Every message names the culprit, quotes the bad value and says the fix."""
from __future__ import annotations


class MemoptError(RuntimeError):
    """Base class of every error memopt raises on purpose."""


class TraceError(MemoptError):
    """The model could be captured neither by ``torch.fx.symbolic_trace`` nor by ``torch.export``."""


class BudgetError(MemoptError):
    """The requested memory budget cannot be met with the current configuration."""


class PassError(MemoptError):
    """A graph rewrite failed; the message names the pass and the node."""
