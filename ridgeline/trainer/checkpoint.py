"""Checkpoints (write, find, check, load) and Hugging Face exports. `Checkpointer` owns the file
format; the trainer owns what goes in (`RunState` and the `Workers`) and hands it over, so this
module never reaches into the trainer.

A checkpoint is the folder `<trainer.ckpt_path>/global_step_<N>`, holding everything the run needs
to go on as if it had never stopped (docs/checkpointing.md):

    policy/             Hugging Face folder: weights (safetensors), config, generation config,
                        tokenizer files; with LoRA the adapters instead of the weights
                        (adapter_model.safetensors, adapter_config.json) and the tokenizer files
    policy_optim.pt     AdamW state + learning-rate schedule state
    critic/             the value model (backbone + value_head.safetensors) and the tokenizer, if any;
                        with LoRA on the critic its backbone's adapters instead of the backbone
    critic_optim.pt     the critic's AdamW + schedule state, if any
    ref/                the reference model, only once `update_ref_every_epoch` replaced it
    trainer_state.json  global step, data position, run id, KL controller, running reward std,
                        skipped-step counters, metrics rows written so far
    rng_state.pt        python `random`, numpy, torch CPU (+ CUDA) RNG states; "ranks": FSDP2 ranks' own
    rollouts_ahead.json asynchronous modes: the batches of the next steps, generated (by older policies)
                        but not yet trained on (ridgeline.trainer.scheduled, docs/async.md)
    config.yaml         the resolved config of the run
    fingerprint.json    what identifies the run: models, training data (sha256), seed, batch size
    COMPLETE            written last, the manifest: the step and every file's size and sha256; a
                        folder without it is never loaded, one whose files differ from it is damaged

Writing is atomic: everything goes into `<ckpt_path>/.tmp_global_step_<N>_<random>`, every file is
fsynced, `COMPLETE` is written, the folder is renamed to `global_step_<N>`, and only then the
pointer file `<ckpt_path>/latest_ckpt_global_step.txt` (SkyRL-Train's name and content: the step
number) is replaced (temp file + os.replace) and old checkpoints pruned. A `ckpt_path` written
before that file existed holds the pointer `latest` (one line `global_step_<N>`): it is still read,
and removed by the next write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ridgeline.config.loader import save_config, saved_config, saved_values
from ridgeline.errors import UserError, disk_full_error, is_disk_full
from ridgeline.models import lora
from ridgeline.models.loading import critic_spec, load_model, policy_spec, read_safetensors, ref_spec, save_hf_model
from ridgeline.models.value_model import VALUE_HEAD_FILE, load_value_model
from ridgeline.tracking.samples import SAMPLES_FILE
from ridgeline.trainer.scheduled import batch_from_json, batch_to_json
from ridgeline.trainer.state import RunState
from ridgeline.training.build import needs_ref
from ridgeline.training.protocols import ValueWorker, Workers
from ridgeline.training.worker import WeightsMismatchError

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

if TYPE_CHECKING:
    from ridgeline.data import PromptDataset

log = logging.getLogger(__name__)

CKPT_PREFIX = "global_step_"
POINTER = "latest_ckpt_global_step.txt"   # SkyRL-Train's pointer: the step number, nothing else
LEGACY_POINTER = "latest"                  # Ridgeline's earlier pointer (`global_step_<N>`): read only
COMPLETE = "COMPLETE"
ROLLOUTS_AHEAD = "rollouts_ahead.json"     # asynchronous modes only
SKYRL_STATE = "trainer_state.pt"           # in every checkpoint SkyRL-Train writes, in none of Ridgeline's
FORMAT = 1
_NAME = re.compile(rf"^{CKPT_PREFIX}(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written, found, or resumed from; the message says why and what to do."""


# ------------------------------------------------------------------------------------ finding
def checkpoint_step(folder: Path) -> int | None:
    m = _NAME.match(Path(folder).name)
    return int(m.group(1)) if m else None


def _listed_step(folder: Path) -> int:
    """The step of a folder known to be a checkpoint (listed or pointed at: its name matched)."""
    step = checkpoint_step(folder)
    if step is None:
        raise ValueError(f"{folder} is not named as a checkpoint ({CKPT_PREFIX}<step>)")
    return step


def is_complete(folder: Path) -> bool:
    folder = Path(folder)
    return checkpoint_step(folder) is not None and (folder / COMPLETE).is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=_listed_step)


