"""Checkpoints (write, find, check, load), Hugging Face exports and Ctrl-C handling for the trainer.

A checkpoint is the folder `<trainer.ckpt_path>/global_step_<N>`, holding everything the run needs
to go on as if it had never stopped (docs/checkpointing.md):

    policy/             Hugging Face folder: weights (safetensors), config, generation config,
                        tokenizer files; with LoRA the adapters instead of the weights
                        (adapter_model.safetensors, adapter_config.json) and the tokenizer files
    policy_optim.pt     AdamW state + learning-rate schedule state
    critic/             the value model (backbone + value_head.safetensors) and the tokenizer, if any
    critic_optim.pt     the critic's AdamW + schedule state, if any
    ref/                the reference model, only once `update_ref_every_epoch` replaced it
    trainer_state.json  global step, data position, run id, KL controller, running reward std,
                        skipped-step counters, metrics rows written so far
    rng_state.pt        python `random`, numpy, torch CPU (+ CUDA) RNG states
    config.yaml         the resolved config of the run
    fingerprint.json    what identifies the run: models, training data (sha256), seed, batch size
    COMPLETE            written last: a folder without it is never loaded

Writing is atomic: everything goes into `<ckpt_path>/.tmp_global_step_<N>_<random>`, every file is
fsynced, `COMPLETE` is written, the folder is renamed to `global_step_<N>`, and only then the
pointer file `<ckpt_path>/latest` is replaced (temp file + os.replace) and old checkpoints pruned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from ridgeline.models import lora
from ridgeline.models.loading import load_model, load_safetensors_into, policy_spec, quiet_transformers, save_hf_model
from ridgeline.models.value_model import VALUE_HEAD_FILE
from ridgeline.training.optim import restore_optimizer

if TYPE_CHECKING:
    from ridgeline.data import PromptDataset
    from ridgeline.trainer.trainer import Trainer

log = logging.getLogger(__name__)

CKPT_PREFIX = "global_step_"
POINTER = "latest"
COMPLETE = "COMPLETE"
FORMAT = 1
_NAME = re.compile(rf"^{CKPT_PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, or resumed from; the message says why and what to do."""


# ------------------------------------------------------------------------------------ finding
def checkpoint_step(folder: Path) -> int | None:
    m = _NAME.match(Path(folder).name)
    return int(m.group(1)) if m else None


def is_complete(folder: Path) -> bool:
    folder = Path(folder)
    return checkpoint_step(folder) is not None and (folder / COMPLETE).is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint the `latest` pointer names; if the pointer is missing or names an incomplete
    folder, the newest complete checkpoint (with a warning); None when there is none."""
    root = Path(root)
    pointer = root / POINTER
    complete = list_checkpoints(root)
    if pointer.is_file():
        folder = root / pointer.read_text().strip()
        if is_complete(folder):
            return folder
        log.warning("%s names %s, which is missing or incomplete; %s", pointer, folder,
                    f"taking the newest complete checkpoint {complete[-1]}" if complete else "no complete checkpoint")
    elif complete:
        log.warning("%s has no %s pointer; taking the newest complete checkpoint %s", root, POINTER, complete[-1])
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder from `path`: the folder itself, or the latest under a
    `ckpt_path` root. Raises CheckpointError naming the problem."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if checkpoint_step(path) is not None:
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker: its writing "
                                  "was interrupted); use an earlier global_step_N folder")
        return path
    folder = latest_checkpoint(path)
    if folder is None:
        raise CheckpointError(f"{path} is neither a checkpoint folder (global_step_N) nor a ckpt_path "
                              "holding a complete checkpoint")
    return folder


def find_resume_checkpoint(cfg: DictConfig) -> Path | None:
    """The checkpoint `trainer.resume_mode` asks for: none -> None; latest -> the one the pointer
    in `trainer.ckpt_path` names (None, logged, when there is none); from_path -> `resume_path`,
    which must be a complete checkpoint."""
    t = cfg.trainer
    if t.resume_mode == "none":
        return None
    if t.resume_mode == "latest":
        folder = latest_checkpoint(Path(t.ckpt_path))
        if folder is None:
            log.info("trainer.resume_mode=latest: no checkpoint in %s; starting at step 0", t.ckpt_path)
        return folder
    path = Path(str(t.resume_path))
    if not path.exists():
        raise CheckpointError(f"trainer.resume_path={path} does not exist (trainer.resume_mode=from_path). "
                              "Fix: name a checkpoint folder <ckpt_path>/global_step_N, or "
                              "trainer.resume_mode=latest")
    if not is_complete(path):
        raise CheckpointError(f"trainer.resume_path={path} is not a complete checkpoint: a folder "
                              f"global_step_N holding a {COMPLETE} marker is needed (a folder without one "
                              "was interrupted while being written). Fix: name an earlier global_step_N, or "
                              "trainer.resume_mode=latest")
    return path


# ------------------------------------------------------------------------------------ identity
def new_run_id() -> str:
    """The tracker run id: made once when a run starts at step 0, kept in every checkpoint."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def _file_digest(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"file": str(path), "size": os.path.getsize(path), "sha256": h.hexdigest()}


