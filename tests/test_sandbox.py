"""The Python sandbox: real bubblewrap sandboxes running real programs.

Each layer is tested where it can be isolated: ``KERNEL_ONLY`` runs bubblewrap without the audit
hook (what the kernel alone stops), ``PROCESS`` is the weaker process-only mode (what the hook alone
stops). The hostile programs through the code env are in test_sandbox_hostile.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO
from sandbox_helpers import PROGRAM_GUARD_S, Victim, assert_none_left, bubblewrap, token

from ridgeline.envs import make
from ridgeline.envs.sandbox import (ProcessOnly, SandboxError, SandboxLimits, SandboxResult, SandboxSettings,
                                    SandboxUnavailable, classify, configure, current_isolation, probe_layers,
                                    resolve_isolation, run_python)

# Programs that end on their own: the wall limit is a hang guard only (sandbox_helpers).
FAST = SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=2)
KERNEL_ONLY = SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=2, use_audit_hook=False)
PROCESS = ProcessOnly()


@pytest.fixture(scope="module")
def bw():
    return bubblewrap()


@pytest.fixture()
def policy():
    """Tests that change the process-wide settings leave the defaults behind."""
    yield configure
    configure(SandboxSettings())


def run(isolation, source: str, stdin: str = "", limits: SandboxLimits = FAST) -> SandboxResult:
    return run_python(textwrap.dedent(source), stdin, limits, isolation)


def assert_blocked(result: SandboxResult, what: str) -> None:
    assert result.killed_reason is not None and result.killed_reason.startswith("blocked: "), result
    assert what in result.killed_reason, result.killed_reason
    assert result.exit_code != 0


# ------------------------------------------------------------------------------ normal programs


def test_program_reads_stdin_and_writes_exact_stdout(bw):
    result = run(bw, """
        import sys
        data = sys.stdin.read()
        sys.stdout.write(data.upper() + "  \\n")
    """, stdin="hello\nworld")
    assert result.ok and result.stdout == "HELLO\nWORLD  \n" and result.stderr == ""
    assert not result.timed_out and result.killed_reason is None and result.isolation == "bwrap"
    assert {"pidns", "netns", "userns", "readonly_root", "tmpfs_work", "rlimits", "nproc", "audit_hook"} <= set(result.layers)


def test_input_function_large_stdin_and_utf8(bw):
    big = "\n".join(str(i) for i in range(100_000)) + "\n"
    result = run(bw, "import sys\nprint(sum(map(int, sys.stdin.read().split())), 'é✓')", stdin=big)
    assert result.ok and result.stdout == f"{sum(range(100_000))} é✓\n"


def test_exception_gives_nonzero_exit_and_traceback(bw):
    result = run(bw, "def f():\n    raise ValueError('boom')\nf()\n")
    assert result.exit_code == 1 and result.killed_reason is None
    assert "ValueError: boom" in result.stderr and "main.py" in result.stderr
    assert run(bw, "import sys; sys.exit(3)").exit_code == 3


def test_syntax_error_and_unusual_sources_do_not_break_the_sandbox(bw):
    result = run(bw, "def f(:\n")
    assert result.exit_code == 1 and "SyntaxError" in result.stderr
    assert run(bw, "print('a')\x00").exit_code == 1  # NUL byte: compile error, not a crash
    assert run(bw, "print('\ud800')").stdout == "?\n"  # lone surrogate (invalid UTF-8) becomes "?"
    assert run(bw, "").ok


def test_threads_work_and_concurrent_calls_from_threads(bw):
    # Deep-recursion idiom of competitive programming: a thread with a bigger stack.
    source = """
        import sys, threading
        sys.setrecursionlimit(100000)
        threading.stack_size(64 * 1024 * 1024)
        def depth(n):
            return 0 if n == 0 else 1 + depth(n - 1)
        out = []
        t = threading.Thread(target=lambda: out.append(depth(20000)))
        t.start(); t.join()
        print(out[0] + int(input()))
    """
    results: dict[int, SandboxResult] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(bw, source, f"{i}\n"))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i].stdout for i in range(3)] == ["20000\n", "20001\n", "20002\n"]


def test_numpy_imports_and_works_in_both_modes(bw):
    source = """
        import numpy as np
        a = np.array([[2.0, 1.0], [1.0, 3.0]])
        print(int(round(np.linalg.det(a))), int(np.arange(int(input())).sum()))
    """
    for isolation in (bw, PROCESS):
        result = run(isolation, source, "10\n", limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=10))
        assert result.ok and result.stdout == "5 45\n", result


def test_only_the_listed_packages_are_importable(bw):
    assert run(bw, "import numpy").ok
    result = run(bw, "import torch")  # installed beside numpy, not listed
    assert "ModuleNotFoundError: No module named 'torch'" in result.stderr
    bare = resolve_isolation(SandboxSettings(packages=()))
    assert "No module named 'numpy'" in run(bare, "import numpy").stderr
    with pytest.raises(SandboxError, match="environment.sandbox.packages lists 'no_such_pkg_x'"):
        resolve_isolation(SandboxSettings(packages=("no_such_pkg_x",)))
    with pytest.raises(SandboxError, match="not an installed package in site-packages"):
        resolve_isolation(SandboxSettings(packages=("ridgeline",)))  # the checkout: never bound


def test_work_dir_is_a_private_tmpfs(bw):
    source = """
        import os, tempfile
        print(os.getcwd(), os.environ["HOME"], sorted(os.listdir(".")))
        with open("notes.txt", "w") as f:
            f.write("kept")
        with tempfile.NamedTemporaryFile("w", delete=False) as f:  # TMPDIR is the work dir
            f.write("t")
        open("/tmp/via-tmp", "w").write("x")  # /tmp is the work dir too
        os.mkdir("sub")
        os.chmod("sub", 0)
        print(open("notes.txt").read(), sorted(n for n in os.listdir(".") if not n.startswith("tmp")))
    """
    first, second = run(bw, source), run(bw, source)
    assert first.ok, first
    assert first.stdout == second.stdout == "/work /work ['main.py']\nkept ['main.py', 'notes.txt', 'sub', 'via-tmp']\n"


def test_process_mode_dir_is_removed_after_the_run():
    result = run(PROCESS, "import os\nopen('x', 'w').write('y')\nos.mkdir('d')\nos.chmod('d', 0)\nprint(os.getcwd())")
    assert result.ok and result.isolation == "process" and not os.path.exists(result.stdout.strip())


# ------------------------------------------------------------------------------ time


def test_infinite_loop_is_killed_at_the_wall_limit(bw):
    # The run returning is the event; how soon after the limit depends on the machine's load, so
    # only the order is checked: not before the limit.
    result = run(bw, "while True:\n    pass\n", limits=SandboxLimits(wall_seconds=1, cpu_seconds=PROGRAM_GUARD_S))
    assert result.timed_out and result.killed_reason == "wall_timeout" and result.exit_code == -9
    assert result.duration_s >= 1


def test_cpu_limit_at_the_soft_limit_and_when_sigxcpu_is_ignored(bw):
    result = run(bw, "while True:\n    pass\n", limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=1))
    assert result.killed_reason == "cpu_limit" and result.exit_code == -signal.SIGXCPU, result
    # Ignoring SIGXCPU only buys the hard limit, soft + 1 s (no wall-time bound asserted: on a loaded
    # machine 2 CPU seconds can take longer than that).
    result = run(bw, "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
                 limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=1))
    assert result.killed_reason == "cpu_limit" and result.exit_code == -signal.SIGKILL, result
    assert not result.timed_out and 1.5 <= result.cpu_s < 3


def test_classification_of_exits():
    assert classify(None, -signal.SIGXCPU, 1.0, 1, None, "") == "cpu_limit"
    assert classify(None, -signal.SIGKILL, 0.1, 5, None, "") is None  # killed, but not by the CPU limit
    assert classify(None, 1, 0.1, 5, None, "Traceback ...\nMemoryError\n") == "memory"
    assert classify(None, 0, 0.1, 5, None, "MemoryError") is None
    assert classify(None, 86, 0.1, 5, "os.fork", "") == "blocked: os.fork"
    assert classify("wall_timeout", -9, 9.0, 5, "os.fork", "") == "wall_timeout"


def test_sleeping_program_is_killed_at_wall_timeout(bw):
    result = run(bw, "import time\ntime.sleep(3600)\n", limits=SandboxLimits(wall_seconds=0.5))
    assert result.killed_reason == "wall_timeout" and result.duration_s >= 0.5


# ------------------------------------------------------------------------------ processes


@pytest.mark.parametrize("source, event", [
    ("import os\nwhile True:\n    os.fork()\n", "os.fork"),
    ("import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '{word}'])\n", "subprocess.Popen"),
    ("import os\nos.system('sleep {word}')\n", "os.system"),
    ("import os\nos.execv('/usr/bin/sleep', ['sleep', '{word}'])\n", "os.exec"),
    ("import os\nos.posix_spawn('/usr/bin/sleep', ['sleep', '{word}'], {{}})\n", "os.posix_spawn"),
    ("import multiprocessing as mp\np = mp.get_context('spawn').Process(target=print)\np.start()\n", "fork_exec"),
])
def test_process_creation_is_blocked_and_nothing_survives(bw, source, event):
    word = token()
    for isolation in (bw, PROCESS):
        assert_blocked(run(isolation, source.format(word=word)), event)
        assert_none_left(word)


def test_fork_bomb_catching_the_denial_is_still_stopped(bw):
    result = run(bw, """
        import os
        while True:
            try:
                os.fork()
            except BaseException:
                pass
    """)
    assert_blocked(result, "os.fork")


def test_allowed_children_die_with_the_run_even_in_their_own_session(bw):
    # max_processes lets children exist; they must still die with the program, when it exits
    # normally, when it times out, and (bubblewrap: the PID namespace ends) after setsid. The
    # program says "parent done" once its child runs (on the host a `sleep <word>`): the pipe's
    # write end is close-on-exec, so the parent reads EOF at that exec, whatever the machine's load.
    source = """
        import os, time
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(r)
            {child}
            os.execv('/usr/bin/sleep', ['sleep', '{word}'])
        os.close(w)
        os.read(r, 1)
        print('parent done', flush=True)
        {tail}
    """
    for child in ("pass", "os.setsid()", "os.setsid()\n            if os.fork(): os._exit(0)"):
        for tail, reason in (("", None), ("time.sleep(3600)", "wall_timeout")):
            word = token()
            program = source.format(child=child, word=word, tail=tail)
            # the wall limit under test must hit a running child: on a machine too busy to start
            # one within it, the same run again with twice the limit
            wall = 1.5 if tail else PROGRAM_GUARD_S
            while (result := run(bw, program, limits=SandboxLimits(wall_seconds=wall, max_processes=2))).stdout == "":
                if wall >= PROGRAM_GUARD_S:
                    break
                wall *= 2
            assert result.killed_reason == reason and result.stdout == "parent done\n", result
            assert_none_left(word)
    assert_blocked(run(bw, "import os\nos.fork()\nos.fork()\nos.fork()\n", limits=SandboxLimits(max_processes=2)),
                   "max_processes")


def test_the_kernel_bounds_the_process_tree_without_the_hook(bw):
    # RLIMIT_NPROC in the sandbox's own user namespace: 1 + max_processes + max_threads tasks.
    result = run(bw, """
        import os, time
        made = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                made += 1
        except OSError as exc:
            print(made, exc.errno)
    """, limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, use_audit_hook=False, max_processes=0, max_threads=3))
    assert result.ok and result.stdout == "3 11\n", result  # EAGAIN after 3 children


def test_thread_count_is_bounded(bw):
    result = run(bw, """
        import threading, time
        threads = []
        try:
            while True:
                t = threading.Thread(target=time.sleep, args=(5,), daemon=True)
                t.start()
                threads.append(t)
        except RuntimeError as exc:
            print(len(threads), exc)
    """, limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, max_threads=4))
    assert result.ok and result.stdout == "4 can't start new thread\n", result


def test_signalling_other_processes(bw):
    victim = Victim()
    try:
        assert_blocked(run(bw, f"import os\nos.kill({victim.pid}, 9)\n"), "os.kill")
        assert_blocked(run(PROCESS, f"import os\nos.kill({victim.pid}, 9)\n"), "os.kill")
        # Without the hook, the kernel: the host's pids do not exist in the sandbox's namespace.
        result = run(bw, f"""
            import os, signal
            for attempt in (lambda: os.kill({victim.pid}, 9), lambda: signal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9),
                            lambda: os.kill(-1, 9)):
                try:
                    attempt()
                    print('sent')
                except OSError as exc:
                    print(type(exc).__name__)
        """, limits=KERNEL_ONLY)
        assert result.stdout.split("\n")[:2] == ["ProcessLookupError", "ProcessLookupError"], result
        assert victim.alive()
    finally:
        victim.close()
    assert run(bw, "import os, signal\nos.kill(os.getpid(), 0)\nprint('ok')").ok


# ------------------------------------------------------------------------------ memory, output, disk


def test_huge_allocation_is_a_memory_error(bw):
    result = run(bw, "x = b'x' * 10**10\n")
    assert result.killed_reason == "memory" and "MemoryError" in result.stderr
    # A program that catches it keeps running normally.
    assert run(bw, "try:\n    x = bytearray(10**10)\nexcept MemoryError:\n    print('caught')").stdout == "caught\n"


def test_huge_output_is_truncated_and_program_stopped(bw):
    limits = SandboxLimits(wall_seconds=PROGRAM_GUARD_S, cpu_seconds=PROGRAM_GUARD_S, max_output_bytes=10_000)
    result = run(bw, "while True:\n    print('x' * 1000)\n", limits=limits)
    assert result.killed_reason == "output_limit" and result.stdout_truncated and not result.timed_out
    assert len(result.stdout) == 10_000
    result = run(bw, "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n", limits=limits)
    assert result.killed_reason == "output_limit" and result.stderr_truncated and len(result.stderr) == 10_000


def test_file_size_and_disk_limits(bw):
    result = run(bw, """
        try:
            with open("big", "wb") as f:
                f.write(b"x" * (3 * 1024 * 1024))
        except OSError as exc:
            print("EFBIG" if exc.errno == 27 else exc)
    """, limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, file_size_mb=1))
    assert result.stdout == "EFBIG\n"
    # Many files, each under the file-size limit, fill the work dir's tmpfs, then ENOSPC; /dev/shm alike.
    for folder in (".", "/dev/shm"):
        result = run(bw, f"""
            written = 0
            try:
                for i in range(100):
                    with open("{folder}/f%d" % i, "wb") as f:
                        f.write(b"x" * (1 << 20))
                        f.flush()
                    written += 1
            except OSError as exc:
                print(written, exc.errno)
        """, limits=SandboxLimits(wall_seconds=PROGRAM_GUARD_S, disk_mb=4, use_audit_hook=False))
        assert result.ok and result.stdout in ("3 28\n", "4 28\n"), result


# ------------------------------------------------------------------------------ filesystem


@pytest.fixture()
def outside(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    return victim


def _write_attempts(victim: Path) -> list[str]:
    keep, new = str(victim / "keep.txt"), str(victim / "new.txt")
    return [f"open({new!r}, 'w').write('x')",
            f"import os\nos.close(os.open({new!r}, os.O_WRONLY | os.O_CREAT))",
            f"import os\nos.symlink({new!r}, 'link')\nopen('link', 'w').write('x')",
            f"import os\nos.chdir('/')\nopen({new[1:]!r}, 'w').write('x')",
            f"import os\nos.remove({keep!r})",
            f"import shutil\nshutil.rmtree({str(victim)!r})",
            f"import os\nos.rename({keep!r}, 'stolen')",
            f"import os\nos.chmod({keep!r}, 0o777)",
            f"import os\nfd = os.open({str(victim)!r}, os.O_RDONLY)\nos.unlink('keep.txt', dir_fd=fd)",
            f"open({str(REPO / 'pyproject.toml')!r}, 'a').write('x')"]


def _intact(victim: Path) -> None:
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "precious" and (victim / "keep.txt").stat().st_mode & 0o777 != 0o777
    assert not (REPO / "pyproject.toml").read_text().endswith("x")


def test_host_files_cannot_be_changed_under_bubblewrap(bw, outside):
    for source in _write_attempts(outside):
        for limits in (FAST, KERNEL_ONLY):
            result = run(bw, source, limits=limits)
            assert not result.ok, source  # not there (ENOENT), read-only (EROFS) or blocked
    _intact(outside)


def test_process_mode_hook_blocks_writes_outside(outside):
    for source in _write_attempts(outside):
        assert_blocked(run(PROCESS, source), "sandbox")
    _intact(outside)


def test_monkeypatching_os_and_builtins_does_not_fool_the_hook(tmp_path):
    target = tmp_path / "evil.txt"
    relative = str(target)[1:]
    sources = [
        # A lying getcwd would make a relative path look like it is inside the sandbox.
        f"import os\nhere = os.getcwd()\nos.chdir('/')\nos.getcwd = lambda: here\nopen({relative!r}, 'w')",
        # A lying lstat would hide the symlink from a resolver built on os.path.realpath.
        f"import os, posixpath\nos.symlink({str(target)!r}, 'link')\nos.lstat = os.stat\n"
        f"posixpath.realpath = lambda p, **k: p\nopen('link', 'w')",
        # A no-op _exit and builtins that always agree.
        f"import os, builtins\nos._exit = lambda code: None\nbuiltins.isinstance = lambda *a: True\n"
        f"builtins.any = lambda *a: False\nopen({str(target)!r}, 'w')",
        f"import sqlite3\nsqlite3.connect({str(target)!r})",
        f"import sqlite3\nsqlite3.connect('file:{target}?mode=rwc', uri=True)",
    ]
    for source in sources:
        assert_blocked(run(PROCESS, source), "")
        assert not target.exists(), source
    assert_blocked(run(PROCESS, "import gc\ngc.get_objects()"), "gc.get_objects")


def test_root_filesystem_is_read_only_without_the_hook(bw):
    for target in ("/usr/evil", "/etc/evil", "/evil", "/dev/evil", "/packages/evil"):
        result = run(bw, f"""
            try:
                open({target!r}, 'w').write('x')
            except OSError as exc:
                print(exc.errno)
        """, limits=KERNEL_ONLY)
        assert result.ok and result.stdout in ("30\n", "13\n"), (target, result)  # EROFS / EACCES
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()


def test_host_files_are_not_visible(bw, tmp_path, monkeypatch):
    secret = tmp_path / "train.jsonl"
    secret.write_text('{"answer": "42"}\n')
    monkeypatch.setenv("RIDGELINE_TEST_SECRET", "hunter2-in-proc")
    paths = [str(secret), str(REPO / "pyproject.toml"), os.path.expanduser("~/.bashrc"), "/etc/shadow", "/etc/passwd",
             f"/proc/{os.getpid()}/environ", f"/proc/{os.getpid()}/cmdline"]
    result = run(bw, f"""
        import os
        for path in {paths!r}:
            try:
                open(path, 'rb').read()
                print('read', path)
            except OSError as exc:
                print(type(exc).__name__)
        print(sorted(p for p in os.listdir('/proc') if p.isdigit()))
    """, limits=KERNEL_ONLY)
    assert result.ok and result.stdout == "FileNotFoundError\n" * len(paths) + "['1']\n", result


def test_the_mount_table_does_not_show_the_checkout(bw):
    # A bind mount's source path is the root field of /proc/*/mountinfo: the allowed packages are
    # bound from a staged copy, not from the checkout's venv.
    import numpy

    venv_numpy = str(Path(numpy.__file__).resolve().parent)
    result = run(bw, """
        import threading
        seen = [open('/proc/self/mountinfo').read()]
        thread = threading.Thread(target=lambda: seen.append(open('/proc/thread-self/mountinfo').read()))
        thread.start(); thread.join()
        print(''.join(seen))
        import numpy
        print(int(numpy.arange(5).sum()))
    """, limits=KERNEL_ONLY)
    assert result.ok and result.stdout.endswith("\n10\n") and " /packages/numpy " in result.stdout, result
    for host_path in (str(REPO), venv_numpy, os.path.dirname(venv_numpy)):
        assert host_path not in result.stdout, host_path


def test_the_staged_packages_are_removed_with_their_process_or_by_the_next_one(tmp_path):
    import numpy

    package = str(Path(numpy.__file__).resolve().parent)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has exited: its folder is a leftover
    leftover = tmp_path / f"ridgeline-sandbox-packages-{gone.pid}-abc"
    alive = tmp_path / f"ridgeline-sandbox-packages-{os.getpid()}-abc"  # this test's process is alive
    for folder in (leftover, alive):
        (folder / "numpy").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", f"from ridgeline.envs.sandbox.staging import staged\n"
                           f"print(staged({package!r}))"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(tmp_path)), cwd=REPO)
    assert done.returncode == 0, done.stderr
    copy = Path(done.stdout.strip())
    assert copy.name == "numpy" and copy.parent.parent == tmp_path and str(REPO) not in str(copy)
    assert not copy.parent.exists()  # removed when its process exited
    assert not leftover.exists() and alive.exists()


# ------------------------------------------------------------------------------ network


@pytest.fixture()
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def assert_no_connection(server: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        server.accept()


def test_sockets_are_blocked_by_the_hook(bw, listener):
    port = listener.getsockname()[1]
    for source in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                   "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))",
                   "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)"):
        for isolation in (bw, PROCESS):
            assert_blocked(run(isolation, source), "socket")
    assert_no_connection(listener)


def test_network_namespace_alone(bw, listener):
    port = listener.getsockname()[1]
    result = run(bw, f"""
        import socket
        for attempt in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),
                        lambda: socket.getaddrinfo('example.com', 80)):
            try:
                attempt()
                print('connected')
            except OSError as exc:
                print(type(exc).__name__)
    """, limits=KERNEL_ONLY)
    assert result.ok and "connected" not in result.stdout and len(result.stdout.split()) == 2, result
    assert_no_connection(listener)


# ------------------------------------------------------------------------------ misc


def test_secret_environment_variable_is_not_visible(bw, monkeypatch):
    monkeypatch.setenv("RIDGELINE_TEST_SECRET", "hunter2")
    for isolation in (bw, PROCESS):
        result = run(isolation, "import os\nprint(dict(os.environ))\nprint(os.environ.get('RIDGELINE_TEST_SECRET'))")
        assert result.ok and "hunter2" not in result.stdout and result.stdout.endswith("None\n")


def test_ctypes_imports_but_foreign_calls_and_rlimit_raising_are_blocked(bw):
    for isolation in (bw, PROCESS):
        assert run(isolation, "import ctypes\nprint(ctypes.sizeof(ctypes.c_int))").stdout == "4\n"
        assert_blocked(run(isolation, "import ctypes\nctypes.CDLL(None).getpid()"), "ctypes.dlsym")
        assert_blocked(run(isolation, "import ctypes\nctypes.CDLL('libc.so.6')"), "ctypes.dlopen")
        assert_blocked(run(isolation, "import ctypes\nctypes.string_at(id(1), 8)"), "ctypes")
        assert_blocked(run(isolation, "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"),
                       "resource.setrlimit")


def test_audit_hook_cannot_be_dodged_with_a_subinterpreter(bw):
    assert_blocked(run(bw, "import _xxsubinterpreters as interpreters\ninterpreters.create()"), "")


# Loads _posixsubprocess's file as a fresh module under NAME from FILE (``{name}``, ``{file}``),
# then starts `sleep WORD` through it: an unhooked process creator (issue 29, item 6).
_FRESH_SPAWNER = """
    import glob, importlib.machinery, importlib.util, os, sys, time
    class Lying(str):
        def __str__(self):
            return 'harmless'
    original = [p for d in sys.path for p in glob.glob(d + '/_posixsubprocess*.so')][0]
    {prepare}
    loader = importlib.machinery.ExtensionFileLoader({name}, {file})
    fresh = importlib.util.module_from_spec(importlib.util.spec_from_loader({name}, loader))
    loader.exec_module(fresh)
    r, w = os.pipe()
    args = [[b'/usr/bin/sleep', b'{word}'], [b'/usr/bin/sleep'], True, (w,), None, None, -1, -1, -1, -1, -1, -1,
            r, w, True, True, -1, None, None, None, -1, None, False]
    try:
        fresh.fork_exec(*args)
    except TypeError:
        fresh.fork_exec(*args[:-1])
    time.sleep(1)
    print('spawned')
