"""Weight transport between a trainer and inference engines in other processes: the trainer's
policy rank 0 broadcasts its weights, the engines receive them (the stale-weights probe that
checks they use them lives in ridgeline.distributed.weight_sync).

The group is the trainer's rank 0 (always rank 0 here) plus one rank per engine process, over
gloo (CPU) or nccl (CUDA), rendezvousing through a TCP store on `host:port` that rank 0 hosts.
It is a *standalone* process group, built from the store rather than with
`torch.distributed.init_process_group`, so it lives beside the trainer's own default group
(FSDP) and the engines' (tensor parallel) without either side having to join the other's world.

Wire protocol of one `send` (every step is a broadcast from rank 0 unless said otherwise):
  1. the header length (one int64),
  2. the header: JSON of the version and, per tensor, name, shape, dtype and byte offset into
     one virtual byte stream (JSON rather than pickle: a receiver never runs code it is sent),
  3. the byte stream in chunks of at most `chunk_bytes` (tensors may straddle chunks),
  4. an all-reduce in which every receiver contributes 1 once it holds all bytes.

Guarantees: `send` returns only after every receiver holds every byte (step 4), so the trainer
may overwrite its parameters right after. Floating-point tensors arrive cast to the `dtype`
passed to `send` (round to nearest even, bit for bit what `tensor.to(dtype)` gives; the engine
then copies them without a second rounding); other tensors arrive unchanged. The sender holds
one chunk of staging memory, the receiver the full set of received weights. A timeout, or a peer
that died, raises `WeightSyncError` naming backend, peers and timeout instead of hanging; after
one, the group is broken and must be rebuilt (`close()` then a new sender / receivers).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist


log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
# Every tensor starts on this byte boundary, so a receiver can view its bytes as the tensor's
# dtype in place, without a copy.
ALIGN = 64
_MB = 1e6


class WeightSyncError(RuntimeError):
    """The sync did not complete: a peer timed out, died, or never joined."""


@dataclass(frozen=True)
class GroupSpec:
    """Who is in the weight-sync group and how it meets. `rank` 0 is the trainer; 1..world_size-1
    are engine processes. `backend` is `generator.weight_sync_backend`, `timeout_s`
    `generator.weight_sync_timeout` (it bounds the rendezvous and every collective)."""

    port: int
    rank: int
    world_size: int
    backend: str = "gloo"
    host: str = "127.0.0.1"
    timeout_s: float = 60.0
    group_name: str = "ridgeline_weight_sync"

    def describe(self) -> str:
        engines = list(range(1, self.world_size))
        return (f"backend={self.backend}, trainer rank 0 + engine ranks {engines} at "
                f"{self.host}:{self.port}, this rank {self.rank}, timeout {self.timeout_s:g}s "
                f"(generator.weight_sync_timeout)")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str      # e.g. "bfloat16"
    offset: int     # bytes into the stream
    nbytes: int


@dataclass(frozen=True)
class SyncHeader:
    version: int
    chunk_bytes: int
    total_bytes: int
    tensors: tuple[TensorMeta, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SyncHeader":
        d = json.loads(raw.decode())
        metas = tuple(TensorMeta(m["name"], tuple(m["shape"]), m["dtype"], m["offset"], m["nbytes"])
                      for m in d["tensors"])
        return cls(d["version"], d["chunk_bytes"], d["total_bytes"], metas)


@dataclass(frozen=True)
class SyncStats:
    """What one `send` cost. MB = 1e6 bytes; seconds are wall time from the header to the ack."""

    version: int
    num_tensors: int
    bytes: int
    num_chunks: int
    seconds: float
    seconds_per_mb: float


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the names headers carry)."""
    return str(dtype).removeprefix("torch.")


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight travels in: floating tensors in the engine's `dtype`, others as they are."""
    return dtype if tensor.is_floating_point() else tensor.dtype


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"weight sync header names an unknown dtype {name!r}")
    return dtype


def _chunk_ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(total, start + chunk)) for start in range(0, total, chunk)]


