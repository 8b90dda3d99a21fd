"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the policy: sharding, exact loss
normalisation across data-parallel ranks, and gathering full weights for checkpoints and export.

Exactness. With D data-parallel ranks each rank holds 1/D of every mini-batch. `reduce_loss`
divides by the normalisers in force; if each rank used its own token/sequence counts, the ranks'
losses would be weighted by their local counts, not the mini-batch's. `global_normalizers`
all-reduces (sums) the local counts, so rank r's loss is (sum of its per-token terms) / (mini-batch
count), and the SUM over ranks of the ranks' losses is the single-process mini-batch loss. Its
gradient is therefore the SUM of the ranks' gradients, which is why `shard_model` sets FSDP2's
gradient divide factor to 1 (`set_gradient_divide_factor(1.0)` plus
`set_force_sum_reduction_for_comms(True)`: a plain SUM reduce-scatter, which gloo supports and
NCCL runs zero-copy) instead of FSDP2's default mean over ranks. The result: the sharded gradient
after backward equals the single-process gradient of the whole mini-batch (up to float summation
order), and so do the optimizer steps.

Gradient clipping. `torch.nn.utils.clip_grad_norm_` on FSDP2's DTensor gradients computes the
GLOBAL norm (the per-shard norms are reduced across the mesh), so clipping and the reported
`policy/grad_norm` match the single-process run.

Hybrid sharding. `fsdp_size` < world size builds a 2-D mesh (replicate = world / fsdp_size,
shard = fsdp_size): parameters are sharded within groups of `fsdp_size` consecutive ranks and
replicated across groups (HSDP: reduce-scatter inside a group, all-reduce across groups). With the
divide factor 1 both reductions sum, so the normalisation argument above is unchanged.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)

from ridgeline.training.batch import TrainingBatch
from ridgeline.training.critic_worker import CriticWorker
from ridgeline.training.forward_path import decoder_forward_count
from ridgeline.training.worker import PolicyWorker, RefWorker


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one: `model.model.layers` for Llama-like HF
    models, else every module whose class name ends with "DecoderLayer"."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    found = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not found:
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    return found


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