def run_fingerprint(cfg: DictConfig, train_data: "PromptDataset") -> dict[str, Any]:
    """What identifies a run: a resume that changes any of it is refused (unless
    `trainer.resume_ignore_config_changes`). Data files are compared by content, not path."""
    t = cfg.trainer
    fingerprint = {
        "trainer.policy.model.path": t.policy.model.path,
        "trainer.policy.model.gguf_file": t.policy.model.get("gguf_file"),
        "trainer.critic.model.path": t.critic.model.path,
        "data.train_data": [_file_digest(f) for f in train_data.files],
        "usable training rows": len(train_data),
        "trainer.seed": t.seed,
        "trainer.train_batch_size": t.train_batch_size,
    }
    settings = lora.lora_settings(cfg)
    if settings is not None:  # only with LoRA on, so checkpoints written before LoRA existed still resume
        fingerprint["trainer.policy.model.lora"] = {"rank": settings.rank, "alpha": settings.alpha,
                                                    "target_modules": _plain(settings.target_modules)}
    return fingerprint


def _plain(targets: str | tuple[str, ...]) -> str | list[str]:
    return targets if isinstance(targets, str) else list(targets)


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per identity item that differs between a checkpoint's run and this config."""
    changes = []
    for key, now in current.items():
        before = saved.get(key)
        if key == "data.train_data":
            if [(d["size"], d["sha256"]) for d in before or []] != [(d["size"], d["sha256"]) for d in now]:
                changes.append(f"data.train_data: the training files' contents differ "
                               f"(checkpoint: {[d['file'] for d in before or []]}, now: {[d['file'] for d in now]})")
        elif before != now:
            why = " (trainer.max_prompt_length or the data changed)" if key == "usable training rows" else ""
            changes.append(f"{key}: {before!r} -> {now!r}{why}")
    return changes


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def check_resume(cfg: DictConfig, folder: Path, fingerprint: dict[str, Any]) -> None:
    """Refuse a resume whose run differs in identity (model, data, seed, batch size), or warn
    with `trainer.resume_ignore_config_changes=true`; log every other config change."""
    saved = json.loads((folder / "fingerprint.json").read_text())
    changes = fingerprint_changes(saved, fingerprint)
    if changes:
        lines = "\n".join(f"  - {c}" for c in changes)
        if not cfg.trainer.resume_ignore_config_changes:
            raise CheckpointError(
                f"refusing to resume from {folder}: this config is not the run that wrote it:\n{lines}\n"
                "Fix: resume with the run's own settings; or start afresh (trainer.resume_mode=none, or "
                "another trainer.ckpt_path); or set trainer.resume_ignore_config_changes=true to resume anyway.")
        log.warning("resuming from %s although the run differs (trainer.resume_ignore_config_changes=true):\n%s",
                    folder, lines)
    before = _flat(OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False))
    now = _flat(OmegaConf.to_container(cfg, resolve=True))
    other = [f"{k}: {before.get(k, '<absent>')!r} -> {now.get(k, '<absent>')!r}"
             for k in sorted(set(before) | set(now)) if before.get(k, "<absent>") != now.get(k, "<absent>")]
    if other:
        log.info("resuming with %d config change(s) against the checkpoint:\n%s", len(other),
                 "\n".join(f"  - {line}" for line in other))


# ------------------------------------------------------------------------------------ metrics
METRICS_FILE = "metrics.jsonl"


