"""Run one program and watch it: output in bounded chunks, a wall-clock deadline, the group kill.

Whatever the isolation, the parent side is the same: the launched command starts in a new session;
stdout/stderr are read in bounded chunks and cut at ``max_output_bytes`` (the program is killed
then); at the deadline, at the output limit, and as soon as the program exits, the whole session's
process group is SIGKILLed (under bubblewrap that ends the program's PID namespace, so nothing it
started survives); stdin comes from an in-memory file.
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import time

from .isolation import Isolation, Launch, memfile
from .types import SandboxError, SandboxLimits, SandboxResult

__all__ = ["run_python", "classify"]

# After the program itself exits, wait at most this long for its pipes to reach EOF (they close at
# once unless a process that escaped the group kill still holds them).
_DRAIN_GRACE_S = 0.5
_REPORT_MAX_BYTES = 64 * 1024


class _Capture:
    """Bytes of one output stream, kept up to ``limit`` (memory stays bounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> bool:
        """Append; True once the stream went over the limit."""
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.data += chunk[: max(room, 0)]
            self.truncated = True
        else:
            self.data += chunk
        return self.truncated

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _has_exited(pid: int) -> bool:
    """True once ``pid`` has exited; does not reap it, so its pid (= process group id) cannot be
    reused while we still kill the group."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None and info.si_pid == pid


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _open_pidfd(pid: int) -> int | None:
    """A pidfd becomes readable when the process exits: an exit wake-up for poll without polling
    on a timer (Linux >= 5.3). None where unavailable; the loop then checks every 10 ms."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _supervise(proc: subprocess.Popen, limits: SandboxLimits, deadline: float) -> tuple[str | None, _Capture, _Capture]:
    """Read output until the program exits (or is killed); returns (our kill reason, stdout, stderr)."""
    assert proc.stdout is not None and proc.stderr is not None
    captures = {proc.stdout.fileno(): _Capture(limits.max_output_bytes),
                proc.stderr.fileno(): _Capture(limits.max_output_bytes)}
    poller = select.poll()  # not select.select: trainer processes can hold fds above 1024
    for fd in captures:
        poller.register(fd, select.POLLIN)
    pidfd = _open_pidfd(proc.pid)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    open_fds, exited, reason = set(captures), False, None
    drain_until = deadline
    try:
        while open_fds or not exited:
            now = time.monotonic()
            if now >= drain_until:
                reason = None if exited else "wall_timeout"
                break
            wait = drain_until - now if pidfd is not None or exited else min(drain_until - now, 0.01)
            for fd, _ in poller.poll(max(1, math.ceil(wait * 1000))):
                if fd == pidfd:
                    poller.unregister(pidfd)
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif captures[fd].add(chunk):
                    reason = "output_limit"
            if reason is not None:
                break
            if not exited and _has_exited(proc.pid):
                exited = True
                _kill_group(proc.pid)
                drain_until = min(deadline, time.monotonic() + _DRAIN_GRACE_S)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    if reason is not None or not exited:
        _kill_group(proc.pid)
    return reason, captures[proc.stdout.fileno()], captures[proc.stderr.fileno()]


def _reap(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for the (exited or SIGKILLed) command; returns (its exit status, CPU time of it and of
    the descendants it waited for, which under bwrap is the program's)."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:  # already reaped elsewhere; nothing to measure
        return proc.wait(), 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _read_report(fd: int) -> list[str]:
    """Lines the bootstrap wrote (layers, blocked actions). Non-blocking: a straggler that still
    holds the pipe must not hang us."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < _REPORT_MAX_BYTES:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").splitlines()


def _parse_report(lines: list[str]) -> tuple[tuple[str, ...], str | None]:
    """(layers, first blocked action) from the bootstrap's report lines."""
    layers: tuple[str, ...] = ()
    blocked = None
    for line in lines:
        if line.startswith("layers: ") and not layers:
            layers = tuple(name for name in line[len("layers: "):].split(",") if name)
        elif line.startswith("blocked: ") and blocked is None:
            blocked = line[len("blocked: "):]
    return layers, blocked


def classify(reason: str | None, exit_code: int, cpu_s: float, cpu_limit: int, blocked: str | None,
             stderr: str) -> str | None:
    """The run's ``killed_reason`` (see :class:`SandboxResult`)."""
    if reason is not None:
        return reason
    if blocked is not None:
        return "blocked: " + blocked
    # SIGXCPU at the soft CPU limit; SIGKILL at the hard one if the program ignored SIGXCPU.
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_s >= cpu_limit - 0.05):
        return "cpu_limit"
    last_line = stderr.rstrip().rsplit("\n", 1)[-1]
    if exit_code != 0 and last_line.startswith("MemoryError"):
        return "memory"
    return None


def run_python(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               isolation: Isolation | None = None) -> SandboxResult:
    """Run ``source`` as ``__main__`` of a fresh, contained Python process fed ``stdin``.

    ``isolation``: None for the one this process is configured with
    (:func:`ridgeline.envs.sandbox.current_isolation`: bubblewrap, or a refusal, or the weaker mode
    when allowed). Guaranteed: returns within about ``limits.wall_seconds`` (+ ~0.5 s of cleanup)
    and does not raise for anything the program does; nothing it started is running when this
    returns. Safe to call from several threads at once (no ``preexec_fn``).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if isolation is None:
        from .policy import current_isolation  # the policy probes with this module's helpers

        isolation = current_isolation()
    try:
        report_r, report_w = os.pipe()
    except OSError as exc:
        raise SandboxError(f"could not create the sandbox report pipe: {exc}") from exc
    try:
        launch = isolation.prepare(source, report_w, limits)
    except BaseException:
        os.close(report_r)
        os.close(report_w)
        raise
    try:
        return _run(isolation, launch, report_r, report_w, stdin, limits)
    finally:
        os.close(report_r)
        launch.cleanup()


def _run(isolation: Isolation, launch: Launch, report_r: int, report_w: int, stdin: str,
         limits: SandboxLimits) -> SandboxResult:
    """Start ``launch`` and supervise it; closes ``report_w`` (the child keeps its own copy)."""
    try:
        stdin_fd = memfile(stdin.encode("utf-8", "replace"), "stdin")
        try:
            start = time.monotonic()
            proc = subprocess.Popen(launch.argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=launch.cwd, env=launch.env, start_new_session=True, close_fds=True,
                                    pass_fds=launch.pass_fds)
        except OSError as exc:
            raise SandboxError(f"could not start the sandbox ({launch.argv[0]}): {exc}") from exc
        finally:
            os.close(stdin_fd)
    finally:
        os.close(report_w)
    try:
        reason, out, err = _supervise(proc, limits, start + float(limits.wall_seconds))
        status, cpu_s = _reap(proc)
        duration = time.monotonic() - start
        layers, blocked = _parse_report(_read_report(report_r))
    finally:
        if proc.returncode is None:  # an unexpected error above: never leave the group running
            _kill_group(proc.pid)
            _reap(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    stderr = err.text()
    exit_code = isolation.exit_code(int(status))
    return SandboxResult(
        stdout=out.text(),
        stderr=stderr,
        exit_code=exit_code,
        timed_out=reason == "wall_timeout",
        killed_reason=classify(reason, exit_code, cpu_s, max(1, math.ceil(limits.cpu_seconds)), blocked, stderr),
        duration_s=duration,
        cpu_s=cpu_s,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        isolation=isolation.name,
        layers=isolation.layers + layers,
    )
