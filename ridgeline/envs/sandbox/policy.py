"""Which isolation this process uses for model-written code, set once per run from the config.

``configure`` (called at the start of a run with ``environment.sandbox``) stores the settings;
``current_isolation`` resolves them once: bubblewrap when it can start a sandbox here; otherwise a
:class:`SandboxUnavailable` whose message says why, how to install bubblewrap and which key allows
the weaker mode; the weaker mode only with ``allow_weak_isolation``, with a warning in the run's log.
Never a silent downgrade.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from .bubblewrap import SANDBOX_UID, Bubblewrap, BubblewrapUnusable
from .isolation import Isolation, ProcessOnly
from .types import SandboxError, SandboxUnavailable

__all__ = ["SandboxSettings", "configure", "current_isolation", "resolve_isolation", "WEAK_KEY"]

log = logging.getLogger(__name__)

WEAK_KEY = "environment.sandbox.allow_weak_isolation"


@dataclass(frozen=True)
class SandboxSettings:
    """``environment.sandbox``: ``allow_weak_isolation`` lets programs run without bubblewrap
    (rlimits + audit hook only) where it cannot run; ``packages``: top-level modules importable
    inside besides the stdlib (bound read-only)."""

    allow_weak_isolation: bool = False
    packages: tuple[str, ...] = ("numpy",)


_lock = threading.Lock()
_settings = SandboxSettings()
_resolved: Isolation | SandboxError | None = None  # resolved (and logged) once per configure()


def configure(settings: SandboxSettings) -> None:
    """Use ``settings`` from now on (a run calls this at its start): the next use resolves them
    afresh (bubblewrap may have been installed meanwhile) and logs the outcome, once per run."""
    global _settings, _resolved
    with _lock:
        _settings, _resolved = settings, None


def current_isolation() -> Isolation:
    """The configured isolation (resolved once, then cached); raises :class:`SandboxUnavailable`."""
    global _resolved
    with _lock:
        if _resolved is None:
            _resolved = _resolve_or_error(_settings)
            if not isinstance(_resolved, SandboxError):
                _announce(_resolved, _settings)
        if isinstance(_resolved, SandboxError):
            raise type(_resolved)(str(_resolved))  # a fresh one: a cached exception would pile up tracebacks
        return _resolved


def resolve_isolation(settings: SandboxSettings) -> Isolation:
    """Resolve ``settings`` now, uncached and unlogged (for tests and `ridgeline doctor`)."""
    outcome = _resolve_or_error(settings)
    if isinstance(outcome, SandboxError):
        raise outcome
    return outcome


def _resolve_or_error(settings: SandboxSettings) -> Isolation | SandboxError:
    try:
        return Bubblewrap.detect(settings.packages)
    except ValueError as exc:  # a package that cannot be bound
        return SandboxError(str(exc))
    except BubblewrapUnusable as exc:
        if settings.allow_weak_isolation:
            return ProcessOnly(reason=str(exc))
        return SandboxUnavailable(
            f"Model-written code cannot be sandboxed on this machine: {exc}. Fix: install bubblewrap >= 0.8 "
            f"(`sudo apt-get install bubblewrap`; `make setup` does it where it can), or set {WEAK_KEY}=true to run "
            "programs with only resource limits and an audit hook, which does not stop a hostile program "
            "(docs/security.md).")


def _announce(isolation: Isolation, settings: SandboxSettings) -> None:
    packages = ", ".join(settings.packages) or "none"
    if isinstance(isolation, Bubblewrap):
        who = f"as uid {SANDBOX_UID}, " if isolation.setpriv else ""
        log.info("code sandbox: bubblewrap %s (own user/pid/net/mount namespaces, seccomp filter, read-only runtime, "
                 "tmpfs work dir, %sthe audit hook as a second layer); packages: %s",
                 ".".join(map(str, isolation.version)), who, packages)
        if isolation.no_inode_bound:
            log.warning("code sandbox: its tmpfs are bounded in size but not in inodes (%s): a program can hold "
                        "about 1 KiB of kernel memory per empty file or folder until its wall-time limit "
                        "(docs/security.md)", isolation.no_inode_bound)
        return
    reason = isolation.reason if isinstance(isolation, ProcessOnly) else isolation.name
    log.warning("%s=true and bubblewrap cannot run here (%s): model-written code runs WITHOUT isolation, with only "
                "resource limits and an audit hook; a hostile program can read host files (the training data "
                "included) and signal this user's processes. Install bubblewrap for real isolation "
                "(docs/security.md).", WEAK_KEY, reason)
