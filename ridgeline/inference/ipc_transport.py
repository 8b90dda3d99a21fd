"""Weight handoff to an engine process on the trainer's own GPU: CUDA IPC handles of flat buckets
(the colocated counterpart of `weight_transport`'s broadcast).

With `trainer.placement.colocate_all=true` on GPUs, policy rank r and engine r share one GPU. The
rank packs the weights into flat buffers on that GPU and hands the engine a handle to each; the
engine maps the trainer's memory and copies out of it, device to device: no host round trip and
no process group. An FSDP2 rank gathers the weights tensor by tensor as their bucket is packed
(`IPCSender.start(..., specs=...)`): never the whole model at once.

Buckets. Tensors keep their order; each is cast to the engine dtype (floating tensors only, bit
for bit `tensor.to(dtype)`) and written at a 64-byte aligned offset of one flat uint8 buffer of at
most `threshold_bytes` (`generator.weight_transfer_threshold_cuda_ipc_GB`, in GiB as SkyRL counts
it); a tensor larger than the threshold gets a bucket of its own. The sender holds one bucket at a
time, so the handoff costs one bucket of device memory beyond the weights themselves.

Handles. `torch.multiprocessing.reductions.reduce_tensor(buffer)`, pickled by torch's
`ForkingPickler` into `IPCHandle.payload`, so an `IPCBucket` is plain data that any pickler carries
(Ray's, a multiprocessing queue):
- CUDA: a cudaIpcMemHandle of the buffer's allocation, which only a process seeing the same GPU
  can open. The bucket names the GPU by UUID; the receiver opens the handle on its own index for
  that GPU (under Ray each actor sees its one GPU as cuda:0, elsewhere the indices may differ) or
  refuses, naming the GPU, when it does not see it.
- CPU (tests; any colocated CPU use): the same reduction moves the buffer into shared memory.
  Under torch's default "file_descriptor" strategy the receiver fetches a file descriptor from the
  sender through multiprocessing's resource sharer, authenticated by the multiprocessing authkey:
  only processes the sender started (fork or spawn) get it; a Ray actor or any other process fails
  with AuthenticationError. So CPU buffers are reduced under the "file_system" strategy (a named
  shared-memory file that any process of this machine can open), switched on only while the
  payload is pickled (the strategy is process-global) and restored after.

Ordering: why a bucket's buffer is alive while the receiver copies out of it. The receiver pulls
buckets one at a time (`IPCReceiver.weights` takes an iterable that fetches lazily) and yields
views into bucket k; when the engine asks for the tensor after bucket k's last, the receiver first
waits for its device (the engine's copies out of bucket k are finished), drops the buffer, and only
then fetches bucket k+1. The sender releases bucket k only when bucket k+1 is asked for
(`IPCTransfer.bucket`) or at `close()`. (torch also keeps a shared CUDA block out of the sender's
allocator until every receiver released it, and a shared-memory file until its last user closes
it: an engine that keeps views past the next fetch, as SGLang's update batching does, holds that
memory a little longer but never reads freed memory.)

Trust: the payload is a pickle (torch's own handle format), like every object Ray or
torch.multiprocessing pass between processes: open buckets only from your own trainer.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, Iterator

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing.reductions import reduce_tensor

from ridgeline.inference.weight_transport import ALIGN, TensorMeta, WeightSyncError, dtype_from_name, dtype_name

GIB = 1024 ** 3
# where `storage_device` sits in the arguments reduce_tensor gives rebuild_cuda_tensor
_CUDA_DEVICE_ARG = 6


# -- buckets (pure) ------------------------------------------------------------------------------

@dataclass(frozen=True)
class BucketPlan:
    """One bucket's layout: its tensors (offsets into the bucket's buffer) and the buffer's size
    (the last tensor's end)."""

    tensors: tuple[TensorMeta, ...]
    nbytes: int


def plan_buckets(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], threshold_bytes: int) -> list[BucketPlan]:
    """(name, shape, wire dtype) in order -> buckets of at most `threshold_bytes`: each tensor at the
    next ALIGN-byte offset of the current bucket, a new bucket when it would not fit; a tensor
    larger than the threshold gets a bucket of its own."""
    if threshold_bytes < 1:
        raise ValueError(f"the bucket threshold must be at least 1 byte, got {threshold_bytes}")
    buckets: list[BucketPlan] = []
    metas: list[TensorMeta] = []
    end = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        offset = -(-end // ALIGN) * ALIGN
        if metas and offset + nbytes > threshold_bytes:
            buckets.append(BucketPlan(tuple(metas), end))
            metas, offset = [], 0
        metas.append(TensorMeta(name, tuple(shape), dtype_name(dtype), offset, nbytes))
        end = offset + nbytes
    if metas:
        buckets.append(BucketPlan(tuple(metas), end))
    return buckets


def _slot(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, as a view into a bucket's flat uint8 buffer."""
    return buffer[meta.offset:meta.offset + meta.nbytes].view(dtype_from_name(meta.dtype)).view(meta.shape)


# -- handles -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IPCHandle:
    """A shared buffer: `payload` is `ForkingPickler.dumps(reduce_tensor(buffer))`."""

    device: str              # "cuda" or "cpu": where the buffer lives
    gpu_uuid: str | None     # CUDA: the GPU holding it (the receiver must see that GPU)
    payload: bytes


@dataclass(frozen=True)
class IPCBucket:
    """What the sender hands the receiver for one bucket of one version."""

    version: int
    index: int                       # 0-based, in order
    count: int                       # buckets in this version
    tensors: tuple[TensorMeta, ...]  # name, shape, dtype and byte offset of each tensor in the buffer
    nbytes: int
    handle: IPCHandle


@contextlib.contextmanager
def _sharing_strategy(strategy: str) -> Iterator[None]:
    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share_buffer(buffer: torch.Tensor) -> IPCHandle:
    """A handle another process opens with `open_buffer` (see the module docstring)."""
    if buffer.is_cuda:
        return IPCHandle("cuda", _gpu_uuid(buffer.device.index), bytes(ForkingPickler.dumps(reduce_tensor(buffer))))
    if buffer.device.type != "cpu":
        raise WeightSyncError(f"IPC weight handoff shares CUDA or CPU buffers, not {buffer.device.type}")
    # "file_system": any process of this machine can open it, not only those this one started
    with _sharing_strategy("file_system"):
        payload = bytes(ForkingPickler.dumps(reduce_tensor(buffer)))
    return IPCHandle("cpu", None, payload)


def _local_gpu_index(uuid: str | None) -> int:
    visible = [_gpu_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid in visible:
        return visible.index(uuid)
    raise WeightSyncError(
        f"a CUDA IPC handle of GPU {uuid} cannot be opened here: this process sees {visible or 'no GPU'}. A "
        "handle opens only on the GPU it was made on, so colocated engines must share their policy rank's GPU "
        "(trainer.placement.colocate_all=true with generator.num_inference_engines = the policy's ranks)")


def open_buffer(handle: IPCHandle) -> torch.Tensor:
    """The sender's buffer, mapped into this process (no copy)."""
    rebuild, args = pickle.loads(handle.payload)
    if handle.device == "cuda":
        args = (*args[:_CUDA_DEVICE_ARG], _local_gpu_index(handle.gpu_uuid), *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild(*args)


# -- the two ends --------------------------------------------------------------------------------

class IPCTransfer:
    """One version's buckets, packed on demand, in order, from `source`: the (name, tensor) pairs of
    the plan in its order, read only as their bucket is packed (a lazy source, e.g. tensors gathered
    from FSDP shards one at a time, is never held whole). Bucket k's buffer lives until bucket k+1
    is asked for, or `close()`. Each source tensor is let go once packed."""

    def __init__(self, version: int, plan: list[BucketPlan], source: Iterator[tuple[str, torch.Tensor]],
                 device: torch.device):
        self.version = version
        self.plan = plan
        self.count = len(plan)
        self.nbytes = sum(b.nbytes for b in plan)
        self._source: Iterator[tuple[str, torch.Tensor]] | None = source
        self._device = device
        self._next = 0
        self._buffer: torch.Tensor | None = None

    @torch.no_grad()
    def bucket(self, index: int) -> IPCBucket:
        """Pack bucket `index` (the next one) and describe it; bucket `index - 1` is released."""
        if index != self._next:
            raise WeightSyncError(f"bucket {index} of weight version {self.version} was asked for, but the next "
                                  f"is {self._next} of {self.count}: buckets go out once each, in order")
        self._release()
        plan = self.plan[index]
        # at least one byte: an empty shared-memory file cannot be mapped
        buffer = torch.empty(max(plan.nbytes, 1), dtype=torch.uint8, device=self._device)
        source = self._source
        if source is None:
            raise WeightSyncError(f"weight version {self.version}: bucket {index} asked for after the transfer closed")
        for meta in plan.tensors:
            item = next(source, None)
            if item is None or item[0] != meta.name or tuple(item[1].shape) != meta.shape:
                got = "nothing" if item is None else f"{item[0]} {tuple(item[1].shape)}"
                raise WeightSyncError(f"weight version {self.version}: bucket {index} expected {meta.name} "
                                      f"{meta.shape} from the weights, got {got}")
            _slot(buffer, meta).copy_(item[1])
            del item
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)  # written before another process reads it
        self._buffer = buffer
        self._next += 1
        return IPCBucket(self.version, index, self.count, plan.tensors, plan.nbytes, share_buffer(buffer))

    def _release(self) -> None:
        if self._buffer is None:
            return
        on_cuda = self._buffer.is_cuda
        self._buffer = None
        if on_cuda:
            torch.cuda.ipc_collect()  # hand back the blocks receivers have let go of

    def close(self) -> None:
        """Release the last bucket and whatever was not sent."""
        self._release()
        self._source = None

    def __enter__(self) -> "IPCTransfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IPCSender:
    """A policy rank's end: `start(weights)` one version, then hand out its buckets in order
    (`IPCTransfer.bucket`) as the receiver asks for them, then `close()` it. `version` counts
    handoffs like `WeightSender`'s."""

    def __init__(self, dtype: torch.dtype, threshold_bytes: int, device: torch.device | str):
        if threshold_bytes < 1:
            raise ValueError(f"the bucket threshold must be at least 1 byte, got {threshold_bytes} "
                             "(generator.weight_transfer_threshold_cuda_ipc_GB)")
        self.dtype = dtype
        self.threshold_bytes = int(threshold_bytes)
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"IPC weight handoff packs buckets on CUDA or CPU, not {self.device}")
        self.version = 0

    def start(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
              specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]] | None = None) -> IPCTransfer:
        """Plan the buckets of these tensors (floating ones cast to `dtype`); `version` (e.g. the
        global step) defaults to one more than the last handoff's. `specs`: each tensor's (name,
        shape, dtype) in order, known without reading `named_tensors`, which then stays lazy and
        is read bucket by bucket (without `specs` the tensors are read at once to plan)."""
        if specs is None:
            pairs = [(name, t.detach()) for name, t in named_tensors]
            specs, named_tensors = [(name, tuple(t.shape), t.dtype) for name, t in pairs], pairs
        plan = plan_buckets(((name, tuple(shape), self.dtype if dtype.is_floating_point else dtype)
                             for name, shape, dtype in specs), self.threshold_bytes)
        if not plan:
            raise ValueError("no tensors to hand over")
        self.version = self.version + 1 if version is None else int(version)
        return IPCTransfer(self.version, plan, ((name, t.detach()) for name, t in named_tensors), self.device)


class IPCReceiver:
    """An engine's end: `engine.update_weights(receiver.weights(buckets))`. `version` is that of
    the last complete handoff (0 before any)."""

    def __init__(self) -> None:
        self.version = 0

    @torch.no_grad()
    def weights(self, buckets: Iterable[IPCBucket]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) of each tensor of `buckets`: one version's buckets in order, fetched lazily.
        Bucket k+1 is fetched only once the device finished reading bucket k (module docstring);
        a view is valid until then."""
        expected, version, count = 0, 0, 0
        for bucket in buckets:
            if bucket.index != expected or (expected and (bucket.version, bucket.count) != (version, count)):
                raise WeightSyncError(f"weight handoff out of order: got bucket {bucket.index}/{bucket.count} of "
                                      f"version {bucket.version} after {expected} bucket(s) of version {version}")
            version, count = bucket.version, bucket.count
            buffer = open_buffer(bucket.handle)
            for meta in bucket.tensors:
                yield meta.name, _slot(buffer, meta)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)  # the engine's copies out of this bucket are done
            del buffer
            expected += 1
        if expected == 0 or expected != count:
            raise WeightSyncError(f"weight handoff of version {version} ended after {expected} of {count} buckets")
        self.version = version