def metrics_rows(run_dir: Path) -> int:
    """Complete rows (lines) of the run's metrics.jsonl."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        return f.read().count(b"\n")


def prepare_metrics(run_dir: Path, resume_from: Path | None) -> None:
    """Before the trackers open metrics.jsonl. Resuming in the run's own folder: cut the file back
    to the rows it held when the checkpoint was written, so the steps redone after it are not
    logged twice. Otherwise (step 0, or another folder's checkpoint) the file is not this run's
    history: set it aside (metrics.jsonl.<time>.old)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    state = json.loads((resume_from / "trainer_state.json").read_text()) if resume_from is not None else {}
    if resume_from is None or Path(state.get("run_dir", "")).resolve() != Path(run_dir).resolve():
        if path.stat().st_size:
            old = path.with_name(f"{METRICS_FILE}.{time.strftime('%Y%m%d-%H%M%S')}.old")
            path.rename(old)
            log.info("%s holds another run's metrics; moved to %s", path, old)
        return
    keep = state["metrics_rows"]
    lines = path.read_bytes().split(b"\n")[:-1]  # complete rows only
    if len(lines) < keep:
        log.warning("%s holds %d rows, fewer than the %d it had at %s; keeping them", path, len(lines), keep,
                    resume_from)
        keep = len(lines)
    dropped = len(lines) - keep
    tmp = path.with_name(f".{METRICS_FILE}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in lines[:keep]))
    os.replace(tmp, path)
    if dropped:
        log.info("%s: dropped %d row(s) logged after the checkpoint (those steps run again)", path, dropped)


# ------------------------------------------------------------------------------------ writing
def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath), directory=True)


def _save_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _write_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _remove(folder: Path) -> None:
    """Remove a folder so that no partly deleted copy keeps its name: rename, then delete."""
    trash = folder.with_name(f".trash_{folder.name}_{secrets.token_hex(4)}")
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _sharded(worker) -> bool:
    """Workers of `trainer.strategy=fsdp2` (ridgeline.distributed.ray_workers) hold no model in
    this process: their ranks gather and write (or read) full weights and optimizer states
    themselves, through `save_hf` / `load_hf` / `save_optimizer` / `load_optimizer`."""
    return hasattr(worker, "save_hf")


def save_policy(trainer: "Trainer", folder: Path) -> None:
    """The policy as a Hugging Face folder (with the tokenizer); a LoRA policy with its adapters
    merged in, so the folder loads with plain transformers."""
    if _sharded(trainer.policy):
        trainer.policy.save_hf(folder)
    elif lora.is_lora(trainer.policy.model):
        lora.save_merged(trainer.policy.model, trainer.tokenizer, folder)
    else:
        save_hf_model(trainer.policy.model, trainer.tokenizer, folder)


def _save_policy_state(trainer: "Trainer", folder: Path) -> None:
    """A checkpoint's `policy/`: what resuming needs. With LoRA only the adapters (and the
    tokenizer): the frozen base is rebuilt from `trainer.policy.model.path`."""
    if not _sharded(trainer.policy) and lora.is_lora(trainer.policy.model):
        lora.save_adapter(trainer.policy.model, folder)
        trainer.tokenizer.save_pretrained(folder)
    else:
        save_policy(trainer, folder)


def save_critic(trainer: "Trainer", folder: Path) -> None:
    """The value model (backbone folder + value_head.safetensors) with the tokenizer."""
    if _sharded(trainer.critic):
        trainer.critic.save_hf(folder)
        return
    with quiet_transformers():
        trainer.critic.model.save_pretrained(folder)
    trainer.tokenizer.save_pretrained(folder)


def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _optim_state(worker) -> dict[str, Any]:
    return {"optimizer": worker.optimizer.state_dict(), "scheduler": worker.scheduler.state_dict()}


