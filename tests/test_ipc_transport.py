"""IPC weight handoff (ridgeline.inference.ipc_transport): the bucket layout, and real second
processes opening the trainer's buffers through `reduce_tensor` (shared memory on this CPU, the
same code that hands CUDA IPC handles on a GPU: tests/gpu/test_ipc_gpu.py): a spawned engine
process, an unrelated process (as a Ray actor is), and Ray engine actors pulling from FSDP ranks."""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from ipc_engine import REPLY_TIMEOUT_S, hand_over, llama_config, random_llama, start_engine, stop_engine
from ridgeline.distributed.ray_workers import weight_sync_kind
from ridgeline.distributed.weight_sync import check_probe, probe_logprobs, probe_tolerance
from ridgeline.inference.ipc_transport import _CUDA_DEVICE_ARG, IPCReceiver, IPCSender, plan_buckets
from ridgeline.inference.weight_transport import WeightSyncError
from ridgeline.models.tiny import TINY_CONFIGS, build_char_tokenizer


# -- buckets --------------------------------------------------------------------------------------

def test_buckets_keep_order_fill_up_to_the_threshold_and_give_a_large_tensor_its_own():
    bf16, i64 = torch.bfloat16, torch.int64
    specs = [("a", (3, 5), bf16), ("b", (4,), i64), ("c", (40,), bf16), ("d", (), bf16), ("e", (200,), bf16),
             ("f", (1,), bf16)]
    plan = plan_buckets(specs, threshold_bytes=96)
    layout = [[(m.name, m.offset, m.nbytes) for m in b.tensors] for b in plan]
    # a: 30 bytes at 0; b starts on the next 64-byte boundary and ends exactly at the threshold;
    # c (80 bytes) would start at 128: a new bucket; d likewise; e (400 bytes > 96) alone; then f
    assert layout == [[("a", 0, 30), ("b", 64, 32)], [("c", 0, 80)], [("d", 0, 2)], [("e", 0, 400)], [("f", 0, 2)]]
    assert [b.nbytes for b in plan] == [96, 80, 2, 400, 2]
    assert [m.dtype for m in plan[0].tensors] == ["bfloat16", "int64"]
    assert [[m.name for m in b.tensors] for b in plan_buckets(specs, 10_000)] == [["a", "b", "c", "d", "e", "f"]]
    with pytest.raises(ValueError, match="at least 1 byte"):
        plan_buckets(specs, 0)


def _in_turn(transfer):
    """The buckets of `transfer` as a receiver pulls them: each asked for after the last was read."""
    for index in range(transfer.count):
        yield transfer.bucket(index)


def test_buckets_go_out_once_each_in_order_cast_to_the_engine_dtype():
    tensors = [("w", torch.randn(3, 4)), ("steps", torch.arange(5)), ("big", torch.randn(64))]
    sender = IPCSender(torch.bfloat16, threshold_bytes=64, device="cpu")
    with sender.start(tensors, version=3) as transfer:
        # w (24 bytes) | steps (40 bytes would start at 64) | big (128 bytes, alone)
        assert (transfer.version, transfer.count, transfer.nbytes) == (3, 3, 24 + 40 + 128)
        with pytest.raises(WeightSyncError, match="bucket 1 of weight version 3 was asked for, but the next is 0"):
            transfer.bucket(1)
        receiver = IPCReceiver()
        received = {name: t.clone() for name, t in receiver.weights(_in_turn(transfer))}
        with pytest.raises(WeightSyncError, match="once each, in order"):
            transfer.bucket(0)
    assert receiver.version == 3
    assert received["w"].dtype == torch.bfloat16 and torch.equal(received["w"], tensors[0][1].to(torch.bfloat16))
    assert received["steps"].dtype == torch.int64 and torch.equal(received["steps"], tensors[1][1])
    assert torch.equal(received["big"], tensors[2][1].to(torch.bfloat16))
    assert sender.start(tensors).version == 4  # the counter goes on from the last version


