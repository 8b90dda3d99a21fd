"""The device a process trains and generates on (`trainer.device`), and what it reports of memory.

Devices always carry an index (`cuda:0`, never a bare `cuda`): a bare CUDA device asks the driver
for its current index, which a CPU-only build (and FakeTensorMode on it) cannot answer.
"""

from __future__ import annotations

import contextlib
import gc
import resource

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def resolve_device(name: str) -> torch.device:
    """`trainer.device` -> a torch device: `auto` is this process's CUDA device when CUDA is
    available (SkyRL configs never name a device, so a GPU machine must get its GPU), else the CPU;
    `cuda` is the current CUDA device (the one `LOCAL_RANK` selected on a rank); `cuda:N` is GPU N.
    A CUDA device on a machine without CUDA is refused with the key named."""
    name = str(name).strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"trainer.device={name} but CUDA is not available here (torch {torch.__version__}, "
                             f"built with CUDA {torch.version.cuda}). Fix: trainer.device=auto or cpu, or "
                             "install a CUDA build of PyTorch on a machine with a GPU")
        # the current device without initialising CUDA in a process that never used it (a Ray driver)
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        index = current if name == "cuda" else int(name.split(":", 1)[1])
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"trainer.device={name}: this machine has {torch.cuda.device_count()} GPU(s)")
        return torch.device("cuda", index)
    raise ValueError(f"trainer.device={name!r} is not a device: one of {', '.join(DEVICE_CHOICES)}")


def use_device(name: str) -> torch.device:
    """`resolve_device`, made this process's current CUDA device: pinned host buffers, NCCL, the
    caching allocator's defaults and every bare `cuda` land on it, not on GPU 0. For the process
    that computes (one process on `trainer.device`); FSDP2 ranks take theirs by rank (`rank_device`)."""
    device = resolve_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def release_device_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the GPU, for another process on it (a
    colocated engine about to wake): Python's garbage first (tensors held only by reference cycles
    keep their blocks), then the cache, then the blocks other processes received by IPC and let go.
    Nothing to do off CUDA."""
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.ipc_collect()


def device_kind(name: str) -> str:
    """What `trainer.device` asks for without asking this machine: "auto", "cpu" or "cuda" (an index
    dropped); ValueError for a name that is not a device. A Ray driver plans with it, and the ranks
    find their GPU themselves."""
    name = str(name).strip().lower()
    if name in ("auto", "cpu", "cuda"):
        return name
    if name.startswith("cuda:") and name[5:].isdigit():
        return "cuda"
    raise ValueError(f"trainer.device={name!r} is not a device: one of {', '.join(DEVICE_CHOICES)}")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device` (nothing for fp32 or None, and nothing on devices autocast
    does not know, e.g. `meta` in the placement tests)."""
    if dtype is None or dtype == torch.float32 or device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def resident_gib() -> float | None:
    """This process's resident memory now (Linux: /proc/self/statm's second field, in pages);
    None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**30
    except (OSError, IndexError, ValueError):
        return None


def memory_metrics(device: torch.device) -> dict[str, float]:
    """`memory/rss_gib` (this process's resident memory now, where the OS reports it: it falls
    when memory is given back, so a chart over steps shows growth), `memory/peak_rss_gib` (its
    peak so far; Linux reports KiB) and, on CUDA, `memory/peak_gpu_gib` (the peak of tensors
    allocated since the last call, which resets it: one figure per step) and
    `memory/reserved_gpu_gib` (what the caching allocator holds)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rss = resident_gib()
    # Linux updates the high-water mark lazily: it may lag the resident size read just now
    metrics = {"memory/peak_rss_gib": peak if rss is None else max(peak, rss)}
    if rss is not None:
        metrics["memory/rss_gib"] = rss
    if device.type == "cuda":
        metrics["memory/peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        metrics["memory/reserved_gpu_gib"] = torch.cuda.memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return metrics