def pointed_step(root: Path) -> int | None:
    """The step the pointer in `root` names: `latest_ckpt_global_step.txt` (SkyRL's file, a step
    number), else the older `latest` (`global_step_<N>`); None when there is no pointer. Raises
    CheckpointError when the pointer holds anything else."""
    root = Path(root)
    pointer = root / POINTER
    if pointer.is_file():
        text = pointer.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(f"{pointer} holds {text!r}, not a step number. Fix: write the step of a "
                                  f"complete checkpoint (e.g. 10 for {CKPT_PREFIX}10) into it, or delete it")
        return int(text)
    legacy = root / LEGACY_POINTER
    if legacy.is_file():
        name = legacy.read_text().strip()
        step = checkpoint_step(Path(name))
        if step is None:
            raise CheckpointError(f"{legacy} holds {name!r}, not a {CKPT_PREFIX}N folder name. Fix: delete it "
                                  "(the newest complete checkpoint is then taken)")
        return step
    return None


def written_by_skyrl(folder: Path) -> bool:
    """A `global_step_N` folder SkyRL-Train wrote (its `trainer_state.pt`, no `COMPLETE`): its
    sharded model and optimizer files are not a format Ridgeline reads."""
    folder = Path(folder)
    return (checkpoint_step(folder) is not None and (folder / SKYRL_STATE).is_file()
            and not (folder / COMPLETE).is_file())


def _skyrl_refusal(folder: Path, how: str) -> CheckpointError:
    return CheckpointError(
        f"{how} {folder}, a checkpoint written by SkyRL-Train (step {checkpoint_step(folder)}; {SKYRL_STATE} "
        "and FSDP shards, which Ridgeline cannot load). Fix: start afresh (trainer.resume_mode=none, or "
        "another trainer.ckpt_path); to start from its weights, save them as a Hugging Face model with "
        "SkyRL (trainer.hf_save_interval) and set trainer.policy.model.path to that folder")


def _pointed_checkpoint(root: Path) -> Path | None:
    """The checkpoint the pointer names (`pointed_step`); if there is no pointer or it names a
    missing or incomplete folder, the newest complete checkpoint (with a warning); None when there
    is none. A pointer naming a checkpoint SkyRL-Train wrote raises CheckpointError (not loadable).
    Its files are not checked (`latest_checkpoint` does)."""
    root = Path(root)
    step = pointed_step(root)
    complete = list_checkpoints(root)
    fallback = f"taking the newest complete checkpoint {complete[-1]}" if complete else "no complete checkpoint"
    if step is not None:
        folder = root / f"{CKPT_PREFIX}{step}"
        if is_complete(folder):
            return folder
        if written_by_skyrl(folder):
            raise _skyrl_refusal(folder, f"the pointer in {root} names")
        log.warning("the pointer in %s names %s, which is missing or incomplete; %s", root, folder, fallback)
    elif complete:
        log.warning("%s has no %s pointer; %s", root, POINTER, fallback)
    return complete[-1] if complete else None


def latest_checkpoint(root: Path) -> Path | None:
    """The newest intact checkpoint from the one the pointer names (`_pointed_checkpoint`) back:
    a damaged one (`checkpoint_damage`) is named with its step and files, and the next older one
    tried, saying so. None when there is no complete checkpoint; CheckpointError when every one
    is damaged (starting at step 0 instead would throw the run away unasked)."""
    root = Path(root)
    newest = _pointed_checkpoint(root)
    if newest is None:
        return None
    step = _listed_step(newest)
    candidates = [newest, *reversed([c for c in list_checkpoints(root) if _listed_step(c) < step])]
    damaged: list[str] = []
    for folder in candidates:
        damage = checkpoint_damage(folder)
        if not damage:
            if damaged:
                log.warning("resuming from the newest intact checkpoint %s (step %d) instead: the steps after it "
                            "are trained again", folder, checkpoint_step(folder))
            return folder
        damaged.append(_damage_line(folder, damage))
        log.warning("%s", damaged[-1])
    raise CheckpointError(f"every checkpoint in {root} is damaged:\n" + "\n".join(f"  - {d}" for d in damaged) +
                          "\nFix: restore the files from a copy, or start afresh (trainer.resume_mode=none, or "
                          "another trainer.ckpt_path)")


def _damage_line(folder: Path, damage: list[str]) -> str:
    return f"checkpoint {folder} (step {checkpoint_step(folder)}) is damaged: {'; '.join(damage)}"