def test_an_incomplete_or_mixed_handoff_is_refused():
    sender = IPCSender(torch.float32, threshold_bytes=16, device="cpu")
    with sender.start([("a", torch.ones(4)), ("b", torch.ones(4))]) as transfer:
        with pytest.raises(WeightSyncError, match="ended after 1 of 2 buckets"):
            list(IPCReceiver().weights([transfer.bucket(0)]))
    with sender.start([("a", torch.ones(4)), ("b", torch.ones(4))]) as transfer:
        first = transfer.bucket(0)
        other_version = dataclasses.replace(first, version=first.version + 1, index=1)
        with pytest.raises(WeightSyncError, match="got bucket 1/2 of version 3 after 1 bucket"):
            list(IPCReceiver().weights([first, other_version]))


def test_the_receiver_rewrites_the_device_where_rebuild_cuda_tensor_takes_it():
    """CUDA handles are opened on the receiver's index for the sender's GPU: the argument the
    receiver replaces must be rebuild_cuda_tensor's `storage_device` (checked here, without a GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert list(inspect.signature(rebuild_cuda_tensor).parameters)[_CUDA_DEVICE_ARG] == "storage_device"


def test_weight_sync_kind_is_ipc_only_for_colocated_cuda_engines():
    assert weight_sync_kind("cuda", colocated=True) == "cuda_ipc"
    assert weight_sync_kind("cuda", colocated=False) == "broadcast"
    assert weight_sync_kind("cpu", colocated=True) == "broadcast"
    assert weight_sync_kind("cpu", colocated=False) == "broadcast"


# -- a real second process --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_proc():
    proc, to_child, to_parent = start_engine("cpu", llama_config(**TINY_CONFIGS["llama"]))
    yield to_child, to_parent
    stop_engine(proc, to_child)


@pytest.fixture(scope="module")
def trainer():
    model = random_llama(llama_config(**TINY_CONFIGS["llama"]), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)  # as a training step would move them
    return model


def test_a_spawned_process_receives_bit_equal_tensors_through_shared_memory(engine_proc):
    to_child, to_parent = engine_proc
    g = torch.Generator().manual_seed(1)
    tensors = [("w", torch.randn(7, 9, generator=g)), ("count", torch.arange(-3, 4)), ("scale", torch.tensor(0.1)),
               ("big", torch.randn(300, generator=g)), ("empty", torch.zeros(0, 4))]
    sender = IPCSender(torch.bfloat16, threshold_bytes=256, device="cpu")
    transfer = sender.start(tensors, version=7)
    assert transfer.count == 3  # w, count, scale | big (600 bytes, alone) | empty (0 bytes, at 640: a new bucket)
    reply = hand_over(transfer, to_child, to_parent, ("raw", 0))
    assert reply["version"] == 7
    assert list(reply["tensors"]) == [name for name, _ in tensors]
    for name, t in tensors:
        got = reply["tensors"][name]
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert hand_over(sender.start(tensors), to_child, to_parent, ("raw", 0))["version"] == 8


@pytest.mark.parametrize("sleep_level", [0, 2])
def test_an_engine_process_loads_the_handoff_bit_for_bit_and_passes_the_probe(engine_proc, trainer, sleep_level):
    """The engine's weights are exactly the trainer's in bf16, also after sleep(level=2) dropped them
    (woken weights first, refilled by the handoff, then the KV cache); the probe agrees."""
    to_child, to_parent = engine_proc
    tok = build_char_tokenizer()
    sender = IPCSender(torch.bfloat16, threshold_bytes=8 * 1024, device="cpu")  # the embedding goes alone
    transfer = sender.start(trainer.named_parameters(), version=11)
    assert transfer.count > 2
    reply = hand_over(transfer, to_child, to_parent, ("engine", sleep_level))
    assert reply["version"] == 11
    for name, p in trainer.named_parameters():
        assert torch.equal(reply["tensors"][name], p.detach().to(torch.bfloat16)), name
    assert torch.equal(reply["tensors"]["lm_head.weight"], reply["tensors"]["model.embed_tokens.weight"])  # still tied
    check_probe(probe_logprobs(trainer, tok), reply["probe"], probe_tolerance(torch.bfloat16), version=11)


_UNRELATED_RECEIVER = """
import io, pickle, sys, torch
from ridgeline.inference.ipc_transport import IPCReceiver
buckets = pickle.loads(sys.stdin.buffer.read())
receiver = IPCReceiver()
out = io.BytesIO()
torch.save({"tensors": {n: t.clone() for n, t in receiver.weights(buckets)}, "version": receiver.version}, out)
sys.stdout.buffer.write(out.getvalue())
"""


def test_a_process_the_trainer_did_not_start_opens_cpu_buckets():
    """A Ray actor is not a child of the sender: torch's default fd passing authenticates with the
    multiprocessing authkey and fails there; the file_system strategy used for CPU buffers works."""
    before = mp.get_sharing_strategy()
    tensors = [("a", torch.randn(5, 3)), ("b", torch.arange(10))]
    with IPCSender(torch.float32, threshold_bytes=1024, device="cpu").start(tensors, version=2) as transfer:
        buckets = [transfer.bucket(0)]
        assert transfer.count == 1
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", _UNRELATED_RECEIVER], input=pickle.dumps(buckets), env=env,
                             capture_output=True, timeout=REPLY_TIMEOUT_S)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    reply = torch.load(io.BytesIO(out.stdout), weights_only=True)
    assert reply["version"] == 2
    assert all(torch.equal(reply["tensors"][n], t) for n, t in tensors)
    assert mp.get_sharing_strategy() == before  # switched for the pickling only


# -- Ray: engine actors pull from their policy ranks -------------------------------------------------

@pytest.mark.integration
def test_ray_engine_actors_pull_buckets_from_their_own_policy_rank():
    """RayIPCWeightSync on this CPU (the buckets live in shared memory instead of GPU memory): two
    FSDP2 policy ranks hand two bf16 engine actors, asleep at level 2, their trained weights; the
    engines wake their weights, load them bit for bit, wake the KV cache, pass the probe and
    generate."""
    import ray

    from ridgeline.config import load_config
    from ridgeline.distributed.ray_workers import RayEngineGroup, RayIPCWeightSync, build_ray_workers
    from ridgeline.inference.types import EngineRequest, SamplingParams

    cfg = load_config(["+experiment=tiny", "data.prepare.num_train=48", "trainer.logger=jsonl",
                       "trainer.strategy=fsdp2", "trainer.placement.policy_num_gpus_per_node=2",
                       "generator.num_inference_engines=2", "generator.model_dtype=bfloat16",
                       "trainer.algorithm.use_kl_loss=false"])
    workers = build_ray_workers(cfg, build_char_tokenizer(), training_batches=1)
    try:
        with pytest.raises(ValueError, match="2 policy ranks and 1 engines. Fix: generator.num_inference_engines=2"):
            RayIPCWeightSync(workers.policy, RayEngineGroup(workers.engine.calls, workers.engine.actors[:1],
                                                             workers.engine.labels[:1]), 1024)
        state = workers.policy.full_state_dict()
        g = torch.Generator().manual_seed(0)
        workers.policy.call("load_full_state_dict",
                            ray.put({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}))
        sync = RayIPCWeightSync(workers.policy, workers.engine, threshold_bytes=16 * 1024)
        workers.engine.sleep(2)
        metrics = sync.sync(5)
        assert metrics["weight_sync/megabytes"] > 0 and metrics["weight_sync/probe_abs_diff"] < 0.25
        trained = workers.policy.full_state_dict()
        for engine in workers.engine.actors:
            engine_state = ray.get(engine.state_dict.remote())
            for name, value in engine_state.items():
                assert value.dtype == torch.bfloat16 and torch.equal(value, trained[name].to(torch.bfloat16)), name
        outputs = workers.engine.generate([EngineRequest([5, 6, 7], SamplingParams(max_generate_length=4))] * 2, seed=0)
        assert len(outputs) == 2 and all(1 <= len(o.response_ids) <= 4 for o in outputs)
    finally:
        workers.shutdown()
