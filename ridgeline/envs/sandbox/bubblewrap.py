"""Programs under bubblewrap (``bwrap``): kernel namespaces around every run.

What the program gets (``docs/security.md`` says what each part stops):

* its own user, PID, network, IPC, UTS and mount namespaces (``--unshare-all --unshare-user``):
  it sees and can signal only its own processes; the network is an unconnected loopback; it cannot
  create further user namespaces (``--disable-userns``), so it cannot mount anything itself;
* a root filesystem holding only the runtime, read-only: ``/usr`` (and ``/bin``, ``/lib*`` as on
  the host), the interpreter's own prefix when it lives elsewhere (pyenv, conda), ``/etc/ld.so.cache``
  and ``/etc/localtime``, and the allowed packages (``environment.sandbox.packages``, each bound
  alone under ``/packages`` from a staged copy, ``staging.py``). Not the checkout, the data, the
  home directory or the host's ``/tmp``;
* ``/work``: a tmpfs of ``disk_mb`` (its cwd, ``HOME``, ``TMPDIR``; ``/tmp`` links to it), holding
  the program as ``main.py``; ``/dev/shm`` a tmpfs of the same size; everything else read-only;
* the seccomp filter of ``seccomp.py`` (``--seccomp``), no capabilities, ``no_new_privs``, a new
  session (``--new-session``), and death with its parent (``--die-with-parent``); the program is
  its PID namespace's init (``--as-pid-1``: bwrap then reaps it, so its CPU time reaches the
  parent's ``wait4``), and when it ends, the kernel kills everything else in the namespace.

RLIMIT_NPROC, set by the bootstrap inside the fresh user namespace, bounds the whole process tree;
the kernel exempts uid 0 from it, so when the trainer runs as root (containers), a first bwrap
(mount and PID namespaces, as root) shows the same runtime, mounts the two tmpfs with an inode
bound (``nr_inodes``, which bwrap 0.8's own ``--tmpfs`` cannot set), and ``setpriv`` drops to uid
65534 before the sandbox's own bwrap starts: the program never runs as host root. A trainer that is
not root gets the same first bwrap inside a user namespace of its own (uid 0 there, with the
capabilities to mount a tmpfs and to map that uid into the sandbox's nested user namespace, both
dropped by the sandbox's bwrap); where the host forbids that nesting (AppArmor's restriction of
unprivileged user namespaces), one bwrap mounts tmpfs bounded in size only, and the log says so.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import dataclasses
from dataclasses import dataclass

from .bootstrap import bootstrap_source
from .isolation import Launch, bootstrap_config, child_env, memfile
from .seccomp import UnsupportedArchitecture, filter_program
from .staging import staged
from .types import SandboxLimits

__all__ = ["Bubblewrap", "BubblewrapUnusable", "Mount", "MIN_VERSION", "package_paths", "runtime_mounts"]

MIN_VERSION = (0, 8, 0)  # --disable-userns (0.8.0) and --size (0.7.0)
WORK = "/work"
PACKAGES = "/packages"
# The unprivileged uid/gid programs run as when the trainer is root ("nobody" on most systems).
SANDBOX_UID = 65534
# Root path: where the first bwrap mounts the two tmpfs (work dir, /dev/shm) with an inode bound.
_ROOT_WORK, _ROOT_SHM = "/.sandbox-work", "/.sandbox-shm"
# Inodes per MiB of a tmpfs: tmpfs' size= counts pages, not inodes, and each inode (a file or an
# empty directory) costs about 1 KiB of kernel memory; 64 per MiB caps that at 1/16 of the size.
INODES_PER_MIB = 64
_PROBE_TIMEOUT_S = 20.0
_MIB = 1024 * 1024


class BubblewrapUnusable(Exception):
    """bwrap is missing, too old, or cannot start a sandbox here; the message says why."""


@dataclass(frozen=True)
class Mount:
    """``kind`` "ro-bind" (``source`` path on ``dest``) or "symlink" (``dest`` -> ``source``)."""

    kind: str
    source: str
    dest: str


def _covered(path: str, mounts: list[Mount]) -> bool:
    return any(m.kind == "ro-bind" and (path == m.dest or path.startswith(m.dest.rstrip("/") + "/")) for m in mounts)


def runtime_mounts(interpreter: str, packages: tuple[str, ...] = ()) -> tuple[Mount, ...]:
    """The read-only runtime: the base system, the interpreter's tree, the allowed packages."""
    mounts: list[Mount] = []
    if os.path.isdir("/usr"):
        mounts.append(Mount("ro-bind", "/usr", "/usr"))
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: the same links as the host
            mounts.append(Mount("symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            mounts.append(Mount("ro-bind", top, top))
    if os.path.isfile("/etc/ld.so.cache"):
        mounts.append(Mount("ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"))
    if os.path.islink("/etc/localtime"):
        mounts.append(Mount("symlink", os.readlink("/etc/localtime"), "/etc/localtime"))
    # pyenv, conda or uv keep the interpreter, its stdlib and libpython outside /usr
    for root in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(interpreter))):
        root = os.path.realpath(root)
        if root != "/" and os.path.isdir(root) and not _covered(root, mounts):
            mounts.append(Mount("ro-bind", root, root))
    for name in packages:
        for path in package_paths(name):  # from a staged copy: the venv's path would show in mountinfo
            mounts.append(Mount("ro-bind", staged(path), f"{PACKAGES}/{os.path.basename(path)}"))
    return tuple(mounts)


