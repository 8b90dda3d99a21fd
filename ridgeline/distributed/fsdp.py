"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the policy, reference and critic ranks:
`FSDPGroup`, the `DataParallel` the workers (ridgeline.training.worker, critic_worker) run in on a
rank: sharding, the all-reduces behind exact loss normalisation, and full weights for checkpoints.

Exactness. With D data-parallel ranks each rank holds 1/D of every mini-batch. `reduce_loss`
divides by the normalisers in force; if each rank used its own token/sequence counts, the ranks'
losses would be weighted by their local counts, not the mini-batch's. The workers'
`step_normalizers` all-reduce (sum) the local counts, so rank r's loss is (sum of its per-token terms) / (mini-batch
count), and the SUM over ranks of the ranks' losses is the single-process mini-batch loss. Its
gradient is therefore the SUM of the ranks' gradients, which is why `shard_model` sets FSDP2's
gradient divide factor to 1 (`set_gradient_divide_factor(1.0)` plus
`set_force_sum_reduction_for_comms(True)`: a plain SUM reduce-scatter, which gloo supports and
NCCL runs zero-copy) instead of FSDP2's default mean over ranks. The result: the sharded gradient
after backward equals the single-process gradient of the whole mini-batch (up to float summation
order), and so do the optimizer steps.

Gradient clipping. `torch.nn.utils.clip_grad_norm_` on FSDP2's DTensor gradients computes the
GLOBAL norm (the per-shard norms are reduced across the mesh), so clipping and the reported
`policy/raw_grad_norm` match the single-process run.

