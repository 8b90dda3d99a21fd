"""The key reference (docs/config_reference.md) generated from the schema: every key with its type,
default and what it does, the latter from the comments the schema's fields carry.

``python -m ridgeline.config.reference`` rewrites the file; tests/test_config_reference.py fails
when it is stale.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

from ridgeline.config.fields import field_type, section_fields, section_type, show
from ridgeline.config.schema import RidgelineConfig, default_of

__all__ = ["REFERENCE", "reference_text", "main"]

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"

HEADER = """# Config key reference

Every key of the config with its type, its default and what it does, generated from the schema
(`ridgeline/config/schema/`: a dataclass per section, a comment on each field) by
`python -m ridgeline.config.reference`; `tests/test_config_reference.py` fails when this file is
stale. Do not edit it by hand: change the field's comment. How keys are set, the presets, the keys of
other SkyRL releases and the longer notes on each feature: [config.md](config.md).
"""


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above it and the comment on its own lines, as text."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    on_line: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            on_line.setdefault(tok.start[0], []).append(tok.string.lstrip("#").strip())
    classdef = ast.parse(source).body[0]
    assert isinstance(classdef, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in classdef.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        row = stmt.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, lines[row - 1].strip().lstrip("#").strip())
            row -= 1
        inline = [text for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                  for text in on_line.get(n, []) if not lines[n - 1].strip().startswith("#")]
        out[stmt.target.id] = " ".join(above + inline)
    return out


def _field_doc(cls: type, name: str) -> str:
    for owner in cls.__mro__:
        if name in owner.__dict__.get("__annotations__", {}):
            text = _comments(owner).get(name, "")
            if text:
                return text
    return ""


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(_type_text(a) for a in rest) + " or null"
    if origin in (list, typing.List):
        return f"list of {_type_text(args[0])}" if args else "list"
    if origin in (dict, typing.Dict):
        return "map"
    if tp is typing.Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    out = [(prefix, cls)] if prefix else []
    for f in section_fields(cls):
        sub = section_type(field_type(cls, f.name))
        if sub is not None:
            out += _sections(sub, f"{prefix}.{f.name}" if prefix else f.name)
    return out


def reference_text() -> str:
    parts = [HEADER]
    for key, cls in _sections(RidgelineConfig, ""):
        parts.append(f"\n## `{key}`\n")
        doc = cls.__doc__  # a dataclass without one gets its signature as __doc__
        if doc and not doc.startswith(f"{cls.__name__}(") and doc != cls.__mro__[1].__doc__:
            parts.append(" ".join(doc.split()) + "\n")
        parts.append("| key | type | default | what it does |\n|---|---|---|---|")
        for f in section_fields(cls):
            tp = field_type(cls, f.name)
            if section_type(tp) is not None:
                continue
            default = default_of(f"{key}.{f.name}")
            choices = f.metadata.get("choices", ())
            what = _field_doc(cls, f.name)
            if choices:
                what = f"{what} One of {', '.join(show(c) for c in choices)}.".strip()
            parts.append(f"| `{key}.{f.name}` | {_cell(_type_text(tp))} | `{_cell(show(default))}` | {_cell(what)} |")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    REFERENCE.write_text(reference_text(), encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
