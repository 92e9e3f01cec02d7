"""Unused imports fail the tests (issue 38): ruff's F401 over the package, tests and tools; skipped only where ruff
is not installed (it is in the dev extras)."""
import shutil
import subprocess
from pathlib import Path

import pytest

import memopt

ROOT = Path(memopt.__file__).resolve().parent.parent


def test_no_unused_imports():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    r = subprocess.run([ruff, "check", "--select", "F401", "--output-format", "concise", "--no-cache",
                        "memopt", "passes", "cost_model", "tools", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, "unused imports (ruff check --select F401 --fix removes them):\n" + r.stdout[-3000:]
