"""The allowed packages as the sandbox binds them: a per-process copy, made of hard links where the
filesystem allows (instant, no space), of each package folder in a private temp dir.

Why not bind the installed folder itself: a bind mount's source path is printed in the program's
``/proc/self/mountinfo`` (its root field), and the installed folder sits in the checkout's venv
(``/home/alice/project/.venv/...``); the staged path says nothing (``/tmp/ridgeline-sandbox-
packages-<pid>-<random>/numpy``). The folder is removed when the process exits; one left by a
killed process is removed by the next process that stages (its pid is in the name).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

__all__ = ["staged"]

_PREFIX = "ridgeline-sandbox-packages-"
_lock = threading.Lock()
_root: tuple[int, str] | None = None  # (owner pid, folder): a forked child stages its own
_staged: dict[str, str] = {}


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another filesystem, or a file this user may not link (protected_hardlinks)
        shutil.copy2(source, destination)


def _remove_leftovers(folder: str) -> None:
    """Staging folders of this user whose process is gone (a SIGKILLed trainer leaves its own)."""
    for name in os.listdir(folder):
        pid = name[len(_PREFIX):].split("-", 1)[0]
        path = os.path.join(folder, name)
        if not name.startswith(_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive (EPERM: another user's process) or already removed
            continue


def _remove(owner: int, folder: str) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def _staging_root() -> str:
    global _root
    if _root is None or _root[0] != os.getpid() or not os.path.isdir(_root[1]):
        temp = tempfile.gettempdir()
        _remove_leftovers(temp)
        folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=temp)
        os.chmod(folder, 0o755)  # the sandbox's uid 65534 reads it; only this user writes it
        _root = (os.getpid(), folder)
        _staged.clear()
        atexit.register(_remove, os.getpid(), folder)
    return _root[1]


def staged(path: str) -> str:
    """A copy of the installed package ``path`` (a folder or a single-file module) under this
    process's staging folder, made once per process. Raises ValueError naming the folders and
    the config key when it cannot be made (a full or read-only temp dir)."""
    with _lock:
        try:
            root = _staging_root()
            if path not in _staged or not os.path.exists(_staged[path]):
                destination = os.path.join(root, os.path.basename(path))
                partial = destination + ".partial"
                shutil.rmtree(partial, ignore_errors=True)
                if os.path.isdir(path):
                    shutil.copytree(path, partial, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(path, partial)
                os.rename(partial, destination)
                _staged[path] = destination
        except (OSError, shutil.Error) as exc:
            raise ValueError(f"environment.sandbox.packages: could not stage {path} for the sandbox in "
                             f"{tempfile.gettempdir()} ({exc}). Fix: free space there or point TMPDIR at a "
                             "writable folder.") from None
        return _staged[path]