# ------------------------------------------------------------------------------------ digests
REQUIRED_FILES = ("trainer_state.json", "rng_state.pt", "fingerprint.json", "config.yaml", "policy/config.json")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under `folder`, by path relative to it ('/'-separated)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def checkpoint_damage(folder: Path) -> list[str]:
    """One line per file of a complete checkpoint that is missing, of another size, or of another
    content than its manifest (COMPLETE) recorded when it was written: a disk error, a copy cut
    short, a hand edit. A checkpoint written before the manifest held digests is checked for its
    required files only."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / COMPLETE).read_text())
    except (OSError, ValueError) as exc:
        return [f"{COMPLETE}: unreadable ({type(exc).__name__}: {exc})"]
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if files is None:  # an older checkpoint: no digests to compare with
        return [f"{name}: missing" for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not isinstance(files, dict) or not all(isinstance(r, dict) and {"size", "sha256"} <= set(r)
                                              for r in files.values()):
        return [f"{COMPLETE}: its file list is not the one Ridgeline writes (edited by hand?)"]
    damage = []
    for name, recorded in files.items():
        path = folder / name
        if not path.is_file():
            damage.append(f"{name}: missing")
        elif path.stat().st_size != recorded["size"]:
            damage.append(f"{name}: {path.stat().st_size} bytes, {recorded['size']} when written")
        elif _sha256(path) != recorded["sha256"]:
            damage.append(f"{name}: its content differs from the sha256 recorded when it was written")
    return damage


def _check_intact(folder: Path, how: str) -> None:
    damage = checkpoint_damage(folder)
    if damage:
        raise CheckpointError(f"{how}: {_damage_line(folder, damage)}. Fix: name another global_step_N folder (an "
                              "earlier one), or restore the files from a copy")


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder from `path`: the folder itself, or the latest under a
    `ckpt_path` root. Raises CheckpointError naming the problem."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if checkpoint_step(path) is not None:
        if written_by_skyrl(path):
            raise _skyrl_refusal(path, "cannot load")
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker: its writing "
                                  "was interrupted); use an earlier global_step_N folder")
        _check_intact(path, "cannot load")
        return path
    folder = latest_checkpoint(path)
    if folder is None:
        raise CheckpointError(f"{path} is neither a checkpoint folder (global_step_N) nor a ckpt_path "
                              "holding a complete checkpoint")
    return folder


def find_resume_checkpoint(cfg: RidgelineConfig) -> Path | None:
    """The checkpoint `trainer.resume_mode` asks for: none (or null, as SkyRL writes it) -> None;
    latest -> the one the pointer in `trainer.ckpt_path` names (`latest_checkpoint`; None, logged,
    when there is none); from_path -> `resume_path`, which must be a complete checkpoint."""
    t = cfg.trainer
    if t.resume_mode in (None, "none"):
        root = Path(t.ckpt_path)
        try:   # only for the note below: a pointer that is not a step does not stop a run that ignores it
            step = pointed_step(root) if root.is_dir() and "://" not in str(t.ckpt_path) else None
        except CheckpointError:
            step = None
        if step is not None:
            log.warning("trainer.resume_mode=%s: starting over at step 0; to resume from %s instead, the same "
                        "command with trainer.resume_mode=latest", t.resume_mode, root / f"{CKPT_PREFIX}{step}")
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
    if written_by_skyrl(path):
        raise _skyrl_refusal(path, "trainer.resume_path names")
    if not is_complete(path):
        raise CheckpointError(f"trainer.resume_path={path} is not a complete checkpoint: a folder "
                              f"global_step_N holding a {COMPLETE} marker is needed (a folder without one "
                              "was interrupted while being written). Fix: name an earlier global_step_N, or "
                              "trainer.resume_mode=latest")
    _check_intact(path, "trainer.resume_path")
    return path


# ------------------------------------------------------------------------------------ identity
def new_run_id() -> str:
    """The tracker run id: made once when a run starts at step 0, kept in every checkpoint."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def run_fingerprint(cfg: RidgelineConfig, train_data: "PromptDataset") -> dict[str, Any]:
    """What identifies a run: a resume that changes any of it is refused (unless
    `trainer.resume_ignore_config_changes`). Data is compared by content (`PromptDataset.digests`),
    not by path."""
    t = cfg.trainer
    fingerprint: dict[str, Any] = {
        "trainer.policy.model.path": t.policy.model.path,
        "trainer.policy.model.gguf_file": t.policy.model.gguf_file,
        "trainer.critic.model.path": t.critic.model.path,
        "data.train_data": [dataclasses.asdict(d) for d in train_data.digests()],
        "usable training rows": len(train_data),
        "trainer.seed": t.seed,
        "trainer.train_batch_size": t.train_batch_size,
    }
    for role in ("policy", "critic"):
        settings = lora.lora_settings(cfg, role)
        if settings is not None:  # only with LoRA on, so checkpoints written before LoRA existed still resume
            fingerprint[settings.key] = settings.identity()
    # the same rule for what came later: present only when it makes the run differ from the default
    if t.ref.model.path != t.policy.model.path and needs_ref(cfg):
        fingerprint["trainer.ref.model.path"] = t.ref.model.path
    for spec in (policy_spec(cfg), ref_spec(cfg) if needs_ref(cfg) else None, critic_spec(cfg)):
        for override in spec.config_overrides if spec is not None else ():
            fingerprint[override.key] = override.value
    return fingerprint


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per identity item that differs between a checkpoint's run and this config (an item
    either one lacks counts as null)."""
    changes = []
    for key in [*current, *(k for k in saved if k not in current)]:
        before, now = saved.get(key), current.get(key)
        if key == "data.train_data":
            before, now = before or [], now or []
            if [(d["size"], d["sha256"]) for d in before] != [(d["size"], d["sha256"]) for d in now]:
                changes.append(f"data.train_data: the training files' contents differ "
                               f"(checkpoint: {[d['file'] for d in before]}, now: {[d['file'] for d in now]})")
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


def check_resume(cfg: RidgelineConfig, folder: Path, fingerprint: dict[str, Any]) -> None:
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
    before = _flat(saved_values(folder / "config.yaml"))
    now = _flat(dataclasses.asdict(cfg))
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
    logged twice, and samples.jsonl back to the checkpoint's steps (`_cut_samples`). Otherwise
    (step 0, or another folder's checkpoint) the file, and the sampled rollouts beside it
    (samples.jsonl), are not this run's history: set them aside (metrics.jsonl.<time>.old,
    samples.jsonl.<time>.old), so its report shows only its own."""
    path = Path(run_dir) / METRICS_FILE
    state = json.loads((resume_from / "trainer_state.json").read_text()) if resume_from is not None else {}
    if resume_from is None or Path(state.get("run_dir", "")).resolve() != Path(run_dir).resolve():
        for other in (path, Path(run_dir) / SAMPLES_FILE):
            if other.is_file() and other.stat().st_size:
                old = other.with_name(f"{other.name}.{time.strftime('%Y%m%d-%H%M%S')}.old")
                other.rename(old)
                log.info("%s holds another run's history; moved to %s", other, old)
        return
    _cut_samples(Path(run_dir) / SAMPLES_FILE, int(state["global_step"]))
    if not path.is_file():
        return
    keep = state["metrics_rows"]
    lines = path.read_bytes().split(b"\n")[:-1]  # complete rows only
    if keep < len(lines) and _timing_row(lines[keep], int(state["global_step"])):
        keep += 1  # the checkpoint's own timings, logged just after it was written: that step is not redone
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


