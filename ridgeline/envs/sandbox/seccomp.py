"""The seccomp filter every sandboxed program runs under (bwrap ``--seccomp FD``).

A classic BPF program, built here with ``struct`` (no libseccomp: its Python bindings are not on
PyPI and the system package only serves the system Python). It allows every system call but the
groups of :data:`DENIED`, which fail with EPERM; a call from another ABI than the host's (i386's
``int 0x80`` on x86_64) kills the process, and on x86_64 every x32 call fails with EPERM (the
filter compares numbers, and an x32 number is the x86_64 one plus bit 30). docs/security.md
says why each group is denied.

Program (``seccomp_data``: ``nr`` at offset 0, ``arch`` at 4)::

    ld arch; jeq HOST_ARCH ? next : kill
    ld nr; [x86_64: jge 0x40000000 ? errno]
    jeq DENIED[0] ? errno ... jeq DENIED[n] ? errno
    ret allow; errno: ret ERRNO|EPERM; kill: ret KILL_PROCESS
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["DENIED", "SYSCALL_NUMBERS", "UnsupportedArchitecture", "denied_numbers", "filter_program", "host_arch"]

# What each group lets a program reach; names are the kernel's (unistd.h).
DENIED: dict[str, tuple[str, ...]] = {
    # Keyrings are not namespaced: the trainer's session keyring (and anything cached in the
    # user's keyrings) is readable, writable and a channel between sandboxes.
    "kernel keyrings": ("add_key", "request_key", "keyctl"),
    # Large, often-exploited kernel surfaces a solution never needs.
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "bpf and perf": ("bpf", "perf_event_open"),
    "userfaultfd": ("userfaultfd",),
    # Reading or writing another task's memory (the sandbox's own children included).
    "tracing": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    # Changing the filesystem view or namespaces (bwrap has set them up before the filter applies).
    "mounts and namespaces": ("mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
                              "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns"),
    "kernel modules and kexec": ("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load"),
    # Kernel memory outside the sandbox's tmpfs sizes and rlimits (a fresh IPC namespace has no
    # usable shmall/shmmax bound): SysV shared memory, semaphores, message queues, POSIX mqueues.
    "SysV IPC and POSIX message queues": (
        "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
        "msgget", "msgsnd", "msgrcv", "msgctl",
        "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr"),
    # Memory outside RLIMIT_AS and the tmpfs sizes: a memfd is written, never mapped (64 fds x
    # file_size_mb each), inotify watches cost kernel memory per watched inode of the runtime.
    "memfd and inotify": ("memfd_create", "memfd_secret", "inotify_init", "inotify_init1", "inotify_add_watch"),
    # Host-wide state and old interfaces (most need capabilities the program lacks; denied anyway).
    "host state": ("acct", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime",
                   "adjtimex", "syslog", "quotactl", "quotactl_fd", "open_by_handle_at", "name_to_handle_at",
                   "fanotify_init", "lookup_dcookie", "vhangup", "iopl", "ioperm", "modify_ldt", "uselib"),
}

# name -> (x86_64, aarch64); None where the architecture has no such call. From the kernel's
# arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h (a test compares
# them with the installed headers).
SYSCALL_NUMBERS: dict[str, tuple[int, int | None]] = {
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "unshare": (272, 97), "setns": (308, 268),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "shmget": (29, 194), "shmat": (30, 196), "shmdt": (67, 197), "shmctl": (31, 195), "semget": (64, 190),
    "semop": (65, 193), "semtimedop": (220, 192), "semctl": (66, 191), "msgget": (68, 186), "msgsnd": (69, 189),
    "msgrcv": (70, 188), "msgctl": (71, 187),
    "mq_open": (240, 180), "mq_unlink": (241, 181), "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183),
    "mq_notify": (244, 184), "mq_getsetattr": (245, 185),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "inotify_init": (253, None), "inotify_init1": (294, 26),
    "inotify_add_watch": (254, 27),
    "acct": (163, 89), "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "syslog": (103, 116), "quotactl": (179, 60), "quotactl_fd": (443, 443), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "fanotify_init": (300, 262), "lookup_dcookie": (212, 18),
    "vhangup": (153, 58), "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None),
    "uselib": (134, None),
}

# linux/audit.h: AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64; the column of SYSCALL_NUMBERS.
_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
_X32_SYSCALL_BIT = 0x40000000

# linux/filter.h and linux/seccomp.h
_LD_W_ABS = 0x20   # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15      # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35      # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06      # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_NR_OFFSET, _ARCH_OFFSET = 0, 4


class UnsupportedArchitecture(Exception):
    """No system-call table for this CPU architecture; the message names it."""


def host_arch() -> str:
    machine = platform.machine().lower()
    machine = _MACHINE_ALIASES.get(machine, machine)
    if machine not in _ARCHES:
        raise UnsupportedArchitecture(f"the sandbox's seccomp filter knows the system calls of x86_64 and aarch64, "
                                      f"not of this machine's {platform.machine() or 'unknown'} architecture")
    return machine


def denied_numbers(arch: str) -> list[int]:
    """The numbers of every denied call that exists on ``arch``, in :data:`DENIED` order."""
    column = _ARCHES[arch][1]
    numbers = (SYSCALL_NUMBERS[name][column] for names in DENIED.values() for name in names)
    return [number for number in numbers if number is not None]


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter, native byte order


def filter_program(arch: str | None = None) -> bytes:
    """The filter for ``arch`` (default: this machine's) as the bytes bwrap's ``--seccomp`` reads."""
    arch = arch or host_arch()
    audit_arch = _ARCHES[arch][0]
    numbers = denied_numbers(arch)
    body: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, _NR_OFFSET)]
    if arch == "x86_64":
        body.append((_JGE_K, 0, 0, _X32_SYSCALL_BIT))  # to errno
    body += [(_JEQ_K, 0, 0, number) for number in numbers]  # to errno
    # Layout after body: [ret allow][ret errno][ret kill]; fill in each jump's distance.
    errno_at = len(body) + 1
    program = [_insn(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
               _insn(_JEQ_K, 0, len(body) + 2, audit_arch)]  # no: jump over body, allow, errno, to kill
    for index, (code, _, _, k) in enumerate(body):
        jump = errno_at - index - 1
        if code == _LD_W_ABS:
            program.append(_insn(code, 0, 0, k))
        else:
            if jump > 255:
                raise ValueError("seccomp filter too long for 8-bit jumps")
            program.append(_insn(code, jump, 0, k))
    program += [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
                _insn(_RET_K, 0, 0, _RET_KILL_PROCESS)]
    return b"".join(program)
