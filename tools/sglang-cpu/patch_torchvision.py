"""Guard torchvision's fake-op registrations so `import torchvision` works without its compiled ops.

PyPI's torchvision is a CUDA build whose `_C` cannot load against the CPU torch wheel; SGLang
imports `torchvision.transforms` while loading a model config, and the import then dies on an
unguarded `register_fake("torchvision::nms")`. This rewrites `_meta_registrations.py` to register
them only when the ops loaded. Idempotent. Usage: python patch_torchvision.py (in the target venv)."""

import importlib.util
import pathlib

spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
ANCHOR = "import torchvision.extension  # noqa: F401\n"
if "_tv_register_fake" not in text:
    if ANCHOR not in text:
        raise SystemExit(f"{path}: the line {ANCHOR.strip()!r} is missing; this torchvision is not the 0.28 the "
                         "patch was written for. Fix: pip install torchvision==0.28.0 --no-deps")
    text = text.replace("@torch.library.register_fake(", "@_tv_register_fake(")
    text = text.replace(ANCHOR, ANCHOR + "\n_tv_register_fake = (torch.library.register_fake if "
                        "torchvision.extension._has_ops()\n                     else (lambda *a, **k: (lambda f: f)))\n", 1)
    path.write_text(text)
print(f"torchvision fake-op registrations guarded: {path}")
