"""Cross-process weight sync over gloo with real processes: an engine process holding HFEngines on
a tiny model with other initial weights receives the trainer's (this process's) weights."""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from ridgeline.distributed.weight_sync import (GroupSpec, StaleWeightsError, WeightReceiver, WeightSender,
                                               WeightSyncError, check_probe, probe_logprobs, probe_tolerance)
from ridgeline.inference.weight_transport import free_port

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GROUP_TIMEOUT_S = 20.0   # a bug fails the test within this, never hangs it
REPLY_TIMEOUT_S = 60.0


def _start_peer(target, *args) -> tuple[mp.Process, int, "mp.Queue"]:
    """A spawned weight-sync peer running `target(port, *args, replies)`: (process, port, replies)."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=target, args=(port, *args, replies), daemon=True)
    proc.start()
    return proc, port, replies


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(raw: bytes):
    return torch.load(io.BytesIO(raw), weights_only=True)


# -- child processes (module level so spawn can import them) ------------------------------------

def _engine_main(port: int, commands, replies) -> None:
    """Rank 1: one fp32 and one bf16 engine on a tiny model seeded differently from the trainer's.
    Per command (apply|drop, dtype): receive, update that engine unless told to drop, reply with
    its state dict, its probe logprobs and the received version."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model("llama", tok, seed=1)
    engines = {name: HFEngine(model, tok, dtype=dtype) for name, dtype in DTYPES.items()}
    replies.put("ready")
    receiver = WeightReceiver(GroupSpec(port=port, rank=1, world_size=2, timeout_s=GROUP_TIMEOUT_S))
    while (cmd := commands.get()) is not None:
        action, dtype_name = cmd
        received = receiver.receive()
        engine = engines[dtype_name]
        if action == "apply":
            engine.update_weights(received)
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        replies.put(_to_bytes({"state": state, "probe": probe_logprobs(engine.model, tok),
                               "version": receiver.version}))
    receiver.close()


def _idle_receiver_main(port: int, timeout_s: float, replies) -> None:
    """Joins the group, then waits to be killed."""
    torch.set_num_threads(1)
    replies.put("ready")
    WeightReceiver(GroupSpec(port=port, rank=1, world_size=2, timeout_s=timeout_s))
    replies.put("joined")
    time.sleep(120)


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_proc():
    commands = mp.get_context("spawn").Queue()
    proc, port, replies = _start_peer(_engine_main, commands)
    try:
        assert replies.get(timeout=REPLY_TIMEOUT_S) == "ready"
        sender = WeightSender(GroupSpec(port=port, rank=0, world_size=2, timeout_s=GROUP_TIMEOUT_S))
        yield sender, commands, replies
        commands.put(None)
        proc.join(timeout=10)
        sender.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.fixture(scope="module")
def trainer(tiny_tokenizer):
    from ridgeline.models.tiny import build_tiny_model
    model = build_tiny_model("llama", tiny_tokenizer, seed=0)
    _perturb(model, seed=0)
    return model


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Make every parameter distinct from any freshly built tiny model (as a training step would)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _sync(engine_proc, model, dtype_name: str, action: str = "apply", **send_kwargs):
    sender, commands, replies = engine_proc
    commands.put((action, dtype_name))
    stats = sender.send(model.named_parameters(), DTYPES[dtype_name], **send_kwargs)
    return stats, _from_bytes(replies.get(timeout=REPLY_TIMEOUT_S))


def _assert_bitwise(engine_state: dict, model, dtype: torch.dtype) -> None:
    want = model.state_dict()
    assert engine_state.keys() == want.keys()
    for name, tensor in want.items():
        got = engine_state[name]
        assert got.dtype == dtype, name
        assert torch.equal(got, tensor.to(dtype)), name


# -- tests --------------------------------------------------------------------------------------

def test_fp32_sync_is_bitwise_and_probe_passes(engine_proc, trainer, tiny_tokenizer):
    stats, reply = _sync(engine_proc, trainer, "float32")
    _assert_bitwise(reply["state"], trainer, torch.float32)
    assert reply["version"] == stats.version == 1
    n_params = sum(p.numel() for p in trainer.parameters())
    assert stats.bytes >= n_params * 4 and stats.num_chunks == 1
    assert stats.num_tensors == len(list(trainer.named_parameters()))
    assert stats.seconds > 0 and stats.seconds_per_mb == pytest.approx(stats.seconds / (stats.bytes / 1e6))
    print(f"\nfp32 sync: {stats.bytes / 1e6:.3f} MB in {stats.seconds * 1e3:.1f} ms "
          f"= {stats.seconds_per_mb * 1e3:.1f} ms/MB")
    diff = check_probe(probe_logprobs(trainer, tiny_tokenizer), reply["probe"], probe_tolerance(torch.float32))
    assert diff <= 1e-5