class _Endpoint:
    """One member of the group: the rendezvous, and collectives that fail loudly."""

    def __init__(self, spec: GroupSpec):
        if spec.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync backend must be gloo or nccl, got {spec.backend!r}")
        if spec.world_size < 2:
            raise ValueError("a weight-sync group needs the trainer and at least one engine")
        self.spec = spec
        self.timeout = timedelta(seconds=spec.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" \
            else torch.device("cpu")
        try:
            # rank 0 hosts the store and waits for every engine to join (bounded by the timeout);
            # the others retry connecting until rank 0 is up, under the same bound.
            self._store = _open_store(spec, self.timeout)
            store = dist.PrefixStore(spec.group_name, self._store)
            self.pg = self._make_group(store)
        except Exception as e:  # noqa: BLE001 - every rendezvous failure gets the same context
            raise WeightSyncError(f"weight-sync group did not form ({spec.describe()}): {e}") from e

    def _make_group(self, store: dist.Store) -> dist.ProcessGroup:
        spec = self.spec
        if spec.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            # The trainer (rank 0) binds the rendezvous host, not whatever the machine's hostname
            # resolves to; so does an engine meeting it on loopback. An engine on another machine
            # cannot bind the trainer's address and takes its own default interface.
            if spec.rank == 0 or is_loopback(spec.host):
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.host)]
            else:
                opts._devices = [dist.ProcessGroupGloo.create_default_device()]
            return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        return dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, opts)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"weight sync failed during {what} ({self.spec.describe()}); a peer "
                                  f"died or stalled. The group is now broken: rebuild it. Cause: {e}") from e

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            work = self.pg.broadcast(tensor, 0, self.timeout)
        except Exception as e:  # noqa: BLE001 - gloo may fail at enqueue when the peer is gone
            raise WeightSyncError(f"weight sync failed during {what} ({self.spec.describe()}): {e}") from e
        self._wait(work, what)

    def _ack(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            work = self.pg.allreduce([flag], dist.ReduceOp.SUM, self.timeout)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"weight sync failed during the ack ({self.spec.describe()}): {e}") from e
        self._wait(work, "the ack")
        return int(flag.item())

    def close(self) -> None:
        """Drop the group; with a dead peer, release what can be released and never block."""
        pg = getattr(self, "pg", None)
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - nothing useful to do when tearing down a broken group
                pass
        self.pg = None
        self._store = None


