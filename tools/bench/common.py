"""What every benchmark in tools/ does last: write its markdown results file and print it."""
from __future__ import annotations

from pathlib import Path
from typing import Union


def write_results_file(out: Union[str, Path], text: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(text)