def shard_model(model: nn.Module, *, mesh: DeviceMesh | None = None, fsdp_size: int | None = None,
                reshard_after_forward: bool = True, cpu_offload: bool = False,
                mixed_precision: MixedPrecisionPolicy | None = None) -> nn.Module:
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
      counts (`global_normalizers`, as `FSDPPolicyWorker` does)."""
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
    return get_model_state_dict(model, options=options)


def _reduction_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_normalizers(num_tokens: float, num_sequences: float,
                       group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """(sum over ranks of num_tokens, sum over ranks of num_sequences): the counts of the whole
    data-parallel mini-batch, to hand to `loss_normalizers`. A collective: every rank calls it
    once per optimizer step. float64, so token counts are exact far beyond any batch size."""
    counts = torch.tensor([num_tokens, num_sequences], dtype=torch.float64, device=_reduction_device())
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return float(counts[0]), float(counts[1])


def _all_reduce_floats(values: list[float], op: dist.ReduceOp) -> list[float]:
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64, device=_reduction_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


# Metrics the base worker reports as a sum over micro-batches of losses normalised by mini-batch
# counts: with global normalisers each rank holds its share and the mini-batch value is the sum.
_SUMMED = {"policy/policy_loss", "policy/final_loss", "policy/kl_loss"}
# Identical on every rank by construction: the global grad norm, the schedule, the step counts.
_SHARED = {"policy/grad_norm", "policy/policy_lr", "policy/optimizer_steps", "policy/skipped_steps"}


class FSDPPolicyWorker(PolicyWorker):
    """`PolicyWorker` on one data-parallel rank of a model sharded with `shard_model`, holding
    this rank's rows of every training batch. The math is the base class's; this class only

    - puts the GLOBAL mini-batch counts (`global_normalizers`) in force for every micro-batch, so
      rank losses sum to the single-process loss and the summed gradients equal its gradient;
    - reduces the metrics across ranks so every rank returns the single-process numbers: the
      losses are summed, token-weighted means are re-weighted by global token counts, `*_max`
      are maxima; grad norm, lr and step counts are already global. Other keys are averaged.

    Every rank must run the same forwards: each decoder forward all-gathers the layer's shards.
    So ranks need the same number of mini- and micro-batches, and `response_logprobs` must take
    the same path on all of them (it runs the decoder twice when rows of a micro-batch share a
    prompt, once otherwise). Both are checked before each optimizer step and each logprob pass;
    a disagreement raises `RuntimeError` on every rank instead of deadlocking. A non-finite loss with
    `nonfinite_loss=skip` on one rank only would desynchronise the ranks (the others run backward);
    the launch timeout catches that hang, the trainer integration should all-reduce finiteness.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._sums: dict[str, float] | None = None

    def _optimizer_step(self, mini: TrainingBatch, sums: dict[str, float], loss_sums: dict[str, float],
                        first_epoch: bool) -> float:
        self._sums = sums  # the base's raw sums: the logprob-mismatch mean needs its token count
        check_micro_forwards(self.model, mini, self.config.micro_batch_size, self.config.forward_options)
        return super()._optimizer_step(mini, sums, loss_sums, first_epoch)

    def step_normalizers(self, mini: TrainingBatch) -> tuple[float, float]:
        return global_step_normalizers(mini)

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()  # as batch_logprobs runs it
        try:
            check_micro_forwards(self.model, batch, self.config.micro_forward_batch_size, self.config.forward_options)
        finally:
            self.model.train(was_training)
        return super().compute_logprobs(batch)

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        self._sums = None
        metrics = super().train(batch)
        sums = self._sums if self._sums is not None else defaultdict(float)
        return reduce_policy_metrics(metrics, local_tokens=float(batch.loss_mask.sum()) * self.config.update_epochs,
                                     mismatch=(sums["mismatch_sum"], sums["mismatch_tokens"], sums["mismatch_max"]))


def check_micro_forwards(model, batch: TrainingBatch, micro_size: int, options) -> None:
    """`check_uniform_forwards` for `batch` run in micro-batches of `micro_size` rows."""
    check_uniform_forwards([decoder_forward_count(model, m, options) for m in batch.chunks(micro_size)])


def global_step_normalizers(mini: TrainingBatch) -> tuple[float, float]:
    """A mini-batch's loss normalisers (tokens, sequences) summed over every rank."""
    return global_normalizers(float(mini.loss_mask.sum()), float(mini.batch_size))


