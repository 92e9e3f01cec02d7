"""Byte units for messages and reports."""
from __future__ import annotations

from typing import Optional

MiB = 1024 * 1024


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if abs(n) >= 1024 ** 3:
        return f"{n / 1024 ** 3:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.2f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"