def trainer_state(trainer: "Trainer") -> dict[str, Any]:
    """The step loop's own state (JSON: floats round-trip exactly)."""
    s = trainer.state
    kl = s.kl_controller
    epoch, batch = trainer.data_position
    return {
        "format": FORMAT,
        "global_step": trainer.global_step,
        "epoch": epoch,                    # the next batch to train is batch `batch` of epoch `epoch`
        "batch_in_epoch": batch,           # of the order shuffled from (seed, epoch)
        "steps_per_epoch": trainer.steps_per_epoch,
        "run_id": trainer.run_id,
        "run_dir": str(trainer.run_dir),
        "metrics_rows": metrics_rows(trainer.run_dir),
        "kl_controller": None if kl is None else {"type": type(kl).__name__, "value": kl.value},
        "reward_std": None if s.reward_std is None else
        {"count": s.reward_std.count, "mean": s.reward_std.mean, "m2": s.reward_std.m2},
        "policy_skipped_steps": trainer.policy.skipped_steps,
        "critic_skipped_steps": trainer.critic.skipped_steps if trainer.critic is not None else None,
        "ref_updated": trainer.ref_updated,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_checkpoint_contents(trainer: "Trainer", folder: Path) -> None:
    """Everything but the COMPLETE marker, into `folder`."""
    _save_torch(_rng_state(), folder / "rng_state.pt")  # first: nothing below may move an RNG first
    _save_policy_state(trainer, folder / "policy")
    if _sharded(trainer.policy):
        trainer.policy.save_optimizer(folder / "policy_optim.pt")
    else:
        _save_torch(_optim_state(trainer.policy), folder / "policy_optim.pt")
    if trainer.critic is not None:
        save_critic(trainer, folder / "critic")
        if _sharded(trainer.critic):
            trainer.critic.save_optimizer(folder / "critic_optim.pt")
        else:
            _save_torch(_optim_state(trainer.critic), folder / "critic_optim.pt")
    if trainer.ref is not None and trainer.ref_updated:
        if _sharded(trainer.ref):
            trainer.ref.save_hf(folder / "ref")
        else:
            with quiet_transformers():
                trainer.ref.model.save_pretrained(folder / "ref")
    _write_json(trainer_state(trainer), folder / "trainer_state.json")
    _write_json(trainer.fingerprint, folder / "fingerprint.json")
    OmegaConf.save(trainer.cfg, folder / "config.yaml", resolve=True)


def _write_pointer(root: Path, name: str) -> None:
    tmp = root / f".{POINTER}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / POINTER)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_path(root, directory=True)


def _clean_stale(root: Path) -> None:
    """Temp and trash folders left by a run that was killed while writing or pruning."""
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(f".tmp_{CKPT_PREFIX}") or p.name.startswith(f".trash_{CKPT_PREFIX}")):
            log.info("removing %s (left by an interrupted checkpoint write)", p)
            shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Remove the oldest complete checkpoints beyond the `keep` newest (-1: keep all); never the
    one the pointer names."""
    if keep is None or keep < 1:
        return []
    removed = []
    for folder in list_checkpoints(root)[:-keep]:
        if protect is not None and folder.name == protect.name:
            continue
        _remove(folder)
        removed.append(folder)
    if removed:
        log.info("removed old checkpoint(s) %s (trainer.max_ckpts_to_keep=%d)",
                 ", ".join(p.name for p in removed), keep)
    return removed


def save_checkpoint(trainer: "Trainer") -> Path:
    """Write `global_step_<N>` atomically, point `latest` at it, prune. On any failure the temp
    folder is removed, the previous checkpoint and pointer stay as they were, and a
    CheckpointError names the path and the cause."""
    t = trainer.cfg.trainer
    root = Path(t.ckpt_path)
    name = f"{CKPT_PREFIX}{trainer.global_step}"
    final = root / name
    tmp = root / f".tmp_{name}_{secrets.token_hex(4)}"
    start = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale(root)
        tmp.mkdir()
        write_checkpoint_contents(trainer, tmp)
        (tmp / COMPLETE).write_text(json.dumps({"global_step": trainer.global_step}) + "\n")
        _fsync_tree(tmp)
        if final.exists():  # from an earlier, abandoned timeline of this ckpt_path
            _remove(final)
        os.rename(tmp, final)
        _fsync_path(root, directory=True)
        _write_pointer(root, name)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = trainer.last_checkpoint or (latest_checkpoint(root) if root.is_dir() else None)
        raise CheckpointError(
            f"could not write checkpoint {final} at step {trainer.global_step}: {type(exc).__name__}: {exc}. "
            f"The run stops; the previous checkpoint ({previous or 'none'}) and the pointer {root / POINTER} "
            "are untouched. Fix the cause (e.g. free disk space, or a trainer.ckpt_path on a larger disk) and "
            "rerun with trainer.resume_mode=latest.") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    trainer.last_checkpoint = final
    prune(root, t.max_ckpts_to_keep, protect=final)
    log.info("checkpoint %s written (%.2f s)", final, time.perf_counter() - start)
    return final


# ------------------------------------------------------------------------------------ loading
def _load_weights(model: torch.nn.Module, folder: Path, skip: tuple[str, ...] = ()) -> None:
    """Load a save_pretrained folder's safetensors into `model` in place."""
    files = [f for f in sorted(folder.glob("*.safetensors")) if f.name not in skip]
    try:
        load_safetensors_into(model, files)
    except ValueError as err:
        raise CheckpointError(f"{folder} does not fit the model: {err} "
                              "(was it written by a run with another model?)") from None


