"""One command per run folder: an exclusive lock on `trainer.run_dir` and on `trainer.ckpt_path`.

Two `ridgeline train` commands on one folder would overwrite each other's config.yaml and
metrics.jsonl, resume from each other's checkpoints and delete each other's temp checkpoints. Each
folder gets a lock file, `.ridgeline.lock`; a training run holds `flock(LOCK_EX | LOCK_NB)` on it
from before it writes anything until it ends, and writes who it is into it (pid, host, start time,
command line). A second command finds the lock taken and stops at once with a `RunLockedError`
naming that holder. The kernel drops a flock when its process ends, however it ends (kill -9
included), so the file a dead run left never blocks: the next run takes the lock and overwrites
the note. A run that ends normally removes its lock file (before it lets go of the lock); a
command that opened the file just before then finds, once it holds the lock, that the path no
longer names the file it locked, and starts over on the new one. On NFS, Linux emulates flock with
POSIX byte-range locks, which hold across machines.

Within one process the lock is re-entrant (counted): a notebook or test that builds a second
trainer on the same folder while an earlier one is still referenced is the same command, not a
rival one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping

from ridgeline.errors import UserError

__all__ = ["LOCK_FILE", "RunFolderError", "RunLock", "RunLockedError", "run_folders"]

LOCK_FILE = ".ridgeline.lock"


class RunLockedError(UserError, RuntimeError):
    """A folder of the run is locked by another command; the message names its pid and host."""


class RunFolderError(UserError, RuntimeError):
    """A folder of the run cannot be created or written (a read-only filesystem, permissions); the
    message names the config key, the folder and the cause."""


def run_folders(trainer_cfg: Any) -> dict[str, str]:
    """The folders a run owns, by config key (`trainer` section of a run config): `trainer.run_dir`,
    and `trainer.ckpt_path` when the run may read or write checkpoints (SkyRL's default ~/ckpts/
    is shared by every run, so a run without checkpoints does not claim it)."""
    t = trainer_cfg
    uses_ckpts = t.ckpt_interval > 0 or t.resume_mode not in (None, "none") or t.ckpt_on_interrupt
    return {"trainer.run_dir": str(t.run_dir), **({"trainer.ckpt_path": str(t.ckpt_path)} if uses_ckpts else {})}


@dataclass
class _Held:
    handle: IO[str]
    count: int


_HELD: dict[Path, _Held] = {}  # this process's locks, by resolved folder


@dataclass
class RunLock:
    """The locks a run holds (`acquire`), released by `release` (idempotent) or when the process ends."""

    folders: list[Path] = field(default_factory=list)

    @classmethod
    def acquire(cls, folders: Mapping[str, str | Path]) -> "RunLock":
        """Lock every folder (config key -> folder; created if missing), or none: RunLockedError
        naming the key, the folder and the holder when one is taken by another process."""
        lock = cls()
        try:
            for key, folder in folders.items():
                resolved = Path(folder).expanduser().resolve()
                if resolved not in lock.folders:
                    _lock(resolved, key)
                    lock.folders.append(resolved)
        except BaseException:
            lock.release()
            raise
        return lock

    def release(self) -> None:
        for folder in self.folders:
            held = _HELD[folder]
            held.count -= 1
            if held.count == 0:
                del _HELD[folder]
                with contextlib.suppress(OSError):   # removed by hand, or the folder turned read-only: left as is
                    (folder / LOCK_FILE).unlink()   # while still held: no one else owns it
                held.handle.close()  # closing the file drops the flock
        self.folders = []


def _lock(folder: Path, key: str) -> None:
    if folder in _HELD:
        _HELD[folder].count += 1
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            handle = _open_locked(folder, key)
            if handle is not None:
                break
    except OSError as exc:  # the first write of the run: a read-only filesystem, permissions, ...
        cause = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, 'no errno')})"
        raise RunFolderError(
            f"{key}={folder} cannot be written: {cause} at {exc.filename or folder}. The run writes its config, "
            f"metrics, checkpoints and final model there, so it stops before anything else. Fix: "
            f"{_writable_fix(key)}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             "command": " ".join(sys.argv)}) + "\n")
    handle.flush()
    _HELD[folder] = _Held(handle, 1)


def _open_locked(folder: Path, key: str) -> IO[str] | None:
    """The lock file of `folder`, opened and flocked; None when the holder removed it between our
    open and our lock (the locked file is no longer the one the path names: try again)."""
    path = folder / LOCK_FILE
    handle = open(path, "a+", encoding="utf-8")  # "a+": the holder's note stays until we own it
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = _describe(handle.read())
        handle.close()
        raise RunLockedError(
            f"{key}={folder} is in use by another ridgeline command: {holder}. Two commands on one folder would "
            "overwrite each other's config, metrics and checkpoints, so this one stops here. Fix: wait for that "
            f"run to end (or stop it), or give this one a folder of its own ({_fix(key)})") from None
    except BaseException:
        handle.close()
        raise
    try:
        current = os.stat(path).st_ino
    except FileNotFoundError:
        current = None
    if current != os.fstat(handle.fileno()).st_ino:
        handle.close()
        return None
    return handle


def _describe(note: str) -> str:
    """The holder as its note tells it: pid, host, since when, which command."""
    try:
        info = json.loads(note)
        return (f"pid {info['pid']} on host {info['host']}, running since {info['started']} "
                f"(command: {info['command']})")
    except (ValueError, KeyError, TypeError):  # it holds the lock but has not written its note yet
        return "a process that has just started (its pid is not written yet)"


def _writable_fix(key: str) -> str:
    if key == "trainer.ckpt_path":
        return "trainer.ckpt_path=<a folder on a writable filesystem>"
    return "a folder on a writable filesystem: trainer.export_path=<folder> (the run folder is inside it), or trainer.run_dir=<folder>"


def _fix(key: str) -> str:
    if key == "trainer.ckpt_path":
        return "trainer.ckpt_path=<another folder>; by default SkyRL's ~/ckpts/ is shared by every run"
    return "trainer.run_name=<another name>, or trainer.export_path / trainer.run_dir elsewhere"
