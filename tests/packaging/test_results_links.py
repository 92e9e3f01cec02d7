"""The repository's markdown links resolve, and every current results file starts with the command that made it.

(a) Every relative link ``[text](target)`` / ``![alt](target)`` in the repository's ``*.md`` files (outside .git,
virtual environments and build output; code spans and fenced blocks skipped) names an existing file or folder,
its ``#anchor`` stripped; http(s), mailto and bare anchors are not checked.
(b) Every results file under docs/results/ (``*.md``, except READMEs and docs/results/archive/, which keeps
superseded sweeps as they were written) names its command within its first 5 lines: a line with "Command" or a
``python -m tools.`` / ``python -m memopt`` command line (backticked or bare). tools/README.md maps scripts to files.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__", ".pytest_cache",
             ".hypothesis", ".ruff_cache", "memopt_export"}
# a link target has no whitespace (a table cell's ``call_module[target=norm](args = ...)`` is not a link)
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
COMMAND = re.compile(r"Command|python -m (tools\.|memopt\b)")
HEAD_LINES = 5


def markdown_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*.md"):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIP_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        out.append(path)
    return sorted(out)


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of each link outside code spans and fenced blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def broken_links(path: Path) -> list[str]:
    out = []
    for number, target in links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):  # http(s), mailto, anchors
            continue
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (ROOT / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        if not resolved.exists():
            out.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    return out


def test_link_checker_finds_a_broken_link_and_skips_code(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [web](https://example.com) [top](#a) ![gone](missing.png)\n"
                    "`[code](nowhere.md)` call_module[target=norm](args = (x,))\n```\n[fenced](nowhere.md)\n```\n")
    assert [t for _, t in links(page)] == ["there.md#a", "https://example.com", "#a", "missing.png"]
    assert broken_links(page) == ["page.md:1: missing.png"]


def test_relative_markdown_links_resolve():
    files = markdown_files()
    assert ROOT / "README.md" in files and RESULTS / "README.md" in files
    broken = [b for path in files for b in broken_links(path)]
    assert not broken, "broken relative links:\n" + "\n".join(broken)


# Current results files that do not name their command in their first lines: none today (dynamic_shapes*.md,
# reliability/soak.md, shampoo/shampoo_cost.md and shampoo_tracking.md give it as a bare first line, which counts).
# Add a file here only with the reason, and prefer fixing the file.
NO_COMMAND_ALLOWED: set = set()


def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.md")
                  if p.name != "README.md" and "archive" not in p.relative_to(RESULTS).parts)


@pytest.mark.parametrize("path", results_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_results_file_starts_with_its_command(path):
    rel = str(path.relative_to(RESULTS))
    if rel in NO_COMMAND_ALLOWED:
        pytest.skip("allow-listed: " + rel)
    head = path.read_text(encoding="utf-8").splitlines()[:HEAD_LINES]
    assert any(COMMAND.search(line) for line in head), f"{rel}: no command in its first {HEAD_LINES} lines"


def test_archive_has_an_index_line_per_file():
    archive = RESULTS / "archive"
    if not archive.exists():
        pytest.skip("no archive")
    index = (archive / "README.md").read_text(encoding="utf-8")
    listed = {t for _, t in links(archive / "README.md")}
    missing = [str(p.relative_to(archive)) for p in sorted(archive.rglob("*.md"))
               if p.name != "README.md" and str(p.relative_to(archive)) not in listed]
    assert not missing, "archived files without a line in docs/results/archive/README.md:\n" + "\n".join(missing)
    assert "replaced" in index.lower() or "superseded" in index.lower()
