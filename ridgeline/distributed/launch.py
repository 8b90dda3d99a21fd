"""Run a function on N local ranks, each in its own process with a process group, and collect
what each rank returns.

For tests and single-node tools: `run_ranks(fn, 2, x)` spawns two processes, joins them into a
gloo (CPU) or nccl (one GPU per rank) group on 127.0.0.1, calls `fn(x)` in each (the rank is
`torch.distributed.get_rank()`), and returns `[result of rank 0, result of rank 1]`. A rank that
raises makes `run_ranks` raise `RankError` with that rank's traceback; a rank that dies or hangs
(a collective its peers never join) is killed at `timeout_s`, so the caller never hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_module
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ridgeline.inference.weight_transport import free_port  # noqa: F401 - part of this module's API


class RankError(RuntimeError):
    """A rank raised, died or timed out. `rank` is the failing rank (None for a timeout) and
    the message carries that rank's traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@contextlib.contextmanager
def _child_env(values: dict[str, str]) -> Iterator[None]:
    # spawned children copy the parent's environment when they start: set it only around start()
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
        # pickled here, not by the queue: torch's queue would pass tensors as shared memory that
        # dies with this process
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable exception still sends its traceback
            payload = None
        results.put((rank, "error", (text, payload)))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout_s: float = 120.0) -> list[Any]:
    """`fn(*args)` on `world_size` spawned ranks; their return values, in rank order.

    `fn` and `args` must be picklable (a module-level function). Children run with
    OMP_NUM_THREADS=1. On the first failure every rank is terminated and RankError is raised,
    chained from the rank's own exception when it could be pickled."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    with _child_env({"OMP_NUM_THREADS": "1"}):
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, args=(rank, world_size, port, backend, timeout_s, fn, args, results),
                            daemon=True)
            p.start()
            procs.append(p)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_module.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise RankError(f"ranks {missing} did not finish within {timeout_s:.0f} s") from None
                for rank, p in enumerate(procs):
                    # exit code 0 without a result can only be a race with the queue: look again
                    if rank not in values and p.exitcode not in (None, 0):
                        raise RankError(f"rank {rank} died with exit code {p.exitcode}", rank) from None
                continue
            if status == "ok":
                values[rank] = pickle.loads(payload)
                continue
            text, exc_payload = payload
            cause = None
            if exc_payload is not None:
                with contextlib.suppress(Exception):
                    cause = pickle.loads(exc_payload)
            raise RankError(f"rank {rank} failed:\n{text}", rank) from cause
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
    return [values[r] for r in range(world_size)]
