"""What the kernel holds around a sandboxed program, with the audit hook off (raw system calls
through ctypes): the seccomp filter, the sandbox's death with a SIGKILLed trainer, and the memory
bound against SysV shared memory and tmpfs inodes (issue 29, items 1-5). Real bubblewrap."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO
from sandbox_helpers import LEAK_GUARD_S, PROGRAM_GUARD_S, assert_none_left, bubblewrap, processes_with, token

from ridgeline.envs.sandbox import SandboxLimits, run_python
from ridgeline.envs.sandbox.bubblewrap import INODES_PER_MIB
from ridgeline.envs.sandbox.seccomp import DENIED, SYSCALL_NUMBERS, filter_program, host_arch

RAW = SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=10, use_audit_hook=False)
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
KEY_SPEC_SESSION_KEYRING, KEYCTL_UNLINK, KEYCTL_SEARCH, KEYCTL_READ = -3, 9, 10, 11


@pytest.fixture(scope="module")
def bw():
    return bubblewrap()


def run(isolation, source: str, limits: SandboxLimits = RAW):
    result = run_python(LIBC + textwrap.dedent(source), "", limits, isolation)
    assert result.exit_code == 0 and result.killed_reason is None, result
    return result


def numbers(names: tuple[str, ...]) -> list[int]:
    column = 0 if host_arch() == "x86_64" else 1
    return [SYSCALL_NUMBERS[name][column] for name in names if SYSCALL_NUMBERS[name][column] is not None]


# ------------------------------------------------------------------------------ the filter


def test_the_program_runs_under_one_seccomp_filter(bw):
    result = run(bw, """
        import re
        print(re.findall(r'^Seccomp(?:_filters)?:\\t(\\d+)$', open('/proc/self/status').read(), re.M))
    """)
    assert result.stdout == "['2', '1']\n" and "seccomp" in result.layers  # mode 2 = filter


@pytest.mark.parametrize("group", list(DENIED))
def test_every_denied_system_call_fails_with_eperm(bw, group):
    # All arguments -1: where the filter did not stop a call, the kernel refuses it for its
    # arguments (EINVAL, EFAULT, EBADF...), so only the filter gives EPERM for all of them.
    result = run(bw, f"""
        for nr in {numbers(DENIED[group])!r}:
            ctypes.set_errno(0)
            print(nr, libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(-1)] * 6), ctypes.get_errno())
    """)
    assert result.stdout.splitlines() == [f"{nr} -1 {errno.EPERM}" for nr in numbers(DENIED[group])], result


def test_allowed_calls_and_the_x32_abi(bw):
    if host_arch() != "x86_64":
        pytest.skip("x32 is an x86_64 ABI")
    # getpid works; the same call through the x32 ABI (bit 30) is refused, so no denied call has an
    # x32 twin that passes.
    result = run(bw, """
        print(libc.syscall(ctypes.c_long(39)))
        ctypes.set_errno(0)
        print(libc.syscall(ctypes.c_long(39 | 0x40000000)), ctypes.get_errno())
        ctypes.set_errno(0)
        print(libc.syscall(ctypes.c_long(250 | 0x40000000), -1, -1, 0, 0, 0), ctypes.get_errno())
    """)
    assert result.stdout == f"1\n-1 {errno.EPERM}\n-1 {errno.EPERM}\n", result


def test_syscall_numbers_match_the_kernel_headers():
    headers = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
               "aarch64": Path("/usr/include/asm-generic/unistd.h")}
    if not all(path.is_file() for path in headers.values()):
        pytest.skip("needs the kernel headers (linux-libc-dev) for both architectures")
    for column, (arch, path) in enumerate(headers.items()):
        defined = {name: int(nr) for name, nr in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", path.read_text())}
        expected = {name: pair[column] for name, pair in SYSCALL_NUMBERS.items()}
        assert expected == {name: defined.get(name) for name in SYSCALL_NUMBERS}, arch
    assert {name for names in DENIED.values() for name in names} == set(SYSCALL_NUMBERS)


def test_the_filter_program_layout():
    # struct sock_filter is 8 bytes: arch load + check, nr load, [x32 check], one jeq per call,
    # allow, errno, kill.
    for arch, extra in (("x86_64", 1), ("aarch64", 0)):
        calls = sum(pair[0 if arch == "x86_64" else 1] is not None for pair in SYSCALL_NUMBERS.values())
        assert len(filter_program(arch)) == 8 * (2 + 1 + extra + calls + 3)


# ------------------------------------------------------------------------------ item 1: keyrings


def test_the_trainers_session_keyring_is_out_of_reach(bw):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    description, payload = f"ridgeline-test-{token()}".encode(), f"secret-{token()}".encode()
    key = libc.syscall(ctypes.c_long(numbers(("add_key",))[0]), b"user",
                       description, payload, ctypes.c_size_t(len(payload)), ctypes.c_long(KEY_SPEC_SESSION_KEYRING))
    if key < 0:
        pytest.skip(f"this process cannot add a key to its session keyring ({os.strerror(ctypes.get_errno())})")
    keyctl = numbers(("keyctl",))[0]
    try:
        # What the program did: find the key in the session keyring, read its payload.
        result = run(bw, f"""
            ctypes.set_errno(0)
            key = libc.syscall(ctypes.c_long({keyctl}), {KEYCTL_SEARCH}, {KEY_SPEC_SESSION_KEYRING}, b"user",
                               {description!r}, 0)
            print(key, ctypes.get_errno())
            buffer = ctypes.create_string_buffer(256)
            ctypes.set_errno(0)
            print(libc.syscall(ctypes.c_long({keyctl}), {KEYCTL_READ}, {key}, buffer, 256), ctypes.get_errno(),
                  buffer.value)
        """)
        assert result.stdout == f"-1 {errno.EPERM}\n-1 {errno.EPERM} b''\n", result
    finally:
        libc.syscall(ctypes.c_long(keyctl), KEYCTL_UNLINK, ctypes.c_long(key), ctypes.c_long(KEY_SPEC_SESSION_KEYRING))


# ------------------------------------------------------------------------------ items 3 and 4: memory


def test_sysv_shared_memory_cannot_hold_memory_past_the_bound(bw):
    # 8 segments of 32 MiB, each touched and detached, would hold 256 MiB outside RLIMIT_AS (128).
    result = run(bw, """
        made, mib = 0, 1 << 20
        libc.shmat.restype = ctypes.c_void_p
        for _ in range(8):
            ctypes.set_errno(0)
            segment = libc.syscall(ctypes.c_long(SHMGET), 0, 32 * mib, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if segment < 0:
                break
            address = libc.shmat(segment, None, 0)
            ctypes.memset(address, 1, 32 * mib)
            libc.shmdt(ctypes.c_void_p(address))
            made += 1
        print(made, ctypes.get_errno())
    """.replace("SHMGET", str(numbers(("shmget",))[0])), limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=10,
                                                                               memory_mb=128, use_audit_hook=False))
    assert result.stdout == f"0 {errno.EPERM}\n", result


def test_tmpfs_inodes_are_bounded(bw):
    if bw.mount is None:
        pytest.skip(f"this host's sandbox has no inode bound ({bw.no_inode_bound}; docs/security.md)")
    # Empty directories cost kernel memory (about 1 KiB each) but no tmpfs pages: size= alone let
    # 337k of them add 331 MiB of slab.
    disk_mb = 4
    result = run(bw, """
        import os
        for folder in ("/work", "/dev/shm"):
            made = 0
            try:
                while made < 100000:
                    os.mkdir(f"{folder}/d{made}")
                    made += 1
            except OSError as exc:
                print(folder, made, exc.errno)
    """, limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=10, disk_mb=disk_mb, use_audit_hook=False))
    inodes = disk_mb * INODES_PER_MIB  # the work dir holds its root and main.py, /dev/shm its root
    assert result.stdout == f"/work {inodes - 2} {errno.ENOSPC}\n/dev/shm {inodes - 1} {errno.ENOSPC}\n", result


# ------------------------------------------------------------------------------ item 2: death with the trainer

# A trainer with three programs mid-sleep (each execs `sleep WORD`, so the host can see it); it
# prints "ready" and waits. ISOLATION resolves the sandbox the way the trainer would.
TRAINER = """
import sys, threading
sys.path.insert(0, {path!r})
from {package} import SandboxLimits, SandboxSettings, resolve_isolation, run_python
isolation = resolve_isolation(SandboxSettings(packages=()))
limits = SandboxLimits(wall_seconds=600, cpu_seconds=600, max_processes=1)
program = "import os\\nos.execv('/usr/bin/sleep', ['sleep', '{word}'])"
for _ in range(3):
    threading.Thread(target=run_python, args=(program, "", limits, isolation)).start()
print("ready", flush=True)
threading.Event().wait()
"""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _kill_trainer_mid_sleep(argv: list[str], word: str) -> None:
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
    try:
        assert trainer.stdout.readline() == b"ready\n", trainer.stderr.read()
        deadline = time.monotonic() + PROGRAM_GUARD_S  # three sandboxes starting: a hang guard only
        while len(processes_with(word)) < 3:
            assert time.monotonic() < deadline and trainer.poll() is None, "the programs never started"
            time.sleep(0.05)
        tree = _descendants(trainer.pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        assert_none_left(word)
        deadline = time.monotonic() + LEAK_GUARD_S
        while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in tree if _alive(pid)], "bwrap processes outlived the trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        trainer.stdout.close()
        trainer.stderr.close()


def test_sandboxes_die_with_a_sigkilled_trainer(bw):
    # As root: two bwraps and a uid change (setpriv) between the trainer and the program.
    word = token()
    source = TRAINER.format(path=str(REPO), package="ridgeline.envs.sandbox", word=word)
    _kill_trainer_mid_sleep([sys.executable, "-c", source], word)


def test_sandboxes_die_with_a_sigkilled_unprivileged_trainer(bw):
    # A normal user's trainer: a first bwrap in a user namespace of its own, then the sandbox's.
    # Run as uid 65534 with the system Python and a copy of the (stdlib-only) sandbox package, as
    # test_sandbox.py::test_the_non_root_path does.
    system_python, setpriv = shutil.which("python3", path="/usr/bin"), shutil.which("setpriv", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not system_python or not setpriv:
        pytest.skip("needs root, setpriv and /usr/bin/python3 to become an unprivileged user with a readable Python")
    folder = Path(tempfile.mkdtemp(prefix="ridgeline-nonroot-"))
    try:
        shutil.copytree(REPO / "ridgeline" / "envs" / "sandbox", folder / "sandbox")
        os.chmod(folder, 0o755)
        for path in folder.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        word = token()
        source = TRAINER.format(path=str(folder), package="sandbox", word=word)
        _kill_trainer_mid_sleep([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", "--",
                                 system_python, "-I", "-c", source], word)
    finally:
        shutil.rmtree(folder)
