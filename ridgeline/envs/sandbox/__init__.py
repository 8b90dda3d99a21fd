"""Run an untrusted Python program (model-written code) contained; see docs/security.md.

:func:`run_python` always returns a :class:`SandboxResult`: whatever the program does (loops
forever, allocates 10 GB, forks, floods stdout, opens sockets, signals other processes, reads the
disk for the answers), the call ends within about ``wall_seconds``, nothing it started outlives it,
and it reports what happened. It raises :class:`SandboxError` only when the sandbox itself cannot
work, never because of the program.

Layers, outermost first:

* bubblewrap (``bubblewrap.py``): own user/PID/network/IPC/mount namespaces, a read-only runtime
  and nothing else of the host's files, a size-limited tmpfs work dir, no capabilities, a seccomp
  filter (``seccomp.py``), RLIMIT_NPROC over the whole tree; it dies with the trainer. Where it cannot run, untrusted code is refused unless
  ``environment.sandbox.allow_weak_isolation`` opts in to the process-only mode (``policy.py``).
* the parent's supervision (``runner.py``): wall-clock deadline, bounded output, SIGKILL of the
  whole session when the program exits or overruns.
* rlimits and an audit hook installed before the program (``bootstrap.py``): CPU, memory, file
  size, open files; the hook refuses fork/exec, sockets, writes outside the work dir, foreign calls
  through ctypes, and a few introspection routes, with a clear ``killed_reason``.

Linux only.
"""

from .bubblewrap import Bubblewrap, BubblewrapUnusable
from .isolation import Isolation, ProcessOnly
from .policy import WEAK_KEY, SandboxSettings, configure, current_isolation, resolve_isolation
from .runner import classify, run_python
from .types import SandboxError, SandboxLimits, SandboxResult, SandboxUnavailable

__all__ = ["Bubblewrap", "BubblewrapUnusable", "Isolation", "ProcessOnly", "SandboxError", "SandboxLimits",
           "SandboxResult", "SandboxSettings", "SandboxUnavailable", "WEAK_KEY", "classify", "configure",
           "current_isolation", "probe_layers", "resolve_isolation", "run_python"]


def probe_layers() -> tuple[str, ...]:
    """The layers a default run gets with the current settings (runs one trivial program)."""
    return run_python("pass", limits=SandboxLimits(wall_seconds=10)).layers
