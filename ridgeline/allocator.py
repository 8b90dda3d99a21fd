"""Run Ridgeline's command-line processes on tcmalloc when the machine has it.

PyTorch's CPU allocator has no cache: every tensor is a `malloc`, and glibc hands blocks over
32 MB straight back to the kernel when they are freed. A training step makes many such blocks (the
dense gradient of a 49k x 576 embedding, the LM head's gradient and bf16 copy, each micro-batch), so
every step faults the same gigabytes in afresh: on the quickstart's policy step (SmolLM2-135M, one
core, bf16) `fill_` of the embedding gradient took 540 ms, an `exp` over fresh logits 274 ms, and the
process spent 8.5 s in the kernel for 51 s of user time. tcmalloc keeps freed pages for reuse: the
same step went from 6.6 s to 5.4 s (docs/benchmarks.md). mimalloc and jemalloc (default settings)
did not help here; glibc's own `M_MMAP_MAX=0` helped half as much.

An allocator has to be in place before the process's first allocation, so the `ridgeline` command
(`entry`) re-executes itself once with tcmalloc in `LD_PRELOAD`, the way PyTorch's CPU performance
guide and IPEX's launcher do it. `RIDGELINE_ALLOCATOR=system` keeps the default allocator, and
`RIDGELINE_TCMALLOC=/path/libtcmalloc.so` names the library. Processes that the run starts (Ray
workers, sandboxes) get the caller's environment back, without the preload.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

SWITCH = "RIDGELINE_ALLOCATOR"        # "auto" (default): tcmalloc when found | "tcmalloc" | "system"
LIBRARY = "RIDGELINE_TCMALLOC"        # an explicit path to the library
_ORIGINAL_PRELOAD = "_RIDGELINE_ORIGINAL_LD_PRELOAD"   # set on the re-executed process
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """The tcmalloc library to preload: `RIDGELINE_TCMALLOC`, else the first found on the system."""
    explicit = os.environ.get(LIBRARY)
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for folder in DIRS:
        for name in NAMES:
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found or None


def active_allocator() -> str:
    """"tcmalloc" when this process runs on it (preloaded or linked), else "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "system"


def requested() -> str:
    """`RIDGELINE_ALLOCATOR`: "auto" (the default, and what an unknown value falls back to),
    "tcmalloc" or "system"."""
    choice = os.environ.get(SWITCH, "auto").strip().lower()
    if choice not in ("auto", "tcmalloc", "system"):
        print(f"ridgeline: {SWITCH}={choice!r} is not one of auto, tcmalloc, system; using auto", file=sys.stderr)
        return "auto"
    return choice


def reexec_with_tcmalloc() -> None:
    """Replace this process with the same command line under tcmalloc, once; returns (doing
    nothing) when it is off, not found, already loaded, or the exec fails."""
    if _ORIGINAL_PRELOAD in os.environ:       # the re-executed process: hide the preload from children
        original = os.environ.pop(_ORIGINAL_PRELOAD)
        if original:
            os.environ["LD_PRELOAD"] = original
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    choice = requested()
    if choice == "system" or not sys.platform.startswith("linux") or active_allocator() == "tcmalloc":
        return
    library = find_tcmalloc()
    if library is None:
        if choice == "tcmalloc":
            print(f"ridgeline: {SWITCH}=tcmalloc but no tcmalloc library was found (apt-get install "
                  f"libtcmalloc-minimal4, or set {LIBRARY}); using the system allocator", file=sys.stderr)
        return
    original = os.environ.get("LD_PRELOAD", "")
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (library, original) if p), **{_ORIGINAL_PRELOAD: original})
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        print(f"ridgeline: could not restart on tcmalloc ({exc}); using the system allocator", file=sys.stderr)
