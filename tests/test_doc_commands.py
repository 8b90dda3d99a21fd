"""Every training command line the docs show composes and passes validation as written (issue 35
item 9: docs that contradicted the code). Each `ridgeline train|sft|dpo` and `main_base` line of a
fenced block in README.md and docs/*.md is read as a shell would (continuations joined, comments
dropped) and its overrides go through `load_config`, the loader a run uses; nothing trains. Lines
with a placeholder (`<your overrides>`, `"$@"`, `"${RUN[@]}"`) are checked with the placeholder left
out; shell variables take the values their block gives them (`: "${NUM_GPUS:=1}"`, `NAME=value`).
Lines that name a GPU are skipped on a machine without one (the refusal is right there). The runs themselves are tested where they are cheap: tests/test_tutorial.py
runs the tutorial's blocks, the presets train in tests/test_presets*.py and the example tests."""

from __future__ import annotations

import re
import shlex

import pytest
import torch
from doc_blocks import REPO, fenced_blocks

from ridgeline.config import ConfigError, load_config

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(ridgeline (train|sft|dpo)|python -m ridgeline\.entrypoints\.main_base)(\s|$)")
# flags of `ridgeline train` that are not overrides, with the number of values each takes
FLAGS = {"--cfg": 1, "-p": 1, "--package": 1, "--resolve": 0, "--debug": 0}


# a block's shell defaults: `: "${NAME:=value}"` and `NAME=value` / `export NAME=value` lines
DEFAULT = re.compile(r'^:\s*"?\$\{(\w+):=([^}]*)\}"?|^(?:export\s+)?(\w+)=(\S+)$')
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def _command_lines() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for lang in ("bash", "sh", ""):
            for block in fenced_blocks(page.read_text(), lang):
                variables = {"HOME": "/home/user"}
                for line in block.code.splitlines():
                    if m := DEFAULT.match(line.strip()):
                        name, value = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                        variables[name] = value.strip("'\"")
                for line in re.sub(r"\\\n\s*", " ", block.code).splitlines():
                    line = line.strip()
                    if COMMAND.match(line):
                        line = re.sub(r"<[^>]*>", "", line)   # `<your overrides>`: the reader's part
                        line = VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), "$?"), line)
                        found.append((f"{page.relative_to(REPO)}:{block.line}", line))
    return found


COMMANDS = _command_lines()


def _overrides(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    words = words[3:] if words[0] == "python" else words[2:]
    out, i = [], 0
    while i < len(words):
        word = words[i]
        if word in FLAGS:
            i += 1 + FLAGS[word]
            continue
        if "$?" not in word and "$" not in word:   # "$@", "${RUN[@]}": the reader's part
            out.append(word)
        i += 1
    return out


def test_the_docs_show_training_commands():
    assert len(COMMANDS) >= 25, COMMANDS  # the scan finds what the pages hold


@pytest.mark.parametrize("where, line", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_command_line_of_the_docs_is_a_valid_config(where, line):
    if "cuda" in line and not torch.cuda.is_available():
        pytest.skip("names a GPU: refused on this machine, as it should be")
    try:
        load_config(_overrides(line))
    except ConfigError as err:
        pytest.fail(f"{where}: `{line}` is refused:\n{err}")
