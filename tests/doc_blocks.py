"""Reading the docs as tests do: fenced code blocks of a markdown page, the skip marker above a
block, and the pip lines of an install block against the Makefile's `make setup`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_MARK = re.compile(r"<!--\s*tutorial-test:\s*skip:\s*(?P<reason>.+?)\s*-->")


@dataclass(frozen=True)
class Block:
    line: int            # 1-based line of the opening fence
    code: str
    skip_reason: str | None


def fenced_blocks(text: str, lang: str) -> list[Block]:
    """The ```<lang> blocks of a markdown text (lang "" for bare ``` blocks), with the reason of a
    `tutorial-test: skip` marker on the line above a block."""
    blocks, lines = [], text.split("\n")
    i = 0
    while i < len(lines):
        opening = lines[i].strip()
        if opening.startswith("```"):
            start, body = i, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if opening[3:].strip() == lang:
                mark = SKIP_MARK.search(lines[start - 1]) if start else None
                blocks.append(Block(start + 1, "\n".join(body), mark.group("reason") if mark else None))
        i += 1
    return blocks


def pip_installs(code: str) -> list[str]:
    """What each `pip install` line of a shell block installs (arguments, comments and -q left out)."""
    found = []
    for line in code.splitlines():
        line = line.split("#", 1)[0].strip()
        if "pip install" in line and "--upgrade pip" not in line:
            found.append(line.split("pip install", 1)[1].replace("-q ", "").strip())
    return found


def makefile_installs() -> list[str]:
    """The `pip install`s of `make setup` (the $(STAMP) recipe), in order."""
    recipe = (REPO / "Makefile").read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    return pip_installs(recipe)