def _open_store(spec: GroupSpec, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it, the others connect to it.

    torch's client handshake (a ping once connected) reads without a time limit, so a peer that
    accepts the connection and never answers would hold this rank forever. The client connects in
    a helper thread that must finish within the timeout; when it does not, the connection it opened
    is shut down (which ends the thread: its read returns) and the rendezvous fails naming the peer."""
    if spec.rank == 0:
        return dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=True, timeout=timeout,
                             wait_for_workers=True)
    outcome: list[dist.TCPStore | Exception] = []

    def connect() -> None:
        try:
            outcome.append(dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout,
                                         wait_for_workers=True))
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)

    earlier = _sockets_to(spec.host, spec.port)
    thread = threading.Thread(target=connect, name="ridgeline-store-connect", daemon=True)
    thread.start()
    thread.join(spec.timeout_s)
    if thread.is_alive():
        for inode, fd in _sockets_to(spec.host, spec.port).items():
            if inode not in earlier:
                _shut(fd)
        thread.join(1.0)
        raise TimeoutError(f"{spec.host}:{spec.port} took the connection but did not answer the rendezvous within "
                           f"{spec.timeout_s:g}s: is that the trainer's weight-sync address and port?")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _sockets_to(host: str, port: int) -> dict[str, int]:
    """This process's sockets connected to host:port, {socket inode: fd} (Linux's /proc; elsewhere
    none are found and a stuck handshake thread stays until its peer closes)."""
    import socket

    try:
        addresses = {_plain_ip(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    found = {}
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as s:
                peer = s.getpeername()
        except (OSError, ValueError):
            continue  # closed meanwhile, not connected, or not an internet socket
        if isinstance(peer, tuple) and peer[1] == port and _plain_ip(peer[0]) in addresses:
            found[link] = int(name)
    return found


def _plain_ip(address: str) -> str:
    """An IPv4 address as itself, also when a dual-stack socket reports it IPv4-mapped (torch's
    store client connects over IPv6: "::ffff:127.0.0.1")."""
    import ipaddress

    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def _shut(fd: int) -> None:
    import socket

    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def usable_backend(requested: str, gpus: bool | None = None) -> str:
    """`generator.weight_sync_backend` as the processes that sync can run it: the base default names
    the GPU transport (nccl), and workers without CUDA speak gloo instead (logged). `gpus`: whether
    they compute on GPUs (a Ray driver knows it from its placement plan, not from its own machine);
    None: this machine's CUDA."""
    if gpus is None:
        gpus = torch.cuda.is_available()
    if requested == "nccl" and not gpus:
        log.info("generator.weight_sync_backend=nccl on workers without GPUs: weight sync uses gloo")
        return "gloo"
    return requested


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race is possible, not likely)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost); an address that does
    not resolve is not."""
    import ipaddress
    import socket

    if not host:
        return False  # "": every interface
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        return all(ipaddress.ip_address(_plain_ip(a)).is_loopback for a in addresses)
    except (OSError, ValueError):
        return False


class TensorBroadcaster(_Endpoint):
    """SGLang's distributed weight-update protocol (`/init_weights_update_group`,
    `/update_weights_from_distributed`), both ends: the names, dtypes and shapes travel in the HTTP
    request, then rank 0 broadcasts the tensors one by one in that order. There is no header and no
    ack in the group: the server's HTTP answer is the acknowledgement. The rendezvous is the same as
    SGLang's (`tcp://master_address:master_port`, engine ranks from `rank_offset`) and so is the group
    (`_make_group`), so Ridgeline's client pushes to a real SGLang server (make test-sglang), and a
    real SGLang trainer-side group could push to `ridgeline serve`."""

    def _make_group(self, store: dist.Store) -> dist.ProcessGroup:
        """The group as SGLang's `init_custom_process_group` builds it through torch's
        `_new_process_group_helper`: the store prefixed by `<group name>/` once more and by the first
        device the backend serves (`Backend.backend_capability`: `cpu/` for gloo, `cuda/` for nccl;
        one backend serves them all). A group keyed otherwise never meets SGLang's ranks: its
        scheduler waits in the rendezvous until the timeout."""
        device = dist.Backend.backend_capability[self.spec.backend][0]
        return super()._make_group(dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{self.spec.group_name}/", store)))

    @torch.no_grad()
    def send_tensors(self, tensors: Iterable[torch.Tensor]) -> int:
        """Rank 0: broadcast each tensor as it is (cast it first); return the bytes sent."""
        sent = 0
        for i, t in enumerate(tensors):
            t = t.detach().to(self.device).contiguous()
            self._broadcast(t, f"tensor {i + 1}")
            sent += t.numel() * t.element_size()
        return sent

    @torch.no_grad()
    def receive_tensors(self, shapes: list[list[int]], dtypes: list[str]) -> list[torch.Tensor]:
        """An engine rank: receive one tensor per (shape, dtype), in order."""
        out = []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            t = torch.empty(tuple(shape), dtype=dtype_from_name(str(dtype).removeprefix("torch.")),
                            device=self.device)
            self._broadcast(t, f"tensor {i + 1}")
            out.append(t)
        return out


class WeightSender(_Endpoint):
    """The trainer's end (rank 0). Construct it while the engines construct their receivers: the
    constructor blocks until every engine joined, or raises `WeightSyncError` after the timeout."""

    def __init__(self, spec: GroupSpec, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if spec.rank != 0:
            raise ValueError("the weight sender is rank 0 of the weight-sync group")
        if chunk_bytes < ALIGN:
            raise ValueError(f"chunk_bytes must be at least {ALIGN}")
        super().__init__(spec)
        self.chunk_bytes = chunk_bytes
        self.version = 0

    @torch.no_grad()
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
             version: int | None = None) -> SyncStats:
        """Broadcast the tensors, floating ones cast to `dtype` (the engines' `generator.model_dtype`).
        `version` (e.g. the global step) defaults to one more than the last send's."""
        start = time.perf_counter()
        self.version = self.version + 1 if version is None else int(version)
        tensors: list[torch.Tensor] = []
        metas: list[TensorMeta] = []
        offset = 0
        for name, t in named_tensors:
            t = t.detach()
            wire = wire_dtype(t, dtype)
            nbytes = t.numel() * wire.itemsize
            offset = -(-offset // ALIGN) * ALIGN
            metas.append(TensorMeta(name, tuple(t.shape), dtype_name(wire), offset, nbytes))
            tensors.append(t)
            offset += nbytes
        header = SyncHeader(self.version, self.chunk_bytes, offset, tuple(metas))
        raw = header.to_bytes()
        self._broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device), "the header length")
        self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device), "the header")

        chunks = _chunk_ranges(header.total_bytes, self.chunk_bytes)
        staging = torch.empty(min(self.chunk_bytes, max(header.total_bytes, 1)), dtype=torch.uint8,
                              device=self.device)
        sent = 0  # chunks broadcast so far
        for meta, t in zip(metas, tensors):
            # cast one tensor at a time so the sender never holds a second copy of the model
            src = t.to(device=self.device, dtype=dtype_from_name(meta.dtype)).contiguous().reshape(-1)
            src = src.view(torch.uint8)
            pos, end = meta.offset, meta.offset + meta.nbytes
            while pos < end:
                k = pos // self.chunk_bytes
                while sent < k:  # every earlier chunk is complete: send it
                    lo, hi = chunks[sent]
                    self._broadcast(staging[:hi - lo], f"chunk {sent + 1}/{len(chunks)}")
                    sent += 1
                stop = min(end, (k + 1) * self.chunk_bytes)
                base = k * self.chunk_bytes
                staging[pos - base:stop - base].copy_(src[pos - meta.offset:stop - meta.offset])
                pos = stop
        while sent < len(chunks):
            lo, hi = chunks[sent]
            self._broadcast(staging[:hi - lo], f"chunk {sent + 1}/{len(chunks)}")
            sent += 1

        acks = self._ack(0)
        if acks != self.spec.world_size - 1:
            raise WeightSyncError(f"only {acks} of {self.spec.world_size - 1} engines acknowledged "
                                  f"version {self.version} ({self.spec.describe()})")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        mb = header.total_bytes / _MB
        return SyncStats(self.version, len(metas), header.total_bytes, len(chunks), seconds,
                         seconds / mb if mb > 0 else 0.0)


