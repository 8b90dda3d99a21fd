"""`data.prepare` (Ridgeline extension): the dataset files a run reads, written from its config.

The files are written when one is missing, and written again when `data.prepare` changed since
they were written: each preparation (`data.prepare` or the `ridgeline prepare` command, both through
`write_dataset`) leaves `MANIFEST` in its output folder: the preparer's arguments with their
defaults filled in, so `data.prepare.num_train=48` on a run folder prepared with 160 rows gives 48
rows, as asked, while `ridgeline prepare gsm8k --output ~/data/gsm8k` counts as the preset's own
preparation. Where the rows were read from (`input_dir`: local files instead of the hub) is not
part of it: the same rows either way. Files that exist without a manifest were not written by
Ridgeline (the user's own, or an older Ridgeline's): they are used as they are, with one warning
saying so, never overwritten.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .prepare_arithmetic import prepare_arithmetic
from .prepare_code import prepare_code
from .prepare_gsm8k import prepare_gsm8k
from .prepare_multiply import prepare_multiply
from .prepare_text2sql import prepare_text2sql
from .schema import DatasetError

__all__ = ["MANIFEST", "PREPARERS", "prepare_dataset", "write_dataset"]

log = logging.getLogger(__name__)

# data.prepare.dataset -> the function writing it; each takes output_dir, env_class and its options
PREPARERS: dict[str, Callable[..., dict[str, Path]]] = {
    "arithmetic": prepare_arithmetic, "code": prepare_code, "gsm8k": prepare_gsm8k,
    "multiply": prepare_multiply, "text2sql": prepare_text2sql}
MANIFEST = ".ridgeline-prepare.json"   # hidden: a dataset folder read with load_dataset skips it
_SOURCE_ONLY = ("output_dir", "input_dir")   # where files go / come from, not what the rows hold


def prepare_dataset(spec: dict[str, Any], wanted: Sequence[Path]) -> None:
    """Write the files of `spec` (`data.prepare` resolved: dataset, output_dir, env_class,
    options) unless the files `wanted` (data.train_data / val_data's files) exist and were written
    from the same settings."""
    out = Path(spec["output_dir"])
    settings = {k: v for k, v in spec.items() if k != "output_dir"}
    manifest = out / MANIFEST
    if wanted and all(p.exists() for p in wanted):
        if not manifest.exists():
            log.warning("data.prepare (dataset %s) was not applied: the data files exist already (%s) and were not "
                        "written by data.prepare (no %s beside them), so they are read as they are. Fix: delete "
                        "them, or set data.prepare.output_dir (and data.train_data / data.val_data) to another "
                        "folder, to have them prepared", settings.get("dataset"), ", ".join(map(str, wanted)),
                        MANIFEST)
            return
        before = _read(manifest)
        now = _identity(settings, "data.prepare")
        if before is not None and _identity(before, "data.prepare") == now:
            return
        log.info("data.prepare changed since the files in %s were written (%s): writing them again", out,
                 "; ".join(_changes(before, now)))
    else:
        log.info("data.prepare: writing the %s dataset into %s", settings["dataset"], out)
    write_dataset(out, settings, "data.prepare")


def write_dataset(out: Path, settings: dict[str, Any], command: str) -> dict[str, Path]:
    """Run the preparer of `settings["dataset"]` with the other settings as its options, writing
    into `out`, then `MANIFEST`; returns the preparer's files. `command` names the options in errors
    (`data.prepare`: config keys; `ridgeline prepare`: the command's own flags)."""
    options = dict(settings)
    dataset = options.pop("dataset")
    _check_options(dataset, options, command)
    try:
        written = PREPARERS[dataset](out, **options)
    except DatasetError:   # already names the file or the source
        raise
    except ValueError as exc:  # the preparers' refusals of their arguments: the user's to fix
        raise DatasetError(f"{command} ({dataset}): {exc}") from exc
    (out / MANIFEST).write_text(json.dumps(_identity(settings, command), indent=1, sort_keys=True) + "\n",
                                encoding="utf-8")
    return written


def _check_options(dataset: str, options: dict[str, Any], command: str) -> None:
    accepted = [p for p in inspect.signature(PREPARERS[dataset]).parameters if p != "output_dir"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise DatasetError(f"{command}.{unknown[0]} is not an option of the {dataset} dataset. Fix: "
                           f"one of {', '.join(accepted)} (e.g. +{command}.{accepted[0]}=...), or remove it")


def _identity(settings: dict[str, Any], command: str) -> dict[str, Any]:
    """What the rows of `settings` are: the dataset and every option of its preparer, defaults
    filled in, without where the files go or come from. A manifest of an unknown dataset (or an
    older Ridgeline's, with an option no longer taken) is compared as written."""
    dataset = settings.get("dataset")
    if dataset not in PREPARERS:
        return dict(settings)
    params = inspect.signature(PREPARERS[dataset]).parameters
    if set(settings) - {"dataset"} - set(params):
        return dict(settings)
    given = {k: v for k, v in settings.items() if k != "dataset"}
    full = {name: given.get(name, p.default) for name, p in params.items()
            if name not in _SOURCE_ONLY and p.default is not inspect.Parameter.empty}
    return {"dataset": dataset, **full}


def _read(manifest: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable: prepared again, as a changed one is
        return None
    return value if isinstance(value, dict) else None


def _changes(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    if before is None:
        return [f"{MANIFEST} unreadable"]
    keys = [*now, *(k for k in before if k not in now)]
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)]