def _load_policy_state(model: torch.nn.Module, folder: Path) -> None:
    """A checkpoint's `policy/` into the one-process policy: full weights, or LoRA adapters."""
    saved_adapters, ours = lora.is_adapter_folder(folder), lora.is_lora(model)
    if saved_adapters != ours:
        held = "LoRA adapters" if saved_adapters else "full weights (no LoRA)"
        raise CheckpointError(f"{folder} holds {held}, but this run has trainer.policy.model.lora.rank "
                              f"{'> 0' if ours else '= 0'}. Fix: resume with the run's own "
                              "trainer.policy.model.lora.* settings, or start afresh (trainer.resume_mode=none)")
    if not ours:
        _load_weights(model, folder)
        return
    try:
        lora.load_adapter(model, folder)
    except ValueError as err:
        raise CheckpointError(f"{err}. Fix: resume with the run's own trainer.policy.model.lora.* settings") from None


def _load_optim(worker, path: Path) -> None:
    """Moments, step counts and schedule position from the checkpoint; hyperparameters from this
    run's config (`restore_optimizer`)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)

    def load() -> None:
        worker.optimizer.load_state_dict(saved["optimizer"])
        worker.scheduler.load_state_dict(saved["scheduler"])
    restore_optimizer(worker.optimizer, worker.scheduler, load)


def load_checkpoint(trainer: "Trainer", folder: Path) -> None:
    """Put the trainer in the state the checkpoint recorded; the engine gets the policy weights."""
    folder = Path(folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: checkpoint format {state.get('format')} is not {FORMAT}")
    if _sharded(trainer.policy):
        trainer.policy.load_hf(folder / "policy")
        trainer.policy.load_optimizer(folder / "policy_optim.pt")
    else:
        _load_policy_state(trainer.policy.model, folder / "policy")
        _load_optim(trainer.policy, folder / "policy_optim.pt")
    trainer.policy.skipped_steps = state["policy_skipped_steps"]
    if trainer.critic is not None:
        if not (folder / "critic").is_dir():
            raise CheckpointError(f"{folder} holds no critic, but trainer.critic.model.path is set")
        if _sharded(trainer.critic):
            trainer.critic.load_hf(folder / "critic")
            trainer.critic.load_optimizer(folder / "critic_optim.pt")
        else:
            _load_weights(trainer.critic.model.backbone, folder / "critic", skip=(VALUE_HEAD_FILE,))
            head = load_file(str(folder / "critic" / VALUE_HEAD_FILE))
            prefix = f"{trainer.critic.model.value_head_prefix}."
            trainer.critic.model.head.load_state_dict({k[len(prefix):]: v for k, v in head.items()})
            _load_optim(trainer.critic, folder / "critic_optim.pt")
        trainer.critic.skipped_steps = state["critic_skipped_steps"] or 0
    if state["ref_updated"]:
        if trainer.ref is not None:
            if _sharded(trainer.ref):
                trainer.ref.load_hf(folder / "ref")
            else:
                _load_weights(trainer.ref.model, folder / "ref")
        trainer.ref_updated = True
    s = trainer.state
    if s.kl_controller is not None and state["kl_controller"] is not None:
        s.kl_controller.value = state["kl_controller"]["value"]
    if s.reward_std is not None and state["reward_std"] is not None:
        for k, v in state["reward_std"].items():
            setattr(s.reward_std, k, v)
    trainer.global_step = state["global_step"]
    epoch, batch = state["epoch"], state["batch_in_epoch"]
    if batch >= trainer.steps_per_epoch:  # fewer batches per epoch now (resume_ignore_config_changes)
        epoch, batch = epoch + 1, 0
    trainer.data_position = (epoch, batch)
    trainer.run_id = state["run_id"]
    trainer.last_checkpoint = folder
    trainer.weight_sync.sync(trainer.global_step)
    _set_rng_state(torch.load(folder / "rng_state.pt", map_location="cpu", weights_only=True))
    log.info("resumed from %s: step %d, next batch %d of epoch %d, run id %s", folder, trainer.global_step,
             batch, epoch, trainer.run_id)


def saved_run_id(folder: Path | None) -> str | None:
    if folder is None:
        return None
    return json.loads((Path(folder) / "trainer_state.json").read_text())["run_id"]


# ------------------------------------------------------------------------------------ exports
def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        _remove(final)
    os.rename(tmp, final)


def export_models(trainer: "Trainer", out: Path) -> Path:
    """`out/policy` (and `out/critic` with a critic) as Hugging Face folders, written to a temp
    sibling and renamed when complete."""
    out = Path(out)
    tmp = out.with_name(f".tmp_{out.name}_{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
        save_policy(trainer, tmp / "policy")
        if trainer.critic is not None:
            save_critic(trainer, tmp / "critic")
        _fsync_tree(tmp)
        _publish(tmp, out)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not export the model to {out} at step {trainer.global_step}: "
                              f"{type(exc).__name__}: {exc}. The run stops.") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s", out)
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """The same folders as a periodic export (`out/policy`, `out/critic`), copied from a checkpoint
    folder or from the latest checkpoint under a ckpt_path. `out` must not hold anything yet. A
    LoRA checkpoint's adapters are merged into its base model (`_export_adapters`)."""
    folder = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty; name a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp_{out.name}_{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        if lora.is_adapter_folder(folder / "policy"):
            _export_adapters(folder, tmp / "policy")
        else:
            shutil.copytree(folder / "policy", tmp / "policy")
        if (folder / "critic").is_dir():
            shutil.copytree(folder / "critic", tmp / "critic")
        _fsync_tree(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _export_adapters(folder: Path, out: Path) -> None:
    """A LoRA checkpoint's policy as a merged Hugging Face folder: the base model its run named
    (`trainer.policy.model.*` in the checkpoint's config.yaml), its adapters merged in, its tokenizer."""
    from transformers import AutoTokenizer

    spec = policy_spec(OmegaConf.load(folder / "config.yaml"))
    tokenizer = AutoTokenizer.from_pretrained(folder / "policy")
    save_hf_model(lora.load_merged(load_model(spec, torch.float32, tokenizer), folder / "policy"), tokenizer, out)


# ------------------------------------------------------------------------------------ Ctrl-C
@contextlib.contextmanager
def interrupt_handling(trainer: "Trainer") -> Iterator[None]:
    """With `trainer.ckpt_on_interrupt`: the first Ctrl-C during a step lets that step finish (the
    loop then raises KeyboardInterrupt); a Ctrl-C between steps, or a second one, interrupts at
    once. On the way out, a KeyboardInterrupt that arrived between steps writes a checkpoint of
    the last completed step; one that arrived inside a step writes nothing (the step's update may
    be half done) and the newest checkpoint stays the resume point."""
    if not trainer.cfg.trainer.ckpt_on_interrupt:
        yield
        return

    def on_sigint(signum, frame):
        if trainer.stop_requested or not trainer.in_step:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        log.warning("Ctrl-C: step %d finishes, then a checkpoint is written and the run stops "
                    "(Ctrl-C again to stop at once without one)", trainer.global_step)

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except KeyboardInterrupt:
        _checkpoint_on_interrupt(trainer)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _checkpoint_on_interrupt(trainer: "Trainer") -> None:
    if trainer.in_step:
        log.warning("interrupted inside step %d: its half-done update is not saved; the newest checkpoint "
                    "is %s", trainer.global_step, trainer.last_checkpoint or "none")
    elif trainer.global_step == 0:
        log.warning("interrupted before the first step: nothing to save")
    elif trainer.last_checkpoint is not None and checkpoint_step(trainer.last_checkpoint) == trainer.global_step:
        log.warning("interrupted after step %d, already saved in %s", trainer.global_step, trainer.last_checkpoint)
    else:
        folder = save_checkpoint(trainer)
        log.warning("interrupted after step %d: checkpoint %s written (resume with "
                    "trainer.resume_mode=latest)", trainer.global_step, folder)
