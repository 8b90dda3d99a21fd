"""Tinker checkpoints on disk: `tinker://<model_id>/<weights|sampler_weights>/<name>` is the folder
`<root>/<model_id>/<weights|sampler_weights>/<name>/` holding

  meta.json            what rebuilds the model: base model, LoRA rank and targets, seed, steps taken
  trainable.safetensors  the trained tensors (the LoRA adapters, or every weight when full-parameter)
  optimizer.pt         AdamW's state (state checkpoints, `weights/`, only)

written whole or not at all (a temporary folder renamed into place, as Ridgeline's run checkpoints),
so a server killed while saving leaves the previous checkpoint and no partial one. A new server on
the same root loads them: a client's state resumes exactly (weights, Adam moments, step count).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from ridgeline.inference.request_fields import RequestError

Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class ModelMeta:
    """What a training client is built from."""

    base_model: str
    lora_rank: int                      # 0: full-parameter
    target_modules: str | list[str]     # peft's target_modules ("all-linear" or names)
    seed: int
    steps: int = 0                      # optimizer steps taken


def check_name(value: str, field: str) -> str:
    if not _NAME.match(value):
        raise RequestError(f"{field} {value!r}: use letters, digits, '.', '_', ':' and '-' (at most 128, "
                           "starting with a letter or digit)", field)
    return value


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: Kind
    name: str

    @classmethod
    def parse(cls, path: str, field: str = "path") -> "TinkerPath":
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS:
            raise RequestError(f"{field} {path!r} is not a tinker://<model_id>/<weights|sampler_weights>/<name> path",
                               field)
        return cls(check_name(parts[0], field), parts[1], check_name(parts[2], field))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


class CheckpointStore:
    def __init__(self, root: Path):
        self.root = root

    def folder(self, path: TinkerPath) -> Path:
        return self.root / path.model_id / path.kind / path.name

    def save(self, path: TinkerPath, meta: ModelMeta, tensors: dict[str, torch.Tensor],
             optimizer: dict | None, *, overwrite: bool) -> None:
        final = self.folder(path)
        if final.exists() and not overwrite:
            raise RequestError(f"path: {path} exists already; pass another name (or overwrite=True)", "path")
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "meta.json").write_text(json.dumps(asdict(meta)))
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / "trainable.safetensors"))
        if optimizer is not None:
            torch.save(optimizer, tmp / "optimizer.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)

    def load(self, path: TinkerPath, *, optimizer: bool) -> tuple[ModelMeta, dict[str, torch.Tensor], dict | None]:
        folder = self.folder(path)
        if not (folder / "meta.json").is_file():
            raise RequestError(f"path: no checkpoint {path} on this server (root {self.root})", "path")
        meta = ModelMeta(**json.loads((folder / "meta.json").read_text()))
        tensors = load_file(str(folder / "trainable.safetensors"))
        state = None
        if optimizer:
            if not (folder / "optimizer.pt").is_file():
                raise RequestError(f"path: {path} holds no optimizer state (a sampler checkpoint); load it without "
                                   "the optimizer", "path")
            state = torch.load(folder / "optimizer.pt", weights_only=True)
        return meta, tensors, state

    def list(self, model_id: str) -> list[tuple[TinkerPath, datetime, int]]:
        """Every checkpoint of `model_id`: (path, time written, size in bytes)."""
        out = []
        for kind in KINDS:
            for folder in sorted((self.root / model_id / kind).glob("[!.]*")):
                if (folder / "meta.json").is_file():
                    size = sum(f.stat().st_size for f in folder.iterdir())
                    when = datetime.fromtimestamp(folder.stat().st_mtime, tz=timezone.utc)
                    out.append((TinkerPath(model_id, kind, folder.name), when, size))
        return out