def _site_dirs() -> set[str]:
    dirs = set(site.getsitepackages()) | {site.getusersitepackages()}
    dirs |= {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return {os.path.realpath(d) for d in dirs}


def package_paths(name: str) -> list[str]:
    """Host paths to bind for the top-level package ``name``: its directory (or single-file module)
    and an auditwheel ``<name>.libs`` folder beside it (numpy's OpenBLAS lives there).

    Raises ValueError when it is not installed in a site-packages folder (an editable checkout would
    expose its whole source tree, and the stdlib is there anyway)."""
    fix = "Fix: environment.sandbox.packages lists top-level modules installed in this Python, e.g. [numpy]."
    if not name or "." in name or "/" in name:
        raise ValueError(f"environment.sandbox.packages: {name!r} is not a top-level module name. {fix}")
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ValueError(f"environment.sandbox.packages lists {name!r}, which is not installed in {sys.executable}. {fix}")
    locations = list(spec.submodule_search_locations or [])
    path = locations[0] if len(locations) == 1 else spec.origin
    if not path or not os.path.exists(path) or os.path.realpath(os.path.dirname(path)) not in _site_dirs():
        raise ValueError(f"environment.sandbox.packages lists {name!r}, found at {path or locations}, which is not "
                         f"an installed package in site-packages (only those are bound into the sandbox). {fix}")
    path = os.path.realpath(path)
    libs = f"{path}.libs" if os.path.isdir(f"{path}.libs") else None
    return [path] + ([libs] if libs else [])


def _ancestors(mounts: tuple[Mount, ...]) -> list[str]:
    """Directories bwrap must create for the mount points; made 0755 explicitly (bwrap would copy
    the host's mode, and a 0700 /root would keep the unprivileged sandbox user out of pyenv)."""
    wanted: set[str] = set()
    for mount in mounts:
        parent = os.path.dirname(mount.dest)
        while parent != "/" and not _covered(parent, list(mounts)):
            wanted.add(parent)
            parent = os.path.dirname(parent)
    return sorted(wanted)


def _mount_args(mounts: tuple[Mount, ...], *, from_view: bool) -> list[str]:
    """bwrap options for ``mounts``; ``from_view``: bind each destination onto itself (the second
    bwrap of the root path sees the first one's view, where the runtime already sits at ``dest``)."""
    args: list[str] = []
    for directory in _ancestors(mounts):
        args += ["--perms", "0755", "--dir", directory]
    for mount in mounts:
        if mount.kind == "symlink":
            args += ["--symlink", mount.source, mount.dest]
        else:
            args += ["--ro-bind", mount.dest if from_view else mount.source, mount.dest]
    return args


def bwrap_version(bwrap: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(part) for part in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise BubblewrapUnusable(f"`{bwrap} --version` failed ({exc})") from None


@dataclass(frozen=True)
class Bubblewrap:
    """The default isolation. ``setpriv`` and ``mount``: set when the trainer runs as root (see the
    module docstring); ``mounts``: the runtime; ``seccomp``: the filter program (``seccomp.py``);
    ``version``: bwrap's, for the log."""

    bwrap: str
    interpreter: str
    mounts: tuple[Mount, ...]
    seccomp: bytes
    setpriv: str | None = None
    mount: str | None = None
    version: tuple[int, ...] = MIN_VERSION
    packages: tuple[str, ...] = ()
    # why the tmpfs have no inode bound (a non-root trainer where the first bwrap cannot run), or ""
    no_inode_bound: str = ""

    name = "bwrap"

    @property
    def layers(self) -> tuple[str, ...]:
        base = ("bwrap", "userns", "pidns", "netns", "ipcns", "mountns", "readonly_root", "tmpfs_work", "no_caps",
                "no_nested_userns", "seccomp")
        return base + (("unprivileged_uid",) if self.setpriv else ()) + (("tmpfs_inodes",) if self.mount else ())

    @classmethod
    def detect(cls, packages: tuple[str, ...] = ()) -> "Bubblewrap":
        """bwrap from PATH, checked by starting one sandbox; raises :class:`BubblewrapUnusable`."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise BubblewrapUnusable("bubblewrap (bwrap) is not installed")
        bwrap = os.path.realpath(bwrap)  # as root it is bound into the first bwrap's view by this path
        version = bwrap_version(bwrap)
        if version < MIN_VERSION:
            raise BubblewrapUnusable(f"{bwrap} is bubblewrap {'.'.join(map(str, version))}, older than the "
                                     f"{'.'.join(map(str, MIN_VERSION))} the sandbox needs (--disable-userns, --size)")
        try:
            seccomp = filter_program()
        except UnsupportedArchitecture as exc:
            raise BubblewrapUnusable(str(exc)) from None
        setpriv = None
        mount = shutil.which("mount")
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            missing = " and ".join(name for name, path in (("setpriv", setpriv), ("mount", mount)) if path is None)
            if setpriv is None or mount is None:
                raise BubblewrapUnusable(f"this process runs as root and {missing}, with which programs drop to an "
                                         "unprivileged user in size- and inode-bounded tmpfs, is not installed "
                                         "(util-linux)")
            setpriv = os.path.realpath(setpriv)
        interpreter = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
        isolation = cls(bwrap=bwrap, interpreter=interpreter, mounts=runtime_mounts(interpreter, packages),
                        seccomp=seccomp, setpriv=setpriv, mount=mount and os.path.realpath(mount), version=version,
                        packages=packages)
        if setpriv is None:  # not root: the inode-bounded tmpfs need a user namespace of our own first
            if mount is None:
                return isolation.without_inode_bound("`mount` (util-linux) is not installed").probed()
            try:
                return isolation.probed()
            except BubblewrapUnusable as exc:
                return isolation.without_inode_bound(str(exc)).probed()
        return isolation.probed()

    def without_inode_bound(self, reason: str) -> "Bubblewrap":
        """The single-bwrap path of a non-root trainer: tmpfs bounded in size only (bwrap 0.8's own)."""
        return dataclasses.replace(self, mount=None, no_inode_bound=reason)

    def probed(self) -> "Bubblewrap":
        self.probe()
        return self

    def probe(self) -> None:
        """Start one sandbox that prints "ok"; raises :class:`BubblewrapUnusable` with bwrap's reason."""
        program, seccomp = memfile(b"", "probe"), memfile(self.seccomp, "seccomp")
        try:
            argv = self.argv([self.interpreter, "-I", "-S", "-c", "print('ok')"], SandboxLimits(), program, seccomp)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, cwd="/",
                                  env=child_env(WORK), pass_fds=(program, seccomp), stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BubblewrapUnusable(f"{self.bwrap} could not start a sandbox ({exc})") from None
        finally:
            os.close(program)
            os.close(seccomp)
        if done.returncode != 0 or done.stdout != "ok\n":
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise BubblewrapUnusable(f"{self.bwrap} could not start a sandbox here ({reason})")

    def argv(self, command: list[str], limits: SandboxLimits, program_fd: int, seccomp_fd: int) -> list[str]:
        """The full command line: [root's first bwrap + mount + setpriv] + the sandbox's bwrap +
        ``command``; ``program_fd`` is copied into ``/work/main.py``, ``seccomp_fd`` holds the filter."""
        disk = int(limits.disk_mb) * _MIB
        setpriv, mount_tool = self.setpriv, self.mount
        two_levels = mount_tool is not None
        if not two_levels:
            # bwrap 0.8 mounts its tmpfs with size= only (no inode bound: docs/security.md)
            scratch = ["--size", str(disk), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                       "--size", str(disk), "--tmpfs", WORK]
        else:
            scratch = ["--bind", _ROOT_SHM, "/dev/shm", "--remount-ro", "/dev", "--bind", _ROOT_WORK, WORK]
        # Not root, two levels: this bwrap starts as uid 0 of the first one's user namespace, with
        # the capabilities it got there; it drops them and maps the trainer's own ids inside, so the
        # program sees what the single-bwrap path shows it.
        own_ids = (["--cap-drop", "ALL", "--uid", str(os.getuid()), "--gid", str(os.getgid())]
                   if two_levels and setpriv is None else [])
        sandbox = [
            self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--hostname", "sandbox", "--seccomp", str(seccomp_fd), *own_ids,
            *_mount_args(self.mounts, from_view=two_levels),
            "--proc", "/proc", "--dev", "/dev", *scratch,
            "--file", str(program_fd), f"{WORK}/main.py",
            "--symlink", WORK, "/tmp", "--chdir", WORK, "--remount-ro", "/",
            "--", *command,
        ]
        if mount_tool is None:
            return sandbox
        # Root: a mount namespace with the same runtime (plus the tools, a full /proc for the inner
        # bwrap to mount its own, and /tmp it mounts its root on); there, as root, the two tmpfs
        # with size and inode bounds; then drop to SANDBOX_UID. Its own PID namespace whose init is
        # a root shell that waits for setpriv (a child, not an exec): when the trainer dies, this
        # bwrap and that shell get SIGKILL (--die-with-parent, root to root), and the kernel then
        # kills everything in the namespace whatever its uid. (A parent-death signal from a root
        # process without capabilities to a uid-65534 child is refused by the kernel's permission
        # check, so it cannot be the link after setpriv.) The shell also passes the CPU time of
        # what it waited for up to the trainer's wait4.
        tools = tuple(Mount("ro-bind", path, path) for path in (self.bwrap, setpriv, mount_tool)
                      if path is not None and not _covered(path, list(self.mounts)))
        # as root the tmpfs belong to SANDBOX_UID; otherwise to uid 0 of the first bwrap's user
        # namespace, which is the trainer's uid outside and the program's inside
        uid = str(SANDBOX_UID) if setpriv is not None else "0"
        options = f"size={disk},nr_inodes={int(limits.disk_mb) * INODES_PER_MIB},mode=0755,uid={uid},gid={uid}"
        mount = f"{mount_tool} -t tmpfs -o {options} tmpfs"
        if setpriv is not None:
            level = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--bind", "/proc", "/proc"]
            drop = [setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--"]
        else:
            # a user namespace of the trainer's own, where it is uid 0: CAP_SYS_ADMIN mounts the
            # tmpfs, CAP_SETFCAP lets the sandbox's bwrap map that uid 0 into its nested namespace
            # (the kernel asks for it when a map names the parent namespace's root)
            level = ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "CAP_SETFCAP", "--proc", "/proc"]
            drop = []
        return [
            self.bwrap, "--die-with-parent", "--unshare-pid", "--as-pid-1", "--cap-drop", "ALL",
            "--cap-add", "CAP_SYS_ADMIN", *level, *_mount_args(self.mounts + tools, from_view=False),
            "--dev", "/dev", "--dir", "/tmp", "--dir", _ROOT_WORK, "--dir", _ROOT_SHM,
            "--", "/bin/sh", "-c", f'{mount} {_ROOT_WORK} && {mount} {_ROOT_SHM} && "$@"; exit $?', "sh",
            *drop, *sandbox,
        ]

    def prepare(self, source: str, report_fd: int, limits: SandboxLimits) -> Launch:
        program = memfile(source.encode("utf-8", "replace"), "main.py")
        try:
            seccomp = memfile(self.seccomp, "seccomp")
        except OSError:
            os.close(program)
            raise
        # The program (its namespace's init), then what limits allow: RLIMIT_NPROC counts threads too.
        tasks = 1 + limits.max_processes + limits.max_threads
        config = bootstrap_config(WORK, f"{WORK}/main.py", report_fd, limits, max_tasks=tasks,
                                  sys_path=(PACKAGES,) if self.packages else ())
        command = [self.interpreter, "-I", "-S", "-B", "-c", bootstrap_source(config)]

        def cleanup() -> None:
            os.close(program)
            os.close(seccomp)

        return Launch(argv=self.argv(command, limits, program, seccomp), cwd="/", env=child_env(WORK),
                      pass_fds=(report_fd, program, seccomp), cleanup=cleanup)

    def exit_code(self, status: int) -> int:
        # bwrap exits with 128 + N when the program died from signal N
        return -(status - 128) if 128 < status <= 128 + 64 else status
