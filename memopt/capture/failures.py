"""How a failed capture is told: the construct of the model's own code it failed on (``user_frame``), the
``TraceError`` with a one-line summary (``trace_error``), and torch.export's own noise held back while it tries
(``_quiet``). Split from ``trace.py``, whose frames ``user_frame`` skips."""
from __future__ import annotations

import logging
import os
import traceback

import torch

from memopt.core.errors import TraceError

_TRACE_FILE = os.path.abspath(os.path.join(os.path.dirname(__file__), "trace.py"))


class _quiet:
    """A failing torch.export prints its whole partial graph to stderr and logs a warning; we report
    the failure ourselves, with its construct. The logger is raised to ERROR and stderr is held back
    for the duration; on success what was written to stderr is passed on."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def __enter__(self) -> None:
        import contextlib
        import io

        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)
        self.buffer = io.StringIO()
        self.redirect = contextlib.redirect_stderr(self.buffer)
        self.redirect.__enter__()

    def __exit__(self, exc_type, *exc) -> None:
        import sys

        self.redirect.__exit__(exc_type, *exc)
        self.logger.setLevel(self.level)
        if exc_type is None and self.buffer.getvalue():
            sys.stderr.write(self.buffer.getvalue())


def trace_error(message: str, summary: str) -> TraceError:
    """A ``TraceError`` with ``summary``: one line naming both failures and the construct (for reports)."""
    return TraceError(message, summary)


def user_frame(error: BaseException) -> str:
    """``file:line (function): code`` of the innermost frame of the traceback outside torch: the
    construct of the model's own code that tracing failed on ("" when there is none)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    # memopt's own test models (memopt/testing) count as model code here; only the capture's own file is skipped
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(torch_dir) and not f.filename.startswith("<")
              and os.path.abspath(f.filename) != _TRACE_FILE]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
