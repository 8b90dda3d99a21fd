"""Helpers for the sandbox tests: the real bubblewrap isolation (or a skip naming why), host-side
checks that nothing a program started is still running, and a victim process to aim signals at."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

# The wall limit of a program a test expects to end on its own (or to be stopped by another bound:
# CPU, output, memory): such programs need well under a second of CPU, and the limit is not what the
# test checks, so it sits far above what a loaded machine takes; it only turns a regression's hang
# into a failure. A test of the wall limit itself sets its own and waits for the program to end.
PROGRAM_GUARD_S = 120.0
# How long a process a sandbox started may take to disappear once the run has returned: none is left
# by then (the kernel ends a PID namespace before its init is reaped); a leaked one sleeps for hours.
LEAK_GUARD_S = 60.0


def bubblewrap():
    """The default isolation (a real bwrap), or skip the test with the refusal's sentence."""
    from ridgeline.envs.sandbox import SandboxSettings, SandboxUnavailable, resolve_isolation

    try:
        return resolve_isolation(SandboxSettings())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


def token() -> str:
    """A unique number-like word: a program runs `/usr/bin/sleep <token>` so that the host can look
    for that process afterwards (no other process has it in its command line)."""
    return f"{time.time() % 100000:.0f}.{uuid.uuid4().int % 10**9:09d}"


def processes_with(word: str) -> list[int]:
    """Host pids whose command line contains ``word``, zombies excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if word in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def assert_none_left(word: str, wait_s: float = LEAK_GUARD_S) -> None:
    deadline = time.monotonic() + wait_s
    while processes_with(word):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes with {word!r} outlived the run: {processes_with(word)}")
        time.sleep(0.05)


class Victim:
    """A host process (`sleep`) the test owns, for programs to try to signal."""

    def __init__(self) -> None:
        self.word = token()
        self.proc = subprocess.Popen(["sleep", self.word])  # the token is a duration of hours
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
