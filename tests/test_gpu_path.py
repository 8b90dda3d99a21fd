"""Issue 36: the GPU path's defects found by reading it, each shown on this CPU where it can be
(a stand-in for what only a GPU does: an IPC tensor that refuses to be shared again, a recorded
call order, a mock of torch.cuda's memory calls). The GPU runs are in tests/gpu/."""

from __future__ import annotations

import torch

from ridgeline.inference.ipc_transport import IPCReceiver, IPCSender


# -- 1. SGLang takes the colocated handoff: each batch a copy this process owns ---------------------

class _RefusesReceived:
    """SGLang's update_weights_from_tensor as torch makes it behave on a GPU: it pickles the batch
    to its scheduler, and a tensor this process received by IPC cannot be shared again ("Consider
    cloning before sending"). On this CPU a received bucket lives in shared memory, which marks it."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def update_weights_from_tensor(self, batch, flush_cache):
        for name, tensor in batch:
            if tensor.is_shared():
                raise RuntimeError("Attempted to send CUDA tensor received from another process; this is not "
                                   "currently supported. Consider cloning before sending.")
            self.loaded[name] = tensor
        return True, ""


def test_sglang_loads_views_of_a_received_bucket_as_copies_of_its_own():
    from ridgeline.inference.sglang_engine import SGLangEngine

    engine = object.__new__(SGLangEngine)  # no sglang here: its Engine is the stand-in above
    engine.dtype, engine.update_batch_bytes, engine._weight_sessions = torch.bfloat16, 64, False
    engine.engine = _RefusesReceived()
    weights = [("a", torch.randn(4, 4)), ("b", torch.randn(16)), ("c", torch.arange(3))]
    sender = IPCSender(torch.bfloat16, threshold_bytes=1024, device="cpu")
    with sender.start(weights, version=1) as transfer:
        buckets = (transfer.bucket(i) for i in range(transfer.count))
        received = IPCReceiver().weights(buckets)
        first = next(received)
        assert first[1].is_shared()  # what the engine is handed is the trainer's memory
        engine.update_weights(iter([first, *received]))
    assert set(engine.engine.loaded) == {"a", "b", "c"}
    for name, value in weights:
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(engine.engine.loaded[name], expected), name
