"""Import a user's module by dotted name or by .py file (a stdlib leaf module every layer may use).

Users extend Ridgeline by registering things (environments, advantage estimators, policy losses)
in a module of their own that the config names: `environment.env_modules`,
`trainer.algorithm.algorithm_modules`. Both go through `load_user_module`, so a file named by two
keys (or twice) runs once per process and its `register` calls never see their name taken by
themselves.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_user_module"]


def load_user_module(spec: str | Path, what: str = "module") -> ModuleType:
    """The module `spec` names: a dotted module name on the Python path (`"my_pkg.algos"`) or a
    path to a `.py` file. A file gets a stable name derived from its resolved path, so loading it
    again returns the cached module instead of executing it a second time. `what` names the kind of
    module in error messages (e.g. "env module")."""
    text = str(spec)
    looks_like_path = isinstance(spec, Path) or text.endswith(".py") or "/" in text or "\\" in text
    if not looks_like_path:
        try:
            return importlib.import_module(text)
        except ImportError as exc:
            raise ImportError(f"could not import {what} {text!r}: {exc}") from exc

    path = Path(text).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {text} (resolved to {path})")
    digest = hashlib.sha1(str(path).encode("utf-8")).hexdigest()[:10]
    module_name = f"ridgeline_user_{_safe_identifier(path.stem)}_{digest}"
    cached = sys.modules.get(module_name)
    if cached is not None:
        return cached
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"could not load {what} from {path}")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so dataclasses/pickling inside the module can find it.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _safe_identifier(stem: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    return cleaned or "module"
