"""Errors raised by memopt. Every message names the culprit, quotes the bad value and says the fix."""
from __future__ import annotations

from typing import Optional


class MemoptError(RuntimeError):
    """Base class of every error memopt raises on purpose."""


class TraceError(MemoptError):
    """The model cannot be captured soundly: neither ``torch.fx.symbolic_trace`` nor ``torch.export`` traces it,
    or the captured graph does not train as the eager model does. ``summary``: one line for reports."""

    def __init__(self, message: str, summary: Optional[str] = None) -> None:
        super().__init__(message)
        self.summary = summary if summary is not None else (message.strip().splitlines() or [""])[0][:300]


class BudgetError(MemoptError):
    """The requested memory budget cannot be met with the current configuration.

    ``budget_bytes`` is the budget asked for and ``minimum_bytes`` the least estimated peak the
    current config reaches (None where unknown), for programs that search for a feasible budget.
    """

    def __init__(self, message: str, budget_bytes: Optional[int] = None, minimum_bytes: Optional[int] = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes


class PassError(MemoptError):
    """A graph rewrite failed; the message names the pass and the node."""
