"""The seam between "how the program is contained" and the supervision every run shares.

An :class:`Isolation` turns (program, limits) into a :class:`Launch`: the command line, the fds it
needs and how to clean up. Two exist: :class:`~ridgeline.envs.sandbox.bubblewrap.Bubblewrap` (the
default and the only mode for untrusted code) and :class:`ProcessOnly`, the weaker mode a user must
allow explicitly (``environment.sandbox.allow_weak_isolation``) on machines where bubblewrap cannot
run: rlimits, the audit hook and a process-group kill, in a host temp dir, with nothing of the
kernel's isolation (other processes visible, host files readable).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Protocol

from .bootstrap import BootstrapConfig, bootstrap_source
from .types import SandboxError, SandboxLimits

__all__ = ["Launch", "Isolation", "ProcessOnly", "bootstrap_config", "child_env", "memfile"]

# Environment of the child. Nothing from the parent: a program printing os.environ must not see
# tokens or keys. Thread caps keep numpy/BLAS from starting per-core thread pools (which
# RLIMIT_NPROC and RLIMIT_AS would then refuse).
_BASE_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class Launch:
    """One prepared run: ``argv`` started with ``cwd`` and ``env`` in a new session, ``pass_fds``
    kept open in it; ``cleanup`` runs after the run whatever happened."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    pass_fds: tuple[int, ...]
    cleanup: Callable[[], None]


class Isolation(Protocol):
    """How a program is contained. ``name``: "bwrap" or "process"; ``layers``: the kernel layers it
    adds (the bootstrap reports its own)."""

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> tuple[str, ...]: ...

    def prepare(self, source: str, report_fd: int, limits: SandboxLimits) -> Launch:
        """The command line that runs ``source`` under ``limits``, reporting on ``report_fd``."""

    def exit_code(self, status: int) -> int:
        """The program's exit status from the launched command's (``-N``: killed by signal N)."""


def bootstrap_config(work: str, program: str, report_fd: int, limits: SandboxLimits, *,
                     max_tasks: int | None, sys_path: tuple[str, ...] = ()) -> BootstrapConfig:
    return BootstrapConfig(
        work=work, program=program, report_fd=report_fd,
        cpu_seconds=max(1, math.ceil(limits.cpu_seconds)), memory_mb=int(limits.memory_mb),
        file_size_mb=int(limits.file_size_mb), max_open_files=int(limits.max_open_files),
        max_processes=int(limits.max_processes), max_tasks=max_tasks, audit_hook=bool(limits.use_audit_hook),
        sys_path=sys_path)


def child_env(work: str) -> dict[str, str]:
    return dict(_BASE_ENV, HOME=work, TMPDIR=work)


def memfile(data: bytes, name: str) -> int:
    """An fd of an anonymous in-memory file holding ``data``, read from the start (stdin, the
    program text): nothing on the host's disk, nothing to delete."""
    fd = os.memfd_create(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class ProcessOnly:
    """The weaker mode: the venv's interpreter in a fresh host temp dir (deleted after), rlimits,
    the audit hook, a new session killed as a group. No namespaces: see the module docstring.
    ``reason``: why bubblewrap is not used (for the log)."""

    reason: str = ""

    name = "process"
    layers = ()

    def prepare(self, source: str, report_fd: int, limits: SandboxLimits) -> Launch:
        root = _make_sandbox_dir(source)
        work = os.path.join(root, "work")
        # No RLIMIT_NPROC: without a user namespace it counts every process of the host user.
        config = bootstrap_config(work, os.path.join(work, "main.py"), report_fd, limits, max_tasks=None)
        argv = [_interpreter(), "-I", "-B", "-c", bootstrap_source(config)]
        return Launch(argv=argv, cwd=work, env=child_env(work), pass_fds=(report_fd,),
                      cleanup=lambda: _remove_tree(root))

    def exit_code(self, status: int) -> int:
        return status


def _interpreter() -> str:
    executable = sys.executable or shutil.which("python3")
    if not executable:
        raise SandboxError("no Python interpreter found to run the program (sys.executable is empty)")
    return executable


def _make_sandbox_dir(source: str) -> str:
    """A fresh private ``<root>/work`` holding the program as ``main.py``; returns ``root`` (a
    realpath, so the audit hook's inside/outside checks compare like with like)."""
    try:
        root = os.path.realpath(tempfile.mkdtemp(prefix="ridgeline-sandbox-"))
    except OSError as exc:
        raise SandboxError(f"could not create a sandbox directory: {exc}") from exc
    try:
        os.mkdir(os.path.join(root, "work"), 0o700)
        with open(os.path.join(root, "work", "main.py"), "wb") as handle:
            handle.write(source.encode("utf-8", "replace"))
    except OSError as exc:
        _remove_tree(root)
        raise SandboxError(f"could not write the program into {root}: {exc}") from exc
    return root


def _remove_tree(path: str) -> None:
    """Delete the sandbox dir even if the program chmod-ed parts of it to 000."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if not os.path.islink(child):  # chmod follows symlinks; never touch anything outside
                try:
                    os.chmod(child, 0o700)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)
