"""Layers only import downward, there are no import cycles, and every module imports first in a fresh process.

The layer of a module is the first entry of ``LAYERS`` whose prefix it starts with (most specific first);
docs/design.md draws the same diagram. Imports under ``if TYPE_CHECKING:`` are annotations, not imports.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import memopt

ROOT = Path(memopt.__file__).resolve().parent.parent
# package -> folder in the repository (pyproject.toml's package-dir)
FOLDERS = {"memopt": ROOT / "memopt", "memopt.passes": ROOT / "passes", "memopt.cost_model": ROOT / "cost_model"}

# (module prefix, layer): lower layers never import higher ones
LAYERS = [
    ("memopt.core", 0),
    ("memopt.runtime", 1),
    # techniques: config + autograd ops + kernels (test models sit at the top)
    ("memopt.testing", 10),
    ("memopt.fewbit", 2), ("memopt.stash", 2), ("memopt.reversible", 2), ("memopt.recompute", 2),
    ("memopt.optim", 2),
    ("memopt.techniques", 3), ("memopt.config", 3), ("memopt.kernel_probes", 3),
    # capture and its fix-ups; the soundness check runs training steps (layer 7)
    ("memopt.capture.soundness", 7), ("memopt.capture", 4), ("memopt.cost_model", 4),
    ("memopt.record.plan", 4),
    ("memopt.passes.planning", 6),
    ("memopt.passes", 5),
    ("memopt.record", 7),
    ("memopt.fidelity.invariant_params", 7), ("memopt.fidelity.degenerate_norms", 7), ("memopt.fidelity.graph_reads", 7), ("memopt.fidelity", 8),
    ("memopt.builder.optimized", 9), ("memopt.builder", 8),
    ("memopt.api", 10), ("memopt.cli", 10), ("memopt.demo", 10), ("memopt.__main__", 10), ("memopt", 10),
]
# the package __init__ files that only re-export the layer below them
PACKAGE_LAYERS = {"memopt": 10}


def modules():
    """{dotted name: path} of every project module."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def layer(name: str) -> int:
    if name in PACKAGE_LAYERS:
        return PACKAGE_LAYERS[name]
    for prefix, value in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return value
    raise AssertionError(f"{name} has no layer in tests/packaging/test_layers.py LAYERS; add it")


def _resolve(name: str, known) -> str:
    """The project module an import names (``from memopt.x import y`` may import the module memopt.x.y)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def project_imports(path: Path, known) -> list:
    """(line, module, top_level) for every import of a project module, TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            if n.split(".")[0] == "memopt":
                found.append((node.lineno, _resolve(n, known), id(node) in top))
    return found


def test_every_module_has_a_layer_and_imports_only_downward():
    known = modules()
    upward = []
    for name, path in known.items():
        for line, target, _ in project_imports(path, known):
            if target != name and layer(target) > layer(name):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({name}, layer {layer(name)}) imports "
                              f"{target} (layer {layer(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


# function-local imports of project modules are allowed only where start-up time matters (the CLI)
LOCAL_IMPORTS_ALLOWED = {"memopt.cli"}


def test_no_function_local_imports_of_project_modules():
    known = modules()
    local = [f"{path.relative_to(ROOT)}:{line} imports {target} inside a function"
             for name, path in known.items() if name not in LOCAL_IMPORTS_ALLOWED
             for line, target, top in project_imports(path, known) if not top]
    assert not local, "\n".join(local)


def test_no_import_cycles():
    nx = pytest.importorskip("networkx")
    known = modules()
    graph = nx.DiGraph()
    for name, path in known.items():
        graph.add_node(name)
        for _, target, _ in project_imports(path, known):
            # a package's own __init__ is imported by each of its modules: not an edge of the design
            if target != name and not name.startswith(target + "."):
                graph.add_edge(name, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:20])


# Imports each module named on stdin first in a forked child of a process that has imported only what memopt
# imports from outside itself (torch, networkx, ...: the argv), so a child pays for memopt alone, not for torch
# again; prints one line per module that fails.
_FORK_IMPORTS = r"""
import importlib, os, sys, traceback
for third in sys.argv[1:]:
    try:
        importlib.import_module(third)
    except Exception:
        pass
names, running, bad = sys.stdin.read().split(), {}, []
def reap():
    pid, status = os.wait()
    r, name = running.pop(pid)
    message = os.read(r, 1 << 16).decode(errors="replace")
    os.close(r)
    if status:
        bad.append(f"{name}: {message or status}")
for name in names:
    if len(running) >= max(2, os.cpu_count() or 2):
        reap()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
        except BaseException as e:
            os.write(w, (traceback.format_exception_only(type(e), e)[-1].strip()).encode())
            os._exit(1)
        os._exit(0)
    os.close(w)
    running[pid] = (r, name)
while running:
    reap()
print("\n".join(bad))
"""


def _outside_imports(cwd: Path) -> list:
    """The top-level modules outside memopt that importing memopt imports (in a fresh interpreter)."""
    r = subprocess.run([sys.executable, "-c", "import sys, memopt; print(' '.join(sorted({m.split('.')[0] for m in "
                        "sys.modules if m.split('.')[0] != 'memopt'})))"], cwd=cwd, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_every_module_imports_first_in_a_fresh_interpreter(tmp_path):
    # each module first in its own process, run from an empty folder so the repository's folders are not on
    # sys.path (an import that works only because another module was imported before fails here); the processes are
    # forked from one that has imported only third-party modules, which cannot depend on memopt's import order
    r = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, *_outside_imports(tmp_path)], cwd=tmp_path,
                       input=" ".join(sorted(modules())), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    bad = r.stdout.strip()
    assert not bad, "modules that fail when imported first:\n" + bad


def test_top_level_passes_and_cost_model_are_not_importable_outside_the_repository(tmp_path):
    for name in ("passes", "cost_model"):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode != 0 and "No module named" in r.stderr, f"'import {name}' works outside the repository"
