"""The code that runs first inside the sandboxed interpreter: rlimits, the audit hook, the program.

It runs as ``python -I [-S] -B -c SOURCE`` with its settings baked into the source as a literal
(constants in the code, rather than argv or the environment, are not something the program can swap
before the hook reads them). Order: resource limits, then the audit hook, then the user program.

The audit hook is the *second* layer. Under bubblewrap the kernel already stops everything that
matters to the host; the hook turns the common attempts (fork, sockets, writes outside the work dir)
into a clear ``killed_reason="blocked: ..."`` and is the main layer only in the weaker
process-only mode. It does not ban ``import ctypes`` (numpy imports it): it refuses what makes
ctypes dangerous, loading a library other than the interpreter itself and resolving or calling a
foreign function or raw address (``ctypes.dlsym``, ``ctypes.call_function``, ``ctypes.cdata``...),
which numpy never does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["BLOCKED_EXIT_CODE", "BootstrapConfig", "bootstrap_source"]

# Exit status the child uses after the audit hook blocked an action (the reason travels over the
# report pipe; the code only makes the exit easy to spot when reading raw logs).
BLOCKED_EXIT_CODE = 86


@dataclass(frozen=True)
class BootstrapConfig:
    """What the bootstrap needs; ``max_tasks`` is RLIMIT_NPROC (None: not set, see the process-only
    mode), ``sys_path``: directories put first on ``sys.path`` (the allowed packages)."""

    work: str
    program: str
    report_fd: int
    cpu_seconds: int
    memory_mb: int
    file_size_mb: int
    max_open_files: int
    max_processes: int
    max_tasks: int | None
    audit_hook: bool
    sys_path: tuple[str, ...] = ()
    blocked_exit_code: int = BLOCKED_EXIT_CODE


def bootstrap_source(config: BootstrapConfig) -> str:
    values = asdict(config)
    values["sys_path"] = list(config.sys_path)
    return _BOOTSTRAP.replace("__CONFIG__", repr(values))


_BOOTSTRAP = r'''
import os, sys
CFG = __CONFIG__


def report(line):
    try:
        os.write(CFG["report_fd"], (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def set_limits():
    import resource

    def limit(which, soft, hard=None):
        hard = soft if hard is None else hard
        _, current_hard = resource.getrlimit(which)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))

    mib = 1024 * 1024
    # CPU: SIGXCPU at the soft limit, SIGKILL one second later if the program catches SIGXCPU.
    limit(resource.RLIMIT_CPU, CFG["cpu_seconds"], CFG["cpu_seconds"] + 1)
    limit(resource.RLIMIT_AS, CFG["memory_mb"] * mib)
    limit(resource.RLIMIT_FSIZE, CFG["file_size_mb"] * mib)
    limit(resource.RLIMIT_NOFILE, CFG["max_open_files"])
    limit(resource.RLIMIT_CORE, 0)
    layers = ["rlimits"]
    if CFG["max_tasks"] is not None:
        # Counted per (user namespace, uid): in bubblewrap's fresh user namespace this is the
        # sandbox's own tasks (its init, this process, children, threads), not the host user's.
        limit(resource.RLIMIT_NPROC, CFG["max_tasks"])
        layers.append("nproc")
    return layers


def install_audit_hook(work, max_processes, report_fd, blocked_exit_code):
    import posix, _posixsubprocess, _stat

    # Everything the hook calls is captured here as a closure variable: the program can monkeypatch
    # os, os.path, sys and even builtins (say os.getcwd or os._exit), but not these references.
    lstat, stat, readlink, getcwd, fspath = posix.lstat, posix.stat, posix.readlink, posix.getcwd, posix.fspath
    write, exit_, getpid, getpgrp = posix.write, posix._exit, posix.getpid, posix.getpgrp
    S_ISLNK, S_ISDIR = _stat.S_ISLNK, _stat.S_ISDIR
    audit, streams = sys.audit, (sys.stdout, sys.stderr)
    is_instance, str_, bytes_, int_, memoryview_ = isinstance, str, bytes, int, memoryview
    str_data = str.__str__  # the characters of a str subclass, whatever its own __str__ says
    OSError_, PermissionError_, BaseException_ = OSError, PermissionError, BaseException

    prefix = work + "/"
    devices = frozenset(("/dev/null", "/dev/stdout", "/dev/stderr"))
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC
    counted_spawns = frozenset(("os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.spawn", "subprocess.Popen"))
    other_spawns = frozenset(("os.exec", "_posixsubprocess.fork_exec", "pty.spawn"))
    denied = frozenset((
        "socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
        "socket.sethostname", "resource.setrlimit", "resource.prlimit", "cpython.PyInterpreterState_New",
        "syslog.openlog", "syslog.syslog", "sqlite3.enable_load_extension", "sqlite3.load_extension",
        # These find any object, e.g. this hook's closure, whose cells could then be rewritten.
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    ))
    denied_imports = frozenset(("_posixsubprocess", "_xxsubinterpreters"))
    # Audit event -> positions of path arguments that must stay inside the sandbox.
    path_args = {
        "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
        "os.chflags": (0,), "os.lchflags": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,),
        "os.truncate": (0,), "os.utime": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
        "shutil.rmtree": (0,), "shutil.chown": (0,), "sqlite3.connect": (0,),
    }
    spawned = [0]
    # Extension modules loaded from where the program can write (a copy with a renamed init symbol
    # would pass any check on the module's name).
    scratch_dirs = (prefix, "/dev/shm/")

    def plain(value):
        """An exact str or bytes holding ``value``'s data: a subclass's methods (startswith, split,
        rpartition, __str__) could lie to the checks, while the kernel and the import machinery's
        C code read the data."""
        if is_instance(value, str_):
            return str_data(value)
        if is_instance(value, bytes_):
            return bytes_(memoryview_(value))
        return value

    # _posixsubprocess.fork_exec (multiprocessing's spawn/forkserver use it) raises no audit event
    # of its own. With no processes allowed, replace it outright (nothing keeps the original around
    # for the program to find); otherwise wrap it. Re-importing a fresh copy is blocked below.
    original_fork_exec = _posixsubprocess.fork_exec if max_processes > 0 else None

    def fork_exec(*args, **kwargs):
        audit("_posixsubprocess.fork_exec")
        if original_fork_exec is None:
            raise PermissionError_("process creation is not allowed in the sandbox")
        return original_fork_exec(*args, **kwargs)

    _posixsubprocess.fork_exec = fork_exec

    def deny(what):
        for stream in streams:
            try:
                stream.flush()
            except BaseException_:
                pass
        message = ("blocked: " + what + "\n").encode("utf-8", "replace")
        for fd, data in ((report_fd, message), (2, b"ridgeline sandbox: " + message)):
            try:
                write(fd, data)
            except BaseException_:
                pass
        exit_(blocked_exit_code)
        raise PermissionError_("blocked: " + what)  # not reached; an exception also aborts the action

    def resolve(path):
        """Absolute path with symlinks resolved (os.path.realpath), from captured functions only."""
        path = plain(path)
        if is_instance(path, bytes_):
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = getcwd() + "/" + path  # relative paths resolve against the current cwd
        pending, parts, hops = path.split("/")[::-1], [], 0
        while pending:
            part = pending.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            candidate = "/" + "/".join(parts + [part])
            try:
                mode = lstat(candidate).st_mode
            except OSError_:
                parts.append(part)  # does not exist (yet): taken literally
                continue
            if not S_ISLNK(mode):
                parts.append(part)
                continue
            hops += 1
            if hops > 40:
                return None
            target = readlink(candidate)
            if target.startswith("/"):
                parts = []
            pending.extend(target.split("/")[::-1])
        return "/" + "/".join(parts)

    def inside(path):
        try:
            path = plain(fspath(path))
            if not (is_instance(path, str_) or is_instance(path, bytes_)):
                return False
            if path in devices:
                return True
            resolved = resolve(path)
            return resolved is not None and (resolved == work or resolved.startswith(prefix))
        except BaseException_:
            return False

    def is_dir(path):
        try:
            return S_ISDIR(stat(path).st_mode)
        except BaseException_:
            return False

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if is_instance(path, int_):
                return  # an fd the program already holds
            if mode is None:
                writes = flags & write_flags
            else:
                writes = "w" in mode or "a" in mode or "x" in mode or "+" in mode
            if writes and not inside(path):
                deny("write outside the sandbox: %r" % (path,))
            if mode is None and not inside(path) and is_dir(path):
                deny("directory fd outside the sandbox: %r" % (path,))
        elif event in denied:
            deny(event)
        elif event.startswith("ctypes."):
            # `import ctypes` opens the interpreter itself (dlopen(None)); anything that reaches a
            # foreign function or a raw address goes further than numpy or a solution needs.
            if event != "ctypes.dlopen" or args[0] is not None:
                deny(event)
        elif event in counted_spawns or event in other_spawns:
            if max_processes <= 0:
                deny("process creation (%s)" % event)
            if event in counted_spawns:
                if spawned[0] >= max_processes:
                    deny("process creation beyond max_processes=%d (%s)" % (max_processes, event))
                spawned[0] += 1
        elif event in path_args:
            for index in path_args[event]:
                target = args[index]
                if is_instance(target, int_) or not inside(target):
                    deny("%s outside the sandbox: %r" % (event, target))
                if event == "sqlite3.connect" and is_instance(target, str_) and target.startswith("file:"):
                    deny("sqlite3 URI filename %r" % (target,))
        elif event == "os.kill":
            if args[0] != 0 and args[0] != getpid():
                deny("os.kill of another process")
        elif event == "os.killpg":
            if args[0] != 0 and args[0] != getpgrp():
                deny("os.killpg of another process group")
        elif event == "import":
            # The name's data, last part: an extension module's init function is found by it, so
            # loading _posixsubprocess's file as "x._posixsubprocess" (or under a str subclass
            # whose __str__ says something else) would give a fresh, unwrapped copy.
            name = plain(args[0])
            if not is_instance(name, str_) or name.rpartition(".")[2] in denied_imports:
                deny("import %r" % (name,))
            filename = args[1]  # an extension module's file (None for the finder's own event)
            if filename is not None:
                where = resolve(plain(fspath(filename)))
                if where is None or where == work or where.startswith(scratch_dirs):
                    deny("native module from a writable directory: %r" % (where,))

    sys.addaudithook(hook)


def run_program(path):
    import builtins, types  # not traceback: it imports re and tokenize, a third of the start-up

    with open(path, "rb") as handle:
        source = handle.read()
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [path]
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        import traceback
        traceback.print_exception(type(exc), exc, None)
        sys.exit(1)
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback
        # Skip this bootstrap's own frame so tracebacks look like a plain `python main.py` run.
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)


def main():
    if os.getpid() == 1:
        # Under bwrap --as-pid-1 the program is its namespace's init, and the kernel spares an
        # init the default action of SIGXCPU; end it at the soft CPU limit as any process would
        # end (bwrap reports a death by signal N as exit status 128 + N).
        import signal
        signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
    sys.path[:0] = CFG["sys_path"]
    os.chdir(CFG["work"])
    layers = set_limits()
    if CFG["audit_hook"]:
        install_audit_hook(CFG["work"], CFG["max_processes"], CFG["report_fd"], CFG["blocked_exit_code"])
        layers.append("audit_hook")
    report("layers: " + ",".join(layers))
    run_program(CFG["program"])


main()
'''