class WeightReceiver(_Endpoint):
    """An engine process's end (rank >= 1). `receive()` blocks until the trainer sends (bounded
    by the timeout), then `engine.update_weights(received)`. `version` is that of the last
    weights received (0 before any)."""

    def __init__(self, spec: GroupSpec):
        if spec.rank == 0:
            raise ValueError("rank 0 of the weight-sync group is the sender")
        super().__init__(spec)
        self.version = 0

    @torch.no_grad()
    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors of the next `send`, in its order, on this endpoint's device. They are views
        into one buffer received in place (no copy), valid until the caller drops them."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length, "the header length")
        raw = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(raw, "the header")
        header = SyncHeader.from_bytes(raw.cpu().numpy().tobytes())

        flat = torch.empty(header.total_bytes, dtype=torch.uint8, device=self.device)
        chunks = _chunk_ranges(header.total_bytes, header.chunk_bytes)
        for i, (lo, hi) in enumerate(chunks):
            self._broadcast(flat[lo:hi], f"chunk {i + 1}/{len(chunks)}")
        self._ack(1)
        self.version = header.version
        out = []
        for m in header.tensors:
            piece = flat[m.offset:m.offset + m.nbytes].view(dtype_from_name(m.dtype))
            out.append((m.name, piece.view(m.shape)))
        return out
