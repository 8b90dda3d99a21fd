"""pyproject.toml's dependency lists match what ridgeline/ imports, both ways: every third-party
package the code imports is declared (core, or an extra when only an optional feature imports it),
and every declared package is imported (issue 21: the list had drifted from the code)."""

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# import name -> distribution, where they differ
DISTRIBUTION = {"hydra": "hydra-core", "yaml": "pyyaml", "math_verify": "math-verify", "mlflow": "mlflow-skinny",
                "huggingface_hub": "huggingface-hub", "skyrl_gym": "skyrl-gym"}
# declared, used without an import statement of ours: name -> where it is used
USED_INDIRECTLY = {
    "gguf": "transformers imports it to read trainer.policy.model.gguf_file",
    "tensorboard": "torch.utils.tensorboard (tracking/tensorboard_tracker.py) needs it",
    "skyrl-gym": "importlib.import_module('skyrl_gym') (envs/skyrl_gym_env.py)",
}
EXTRAS_NOT_FOR_THE_CODE = {"dev", "skyrl04-parity"}   # the test runner; what the skyrl 0.4 wheel imports (make test-skyrl04)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [_name(r) for r in project["dependencies"]]
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()
              if extra not in EXTRAS_NOT_FOR_THE_CODE}
    return {_name(r) for r in project["dependencies"]}, extras


def imported() -> dict[str, set[str]]:
    """Distribution -> the modules of ridgeline/ importing it (at any depth: lazy imports count)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "ridgeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("ridgeline", "__future__"):
                    continue
                dist = DISTRIBUTION.get(top, top).lower().replace("_", "-")
                found.setdefault(dist, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_import_is_declared():
    core, extras = declared()
    optional = set().union(*extras.values())
    undeclared = {dist: sorted(where) for dist, where in imported().items() if dist not in core | optional}
    assert undeclared == {}, f"imported but not in pyproject.toml: {undeclared}"


def test_every_declared_package_is_imported():
    core, extras = declared()
    used = set(imported()) | set(USED_INDIRECTLY)
    unused = sorted((core | set().union(*extras.values())) - used)
    assert unused == [], f"declared in pyproject.toml but imported nowhere in ridgeline/: {unused}"


def test_optional_packages_are_imported_only_inside_functions():
    """An extra's package (ray, vllm, wandb, ...) is imported where its feature runs, so a core
    install imports every module that does not need it."""
    core, extras = declared()
    optional = set().union(*extras.values()) - core
    at_top = []
    for path in sorted((REPO / "ridgeline").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if DISTRIBUTION.get(top, top).lower().replace("_", "-") in optional:
                    at_top.append(f"{path.relative_to(REPO)}: {name}")
    assert at_top == [], at_top