FINAL_FOLDERS = ("final_model", "final_critic")


def clean_interrupted_writes(run_dir: Path) -> None:
    """What a process killed while writing into the run folder leaves there: temp and trash folders
    of the final model and critic (`publish_folder`), temp files of metrics.jsonl and samples.jsonl
    (`prepare_metrics`). Call it with the run folder locked (run_lock): no other command writes there."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    folders = tuple(f"{kind}_{name}_" for kind in (".tmp", ".trash") for name in FINAL_FOLDERS)
    files = tuple(f".{name}." for name in (METRICS_FILE, SAMPLES_FILE))
    for p in run_dir.iterdir():
        if p.is_dir() and p.name.startswith(folders):
            log.info("removing %s (left by an interrupted write of the final model)", p)
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and p.name.startswith(files) and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)


def _timing_row(line: bytes, step: int) -> bool:
    """Whether a metrics.jsonl row is step `step`'s row of timings alone (the trainer logs one after
    the step's exports and checkpoint are written)."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return (isinstance(row, dict) and row.get("step") == step and len(row) > 1
            and all(k == "step" or k.startswith("timing/") for k in row))


def _cut_samples(path: Path, last_step: int) -> None:
    """Drop the sampled rollouts of the steps after `last_step` (the checkpoint's: they are redone)."""
    if not path.is_file():
        return
    lines = path.read_bytes().split(b"\n")
    kept = []
    for line in lines:
        try:
            step = json.loads(line).get("step") if line.strip() else None
        except (ValueError, AttributeError):  # a truncated last line, left by the killed process
            continue
        if isinstance(step, int) and step <= last_step:
            kept.append(line + b"\n")
    if len(kept) < sum(1 for line in lines if line.strip()):
        tmp = path.with_name(f".{SAMPLES_FILE}.{secrets.token_hex(4)}.tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)


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


def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    if not isinstance(np_state, tuple):  # legacy=True gives the tuple unless the generator is not MT19937
        raise TypeError(f"numpy's global generator is not MT19937: its state cannot be checkpointed ({np_state})")
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    # only a process that computes on CUDA has CUDA generators to save: asking for them would open a
    # context (~0.5 GiB) on every GPU of a Ray driver, whose ranks save their own (`rank_rng_states`)
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _rank_rng_states(workers: Workers) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The generator states of the trained workers' ranks (none in one process)."""
    states = {"policy": workers.policy.rank_rng_states()}
    if workers.critic is not None:
        states["critic"] = workers.critic.rank_rng_states()
    return states


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_initialized():  # a Ray driver: no CUDA generator of its own
        return
    saved = state.get("cuda", [])
    if len(saved) != torch.cuda.device_count():
        log.warning("the checkpoint holds the CUDA generator states of %d GPU(s), this machine has %d: the CUDA "
                    "generators start from trainer.seed instead (sampling on the GPU will differ from the run that "
                    "wrote it)", len(saved), torch.cuda.device_count())
        return
    torch.cuda.set_rng_state_all(saved)


def run_state_json(run: RunState, workers: Workers, run_dir: Path, steps_per_epoch: int) -> dict[str, Any]:
    """The step loop's own state (JSON: floats round-trip exactly)."""
    s = run.algorithm
    kl = s.kl_controller
    epoch, batch = run.data_position
    return {
        "format": FORMAT,
        "global_step": run.global_step,
        "epoch": epoch,                    # the next batch to train is batch `batch` of epoch `epoch`
        "batch_in_epoch": batch,           # of the order shuffled from (seed, epoch)
        "steps_per_epoch": steps_per_epoch,
        "run_id": run.run_id,
        "run_dir": str(run_dir),
        "metrics_rows": metrics_rows(run_dir),
        "kl_controller": None if kl is None else {"type": type(kl).__name__, "value": kl.value},
        "reward_std": None if s.reward_std is None else
        {"count": s.reward_std.count, "mean": s.reward_std.mean, "m2": s.reward_std.m2},
        "policy_skipped_steps": workers.policy.skipped_steps,
        "critic_skipped_steps": workers.critic.skipped_steps if workers.critic is not None else None,
        "ref_updated": run.ref_updated,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _write_pointer(root: Path, step: int) -> None:
    """`latest_ckpt_global_step.txt` := the step, as SkyRL writes it (digits, no newline), but
    atomically: a reader sees the old pointer or the new one, never a torn file. The older `latest`
    pointer goes once the new one is in place, so one file says which checkpoint is the latest."""
    tmp = root / f".{POINTER}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / POINTER)
    finally:
        tmp.unlink(missing_ok=True)
    (root / LEGACY_POINTER).unlink(missing_ok=True)
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


# ------------------------------------------------------------------------------------ the checkpointer
class Checkpointer:
    """Writes and reads a run's checkpoints and exports. It owns the file format (the module
    docstring); the trainer owns the state (`RunState`, the workers) and hands it over."""

    def __init__(self, cfg: RidgelineConfig, tokenizer: PreTrainedTokenizerBase, fingerprint: dict[str, Any],
                 run_dir: Path):
        self.cfg, self.tokenizer, self.fingerprint, self.run_dir = cfg, tokenizer, fingerprint, Path(run_dir)
        self.root = Path(cfg.trainer.ckpt_path)
        self.last: Path | None = None   # the newest checkpoint this run wrote or resumed from

    # -- writing ---------------------------------------------------------------------------------
    def _write_contents(self, folder: Path, run: RunState, workers: Workers, steps_per_epoch: int) -> None:
        """Everything but the COMPLETE marker, into `folder`."""
        # first: nothing below may move an RNG first; FSDP2 ranks' own states under "ranks"
        _save_torch({**_rng_state(), "ranks": _rank_rng_states(workers)}, folder / "rng_state.pt")
        workers.policy.save_weights(folder / "policy")
        self.tokenizer.save_pretrained(folder / "policy")
        workers.policy.save_optimizer(folder / "policy_optim.pt")
        if workers.critic is not None:
            workers.critic.save_weights(folder / "critic")
            self.tokenizer.save_pretrained(folder / "critic")
            workers.critic.save_optimizer(folder / "critic_optim.pt")
        if workers.ref is not None and run.ref_updated:
            workers.ref.save_weights(folder / "ref")
        _write_json(run_state_json(run, workers, self.run_dir, steps_per_epoch), folder / "trainer_state.json")
        if run.rollouts_ahead:
            ahead = [batch_to_json(b) for b in run.rollouts_ahead]
            (folder / ROLLOUTS_AHEAD).write_text(json.dumps(ahead, default=str) + "\n")
        _write_json(self.fingerprint, folder / "fingerprint.json")
        save_config(self.cfg, folder / "config.yaml")

    def save(self, run: RunState, workers: Workers, steps_per_epoch: int) -> Path:
        """Write `global_step_<N>` atomically and point `latest_ckpt_global_step.txt` at it
        (`prune_old` then removes the oldest). On any failure the temp folder is removed, the
        previous checkpoint and pointer stay as they were, and a CheckpointError names the path and
        the cause."""
        root = self.root
        name = f"{CKPT_PREFIX}{run.global_step}"
        final = root / name
        tmp = root / f".tmp_{name}_{secrets.token_hex(4)}"
        start = time.perf_counter()
        try:
            root.mkdir(parents=True, exist_ok=True)
            _clean_stale(root)
            tmp.mkdir()
            self._write_contents(tmp, run, workers, steps_per_epoch)
            # the manifest, last: the digests a resume checks the files against (checkpoint_damage)
            manifest = {"global_step": run.global_step, "files": file_digests(tmp)}
            (tmp / COMPLETE).write_text(json.dumps(manifest, indent=1) + "\n")
            _fsync_tree(tmp)
            if final.exists():  # from an earlier, abandoned timeline of this ckpt_path
                _remove(final)
            os.rename(tmp, final)
            _fsync_path(root, directory=True)
            _write_pointer(root, run.global_step)
        except Exception as exc:
            previous = self.last or (_pointed_checkpoint(root) if root.is_dir() else None)
            err = write_failure(exc, final, f"checkpoint (step {run.global_step})",
                                f"The run stops; the previous checkpoint ({previous or 'none'}) and the pointer "
                                f"{root / POINTER} are untouched.",
                                "free disk space, or a trainer.ckpt_path on a larger disk, then rerun with "
                                "trainer.resume_mode=latest")
            shutil.rmtree(tmp, ignore_errors=True)  # after write_failure: it may measure the space left
            raise err from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.last = final
        log.info("checkpoint %s written (%.2f s)", final, time.perf_counter() - start)
        return final

    def prune_old(self) -> list[Path]:
        """Remove the oldest checkpoints beyond `trainer.max_ckpts_to_keep`, never the newest one
        written (`last`); the removed folders. Separate from `save` so the trainer can time it
        (SkyRL's `timing/cleanup_old_checkpoints`)."""
        if not self.root.is_dir():
            return []
        return prune(self.root, self.cfg.trainer.max_ckpts_to_keep, protect=self.last)

    # -- loading ---------------------------------------------------------------------------------
    def load(self, folder: Path, run: RunState, workers: Workers, steps_per_epoch: int) -> None:
        """Put `run` and the workers in the state the checkpoint recorded. The caller syncs the
        engines to the resumed policy; the RNG states are restored last, after every load."""
        folder = Path(folder)
        state = json.loads((folder / "trainer_state.json").read_text())
        if state.get("format") != FORMAT:
            raise CheckpointError(f"{folder}: checkpoint format {state.get('format')} is not {FORMAT}")
        try:
            workers.policy.load_weights(folder / "policy")
            workers.policy.load_optimizer(folder / "policy_optim.pt")
            workers.policy.skipped_steps = state["policy_skipped_steps"]
            if workers.critic is not None:
                if not (folder / "critic").is_dir():
                    raise CheckpointError(f"{folder} holds no critic, but trainer.critic.model.path is set")
                workers.critic.load_weights(folder / "critic")
                workers.critic.load_optimizer(folder / "critic_optim.pt")
                workers.critic.skipped_steps = state["critic_skipped_steps"] or 0
            if state["ref_updated"] and workers.ref is not None:
                workers.ref.load_weights(folder / "ref")
        except WeightsMismatchError as err:
            raise CheckpointError(str(err)) from None
        run.ref_updated = bool(state["ref_updated"])
        s = run.algorithm
        if s.kl_controller is not None and state["kl_controller"] is not None:
            s.kl_controller.value = state["kl_controller"]["value"]
        if s.reward_std is not None and state["reward_std"] is not None:
            for k, v in state["reward_std"].items():
                setattr(s.reward_std, k, v)
        run.global_step = state["global_step"]
        epoch, batch = state["epoch"], state["batch_in_epoch"]
        if batch >= steps_per_epoch:  # fewer batches per epoch now (resume_ignore_config_changes)
            epoch, batch = epoch + 1, 0
        run.data_position = (epoch, batch)
        run.run_id = state["run_id"]
        ahead = folder / ROLLOUTS_AHEAD
        run.rollouts_ahead = ([batch_from_json(b) for b in json.loads(ahead.read_text())] if ahead.exists() else [])
        if run.rollouts_ahead and self.cfg.trainer.async_mode == "sync":
            log.warning("%s holds %d batch(es) an asynchronous run generated ahead; with trainer.async_mode=sync those "
                        "steps are generated again by the current policy", folder, len(run.rollouts_ahead))
            run.rollouts_ahead = []
        self.last = folder
        log.info("resumed from %s: step %d, next batch %d of epoch %d, run id %s", folder, run.global_step,
                 batch, epoch, run.run_id)

    @staticmethod
    def restore_rng(folder: Path, workers: Workers) -> None:
        """The Python, numpy, torch and CUDA generator states the checkpoint recorded, this
        process's and its workers' ranks'."""
        state = torch.load(Path(folder) / "rng_state.pt", map_location="cpu", weights_only=True)
        _set_rng_state(state)
        ranks = state.get("ranks", {})  # older checkpoints hold none
        workers.policy.set_rank_rng_states(ranks.get("policy", []))
        if workers.critic is not None:
            workers.critic.set_rank_rng_states(ranks.get("critic", []))

    # -- exports ---------------------------------------------------------------------------------
    def save_model(self, workers: Workers, out: Path) -> None:
        """`out/policy` (and `out/critic` with a critic): folders `from_pretrained` loads, with the
        tokenizer; a LoRA policy has its adapters merged in."""
        self._write_policy(workers, out / "policy")
        if workers.critic is not None:
            self._write_critic(workers.critic, out / "critic")

    def _write_policy(self, workers: Workers, folder: Path) -> None:
        workers.policy.export_weights(folder)
        self.tokenizer.save_pretrained(folder)

    def _write_critic(self, critic: ValueWorker, folder: Path) -> None:
        critic.export_weights(folder)
        self.tokenizer.save_pretrained(folder)

    def export(self, workers: Workers, out: Path, step: int) -> Path:
        """`save_model` into `out`, written to a temp sibling and renamed when complete."""
        out = Path(out)
        publish_folder(out, lambda tmp: self.save_model(workers, tmp), f"the step-{step} export",
                       f"The run stops; nothing half-written is left at {out} (an older folder there is untouched).",
                       "free disk space, or a trainer.export_path on a larger disk (or a larger "
                       "trainer.hf_save_interval)")
        log.info("exported %s", out)
        return out

    def save_final(self, workers: Workers, run_dir: Path) -> Path:
        """`run_dir/final_model` (the policy, loadable with plain transformers) and, with a critic,
        `run_dir/final_critic`: each written to a temp sibling and renamed when complete, so a
        failure (a full disk) never leaves a folder that does not load. Returns final_model."""
        out = Path(run_dir) / FINAL_FOLDERS[0]
        fix = ("free disk space, or a trainer.export_path on a larger disk; with trainer.ckpt_interval set, "
               "`ridgeline export <trainer.ckpt_path> OUT` exports the last checkpoint")
        publish_folder(out, lambda tmp: self._write_policy(workers, tmp), "the final model",
                       f"Training is over, but the final model is not saved: nothing half-written is left at {out}.",
                       fix)
        if workers.critic is not None:
            critic, worker = Path(run_dir) / FINAL_FOLDERS[1], workers.critic
            publish_folder(critic, lambda tmp: self._write_critic(worker, tmp), "the final critic",
                           f"Training is over and {out} is written, but the critic is not: nothing half-written is "
                           f"left at {critic}.", fix)
        return out


def saved_run_id(folder: Path | None) -> str | None:
    if folder is None:
        return None
    return json.loads((Path(folder) / "trainer_state.json").read_text())["run_id"]


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        _remove(final)
    os.rename(tmp, final)


def write_failure(exc: Exception, final: Path, what: str, consequence: str, fix: str) -> UserError:
    """The one error for a folder that could not be written: DiskFullError ("no space left on
    device", the path, the space left) for a full disk, else a CheckpointError with the cause. Call
    it before removing what was written: a full disk is also told by the space left."""
    if is_disk_full(exc, final.parent):
        return disk_full_error(final, what, consequence, fix)
    return CheckpointError(f"could not write {what} to {final}: {type(exc).__name__}: {exc}. {consequence} Fix: {fix}")


def publish_folder(final: Path, write: Callable[[Path], None], what: str, consequence: str, fix: str) -> None:
    """`write(tmp)` into a temp sibling `.tmp_<name>_<random>` of `final`, every file fsynced, then
    renamed to `final` (an older `final` moved aside and deleted first): a reader finds the whole
    folder or the one that was there before, never a part. On failure the temp folder is removed and
    `write_failure` says what happened (`consequence`, `fix`: the message's last sentences)."""
    tmp = final.with_name(f".tmp_{final.name}_{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        _fsync_tree(tmp)
        _publish(tmp, final)
        _fsync_path(final.parent, directory=True)
    except Exception as exc:
        err = write_failure(exc, final, what, consequence, fix)
        shutil.rmtree(tmp, ignore_errors=True)
        raise err from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------ exports of a checkpoint
def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """The same folders as a periodic export (`out/policy`, `out/critic`), copied from a checkpoint
    folder or from the latest checkpoint under a ckpt_path. `out` must not hold anything yet. A
    LoRA checkpoint's adapters are merged into its base model (`_export_adapters`)."""
    folder = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty; name a new folder")
    publish_folder(out, lambda tmp: _copy_models(folder, tmp), f"the export of {folder}",
                   f"Nothing half-written is left at {out}.", "free disk space, or name a folder on a larger disk")
    return folder


def _copy_models(folder: Path, out: Path) -> None:
    """A checkpoint's policy (and critic) as Hugging Face folders under `out`."""
    if lora.is_adapter_folder(folder / "policy"):
        _export_adapters(folder, out / "policy")
    else:
        shutil.copytree(folder / "policy", out / "policy")
    if lora.is_adapter_folder(folder / "critic"):
        _export_critic_adapters(folder, out / "critic")
    elif (folder / "critic").is_dir():
        shutil.copytree(folder / "critic", out / "critic")


def _export_adapters(folder: Path, out: Path) -> None:
    """A LoRA checkpoint's policy as a merged Hugging Face folder: the base model its run named
    (`trainer.policy.model.*` in the checkpoint's config.yaml), its adapters merged in, its tokenizer."""
    from transformers import AutoTokenizer

    spec = policy_spec(saved_config(folder / "config.yaml"))
    tokenizer = AutoTokenizer.from_pretrained(folder / "policy")
    save_hf_model(lora.load_merged(load_model(spec, torch.float32, tokenizer), folder / "policy"), tokenizer, out)


def _export_critic_adapters(folder: Path, out: Path) -> None:
    """A LoRA checkpoint's critic as a value model folder: the backbone its run named with the
    adapters merged in, the trained value head beside it, its tokenizer."""
    from transformers import AutoTokenizer

    cfg = saved_config(folder / "config.yaml")
    spec = critic_spec(cfg)
    if spec is None:
        raise CheckpointError(f"{folder / 'critic'} holds critic adapters, but the checkpoint's config.yaml names no "
                              "trainer.critic.model.path to merge them into")
    tokenizer = AutoTokenizer.from_pretrained(folder / "critic")
    critic = load_value_model(spec, torch.float32, tokenizer,
                              value_head_prefix=cfg.trainer.algorithm.value_head_prefix)
    critic.backbone = lora.load_merged(lora.plain(critic.backbone), folder / "critic")  # fresh: plain is itself
    critic.head.load_state_dict({k.split(".", 1)[1]: v for k, v in
                                 read_safetensors([folder / "critic" / VALUE_HEAD_FILE]).items()})
    critic.save_pretrained(out)
    tokenizer.save_pretrained(out)
