"""The docs hold together: the README indexes every page, links resolve, the environment-variable
reference names every RIDGELINE_* variable the code reads, install blocks match `make setup`, and
the data-format example runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import REPO, fenced_blocks, makefile_installs, pip_installs
from conftest import HANG_GUARD_S

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> list[str]:
    """The lines of a markdown page outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _links(path: Path) -> list[str]:
    """Relative link targets of a markdown page, outside code blocks."""
    return [t for line in _prose(path) for t in LINK.findall(line) if not re.match(r"[a-z]+:", t)]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces -> -."""
    heads = [line.lstrip("#").strip() for line in _prose(path) if re.match(r"#+ ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_readme_indexes_every_doc():
    linked = {(REPO / t.split("#")[0]).resolve() for t in _links(REPO / "README.md")}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_named_docs_exist(page):
    """Pages named in prose (`docs/foo.md`) exist too."""
    named = set(re.findall(r"\bdocs/([a-z_]+\.md)", page.read_text()))
    assert not [n for n in named if not (DOCS / n).exists()]


def test_env_vars_doc_names_every_ridgeline_variable():
    names = set()
    for path in (REPO / "ridgeline").rglob("*.py"):
        names |= set(re.findall(r"\bRIDGELINE_[A-Z_]+\b", path.read_text()))
    doc = (DOCS / "env_vars.md").read_text()
    assert names and not sorted(n for n in names if n not in doc)


def test_readme_install_matches_makefile():
    """The README's install without make is what `make setup` runs."""
    block = next(b for b in fenced_blocks((REPO / "README.md").read_text(), "bash") if "pip install torch" in b.code)
    assert pip_installs(block.code) == makefile_installs()


def test_data_format_example_runs(tmp_path):
    """The example writes rows and loads them as a run does; it prints what the page says."""
    text = (DOCS / "data_format.md").read_text()
    example = fenced_blocks(text, "python")[0]
    printed = next(b for b in fenced_blocks(text, "") if b.line > example.line)   # the block after it
    done = subprocess.run([sys.executable, "-c", example.code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == printed.code.strip()