"""


@pytest.mark.parametrize("prepare, name, file, what", [
    # a str subclass whose __str__ lies to the hook's name check
    ("", "Lying('_posixsubprocess')", "original", "import '_posixsubprocess'"),
    # a copy in the work dir with its init symbol renamed: no name check can see it
    ("data = open(original, 'rb').read().replace(b'PyInit__posixsubprocess', b'PyInit_innocent_module_')\n"
     "open('innocent_module_.so', 'wb').write(data)", "'innocent_module_'", "'/work/innocent_module_.so'",
     "native module from a writable directory"),
])
def test_a_fresh_posixsubprocess_cannot_be_smuggled_past_the_hook(bw, prepare, name, file, what):
    word = token()
    source = textwrap.dedent(_FRESH_SPAWNER).format(prepare=prepare, name=name, file=file, word=word)
    for isolation in (bw, PROCESS):
        if isolation is PROCESS:  # the process-only mode's work dir is a host temp dir
            source = source.replace("'/work/innocent_module_.so'", "os.path.abspath('innocent_module_.so')")
        result = run_python(source, "", FAST, isolation)
        assert_blocked(result, what)
        assert "spawned" not in result.stdout
        assert_none_left(word)


def test_layers(bw, policy):
    assert {"bwrap", "pidns", "rlimits", "nproc", "audit_hook"} <= set(probe_layers())
    assert run(PROCESS, "pass", limits=SandboxLimits(use_audit_hook=False)).layers == ("rlimits",)
    if os.geteuid() == 0:  # root: programs run as an unprivileged user, where RLIMIT_NPROC applies
        result = run(bw, "import os\nprint(os.getuid(), os.geteuid())")
        assert result.stdout == "65534 65534\n" and "unprivileged_uid" in result.layers


def test_invalid_limits_are_rejected():
    for bad in ({"wall_seconds": 0}, {"max_processes": -1}, {"max_threads": 1.5}, {"disk_mb": 0}):
        with pytest.raises(ValueError):
            SandboxLimits(**bad)


# ------------------------------------------------------------------------------ the policy


def _fake_bwrap(folder: Path, script: str) -> None:
    path = folder / "bwrap"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_no_sandbox_refuses_with_one_sentence_naming_the_key(tmp_path, monkeypatch, policy):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found
    with pytest.raises(SandboxUnavailable) as info:
        resolve_isolation(SandboxSettings())
    message = str(info.value)
    assert message.startswith("Model-written code cannot be sandboxed on this machine: bubblewrap (bwrap) is not "
                              "installed. Fix: install bubblewrap >= 0.8 (`sudo apt-get install bubblewrap`")
    assert "environment.sandbox.allow_weak_isolation=true" in message and "\n" not in message
    # The code env refuses to be built: the trainer builds every row's env before training.
    policy(SandboxSettings())
    with pytest.raises(SandboxUnavailable, match="allow_weak_isolation"):
        make("code", extras={"reward_spec": {"ground_truth": [{"input": "", "output": "1"}]}})
    # Too old, or unable to start a sandbox here: bwrap's own reason is in the sentence.
    _fake_bwrap(tmp_path, "echo bubblewrap 0.6.1\n")
    with pytest.raises(SandboxUnavailable, match="bubblewrap 0.6.1, older than the 0.8.0"):
        resolve_isolation(SandboxSettings())
    for tool in ("setpriv", "mount"):  # as root, the sandbox's tmpfs are mounted and programs drop to uid 65534
        found = shutil.which(tool, path="/usr/bin:/bin")
        if found:
            (tmp_path / tool).symlink_to(found)
    _fake_bwrap(tmp_path, 'case "$1" in --version) echo bubblewrap 0.9.0;; *) echo "bwrap: No permissions to '
                          'create new namespace" >&2; exit 1;; esac\n')
    with pytest.raises(SandboxUnavailable, match=r"could not start a sandbox here \(bwrap: No permissions"):
        resolve_isolation(SandboxSettings())


def test_weak_mode_only_when_allowed_and_logged_every_run(tmp_path, monkeypatch, policy, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found
    weak = SandboxSettings(allow_weak_isolation=True)
    for _ in range(2):  # two runs in one process: each logs it
        policy(weak)
        with caplog.at_level(logging.WARNING, logger="ridgeline.envs.sandbox.policy"):
            caplog.clear()
            isolation = current_isolation()
            current_isolation()
        assert isinstance(isolation, ProcessOnly)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "environment.sandbox.allow_weak_isolation=true" in warnings[0]
        assert "WITHOUT isolation" in warnings[0] and "bubblewrap (bwrap) is not installed" in warnings[0]
    env = make("code", extras={"reward_spec": {"ground_truth": [{"input": "", "output": "1"}]}}, timeout_s=5)
    out = env.step("```python\nprint(1)\n```")
    assert out.reward == 1.0 and out.metadata["isolation"] == "process"


def test_bubblewrap_run_is_logged_as_such(bw, policy, caplog):
    policy(SandboxSettings())
    with caplog.at_level(logging.INFO, logger="ridgeline.envs.sandbox.policy"):
        assert current_isolation().name == "bwrap"
    assert any("code sandbox: bubblewrap" in r.getMessage() for r in caplog.records)
    assert not any(r.levelno == logging.WARNING for r in caplog.records)
    # a non-root trainer whose host forbids the first bwrap's user namespace is told what it lacks
    from ridgeline.envs.sandbox.policy import _announce
    with caplog.at_level(logging.WARNING, logger="ridgeline.envs.sandbox.policy"):
        _announce(dataclasses.replace(bw, mount=None, no_inode_bound="bwrap: uid map refused"),
                  SandboxSettings())
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "bounded in size but not in inodes (bwrap: uid map refused)" in warning


def test_the_non_root_path(tmp_path_factory):
    """A normal user's path (a first bwrap in a user namespace of its own mounts the inode-bounded
    tmpfs, the sandbox's bwrap inside it), run for real as uid 65534 with the system Python: the
    sandbox package is stdlib-only, so a copy of it runs there. Then the single bwrap it falls back
    to where the host forbids that user namespace (tmpfs bounded in size only)."""
    system_python, setpriv = shutil.which("python3", path="/usr/bin"), shutil.which("setpriv", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not system_python or not setpriv:
        pytest.skip("needs root, setpriv and /usr/bin/python3 to become an unprivileged user with a readable Python")
    bubblewrap()
    folder = Path(tempfile.mkdtemp(prefix="ridgeline-nonroot-"))  # not under pytest's 0700 tmp folders
    try:
        shutil.copytree(REPO / "ridgeline" / "envs" / "sandbox", folder / "sandbox")
        (folder / "check.py").write_text(textwrap.dedent(f"""
            import os, sys
            sys.path.insert(0, {str(folder)!r})
            from sandbox import SandboxLimits, SandboxSettings, resolve_isolation, run_python
            iso = resolve_isolation(SandboxSettings(packages=()))
            assert iso.setpriv is None and os.getuid() == 65534
            r = run_python("import os\\nprint(os.getuid(), os.getpid())", isolation=iso)
            print(r.stdout.strip(), 'unprivileged_uid' in r.layers)
            r = run_python("import os, time\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
                           "            time.sleep(5)\\n            os._exit(0)\\n        n += 1\\nexcept OSError as e:\\n"
                           "    print(n, e.errno)", limits=SandboxLimits(use_audit_hook=False, max_threads=3), isolation=iso)
            print(r.stdout.strip())
            r = run_python("open({str(folder / 'evil')!r}, 'w')", limits=SandboxLimits(use_audit_hook=False), isolation=iso)
            print(r.stderr.strip().splitlines()[-1].split(':')[0])
            fill = ("import os\\nn = 0\\ntry:\\n    while True:\\n        os.mkdir('d%d' % n)\\n        n += 1\\n"
                    "except OSError as e:\\n    print(n, e.errno, open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
            r = run_python(fill, limits=SandboxLimits(disk_mb=2, use_audit_hook=False), isolation=iso)
            print(r.stdout.strip(), 'tmpfs_inodes' in r.layers)
            # where the host forbids the first bwrap's user namespace: one bwrap, bounded in size only
            single = iso.without_inode_bound("a test")
            r = run_python("import os\\nfor n in range(1000):\\n    os.mkdir('d%d' % n)\\nprint(len(os.listdir()))",
                           limits=SandboxLimits(disk_mb=2), isolation=single)
            print(r.stdout.strip() or r.stderr, 'tmpfs_inodes' in r.layers, single.no_inode_bound)
        """))
        os.chmod(folder, 0o755)
        for path in folder.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        done = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", "--", system_python,
                               "-I", str(folder / "check.py")], capture_output=True, text=True, timeout=120, cwd="/")
        assert done.returncode == 0, done.stderr
        # 2 MiB tmpfs: 64 inodes per MiB, the root folder and main.py take two; no capability left
        assert done.stdout.splitlines() == ["65534 1 False", "3 11", "FileNotFoundError", "126 28 0000000000000000 True",
                                            "1001 False a test"], done.stdout
        assert not (folder / "evil").exists()
    finally:
        shutil.rmtree(folder)
