"""Errors a user fixes, and how a full disk is told apart (a stdlib leaf module every layer may use).

`UserError` is the one family the `ridgeline` command reports as a single message with exit code 2
and no traceback (`ridgeline --debug ...` or `RIDGELINE_DEBUG=1` adds it): bad config, data, model
paths, environments, a run folder another command holds, a disk that filled up. Each layer keeps
its own subclass (`ConfigError`, `DatasetError`, `ModelLoadError`, `EnvironmentCheckError`,
`CheckpointError`, `RunLockedError`, ...) so callers can catch what they handle; every subclass
also keeps its historical builtin base (ValueError, RuntimeError) for code that catches those.
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["DEBUG_ENV", "DiskFullError", "UserError", "debug_enabled", "disk_full_error", "is_disk_full",
           "report_user_errors"]

DEBUG_ENV = "RIDGELINE_DEBUG"
# errnos that mean "the filesystem has no room": full, or over the user's quota
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# how libraries that swallow the errno word it: safetensors (Rust's io::ErrorKind), torch's zip writer
# reports only "file write failed", hence the free-space check in `is_disk_full`
_NO_SPACE_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded")
_FULL_BELOW_BYTES = 1 << 20  # a filesystem with less free than this, right after a failed write, is full


class UserError(Exception):
    """An error whose message says what the user got wrong and how to fix it (key, file, row named)."""

    headline: str | None = None  # a first line the command prints before the message, if any


class DiskFullError(UserError):
    """A write failed because the filesystem holding `path` has no space left."""


def debug_enabled() -> bool:
    """Whether `RIDGELINE_DEBUG` asks for tracebacks of user errors (1, true, yes)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during (`__cause__`, else `__context__`), each once."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def is_disk_full(exc: BaseException, path: str | Path | None = None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a full disk: ENOSPC / EDQUOT, the text
    libraries use for them, or, for a writer that reports neither (torch.save's "file write failed"),
    less than 1 MiB free on `path`'s filesystem at the moment of the failure (call this before
    removing what was written)."""
    for e in exception_chain(exc):
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _NO_SPACE):
            return True
        if any(text in str(e) for text in _NO_SPACE_TEXT):
            return True
    return path is not None and _free_bytes(Path(path)) < _FULL_BELOW_BYTES


def _free_bytes(path: Path) -> int:
    for folder in (path, *path.parents):  # the nearest existing folder: `path` may not exist yet
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return 1 << 62


def disk_full_error(path: str | Path, what: str, consequence: str, fix: str) -> DiskFullError:
    """The one message for a full disk: what was written where, how much room is left, what the
    failure left behind, and the fix."""
    free = _free_bytes(Path(path))
    return DiskFullError(f"no space left on device writing {what} to {path} ({_size(free)} free there). "
                         f"{consequence} Fix: {fix}")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def report_user_errors(command: Callable[[], int], prog: str, debug: bool = False) -> int:
    """Run `command` (a CLI command returning its exit code) and turn what a user fixes into one
    message on stderr: a `UserError`, or an OSError of a full disk, exit code 2; Ctrl-C, 130. The
    traceback is printed above the message only with `debug` (`--debug`) or `RIDGELINE_DEBUG=1`.
    Every other exception propagates with its traceback: it is a bug, not the user's to fix."""
    try:
        return command()
    except UserError as err:
        error: BaseException = err
        message = f"{err.headline}\n{err}" if err.headline else str(err)
    except OSError as err:
        if not is_disk_full(err):
            raise
        error = err
        where = f" writing {err.filename}" if err.filename else ""
        message = (f"no space left on device{where} ({err.strerror or err}). Fix: free space there, or point the "
                   "run's folders (trainer.export_path, trainer.ckpt_path) at a larger disk")
    except KeyboardInterrupt as err:
        print(f"{prog}: interrupted{': ' + str(err) if str(err) else ''}", file=sys.stderr)
        return 130
    if debug or debug_enabled():
        traceback.print_exception(error)
    print(f"{prog}: {message}", file=sys.stderr)
    return 2
