"""The colocated Ray path without Ray: one FSDP2 policy rank (`TrainingRank`, in this process, a
world of one) and its engine (`EngineRank`, the embedded engine, in a spawned process) on one
device, driven in the order `build_ray_workers` and the trainer drive them: the engine starts
alone and sleeps (level 2), the rank starts and trains, the engine wakes its weights, takes the
rank's weights over IPC (CUDA IPC on a GPU, shared memory on a CPU), wakes its KV cache and passes
the probe. Each process reports its device memory (allocated and reserved) at every stage.

Used by tests/test_gpu_path.py on this CPU (the order and the handoff) and by
tests/gpu/test_colocated_gpu.py on a GPU (the memory too). Ray itself is not needed, so the GPU
image without Ray runs it: the actors are the classes Ray would host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from ridgeline.distributed.ray_workers import EngineRank, TrainingRank
from ridgeline.inference.weight_transport import free_port
from ridgeline.training.batch import build_training_batch

REPLY_TIMEOUT_S = 300.0


def colocated_overrides(export_path, device: str, *extra: str) -> list[str]:
    """The tiny preset as one FSDP2 policy rank colocated with one embedded engine on `device`."""
    return ["+experiment=tiny", f"trainer.export_path={export_path}", "trainer.strategy=fsdp2",
            "trainer.placement.colocate_all=true", "trainer.placement.policy_num_gpus_per_node=1",
            "trainer.placement.ref_num_gpus_per_node=1", "generator.num_inference_engines=1",
            "trainer.algorithm.use_kl_loss=false", "generator.model_dtype=bfloat16", f"trainer.device={device}",
            "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2", "generator.n_samples_per_prompt=2",
            *extra]


def memory(device: str) -> dict[str, int]:
    """This process's device memory in bytes: tensors allocated, and what the allocator reserves."""
    if device != "cuda":
        return {"allocated": 0, "reserved": 0}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def engine_main(cfg, to_child, to_parent) -> None:
    """The engine process: an `EngineRank` answering (op, arg) commands with (kind, value) replies;
    during a "load" it asks the parent for buckets with ("bucket", index)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    device = cfg.trainer.device
    rank = EngineRank(cfg)
    to_parent.put(("done", memory(device)))

    def fetch(index: int):
        to_parent.put(("bucket", index))
        return to_child.get()

    while (cmd := to_child.get()) is not None:
        op, arg = cmd
        if op == "sleep":
            rank.sleep(arg)
        elif op == "wake_up":
            rank.wake_up(arg)
        elif op == "load":
            to_parent.put(("done", rank.load_ipc(fetch)))
            continue
        elif op == "probe":
            to_parent.put(("done", rank.probe().tolist()))
            continue
        elif op == "generate":
            to_parent.put(("done", [o.response_ids for o in rank.generate(arg, seed=0)]))
            continue
        to_parent.put(("done", memory(device)))


@dataclass
class ColocatedRun:
    """What a run of the colocated path measured (bytes) and produced."""

    engine: dict[str, dict[str, int]] = field(default_factory=dict)   # stage -> the engine's memory
    rank: dict[str, dict[str, int]] = field(default_factory=dict)     # stage -> the rank's memory
    order: list[str] = field(default_factory=list)
    version: int = 0
    trainer_probe: list[float] = field(default_factory=list)
    engine_probe: list[float] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    grads_left: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def _batch(tokenizer, samples: int):
    prompt, response = tokenizer("2 + 3 =")["input_ids"], tokenizer(" 5")["input_ids"] + [tokenizer.eos_token_id]
    batch = build_training_batch([prompt] * samples, [response] * samples, [[1] * len(response)] * samples,
                                 [float(i % 2) for i in range(samples)], [f"u{i // 2}" for i in range(samples)], None,
                                 tokenizer.pad_token_id)
    batch.advantages = (batch.rewards.sum(-1, keepdim=True) - 0.5) * batch.loss_mask
    return batch


def run_colocated(cfg, requests) -> ColocatedRun:
    """Drive one policy rank and its engine through start-up, a training step and the weight sync
    on `cfg.trainer.device` ("cuda" or "cpu"); `cfg` asks for fsdp2, colocate_all and one engine."""
    device = cfg.trainer.device
    out = ColocatedRun()
    ctx = mp.get_context("spawn")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine_main, args=(cfg, to_child, to_parent), daemon=True)
    rank = TrainingRank(cfg, "policy", 0, 1, training_batches=2)

    def engine(op: str, arg=None):
        to_child.put((op, arg))
        while True:
            kind, value = to_parent.get(timeout=REPLY_TIMEOUT_S)
            if kind == "bucket":  # the engine pulls the rank's next bucket
                to_child.put(rank.ipc_bucket(value))
                continue
            return value

    proc.start()
    try:
        # start-up, as build_ray_workers: the engine alone, built, asleep; then the rank
        out.engine["built"] = to_parent.get(timeout=REPLY_TIMEOUT_S)[1]
        out.order.append("engine built")
        out.engine["asleep"] = engine("sleep", 2)
        out.order.append("engine asleep")
        rank.setup("127.0.0.1", free_port())
        out.order.append("rank set up")
        out.rank["set up"] = memory(device)
        # a step, as the trainer's: logprobs and training while the engine sleeps
        batch = _batch(rank.tokenizer, 4)
        rank.compute_logprobs(batch)
        out.metrics = rank.train(batch)
        out.rank["trained"] = memory(device)
        out.grads_left = sum(p.grad is not None for p in rank.worker.model.parameters())
        # the sync, as RayIPCWeightSync: weights wake, the handoff, the KV cache wakes, the probe
        out.engine["weights awake"] = engine("wake_up", ("weights",))
        rank.start_ipc("bfloat16", 16 * 1024 * 1024, 1)
        out.version = engine("load")
        rank.finish_ipc()
        out.rank["synced"] = memory(device)
        out.engine["awake"] = engine("wake_up", ("kv_cache",))
        out.trainer_probe = rank.probe().tolist()
        out.engine_probe = engine("probe")
        out.responses = engine("generate", requests)
    finally:
        to_child.put(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
        rank.shutdown()
    return out
