"""`trainer.strategy=fsdp2`: the policy and reference as groups of FSDP2 ranks, and the inference
engines, each a Ray actor placed by `trainer.placement.*`; plus the driver-side objects the
trainer loop uses in place of the one-process workers (same methods, so the loop is one code).

    driver (Trainer)                       Ray actors
    RayPolicyGroup.train(batch)   ──rows──▶ TrainingRank x N (policy)  ─┐ torch.distributed
    RayRefGroup.compute_logprobs  ──rows──▶ TrainingRank x N (ref)      │ (gloo / nccl): FSDP2
      (a LoRA policy's reference: RayBaseModelRefGroup, on the policy ranks, adapters off)
    RayEngineGroup.generate(reqs) ─reqs──▶ EngineRank x E (hf engine)  │
    RayWeightSync.sync(step)      policy rank 0 ══weight-sync group══▶ every engine (+ probe)
    RayIPCWeightSync.sync(step)   policy rank r ══CUDA IPC buckets══▶ engine r on its GPU (+ probe)

Batches travel through Ray's object store; each rank gets its share of every mini-batch
(`rank_shares`), so the FSDP ranks together take exactly the single-process optimizer steps
(ridgeline.distributed.fsdp). Weights travel over their own process group (weight_sync.py), or,
to engines colocated on the policy's GPUs, as IPC handles (`weight_sync_kind` picks).
"""

from __future__ import annotations

import copy
import datetime
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ridgeline.distributed.fsdp import FSDPGroup, GatheredState, rank_device
from ridgeline.distributed.launch import free_port
from ridgeline.distributed.placement import PlacementConfigError, PlacementPlan, bundle_index, plan_placement
from ridgeline.distributed.ray_calls import Actor, ActorCalls, Call, this_node
from ridgeline.distributed.ray_runtime import import_ray, init_ray, reserve_pools
from ridgeline.distributed.weight_sync import (GroupSpec, ProbeTolerance, SyncStats, WeightReceiver, WeightSender,
                                               WeightSync, probe_engines, probe_logprobs, probe_tokens, probe_tolerance,
                                               sync_report)
from ridgeline.inference.ipc_transport import GIB, IPCBucket, IPCReceiver, IPCSender, IPCTransfer
from ridgeline.inference.parallelism import EngineParallelism
from ridgeline.inference.types import WAKE_TAGS, EngineOutput, EngineRequest, MemoryTag
from ridgeline.inference.weight_transport import usable_backend
from ridgeline.models.device import device_kind, release_device_memory
from ridgeline.models.loading import DTYPES, load_tokenizer
from ridgeline.seeding import derive_seed
from ridgeline.training.batch import RankShare, TrainingBatch, rank_shares
from ridgeline.training.build import (build_critic, build_policy_worker, build_ref_worker, needs_ref, policy_spec,
                                     policy_train_config, ref_is_policy_base, seed_everything,
                                     training_autocast_dtype, training_precision)
from ridgeline.training.critic_worker import CriticWorker
from ridgeline.training.forward_path import PLAIN
from ridgeline.training.protocols import Worker
from ridgeline.training.worker import ModelWorker, PolicyTrainConfig, PolicyWorker, RefWorker, TrainedWorker

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig
    from ridgeline.config.schema.trainer import FSDPConfig

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from ridgeline.inference.remote import RemoteEngine, RemoteSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
W = TypeVar("W", bound="ModelWorker[Any]")
Role = Literal["policy", "ref", "critic"]


# ------------------------------------------------------------------------------------- actors
# SkyRL 0.4's dtype names (trainer.<role>.fsdp_config.mixed_precision.*)
FSDP_TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _model_on_device(method: Callable[..., R]) -> Callable[..., R]:
    """A `TrainingRank` call that computes with its model: the parameters come to the device first
    and the GPU goes back to a colocated engine afterwards (`TrainingRank._hand_back`)."""
    @functools.wraps(method)
    def call(self: "TrainingRank", *args: Any, **kwargs: Any) -> R:
        self._model_to_device()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._hand_back()
    return call