def test_bf16_sync_matches_trainer_cast_to_bf16(engine_proc, trainer, tiny_tokenizer):
    stats, reply = _sync(engine_proc, trainer, "bfloat16", version=7)
    _assert_bitwise(reply["state"], trainer, torch.bfloat16)
    assert reply["version"] == stats.version == 7
    n_params = sum(p.numel() for p in trainer.parameters())
    assert n_params * 2 <= stats.bytes < n_params * 4  # sent as bf16, not fp32
    check_probe(probe_logprobs(trainer, tiny_tokenizer), reply["probe"], probe_tolerance(torch.bfloat16))


def test_small_chunks_give_the_same_weights(engine_proc, trainer):
    sender = engine_proc[0]
    sender.chunk_bytes = 4096  # far smaller than most tensors: they straddle chunks
    try:
        stats, reply = _sync(engine_proc, trainer, "float32")
    finally:
        sender.chunk_bytes = 64 * 1024 * 1024
    assert stats.num_chunks == -(-stats.bytes // 4096) > 10
    _assert_bitwise(reply["state"], trainer, torch.float32)
    assert reply["version"] == stats.version == 8  # counts on from the explicit 7


def test_probe_catches_an_engine_that_dropped_the_update(engine_proc, tiny_tokenizer):
    from ridgeline.models.tiny import build_tiny_model
    model = build_tiny_model("llama", tiny_tokenizer, seed=0)
    _perturb(model, seed=1)  # new policy, unlike anything the engine holds
    _, reply = _sync(engine_proc, model, "float32", action="drop")
    with pytest.raises(StaleWeightsError, match="max \\|diff\\|") as err:
        check_probe(probe_logprobs(model, tiny_tokenizer), reply["probe"], probe_tolerance(torch.float32),
                    version=reply["version"])
    assert err.value.max_abs_diff > 1e-3


@pytest.mark.parametrize("peer", ["killed", "stalled"])
@pytest.mark.integration
def test_dead_or_stalled_receiver_raises_within_timeout(peer):
    """A receiver killed after joining fails the send at once (gloo sees the closed connection);
    one that is alive but never calls receive() fails it once the timeout passes."""
    timeout_s = 2.0
    proc, port, replies = _start_peer(_idle_receiver_main, timeout_s)
    try:
        assert replies.get(timeout=REPLY_TIMEOUT_S) == "ready"
        sender = WeightSender(GroupSpec(port=port, rank=0, world_size=2, timeout_s=timeout_s))
        assert replies.get(timeout=REPLY_TIMEOUT_S) == "joined"
        if peer == "killed":
            proc.kill()
            proc.join()
        start = time.perf_counter()
        with pytest.raises(WeightSyncError) as err:
            sender.send([("w", torch.ones(1000))], torch.float32)
        assert time.perf_counter() - start < timeout_s + 60  # not gloo's 30-minute default; room for a busy machine
        msg = str(err.value)
        assert "backend=gloo" in msg and "engine ranks [1]" in msg and "timeout 2s" in msg
        sender.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_receiver_that_never_joins_raises_within_timeout():
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match="did not form.*backend=gloo.*timeout 1.5s"):
        WeightSender(GroupSpec(port=free_port(), rank=0, world_size=2, timeout_s=1.5))
    assert time.perf_counter() - start < 1.5 + 60  # not gloo's 30-minute default; room for a busy machine


def test_check_probe_shapes_and_nan():
    ok = torch.tensor([-1.0, -2.0])
    assert check_probe(ok, ok + 1e-6, 1e-5) < 1e-5
    with pytest.raises(StaleWeightsError):
        check_probe(ok, torch.tensor([-1.0]), 1.0)
    with pytest.raises(StaleWeightsError):
        check_probe(ok, torch.tensor([float("nan"), -2.0]), 1.0)


def test_low_precision_engines_are_held_to_the_mean_difference():
    from ridgeline.distributed.weight_sync import ProbeTolerance
    trainer = torch.tensor([-0.5, -1.0, -2.0, -3.0])
    rounded = trainer + torch.tensor([0.2, -0.05, 0.0, 0.05])  # one token off by 0.2: bf16 rounding
    assert probe_tolerance(torch.bfloat16) == ProbeTolerance("mean", 0.25)
    assert check_probe(trainer, rounded, probe_tolerance(torch.bfloat16)) == pytest.approx(0.075)
    with pytest.raises(StaleWeightsError, match="mean"):
        check_probe(trainer, trainer + 1.7, probe_tolerance(torch.bfloat16))
    with pytest.raises(StaleWeightsError, match="max"):
        check_probe(trainer, rounded, probe_tolerance(torch.float32))
