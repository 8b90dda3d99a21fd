"""What a sandbox run takes (:class:`SandboxLimits`) and gives back (:class:`SandboxResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SandboxLimits", "SandboxResult", "SandboxError", "SandboxUnavailable"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (e.g. the interpreter could not be started); never raised because
    of anything the program did."""


class SandboxUnavailable(SandboxError):
    """No isolation tool can run here and the weaker process-only mode was not allowed; the message
    is one sentence naming the reason, the fix and the config key."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one run. Sizes in MiB; ``max_output_bytes`` applies to stdout and stderr each.

    ``max_processes``: child processes the program may create (0: none). ``max_threads``: threads
    beyond the main one. Under bubblewrap the kernel holds the whole tree to
    ``2 + max_processes + max_threads`` tasks (RLIMIT_NPROC in the sandbox's own user namespace:
    the sandbox's init, the program, its children and threads); the audit hook additionally refuses
    process creation past ``max_processes``. ``disk_mb``: size of the writable work dir (a tmpfs)
    and of ``/dev/shm`` each (and ``64 x disk_mb`` inodes each where the host allows it:
    docs/security.md); ``file_size_mb``: the largest file (RLIMIT_FSIZE).
    ``use_audit_hook``: the in-process second layer; off only to test the kernel layers alone.
    """

    wall_seconds: float = 10.0
    cpu_seconds: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 8
    disk_mb: int = 64
    max_processes: int = 0
    max_threads: int = 16
    max_output_bytes: int = 1 << 20
    max_open_files: int = 64
    use_audit_hook: bool = True

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "file_size_mb", "disk_mb", "max_output_bytes",
                     "max_open_files"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        for name in ("max_processes", "max_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SandboxLimits.{name} must be an int >= 0, got {value!r}")


@dataclass
class SandboxResult:
    """What one run did.

    exit_code: the program's exit status; negative ``-N`` when it died from signal N (as
        ``subprocess`` reports it), e.g. -9 after a wall-timeout kill.
    timed_out: the wall-clock deadline was hit (then ``killed_reason == "wall_timeout"``).
    killed_reason: why the sandbox ended the program, or None when it ended on its own:
        "wall_timeout", "cpu_limit", "memory" (a MemoryError from RLIMIT_AS, which the program may
        also catch), "output_limit", or "blocked: <what>" (the audit hook refused an action).
    duration_s: wall time from start to exit; cpu_s: CPU time of the program (user + system).
    isolation: "bwrap" or "process" (the weaker mode, only when allowed explicitly).
    layers: the isolation layers that took effect, the kernel's (e.g. "pidns", "netns",
        "readonly_fs") then the bootstrap's ("rlimits", "nproc", "audit_hook"); the bootstrap's
        are missing if the program could not even start it.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_reason: str | None
    duration_s: float
    cpu_s: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    isolation: str = ""
    layers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """Exited with status 0 and the sandbox did not have to intervene."""
        return self.exit_code == 0 and self.killed_reason is None
