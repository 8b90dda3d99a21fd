"""No import circles in ridgeline/: every import a module makes (at the top, inside a function, or
for types only) goes to a module that does not import it back, directly or through others.

Types-only imports of the config schema (``if TYPE_CHECKING: from ridgeline.config.schema ...``)
are the one exception: the schema's rules still call a few layers' checks (the placement plan, the
loss registry, LoRA's reference rule), so naming its types below them closes a circle the checker
sees and Python never runs (docs/architecture.md, "The config object")."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_TYPES = ("ridgeline.config.schema", "ridgeline.config.loss_view")


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "ridgeline").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    types_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                  for sub in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else ".".join(name.split(".")[:-node.level] + [node.module])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if not target or target == name:
                continue
            if id(node) in types_only and target.startswith(SCHEMA_TYPES):
                continue
            out.add(target)
    return out


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        raise AssertionError(f"import circle: {' -> '.join(err.args[1])}") from None