def check_uniform_forwards(passes: list[int]) -> None:
    """Raise RuntimeError on every rank unless all ranks will run the same forwards (`passes`:
    decoder forwards per micro-batch, in order). A collective; two small all-reduces."""
    count = torch.tensor([len(passes), -len(passes)], dtype=torch.float64, device=_reduction_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count[0] != -count[1]:
        raise RuntimeError(f"FSDP ranks hold different numbers of micro-batches ({int(-count[1])} to "
                           f"{int(count[0])}); every rank must hold the same number of rows")
    if not passes:
        return
    local = torch.tensor(passes, dtype=torch.float64, device=_reduction_device())
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if not torch.equal(both[:len(passes)], -both[len(passes):]):
        raise RuntimeError("FSDP ranks disagree on the shared-prompt forward path of a micro-batch (rows sharing "
                           "a prompt on some ranks, not on others); keep GRPO groups whole within each "
                           "rank's micro-batches, or give every rank the same grouping")


def reduce_policy_metrics(metrics: dict[str, float], local_tokens: float,
                          mismatch: tuple[float, float, float]) -> dict[str, float]:
    """One rank's `PolicyWorker.train` metrics -> the whole data-parallel batch's (see
    `FSDPPolicyWorker`). `local_tokens` is the rank's loss-token count times the epochs (the
    base's token-mean denominator before its max(1, .)); `mismatch` its raw logprob-mismatch
    (sum, tokens, max). A collective; every rank must report the same metric keys except the
    `rollout/logprob_abs_diff_*` pair, which is rebuilt from `mismatch`."""
    out = reduce_rank_metrics({k: v for k, v in metrics.items() if not k.startswith("rollout/logprob_abs_diff")},
                              local_tokens, prefix="policy/", summed=_SUMMED, shared=_SHARED)
    mismatch_sum, mismatch_tokens = _all_reduce_floats([mismatch[0], mismatch[1]], dist.ReduceOp.SUM)
    (worst,) = _all_reduce_floats([mismatch[2]], dist.ReduceOp.MAX)
    if mismatch_tokens:
        out["rollout/logprob_abs_diff_mean"] = mismatch_sum / mismatch_tokens
        out["rollout/logprob_abs_diff_max"] = worst
    return out


def reduce_rank_metrics(metrics: dict[str, float], local_tokens: float, *, prefix: str, summed: set[str],
                        shared: set[str]) -> dict[str, float]:
    """A worker's metrics on one rank -> the whole data-parallel batch's: keys in `shared` are
    equal on every rank already; keys in `summed` are losses normalised by mini-batch-global
    counts (each rank holds its share: sum them); other `<prefix>*` keys are token-weighted means
    over the rank's `local_tokens` (re-weighted by global tokens); `*_max` are maxima; anything
    else is averaged over ranks. A collective; every rank must report the same keys."""
    weight = max(1.0, local_tokens)
    keys = sorted(k for k in metrics if k not in shared)
    sums, maxes = [], []
    for key in keys:
        if key.endswith("_max"):
            maxes.append(metrics[key])
        elif key in summed or not key.startswith(prefix):
            sums.append(metrics[key])
        else:
            sums.append(metrics[key] * weight)
    sums.append(local_tokens)
    sums = _all_reduce_floats(sums, dist.ReduceOp.SUM)
    maxes = _all_reduce_floats(maxes, dist.ReduceOp.MAX)
    global_tokens = sums[-1]
    world = dist.get_world_size()
    out = dict(metrics)
    s, m = iter(sums), iter(maxes)
    for key in keys:
        if key.endswith("_max"):
            out[key] = next(m)
        elif key in summed:
            out[key] = next(s)
        elif key.startswith(prefix):
            out[key] = next(s) / max(1.0, global_tokens)
        else:
            out[key] = next(s) / world
    return out


_CRITIC_SUMMED = {"critic/value_loss"}
_CRITIC_SHARED = {"critic/grad_norm", "critic/lr", "critic/optimizer_steps", "critic/skipped_steps"}


class FSDPCriticWorker(CriticWorker):
    """`CriticWorker` on one rank of a sharded value model, as `FSDPPolicyWorker` is for the
    policy: global loss normalisers, metrics reduced across ranks. The critic always runs its
    padded forward here (`ValueModel.forward`, where FSDP's root gathers the embeddings and the
    head); the packed path calls the backbone directly, around the root's hooks."""

    def step_normalizers(self, mini: TrainingBatch) -> tuple[float, float]:
        return global_step_normalizers(mini)

    def compute_values(self, batch: TrainingBatch) -> torch.Tensor:
        check_uniform_forwards([1] * math.ceil(batch.batch_size / self.config.micro_forward_batch_size))
        return super().compute_values(batch)

    def train(self, batch: TrainingBatch) -> dict[str, float]:
        check_uniform_forwards([1] * math.ceil(batch.batch_size / self.config.micro_batch_size))
        metrics = super().train(batch)
        return reduce_rank_metrics(metrics, float(batch.loss_mask.sum()) * self.config.update_epochs,
                                   prefix="critic/", summed=_CRITIC_SUMMED, shared=_CRITIC_SHARED)


class FSDPRefWorker(RefWorker):
    """`RefWorker` on one rank of a sharded reference model: the same forward-only logprobs, after
    checking that every rank will run the same decoder forwards (see `FSDPPolicyWorker`)."""

    def compute_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        check_micro_forwards(self.model, batch, self.micro, self.forward_options)
        return super().compute_logprobs(batch)