LoRA. A LoRA model (the policy's PeftModel, a critic with an adapted backbone) is wrapped before
sharding and sharded as any other: FSDP2 holds frozen base weights and trainable adapters side by
side in one parameter group per layer, all-gathers both for the forward and reduce-scatters
gradients only for the adapters (and a critic's value head), which are all the optimizer holds.
Checkpoints gather only those (`trainable_state_dict`); the engines' merged weights are computed
from the gathered full state (ridgeline.models.lora.AdapterLayout).

Hybrid sharding. `fsdp_size` < world size builds a 2-D mesh (replicate = world / fsdp_size,
shard = fsdp_size): parameters are sharded within groups of `fsdp_size` consecutive ranks and
replicated across groups (HSDP: reduce-scatter inside a group, all-reduce across groups). With the
divide factor 1 both reductions sum, so the normalisation argument above is unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, ValueType, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)

from ridgeline.models.device import device_kind, resolve_device
from ridgeline.models.lora import plain
from ridgeline.training.parallel import M, check_trainable_names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one: `model.model.layers` for Llama-like HF
    models (under a LoRA policy's PeftModel too), else every module whose class name ends with
    "DecoderLayer" (the critic's)."""
    inner = getattr(plain(model), "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    found = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not found:
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    return found


def rank_device(name: str) -> torch.device:
    """This rank's device from `trainer.device`: on CUDA the GPU `LOCAL_RANK` names (torchrun sets
    it; under Ray, CUDA_VISIBLE_DEVICES shows the actor its one GPU as index 0), made the current
    device so NCCL and the caching allocator use it; else the CPU. Only the kind of `name` counts:
    a rank's GPU is its rank's, so an index (`cuda:N`, refused with fsdp2 by the config check) is
    never checked against the GPUs this process sees."""
    device = resolve_device(device_kind(name))
    if device.type != "cuda":
        return device
    index = int(os.environ.get("LOCAL_RANK", device.index or 0)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build_mesh(fsdp_size: int | None = None) -> DeviceMesh:
    """1-D ("shard",) mesh over all ranks, or with 0 < fsdp_size < world size the 2-D
    ("replicate", "shard") mesh of hybrid sharding; fsdp_size must divide the world size."""
    world = dist.get_world_size()
    if fsdp_size is None or fsdp_size <= 0 or fsdp_size == world:
        return init_device_mesh(_device_type(), (world,), mesh_dim_names=("shard",))
    if world % fsdp_size:
        raise ValueError(f"fsdp_size={fsdp_size} does not divide the world size {world}")
    return init_device_mesh(_device_type(), (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))


def shard_model(model: M, *, mesh: DeviceMesh | None = None, fsdp_size: int | None = None,
                reshard_after_forward: bool = True, cpu_offload: bool = False,
                mixed_precision: MixedPrecisionPolicy | None = None) -> M:
    """Apply FSDP2 to every decoder layer, then to the root (embeddings, final norm, tied head);
    in place, and the model is returned. Call on every rank, after the process group exists and
    before building the optimizer (the optimizer must hold the sharded DTensor parameters).

    - `mesh`: defaults to `build_mesh(fsdp_size)`.
    - `reshard_after_forward`: for the layers (ZeRO-3 when True, ZeRO-2-like when False). The root
      never reshards after forward: its parameters are needed again at once by backward, and
      ridgeline's forward (`forward_last_logits`) calls `model.get_decoder()` and the output
      embedding rather than `model.forward`, so the root's all-gather is hooked onto
      `get_decoder` (`register_fsdp_forward_method`) and must stay gathered until the head ran.
    - `cpu_offload`: keep sharded parameters, gradients and optimizer state on the CPU (GPU
      ranks; a no-op on CPU ranks).
    - `mixed_precision`: an FSDP2 MixedPrecisionPolicy (e.g. bf16 params, fp32 reduce).
    - Gradients are SUMMED across ranks (divide factor 1): losses must be normalised by global
      counts (the workers' `step_normalizers`)."""
    mesh = mesh if mesh is not None else build_mesh(fsdp_size)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cpu_offload and _device_type() == "cuda":  # on CPU ranks everything already lives on the CPU
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if hasattr(model, "get_decoder"):
        register_fsdp_forward_method(model, "get_decoder")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU, on rank 0; an empty dict on the other ranks.
    A collective: every rank must call it. Keys and values are those of the unsharded model's
    `state_dict()`, so it loads into a fresh model of the same config."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return _tensors(get_model_state_dict(model, options=options))


def _tensors(state: dict[str, ValueType]) -> dict[str, torch.Tensor]:
    """DCP's model state dict as what it holds: a model's state dict is all tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model state {name} is a {type(value).__name__}, not a tensor")
        out[name] = value
    return out


def _values(state: Mapping[str, torch.Tensor]) -> dict[str, ValueType]:
    """Tensors as DCP's value type (its dict is typed for every state, not only a model's)."""
    return {name: value for name, value in state.items()}


class GatheredState(Mapping[str, torch.Tensor]):
    """A sharded model's full parameters, gathered one at a time as they are read (on `device`,
    where the all-gather runs: a CPU-offloaded shard is copied there first), so a reader that
    takes one tensor at a time never holds the whole model. Reading is a collective: every rank
    must read the same names in the same order. Keys: the model's parameters, tied ones once.
    `specs()` gives the same keys as `meta` tensors of the full shapes, gathering nothing."""

    def __init__(self, model: nn.Module, device: torch.device):
        self._params = dict(model.named_parameters())
        self._device = device

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._params[name].detach()
        if not isinstance(value, DTensor):
            return value.to(self._device)
        local = value.to_local()
        if local.device != self._device:  # a shard waiting on the host: the all-gather runs on the device
            value = DTensor.from_local(local.to(self._device), value.device_mesh, value.placements,
                                       run_check=False, shape=value.shape, stride=value.stride())
        return value.full_tensor()

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def specs(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in self._params.items()}


def _reduction_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64, device=_reduction_device())  # float64: exact token counts
    dist.all_reduce(t, op=op)
    return t.tolist()


def _tied_names(model: nn.Module) -> set[str]:
    """State-dict names a Hugging Face folder leaves out because they share another's tensor."""
    config = getattr(model, "config", None)
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


@dataclass(frozen=True)
class FSDPGroup:
    """`DataParallel` for one FSDP2 rank of a torch.distributed group (gloo on CPU ranks, NCCL on
    GPU ranks, one GPU per rank): the workers' all-reduces, FSDP2 sharding with the
    `fsdp_config` settings, and full (world-size-free) weights and optimizer states.

    - `device`: where the rank computes (`cuda:LOCAL_RANK`, or the CPU).
    - `fsdp_size`, `reshard_after_forward`, `cpu_offload`: `trainer.<role>.fsdp_config.*`.
    - `param_dtype`, `reduce_dtype`: FSDP2's MixedPrecisionPolicy on GPU ranks
      (`fsdp_config.mixed_precision.*`): parameters are gathered in `param_dtype` for compute
      (bf16) and gradients reduce-scattered in `reduce_dtype`, while the sharded master weights and
      the optimizer stay float32. None: compute in the parameters' own dtype (autocast still applies).
    """

    device: torch.device
    fsdp_size: int | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def all_sum(self, values: list[float]) -> list[float]:
        return _all_reduce(values, dist.ReduceOp.SUM)

    def all_max(self, values: list[float]) -> list[float]:
        return _all_reduce(values, dist.ReduceOp.MAX)

    def place(self, model: M) -> M:
        if not self.cpu_offload:
            model = model.to(self.device)  # with CPU offload the shards stay on the host
        policy = (MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
                  if self.param_dtype is not None else None)
        return shard_model(model, fsdp_size=self.fsdp_size, reshard_after_forward=self.reshard_after_forward,
                           cpu_offload=self.cpu_offload, mixed_precision=policy)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(model)

    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        missing = set(model.state_dict()) - set(state)
        if missing - _tied_names(model):
            raise ValueError(f"missing {sorted(missing)[:5]}")
        set_model_state_dict(model, _values(state), options=StateDictOptions(full_state_dict=True, strict=False))

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # DCP's ignore_frozen_params still returns a frozen weight tied to another (a tied LM head)
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return {k: v for k, v in _tensors(get_model_state_dict(model, options=options)).items() if k in trainable}

    def load_trainable_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        check_trainable_names(model, state)
        set_model_state_dict(model, _values(state), options=StateDictOptions(full_state_dict=True, strict=False))

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
