"""One installed package: the wheel holds ``memopt`` only (passes/ and cost_model/ inside it as memopt.passes
and memopt.cost_model), and pyproject.toml's explicit package list names every folder with Python files."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import memopt

ROOT = Path(memopt.__file__).resolve().parent.parent
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None


def _pyproject():
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_names_every_folder_with_python_files():
    setup = _pyproject()
    folders = {"memopt": ROOT / "memopt", **{k: ROOT / v for k, v in setup["package-dir"].items()}}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("*.py"):
            rel = init.parent.relative_to(folder)
            if "__pycache__" not in rel.parts:
                found.add(".".join([package, *rel.parts]))
    listed = set(setup["packages"])
    assert found - listed == set(), f"folders with .py files missing from pyproject.toml packages: {found - listed}"
    assert listed - found == set(), f"pyproject.toml lists packages with no folder: {listed - found}"
    assert {p.split(".")[0] for p in listed} == {"memopt"}


def test_the_wheel_has_one_top_level_package(tmp_path):
    # built from a copy: an in-tree build would leave build/ and *.egg-info in the repository
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("memopt", "passes", "cost_model"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(source)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("memopt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"memopt"}, f"top-level entries in the wheel: {sorted(top)}"
    for needed in ("memopt/passes/planning/planner.py", "memopt/cost_model/analysis.py", "memopt/runtime/kernels.c",
                   "memopt/fewbit/default_tables.json"):
        assert needed in names, f"{needed} is not in the wheel"
