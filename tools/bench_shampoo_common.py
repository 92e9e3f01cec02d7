"""What the 4-bit Shampoo benchmarks share: the results file, which starts with its command."""
from __future__ import annotations

from pathlib import Path

import torch
from results_file import write_results_file

RESULTS = Path(__file__).parents[1] / "docs" / "results"


def write_results(out: str, title: str, command: str, doc: str, body: str) -> None:
    """Write ``# title``, the command (and torch version), the script's docstring without its first
    and ``Run:`` lines, then ``body``, to ``out``; print it."""
    description = doc.split("\n", 1)[1].rsplit("Run:", 1)[0].strip()
    threads = ", 1 thread" if torch.get_num_threads() == 1 else ""
    text = (f"# {title}\n\nCommand: `{command}` (torch {torch.__version__}, CPU{threads}).\n\n"
            f"{description}\n\n{body.strip()}\n")
    write_results_file(out, text)