class TrainingRank:
    """One data-parallel rank of the policy, reference or critic, run as a Ray actor: the same
    worker class the single process uses, in an `FSDPGroup`. Methods marked "collective" must be
    called on every rank of the group at once."""

    def __init__(self, cfg: RidgelineConfig, role: Role, rank: int, world_size: int, training_batches: int):
        self.cfg = cfg
        self.role, self.rank, self.world_size = role, rank, world_size
        self.training_batches = training_batches  # the run's trainer steps: the schedule's length
        self._worker: PolicyWorker | RefWorker | CriticWorker | None = None   # built by `setup`
        self._group: FSDPGroup | None = None
        self.base_ref: RefWorker | None = None   # a LoRA policy rank's reference: its base, adapters off
        self.sender: WeightSender | None = None
        self.ipc_sender: IPCSender | None = None
        self.ipc_transfer: IPCTransfer | None = None
        self.shares_gpu = False   # an engine wakes on this rank's GPU after each call: hand it back
        self.remote: RemoteEngine | None = None   # rank 0's client to remote servers (init_remote_push)

    def node(self) -> tuple[str, str]:
        """(node id, ip) where this rank runs, for the messages that name a lost actor."""
        return this_node()

    def master_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the group's rendezvous (this node's address, a free port)."""
        import ray
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, host: str, port: int) -> dict[str, float]:
        """Collective: join the group (NCCL on a GPU, gloo on a CPU), then build this rank's
        sharded model (and optimizer)."""
        t = self.cfg.trainer
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = rank_device(t.device)
        self.shares_gpu = (device.type == "cuda" and bool(t.placement.colocate_all)
                           and bool(self.cfg.generator.run_engines_locally))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{host}:{port}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=float(t.placement.timeout_s)))
        seed_everything(t.seed)
        self.tokenizer = load_tokenizer(policy_spec(self.cfg))
        fsdp: FSDPConfig = {"policy": t.policy.fsdp_config, "ref": t.ref.fsdp_config,
                            "critic": t.critic.fsdp_config}[self.role]
        compute = training_autocast_dtype(training_precision(t), device)
        # SkyRL 0.4's fsdp_config.mixed_precision on GPU ranks; a run in fp32 (trainer.mixed_precision=fp32,
        # or bf16=false) gathers fp32 whatever param_dtype says, as SkyRL's bf16=false does
        mp = fsdp.mixed_precision
        param = FSDP_TORCH_DTYPES[mp.param_dtype] if compute is not None else None
        group = FSDPGroup(device, fsdp_size=fsdp.fsdp_size, reshard_after_forward=fsdp.reshard_after_forward,
                          cpu_offload=fsdp.cpu_offload, param_dtype=param if device.type == "cuda" else None,
                          reduce_dtype=FSDP_TORCH_DTYPES[mp.reduce_dtype])
        self._group = group
        worker: PolicyWorker | RefWorker | CriticWorker | None
        if self.role == "policy":
            worker = build_policy_worker(self.cfg, self.tokenizer, group, training_batches=self.training_batches)
            if ref_is_policy_base(self.cfg):
                self.base_ref = build_ref_worker(self.cfg, self.tokenizer, policy=worker, parallel=group)
        elif self.role == "critic":
            # the padded forward: the packed one calls the backbone around the FSDP root's hooks
            worker = build_critic(self.cfg, self.tokenizer, training_batches=self.training_batches, parallel=group,
                                  options=PLAIN)
        else:
            worker = build_ref_worker(self.cfg, self.tokenizer, parallel=group)
        if worker is None:  # the plan makes ranks only for the roles the config needs
            raise RuntimeError(f"a {self.role} rank was started, but the config needs no {self.role} model")
        self._worker = worker
        parameters = float(sum(p.numel() for p in worker.model.parameters()))
        self._hand_back()  # the engine's first wake (the sync of the start weights) follows
        return {"parameters": parameters}

    # -- this rank's worker, by what the call needs (the driver calls each role's own methods) --
    @property
    def worker(self) -> PolicyWorker | RefWorker | CriticWorker:
        if self._worker is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: setup() has not run")
        return self._worker

    @property
    def group(self) -> FSDPGroup:
        if self._group is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: setup() has not run")
        return self._group

    def _role_worker(self, kind: type[W]) -> W:
        """The worker as `kind` (the driver calls only a role's own methods: a mismatch is a bug)."""
        worker = self.worker
        if not isinstance(worker, kind):
            raise TypeError(f"{self.role} rank {self.rank} holds a {type(worker).__name__}, not a {kind.__name__}")
        return worker

    # -- training --------------------------------------------------------------------------
    @_model_on_device
    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:  # collective (policy, ref)
        worker = self.worker
        if isinstance(worker, CriticWorker):
            raise TypeError(f"critic rank {self.rank} computes values, not logprobs")
        return worker.compute_logprobs(batch)

    @_model_on_device
    def compute_ref_logprobs(self, batch: TrainingBatch) -> torch.Tensor:  # collective (a LoRA policy's ranks)
        if self.base_ref is None:
            raise TypeError(f"{self.role} rank {self.rank} holds no base-model reference (not a LoRA policy's rank)")
        return self.base_ref.compute_logprobs(batch)

    @_model_on_device
    def compute_values(self, batch: TrainingBatch) -> torch.Tensor:  # collective (critic)
        return self._role_worker(CriticWorker).compute_values(batch)

    @_model_on_device
    def train(self, batch: TrainingBatch) -> dict[str, float]:  # collective (policy, critic)
        worker = self.worker
        if isinstance(worker, RefWorker):
            raise TypeError(f"ref rank {self.rank} does not train")
        return worker.train(batch)

    def _offloads_model(self) -> bool:
        """The parameters wait on the host between calls: the rank shares its GPU with an engine and
        FSDP2 does not keep them on the host already (`fsdp_config.cpu_offload`)."""
        return self.shares_gpu and not self.group.cpu_offload

    def _model_to_device(self) -> None:
        if self._offloads_model():
            model: nn.Module = self.worker.model   # nn.Module.to: transformers' wrapped `to` confuses mypy
            model.to(self.group.device)

    def _hand_back(self) -> None:
        """Give the GPU back to the engine that shares it (SkyRL's offload under colocate_all): the
        gradients go (they stay allocated after the last optimizer step), the parameters move to
        the host, and the caching allocator returns its free blocks to the device: it keeps a call's
        peak (activations, gathered weights, the IPC bucket, the old blocks of optimizer state
        moved to the host) reserved otherwise, and the engine's wake (KV cache at
        generator.gpu_memory_utilization of the GPU) would not fit."""
        if not self.shares_gpu:
            return
        if isinstance(self.worker, TrainedWorker):
            self.worker.optimizer.zero_grad(set_to_none=True)
        if self._offloads_model():
            model: nn.Module = self.worker.model
            model.to("cpu")
        release_device_memory(self.group.device)

    def skipped_steps(self) -> int:
        return self._role_worker(TrainedWorker).skipped_steps

    def set_skipped_steps(self, value: int) -> None:
        self._role_worker(TrainedWorker).skipped_steps = value

    # -- weights ---------------------------------------------------------------------------
    @_model_on_device
    def full_state_dict(self) -> dict[str, torch.Tensor]:  # collective; rank 0 gets the weights
        return self.worker.full_state_dict()

    @_model_on_device
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:  # collective
        self.group.load_full_state_dict(self.worker.model, state)

    def init_weight_sender(self, spec: GroupSpec) -> None:
        self.sender = WeightSender(spec)

    def _engine_weights(self) -> list[tuple[str, torch.Tensor]] | None:  # collective
        """The gathered weights as engines take them (tied weights once; with LoRA merged, from
        the gathered base and adapters) on rank 0; None elsewhere."""
        state = self.full_state_dict()
        return list(self._role_worker(PolicyWorker).engine_weights(state)) if self.rank == 0 else None

    @_model_on_device
    def send_weights(self, dtype: str, version: int) -> SyncStats | None:  # collective
        weights = self._engine_weights()
        if weights is None:
            return None
        if self.sender is None:
            raise RuntimeError(f"policy rank {self.rank}: send_weights before init_weight_sender")
        return self.sender.send(weights, DTYPES[dtype], version=version)

    # -- CUDA IPC to the engine on this rank's GPU (RayIPCWeightSync) ---------------------------
    def start_ipc(self, dtype: str, threshold_bytes: int, version: int) -> int:  # collective
        """Plan the buckets of the full weights for this rank's engine, which pulls them with
        `ipc_bucket`; returns their bytes. Nothing is gathered here: each bucket gathers its own
        tensors from the shards as it is packed (on the device: no host round trip), so the rank
        holds one bucket and the tensor being packed, never the full model (every rank packs
        every bucket: its engine pulls them all, so the all-gathers meet)."""
        device = self.group.device
        policy = self._role_worker(PolicyWorker)
        if self.ipc_sender is None:
            self.ipc_sender = IPCSender(DTYPES[dtype], threshold_bytes, device)
        state = GatheredState(policy.model, device)
        # engines name tied weights once; a LoRA policy's are merged (shapes from meta tensors)
        specs = [(name, tuple(t.shape), t.dtype) for name, t in policy.engine_weights(state.specs())]
        self.ipc_transfer = self.ipc_sender.start(policy.engine_weights(state), version, specs=specs)
        return self.ipc_transfer.nbytes

    def ipc_bucket(self, index: int) -> IPCBucket:
        """Pack bucket `index` for the engine (bucket `index - 1`, which it finished reading, goes)."""
        if self.ipc_transfer is None:
            raise RuntimeError(f"policy rank {self.rank}: ipc_bucket({index}) before start_ipc")
        return self.ipc_transfer.bucket(index)

    def finish_ipc(self) -> None:
        """Release the last bucket and the gathered weights (and their memory, to the engine)."""
        if self.ipc_transfer is not None:
            self.ipc_transfer.close()
            self.ipc_transfer = None
        self._hand_back()

    def init_remote_push(self, settings: RemoteSettings) -> None:
        """Rank 0 opens its own client to the remote servers: it holds the full weights after the
        gather, so it pushes them (the driver's client generates)."""
        if self.rank == 0:
            from ridgeline.inference.remote import RemoteEngine
            self.remote = RemoteEngine(settings)

    @_model_on_device
    def push_remote(self, version: int) -> dict[str, float] | None:  # collective
        weights = self._engine_weights()
        if weights is None:
            return None
        if self.remote is None:
            raise RuntimeError(f"policy rank {self.rank}: push_remote before init_remote_push")
        return self.remote.push_weights(weights, version)

    @_model_on_device
    def probe(self) -> torch.Tensor:  # collective (a sharded forward)
        return probe_logprobs(self._role_worker(PolicyWorker).model, self.tokenizer, device=self.group.device)

    # -- checkpoints: the worker's own methods, world-size-free files ---------------------------
    @_model_on_device
    def save_weights(self, folder: str) -> None:  # collective; rank 0 writes
        self.worker.save_weights(Path(folder))

    @_model_on_device
    def export_weights(self, folder: str) -> None:  # collective; rank 0 writes
        self.worker.export_weights(Path(folder))

    @_model_on_device
    def load_weights(self, folder: str) -> None:  # collective; every rank reads the folder
        self.worker.load_weights(Path(folder))

    @_model_on_device
    def save_optimizer(self, path: str) -> None:  # collective; rank 0 writes
        self._role_worker(TrainedWorker).save_optimizer(Path(path))

    @_model_on_device
    def load_optimizer(self, path: str) -> None:  # collective; every rank reads the file
        self._role_worker(TrainedWorker).load_optimizer(Path(path))

    # -- this process's generators (checkpoints: the driver opens no CUDA context, ranks save their own)
    def rng_state(self) -> dict[str, torch.Tensor]:
        state = {"torch": torch.get_rng_state()}
        device = self.group.device
        if device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(device)
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch"])
        device = self.group.device
        if device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class EngineRank:
    """One inference engine (hf, vllm or sglang: `generator.backend`) in its own process, run as a
    Ray actor; it receives weights over the weight-sync group and loads them with `update_weights`."""

    def __init__(self, cfg: RidgelineConfig):
        from ridgeline.inference.build import build_engine

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.tokenizer = load_tokenizer(policy_spec(cfg))
        self.engine = build_engine(cfg, self.tokenizer)
        self.receiver: WeightReceiver | None = None
        self.ipc_receiver = IPCReceiver()
        self.call_timeout_s = float(cfg.trainer.placement.actor_call_timeout_s)

    def node(self) -> tuple[str, str]:
        """(node id, ip) where this engine runs, for the messages that name a lost actor."""
        return this_node()

    def dtype(self) -> str:
        return str(self.engine.dtype).removeprefix("torch.")

    def generate(self, requests: list[EngineRequest], seed: int | None) -> list[EngineOutput]:
        return self.engine.generate(requests, seed=seed)

    def init_weight_receiver(self, spec: GroupSpec) -> None:
        self.receiver = WeightReceiver(spec)

    def receive_weights(self) -> int:
        if self.receiver is None:
            raise RuntimeError("receive_weights before init_weight_receiver")
        self.engine.update_weights(self.receiver.receive())
        return self.receiver.version

    def receive_ipc(self, sender: "ActorHandle") -> int:
        """Load the weights policy rank `sender` (on this engine's GPU) offers after `start_ipc`
        (`load_ipc`, each bucket asked of the rank by Ray). Returns the version received."""
        import ray

        calls, rank = ActorCalls(ray, self.call_timeout_s), Actor("the policy rank on this engine's GPU", *this_node())
        return self.load_ipc(lambda index: calls.get_one(Call(rank, f"ipc_bucket({index})",
                                                              sender.ipc_bucket.remote(index))))

    def load_ipc(self, fetch: Callable[[int], IPCBucket]) -> int:
        """Load a CUDA IPC handoff whose bucket k `fetch(k)` asks of the sending rank: the buckets
        are pulled one by one while the engine loads them, so the sender packs bucket k+1 only after
        the engine finished reading bucket k (ridgeline.inference.ipc_transport). Returns the
        version received."""
        def buckets():
            index, count = 0, 1
            while index < count:
                bucket = fetch(index)
                count, index = bucket.count, index + 1
                yield bucket

        self.engine.update_weights(self.ipc_receiver.weights(buckets()))
        return self.ipc_receiver.version

    def probe(self) -> torch.Tensor:
        return torch.tensor(self.engine.score(*probe_tokens(self.tokenizer)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The embedded engine's weights (tests compare them with the policy's)."""
        from ridgeline.inference.hf_engine import HFEngine

        if not isinstance(self.engine, HFEngine):
            raise TypeError(f"state_dict: only the embedded hf engine holds its weights here, "
                            f"not {type(self.engine).__name__}")
        return {k: v.clone() for k, v in self.engine.model.state_dict().items()}

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        self.engine.wake_up(tags)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


# ------------------------------------------------------------------------------ driver side
class _RankGroup:
    """The actors of one FSDP group, called together (`labels`: each actor and its node, for the
    message when one is lost). Batches are split by `rank_shares` over mini-batches of
    `mini_batch_trajectories` trajectories, as the ranks' workers expect."""

    def __init__(self, calls: ActorCalls, actors: list[Any], labels: list[Actor], mini_batch_trajectories: int):
        self.calls = calls
        self.actors = actors
        self.labels = labels
        self.mini_batch_trajectories = mini_batch_trajectories

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank at once; the ranks' results."""
        return self.wait(method, [getattr(a, method).remote(*args) for a in self.actors])

    def wait(self, method: str, refs: list[Any]) -> list[Any]:
        """The results of `method` called on the ranks (`refs`, in rank order), bounded (`ActorCalls`)."""
        return self.calls.get([Call(label, method, ref) for label, ref in zip(self.labels, refs)])

    def call_split(self, method: str, batch: TrainingBatch) -> tuple[list[RankShare], list[Any]]:
        """`method(rank's share)` on every rank at once; (each rank's share, its result)."""
        shares = rank_shares(batch.trajectories(), self.mini_batch_trajectories, self.world_size)
        refs = [getattr(a, method).remote(batch.share(share)) for a, share in zip(self.actors, shares)]
        return shares, self.wait(method, refs)

    def gather_rows(self, method: str, batch: TrainingBatch) -> torch.Tensor:
        """A per-token `[B, R]` result of `method`, the ranks' rows put back in batch order (their
        padding rows left out)."""
        shares, parts = self.call_split(method, batch)
        out = torch.zeros(batch.batch_size, batch.response_width)
        for share, part in zip(shares, parts):
            real = ~share.padding
            out[share.rows[real]] = part[real]
        return out

    # weights on disk (ridgeline.trainer.checkpoint): full weights, world-size free
    def save_weights(self, folder: Path) -> None:
        self.call("save_weights", str(folder))

    def export_weights(self, folder: Path) -> None:
        self.call("export_weights", str(folder))

    def load_weights(self, folder: Path) -> None:
        self.call("load_weights", str(folder))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.call("full_state_dict")[0]


class _TrainedGroup(_RankGroup):
    """A group with an optimizer: training steps, skipped-step count, optimizer checkpoints."""

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        _, metrics = self.call_split("train", batch)
        return metrics[0]  # the ranks reduce their metrics among themselves: all equal

    @property
    def skipped_steps(self) -> int:
        return self.calls.get_one(Call(self.labels[0], "skipped_steps", self.actors[0].skipped_steps.remote()))

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.call("set_skipped_steps", value)

    def save_optimizer(self, path: Path) -> None:
        self.call("save_optimizer", str(path))

    def load_optimizer(self, path: Path) -> None:
        self.call("load_optimizer", str(path))

    def rank_rng_states(self) -> list[dict[str, torch.Tensor]]:
        return self.call("rng_state")

    def set_rank_rng_states(self, states: list[dict[str, torch.Tensor]]) -> None:
        if len(states) != self.world_size:
            log.warning("the checkpoint holds the generator states of %d rank(s), this run has %d: the ranks keep "
                        "the states trainer.seed gave them", len(states), self.world_size)
            return
        self.wait("set_rng_state", [a.set_rng_state.remote(state) for a, state in zip(self.actors, states)])


class RayPolicyGroup(_TrainedGroup):
    """The trainer's `policy` when it is N FSDP2 ranks: the local `PolicyWorker`'s methods."""

    def __init__(self, calls: ActorCalls, actors: list[Any], labels: list[Actor], config: PolicyTrainConfig,
                 mini_batch_trajectories: int):
        super().__init__(calls, actors, labels, mini_batch_trajectories)
        self.config = config

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return self.gather_rows("compute_logprobs", batch)


class RayCriticGroup(_TrainedGroup):
    """The trainer's `critic` when it is N FSDP2 ranks: the local `CriticWorker`'s methods."""

    def compute_values(self, batch: TrainingBatch) -> torch.Tensor:
        return self.gather_rows("compute_values", batch)


class RayRefGroup(_RankGroup):
    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return self.gather_rows("compute_logprobs", batch)

    def load_from(self, policy: Worker) -> None:
        """`update_ref_every_epoch`: the policy's current weights."""
        if not isinstance(policy, RayPolicyGroup):  # the ranks pass the weights actor to actor
            raise TypeError(f"a Ray reference group loads from the Ray policy group, not a {type(policy).__name__}")
        refs = [a.full_state_dict.remote() for a in policy.actors]  # collective over the policy ranks
        self.call("load_full_state_dict", refs[0])  # Ray passes rank 0's weights actor to actor, not via here
        # the other ranks' part of the gather (None each): rank 0's full weights never come to the driver
        policy.calls.get([Call(label, "full_state_dict", ref) for label, ref in zip(policy.labels[1:], refs[1:])])


class RayBaseModelRefGroup(_RankGroup):
    """The reference of a LoRA policy on Ray: the policy ranks themselves, each running its shard
    of the policy with the adapters switched off (`BaseModelRefWorker`), as in one process. No
    reference ranks start and no second copy of the base exists; the policy's FSDP group already
    holds it sharded, and a reference group of its own would hold it again on the same devices."""

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        return self.gather_rows("compute_ref_logprobs", batch)

    def load_from(self, policy: Worker) -> None:
        raise RuntimeError("a LoRA policy's reference is its frozen base model and cannot take the policy's weights "
                           "(trainer.update_ref_every_epoch=true is refused with trainer.policy.model.lora.rank > 0)")

    def save_weights(self, folder: Path) -> None:
        raise RuntimeError("a LoRA policy's reference is its frozen base model: there is nothing of its own to save")

    def load_weights(self, folder: Path) -> None:
        raise RuntimeError("a LoRA policy's reference is its frozen base model: there is nothing of its own to load")


class RayEngineGroup:
    """The `InferenceEngine` the generator calls: requests split into contiguous, near-equal
    slices (a GRPO group's copies are adjacent, so they mostly stay on one engine and share its
    prompt prefill), one slice per engine, run concurrently; outputs in request order."""

    def __init__(self, calls: ActorCalls, actors: list[Any], labels: list[Actor]):
        self.calls = calls
        self.actors = actors
        self.labels = labels  # each engine and its node, for the message when one is lost
        self.dtype = DTYPES[calls.get_one(Call(labels[0], "dtype", actors[0].dtype.remote()))]

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every engine at once; their results (bounded: `ActorCalls`)."""
        return self.calls.get([Call(label, method, getattr(a, method).remote(*args))
                               for label, a in zip(self.labels, self.actors)])

    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        k = len(self.actors)
        bounds = [len(requests) * i // k for i in range(k + 1)]
        # one engine samples exactly what the embedded engine would; several get a seed each
        seeds = [seed if seed is None or k == 1 else derive_seed(seed, "engine", i) for i in range(k)]
        calls = [Call(self.labels[i], "generate", a.generate.remote(requests[lo:hi], seeds[i]))
                 for i, (a, lo, hi) in enumerate(zip(self.actors, bounds, bounds[1:])) if hi > lo]
        return [out for part in self.calls.get(calls) for out in part]

    def update_weights(self, named_tensors) -> None:
        raise RuntimeError("engines in other processes take weights through RayWeightSync.sync, not update_weights")

    def sleep(self, level: int = 1) -> None:
        self.call("sleep", level)

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        self.call("wake_up", tags)

    def close(self) -> None:
        """Nothing to release here: `RayWorkers.shutdown` kills the engine actors."""


class RayWeightSync:
    """Policy rank 0 -> every engine over a standalone gloo/nccl group, then the stale-weights
    probe: each engine's logprobs on a fixed text must match the trainer's within the tolerance
    of the engine's dtype, or the run stops with `StaleWeightsError`."""

    def __init__(self, policy: RayPolicyGroup, engines: RayEngineGroup, backend: str, timeout_s: float):
        self.policy, self.engines = policy, engines
        calls = policy.calls
        host, port = calls.get_one(Call(policy.labels[0], "master_address", policy.actors[0].master_address.remote()))
        world = 1 + len(engines.actors)
        specs = [GroupSpec(port=port, rank=r, world_size=world, backend=backend, host=host, timeout_s=timeout_s)
                 for r in range(world)]
        calls.get([Call(policy.labels[0], "init_weight_sender", policy.actors[0].init_weight_sender.remote(specs[0]))]
                  + [Call(label, "init_weight_receiver", e.init_weight_receiver.remote(s))
                     for label, e, s in zip(engines.labels, engines.actors, specs[1:])])
        self.dtype = str(engines.dtype).removeprefix("torch.")
        self.tolerance = probe_tolerance(engines.dtype)
        self.describe = specs[0].describe()

    def sync(self, version: int) -> dict[str, float]:
        sends = [Call(label, "send_weights", a.send_weights.remote(self.dtype, version))
                 for label, a in zip(self.policy.labels, self.policy.actors)]
        receives = [Call(label, "receive_weights", e.receive_weights.remote())
                    for label, e in zip(self.engines.labels, self.engines.actors)]
        # one wait over senders and receivers: a lost engine is named while rank 0 still sends
        results = self.policy.calls.get(sends + receives)
        stats: SyncStats = results[0]
        versions = results[len(sends):]
        if any(v != version for v in versions):
            raise RuntimeError(f"engines report weight versions {versions} after sending version {version}")
        t0 = time.perf_counter()
        worst = self.probe(version)
        return sync_report(version, stats.bytes, stats.seconds, worst, time.perf_counter() - t0,
                           f"{len(self.engines.actors)} engine(s)", self.tolerance)

    def probe(self, version: int | None = None) -> float:
        return probe_ray_engines(self.policy, self.engines, self.tolerance, version)


def probe_ray_engines(policy: RayPolicyGroup, engines: RayEngineGroup, tolerance: ProbeTolerance,
                      version: int | None = None) -> float:
    """The worst engine's |logprob difference| from the trainer on the probe text (max over tokens
    for float32 engines, mean for bf16/fp16: `probe_tolerance`); `StaleWeightsError` when one
    exceeds the engine dtype's tolerance."""
    return probe_engines(policy.call("probe")[0], engines.call("probe"), tolerance, version)


def weight_sync_kind(device: str, colocated: bool) -> Literal["cuda_ipc", "broadcast"]:
    """How the weights reach engine actors: CUDA IPC handles when the policy computes on CUDA
    (`device`: "cuda" or "cpu") and every engine shares a policy rank's GPU
    (`trainer.placement.colocate_all`); otherwise a broadcast over the weight-sync group."""
    return "cuda_ipc" if device == "cuda" and colocated else "broadcast"


class RayIPCWeightSync:
    """Engines colocated with the policy on GPUs: policy rank r hands engine r, on the same GPU,
    CUDA IPC handles of its gathered weights in buckets of at most `threshold_bytes`
    (`generator.weight_transfer_threshold_cuda_ipc_GB`), then the same probe as `RayWeightSync`.

    Wake order (the engines sleep while the trainer trains): the engines' weights wake first, the
    weights are handed over, then the KV cache wakes, so device memory never holds the trainer's
    state and a full KV cache at once. Engines that are awake are left as they are."""

    def __init__(self, policy: RayPolicyGroup, engines: RayEngineGroup, threshold_bytes: int):
        if len(engines.actors) != policy.world_size:
            # a handle opens only on its own GPU: engine r must share policy rank r's
            raise ValueError(f"CUDA IPC weight sync pairs policy rank r with engine r on one GPU, but there are "
                             f"{policy.world_size} policy ranks and {len(engines.actors)} engines. Fix: "
                             f"generator.num_inference_engines={policy.world_size}, or "
                             "trainer.placement.colocate_all=false")
        self.policy, self.engines = policy, engines
        self.threshold_bytes = int(threshold_bytes)
        self.dtype = str(engines.dtype).removeprefix("torch.")
        self.tolerance = probe_tolerance(engines.dtype)
        self.describe = (f"CUDA IPC, policy rank r -> engine r ({policy.world_size} pair(s)), buckets of at most "
                         f"{self.threshold_bytes / GIB:g} GiB (generator.weight_transfer_threshold_cuda_ipc_GB)")

    def sync(self, version: int) -> dict[str, float]:
        self.engines.wake_up(("weights",))
        start = time.perf_counter()
        nbytes = self.policy.call("start_ipc", self.dtype, self.threshold_bytes, version)[0]
        try:
            versions = self.engines.calls.get([Call(label, "receive_ipc", e.receive_ipc.remote(p)) for label, e, p
                                               in zip(self.engines.labels, self.engines.actors, self.policy.actors)])
        finally:
            self.policy.call("finish_ipc")
        seconds = time.perf_counter() - start
        if any(v != version for v in versions):
            raise RuntimeError(f"engines report weight versions {versions} after sending version {version}")
        self.engines.wake_up(("kv_cache",))
        t0 = time.perf_counter()
        worst = self.probe(version)
        return sync_report(version, nbytes, seconds, worst, time.perf_counter() - t0,
                           f"{len(self.engines.actors)} colocated engine(s) over CUDA IPC", self.tolerance)

    def probe(self, version: int | None = None) -> float:
        return probe_ray_engines(self.policy, self.engines, self.tolerance, version)


# ------------------------------------------------------------------------------ building
@dataclass
class RayWorkers:
    policy: RayPolicyGroup
    ref: RayRefGroup | RayBaseModelRefGroup | None
    critic: RayCriticGroup | None
    engine: Any   # RayEngineGroup, or a RemoteEngine client (generator.run_engines_locally=false)
    weight_sync: WeightSync   # RayWeightSync, RayIPCWeightSync, or RemoteWeightSync to remote servers
    plan: PlacementPlan
    groups: dict[str, Any]
    parameters: int = 0   # of the policy

    def shutdown(self) -> None:
        ray = self.policy.calls.ray
        from ray.util.placement_group import remove_placement_group
        actors = {id(a): a for g in (self.policy, self.ref, self.critic) if g is not None for a in g.actors}
        for a in actors.values():  # a LoRA policy's reference group is the policy's actors
            ray.kill(a)
        for a in getattr(self.engine, "actors", []):  # a RemoteEngine has no actors: close its client
            ray.kill(a)
        self.engine.close()
        for g in self.groups.values():
            remove_placement_group(g)


def cluster_device(trainer_device: str, cluster_gpus: float) -> Literal["GPU", "CPU"]:
    """What the workers compute on, from `trainer.device` and the GPUs the Ray cluster has (not the
    driver's own: a CPU-only head node of a GPU cluster must still plan GPU workers). `auto`: GPUs
    when the cluster has any; `cuda` on a cluster without GPUs is refused, naming the key."""
    kind = device_kind(trainer_device)
    if kind == "cuda" and cluster_gpus <= 0:
        raise PlacementConfigError(f"trainer.device={trainer_device} asks for GPU workers, but the Ray cluster has no "
                                   "GPU. Fix: trainer.device=auto or cpu, or join a cluster with GPUs (RAY_ADDRESS)")
    return "GPU" if kind == "cuda" or (kind == "auto" and cluster_gpus > 0) else "CPU"


def placement_plan(cfg: RidgelineConfig, device: Literal["GPU", "CPU"]) -> PlacementPlan:
    """The run's pools with bundles of one `device` each (`cluster_device`)."""
    g = cfg.generator
    # an engine takes tensor x pipeline x data parallel devices of the plan (SkyRL's count), one engine
    # process per data-parallel rank; the embedded hf engine computes on the first device of its block
    return plan_placement(cfg.trainer.placement, num_engines=int(g.num_inference_engines),
                          engine=EngineParallelism.from_config(g),
                          use_ref=needs_ref(cfg) and not ref_is_policy_base(cfg),
                          use_critic=cfg.trainer.critic.model.path is not None, device=device,
                          remote_engines=not g.run_engines_locally)


def build_ray_workers(cfg: RidgelineConfig, tokenizer, training_batches: int) -> RayWorkers:
    """Start or join Ray, reserve the plan's pools, start every actor, build the sharded models and
    connect the weight-sync group; `training_batches` (the run's trainer steps) sizes the
    learning-rate schedules. The trainer pushes the first weights (`weight_sync.sync(0)`, or
    the resumed checkpoint's)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray = import_ray()
    t = cfg.trainer
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
           "RIDGELINE_PROGRESS": "0"}
    init_ray(placement_plan(cfg, "CPU").total_bundles, env)  # the counts size a local instance
    # GPU or CPU workers: what the cluster has, never what this (driver) process sees
    plan = placement_plan(cfg, cluster_device(t.device, float(ray.cluster_resources().get("GPU", 0.0))))
    groups = reserve_pools(plan, float(t.placement.timeout_s))
    # the actors compute where the plan puts them: `auto` settled here, a rank's GPU is its own
    actor_cfg = copy.deepcopy(cfg)
    actor_cfg.trainer.device = "cuda" if plan.device == "GPU" else "cpu"

    def actor(cls, role: str, index: int, *args: Any):
        pool = plan.pool_of(role)
        options = {**plan.actor_resources(role),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       placement_group=groups[pool.name], placement_group_bundle_index=bundle_index(plan, role, index))}
        return ray.remote(cls).options(**options).remote(*args)

    calls = ActorCalls(ray, float(t.placement.actor_call_timeout_s))
    labels: dict[str, list[Actor]] = {}

    def located(role: str, actors: list[Any]) -> list[Any]:
        """`actors`, once each has told its node: messages name actor and node when one is lost."""
        names = [f"{role} rank {r}" if role != "engine" else f"engine {r}" for r in range(len(actors))]
        nodes = calls.get([Call(Actor(name), "node", a.node.remote()) for name, a in zip(names, actors)])
        labels[role] = [Actor(name, node_id, ip) for name, (node_id, ip) in zip(names, nodes)]
        return actors

    def start_ranks() -> tuple[list[Any], list[Any], list[Any], list[dict[str, float]]]:
        policy_actors = located("policy", [actor(TrainingRank, "policy", r, actor_cfg, "policy", r,
                                                 plan.ranks["policy"], training_batches)
                                           for r in range(plan.ranks["policy"])])
        ref_actors = located("ref", [actor(TrainingRank, "ref", r, actor_cfg, "ref", r, plan.ranks["ref"],
                                           training_batches) for r in range(plan.ranks.get("ref", 0))])
        critic_actors = located("critic", [actor(TrainingRank, "critic", r, actor_cfg, "critic", r,
                                                 plan.ranks["critic"], training_batches)
                                           for r in range(plan.ranks.get("critic", 0))])
        infos = []
        for role, actors in (("policy", policy_actors), ("ref", ref_actors), ("critic", critic_actors)):
            if actors:
                host, port = calls.get_one(Call(labels[role][0], "master_address", actors[0].master_address.remote()))
                infos.append(calls.get([Call(label, "setup", a.setup.remote(host, port))
                                        for label, a in zip(labels[role], actors)])[0])
        return policy_actors, ref_actors, critic_actors, infos

    n = cfg.generator.n_samples_per_prompt
    engine_actors = located("engine", [actor(EngineRank, "engine", i, actor_cfg)
                                       for i in range(plan.num_engines)])  # none if remote
    shares_gpus = plan.device == "GPU" and bool(t.placement.colocate_all)
    policy_actors, ref_actors, critic_actors, infos = start_engines_first(calls, engine_actors, labels["engine"],
                                                                          shares_gpus, start_ranks)
    log.info("Ray actors' nodes: %s", "; ".join(str(label) for role in ("policy", "ref", "critic", "engine")
                                                 for label in labels[role]))
    mini = t.policy_mini_batch_size * n
    # the driver's copy of the ranks' settings (the trainer reads kl_estimator from it): computed for
    # the host, so the driver never opens a CUDA context; the ranks compute their own
    policy = RayPolicyGroup(calls, policy_actors, labels["policy"], policy_train_config(cfg, torch.device("cpu")), mini)
    ref: RayRefGroup | RayBaseModelRefGroup | None = (RayRefGroup(calls, ref_actors, labels["ref"], mini)
                                                      if ref_actors else None)
    if ref_is_policy_base(cfg):
        ref = RayBaseModelRefGroup(calls, policy_actors, labels["policy"], mini)
        log.info("reference: the LoRA policy's base model on the policy ranks (adapters off); "
                 "trainer.placement.ref_* and trainer.ref.fsdp_config are not used")
    critic = (RayCriticGroup(calls, critic_actors, labels["critic"], t.critic_mini_batch_size * n)
              if critic_actors else None)
    if not cfg.generator.run_engines_locally:
        return _with_remote_engines(cfg, tokenizer, plan, groups, policy, ref, critic,
                                    int(infos[0]["parameters"]))
    engines = RayEngineGroup(calls, engine_actors, labels["engine"])
    g = cfg.generator
    sync: RayIPCWeightSync | RayWeightSync
    if weight_sync_kind("cuda" if plan.device == "GPU" else "cpu", bool(t.placement.colocate_all)) == "cuda_ipc":
        sync = RayIPCWeightSync(policy, engines, int(float(g.weight_transfer_threshold_cuda_ipc_GB) * GIB))
    else:
        sync = RayWeightSync(policy, engines, usable_backend(g.weight_sync_backend, gpus=plan.device == "GPU"),
                             float(g.weight_sync_timeout))
    log.info("Ray workers up: %s; weight sync %s", plan.describe(), sync.describe)
    return RayWorkers(policy, ref, critic, engines, sync, plan, groups, parameters=int(infos[0]["parameters"]))


def start_engines_first(calls: ActorCalls, engines: list[Any], labels: list[Actor], shares_gpus: bool,
                        start_ranks: Callable[[], T]) -> T:
    """Start the engines alone, then the ranks (SkyRL's order): vLLM sizes its KV cache from the
    GPU's free memory and checks that no other process took memory while it profiled, so no rank
    may load a model on that GPU meanwhile. Engines sharing the ranks' GPUs are put to sleep before
    the ranks start (level 2: the first weight sync brings the policy's weights)."""
    if engines:
        calls.get([Call(label, "dtype", e.dtype.remote()) for label, e in zip(labels, engines)])  # once built
        if shares_gpus:
            calls.get([Call(label, "sleep", e.sleep.remote(2)) for label, e in zip(labels, engines)])
    return start_ranks()


def _with_remote_engines(cfg: RidgelineConfig, tokenizer, plan: PlacementPlan, groups: dict[str, Any], policy: RayPolicyGroup,
                         ref: RayRefGroup | RayBaseModelRefGroup | None, critic: RayCriticGroup | None, parameters: int) -> RayWorkers:
    """`generator.run_engines_locally=false`: the driver's client generates; policy rank 0 pushes the
    gathered weights to the servers over its own weight-update group; the probe compares the
    sharded policy with every server."""
    from ridgeline.distributed.weight_sync import RemoteWeightSync
    from ridgeline.inference.remote import RemoteEngine, RemoteSettings

    settings = RemoteSettings.from_config(cfg, gpus=plan.device == "GPU")  # rank 0 pushes, on the plan's device
    engine = RemoteEngine(settings)
    policy.call("init_remote_push", settings)
    sync = RemoteWeightSync(engine, tokenizer, push=lambda version: policy.call("push_remote", version)[0],
                            trainer_probe=lambda: policy.call("probe")[0])
    log.info("Ray workers up: %s; engines: %d remote server(s)", plan.describe(), len(engine.urls))
    return RayWorkers(policy, ref, critic, engine, sync, plan, groups, parameters=parameters)
