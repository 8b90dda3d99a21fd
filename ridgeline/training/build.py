"""Building the policy, reference and critic workers from the config: one code for the single
process (`ridgeline.trainer`, a world of one on `trainer.device`) and for every FSDP2 rank
(`ridgeline.distributed.ray_workers`, which passes its `FSDPGroup`)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from transformers import PreTrainedModel
from ridgeline.algorithms import load_algorithm_modules, resolve_kl_estimator
from ridgeline.config.loss_view import LossConfig
from ridgeline.config.loss_view import loss_config as algorithm_view
from ridgeline.config.schema import RidgelineConfig, TrainerConfig
from ridgeline.config.schema.trainer import OptimizerConfig
from ridgeline.models.device import resolve_device, use_device
from ridgeline.models.forward import enable_activation_checkpointing, select_attention
from ridgeline.models.loading import (ModelSpec, cpu_has_fast_bf16, critic_spec, load_model, load_tokenizer,
                                      policy_spec, ref_spec)
from ridgeline.models.lora import lora_settings, reference_is_base, wrap
from ridgeline.models.source import ModelLoadError
from ridgeline.models.value_model import load_value_model
from ridgeline.seeding import derive_seed
from ridgeline.training.critic_worker import CriticTrainConfig, CriticWorker
from ridgeline.training.forward_path import ForwardOptions
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.parallel import DataParallel, SingleProcess
from ridgeline.training.profiler import ProfilerSettings, StepProfiler
from ridgeline.training.worker import BaseModelRefWorker, PolicyTrainConfig, PolicyWorker, RefWorker

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Python, numpy and torch (CPU and every CUDA device) from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CUDA generators too


def single_process(cfg: RidgelineConfig) -> SingleProcess:
    """The world of one the single-process trainer's workers share, on `trainer.device`."""
    return SingleProcess(use_device(cfg.trainer.device))  # and the current CUDA device (`use_device`)


def training_precision(trainer_cfg: TrainerConfig) -> str:
    """The training precision two keys ask for: `trainer.mixed_precision`, with SkyRL's
    `trainer.bf16=false` turning its `auto` into fp32 (bf16 with bf16=false is refused by validation)."""
    if not trainer_cfg.bf16:
        return "fp32"
    return str(trainer_cfg.mixed_precision)


def training_autocast_dtype(mixed_precision: str, device: torch.device | None = None) -> torch.dtype | None:
    """`trainer.mixed_precision` on `device`: bf16 compute (master weights stay fp32) or None for fp32;
    `auto` is bf16 where the device runs it fast (a CUDA GPU with bf16, a CPU with AMX/AVX512-BF16)."""
    if mixed_precision == "fp32":
        return None
    if mixed_precision == "bf16":
        return torch.bfloat16
    device = device or resolve_device("auto")
    fast = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_fast_bf16()
    return torch.bfloat16 if fast else None


def training_max_tokens(cfg: RidgelineConfig) -> int:
    """The longest row a training forward can see: the longest prompt (or multi-turn input) plus
    the longest generation."""
    g = cfg.generator
    return max(int(cfg.trainer.max_prompt_length), int(g.max_input_length)) + int(g.sampling_params.max_generate_length)


def skyrl_max_seq_len(cfg: RidgelineConfig) -> int:
    """SkyRL's `trainer.algorithm.max_seq_len`, the constant seq_mean_token_sum_norm divides every
    row's loss sum by: `generator.max_input_length + generator.sampling_params.max_generate_length`
    (SkyRL 0.3.1 derives it in validate_cfg), unless SkyRL 0.4's `trainer.algorithm.max_seq_len` sets it."""
    g = cfg.generator
    if cfg.trainer.algorithm.max_seq_len is not None:
        return int(cfg.trainer.algorithm.max_seq_len)
    return int(g.max_input_length) + int(g.sampling_params.max_generate_length)


def loss_temperature(cfg: RidgelineConfig) -> float:
    """The temperature the trainer's logprobs divide logits by: SkyRL 0.4's
    `trainer.algorithm.temperature`, by default the sampler's `generator.sampling_params.temperature`."""
    t = cfg.trainer.algorithm.temperature
    return float(cfg.generator.sampling_params.temperature if t is None else t)


def loss_config(cfg: RidgelineConfig) -> LossConfig:
    """What a policy loss gets as `config`: the `trainer.algorithm` section plus SkyRL's derived
    `max_seq_len` (a loss written for SkyRL reads `config.max_seq_len`), resolved and read-only."""
    alg = cfg.trainer.algorithm
    return algorithm_view(alg, skyrl_max_seq_len(cfg), dpo=cfg.dpo if alg.loss_name == "dpo" else None)


def load_training_model(cfg: RidgelineConfig, spec: ModelSpec, dtype: torch.dtype, tokenizer, device: torch.device):
    """A model for the training-side workers, on the host (its group places it): the attention
    kernel `select_attention` picks for `device` (FlashAttention-2 / SDPA on CUDA, eager for
    short rows on a CPU)."""
    model = load_model(spec, dtype, tokenizer)
    kernel = select_attention(model, device, training_max_tokens(cfg), bool(cfg.trainer.flash_attn))
    log.info("%s: %s attention on %s", spec.path, kernel, device)
    return model


def forward_options(cfg: RidgelineConfig) -> ForwardOptions:
    """`trainer.use_sample_packing`: micro-batches whose rows do not share a prompt run packed
    (ridgeline.training.forward_path has the rule and its measurements)."""
    return ForwardOptions(sample_packing=bool(cfg.trainer.use_sample_packing))


def policy_train_config(cfg: RidgelineConfig, device: torch.device | None = None) -> PolicyTrainConfig:
    """The policy worker's settings (the same on every rank: each holds its share of every
    mini-batch, `training.batch.rank_shares`)."""
    t, g, alg = cfg.trainer, cfg.generator, cfg.trainer.algorithm
    return PolicyTrainConfig(
        mini_batch_trajectories=t.policy_mini_batch_size * g.n_samples_per_prompt,
        micro_batch_size=t.micro_train_batch_size_per_gpu,
        micro_forward_batch_size=t.micro_forward_batch_size_per_gpu,
        update_epochs=t.update_epochs_per_batch,
        temperature=loss_temperature(cfg),
        policy_loss=alg.policy_loss_type or alg.ppo_loss_type,
        loss_reduction=alg.loss_reduction,
        algorithm=loss_config(cfg),
        max_seq_len=skyrl_max_seq_len(cfg),
        use_kl_loss=alg.use_kl_loss, kl_loss_coef=alg.kl_loss_coef,
        kl_estimator=resolve_kl_estimator(alg.kl_estimator_type, alg.use_kl_estimator_k3, alg.use_abs_kl),
        use_entropy_loss=alg.use_entropy_loss, entropy_loss_coef=alg.entropy_loss_coef,
        max_grad_norm=t.policy.optimizer_config.max_grad_norm,
        autocast_dtype=training_autocast_dtype(training_precision(t), device),
        nonfinite_loss=t.nonfinite_loss,
        forward_options=forward_options(cfg),
    )


def build_policy_worker(cfg: RidgelineConfig, tokenizer, parallel: DataParallel | None = None, *,
                        training_batches: int) -> PolicyWorker:
    """The policy model (float32 master weights) with its optimizer and schedule, placed by
    `parallel` (default: one process on `trainer.device`); `training_batches`: the trainer steps of
    the whole run, which the schedule's length is counted from (`lr_schedule`). With `trainer.policy.model.lora.rank > 0`
    the model is wrapped with LoRA adapters (after activation checkpointing is set up, which peft
    needs to know) and the optimizer holds only the adapters. Placement (FSDP2 sharding on ranks)
    comes after that and before the optimizer, which must hold the placed parameters."""
    t = cfg.trainer
    load_algorithm_modules(t.algorithm.algorithm_modules)  # a rank looks the user's loss up by name too
    parallel = parallel or single_process(cfg)
    model = load_training_model(cfg, policy_spec(cfg), torch.float32, tokenizer, parallel.device)
    if t.gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=bool(t.gradient_checkpointing_use_reentrant))
    model.config.use_cache = False
    lora = lora_settings(cfg)
    if lora is not None:
        model = wrap(model, lora, seed=t.seed)
    model = parallel.place(model)
    opt = t.policy.optimizer_config
    optimizer = build_optimizer(model, opt.lr, adam_betas(opt), opt.weight_decay)
    worker = PolicyWorker(model, policy_train_config(cfg, parallel.device), optimizer,
                          build_scheduler(optimizer, lr_schedule(cfg, "policy", training_batches)), parallel)
    worker.offload_optimizer = offloads_optimizer(cfg, opt, parallel.device)
    worker.profiler = step_profiler(cfg, parallel.rank)
    return worker


def adam_betas(opt: OptimizerConfig) -> tuple[float, float]:
    """(beta1, beta2) of `adam_betas` (validation checked it holds two numbers)."""
    beta1, beta2 = opt.adam_betas
    return beta1, beta2


def step_profiler(cfg: RidgelineConfig, rank: int) -> StepProfiler | None:
    """This rank's torch.profiler (`trainer.policy.torch_profiler_config`), or None: off, or a rank
    not in `ranks`. save_path null: `<trainer.run_dir>/profiler`."""
    p = cfg.trainer.policy.torch_profiler_config
    if not p.enable or rank not in list(p.ranks):
        return None
    folder = Path(p.save_path) if p.save_path is not None else Path(cfg.trainer.run_dir) / "profiler"
    return StepProfiler(ProfilerSettings(
        save_path=folder.expanduser(), activities=tuple(p.activities), skip_first=p.skip_first, wait=p.wait,
        warmup=p.warmup, active=p.active, repeat=p.repeat, record_shapes=p.record_shapes,
        profile_memory=p.profile_memory, with_stack=p.with_stack, with_flops=p.with_flops,
        with_modules=p.with_modules, use_gzip=p.use_gzip), rank)


def optimizer_steps_per_batch(cfg: RidgelineConfig, role: Literal["policy", "critic"]) -> int:
    """Optimizer steps `role` takes on one training batch: `update_epochs_per_batch` passes over
    train_batch_size / `<role>_mini_batch_size` mini-batches (validation made the division exact)."""
    t = cfg.trainer
    return int(t.update_epochs_per_batch) * (int(t.train_batch_size) // (t.policy_mini_batch_size if role == "policy" else t.critic_mini_batch_size))


def lr_schedule(cfg: RidgelineConfig, role: Literal["policy", "critic"], training_batches: int) -> LRSchedule:
    """`role`'s `optimizer_config.scheduler` over the run's optimizer steps: `training_batches`
    (prompt batches per epoch x epochs, SkyRL's `total_training_steps`) x the optimizer steps
    of one batch. SkyRL 0.3.1 passed the batch count alone while stepping the schedule per optimizer
    step, so a decaying schedule ended early; SkyRL fixed that after 0.3.1 (NovaSky-AI/SkyRL#873)
    and Ridgeline counts as the fix does."""
    opt = (cfg.trainer.policy if role == "policy" else cfg.trainer.critic).optimizer_config
    return LRSchedule(name=str(opt.scheduler), num_warmup_steps=warmup_steps(cfg, opt),
                      num_training_steps=int(training_batches) * optimizer_steps_per_batch(cfg, role))


def warmup_steps(cfg: RidgelineConfig, optimizer_config: OptimizerConfig) -> int:
    """Optimizer steps of warmup for one model: its `optimizer_config.num_warmup_steps` (SkyRL 0.3.1's
    key) when set, else `trainer.num_warmup_steps` (validation refuses two different values)."""
    return int(optimizer_config.num_warmup_steps or cfg.trainer.num_warmup_steps)


def offloads_optimizer(cfg: RidgelineConfig, optimizer_config: OptimizerConfig, device: torch.device) -> bool:
    """`optimizer_config.offload_after_step` acts where it frees something: on a GPU shared with
    the engines (`trainer.placement.colocate_all`, engines in this job)."""
    return (bool(optimizer_config.offload_after_step) and device.type == "cuda"
            and bool(cfg.trainer.placement.colocate_all) and bool(cfg.generator.run_engines_locally))


def needs_ref(cfg: RidgelineConfig) -> bool:
    alg = cfg.trainer.algorithm
    return bool(alg.use_kl_loss or alg.use_kl_in_reward)


def ref_is_policy_base(cfg: RidgelineConfig) -> bool:
    """A reference is needed and it is the LoRA policy's own frozen base (`BaseModelRefWorker`):
    no reference model is loaded, and on Ray no reference ranks start (the policy ranks serve it)."""
    return needs_ref(cfg) and reference_is_base(cfg.trainer)


def build_ref_worker(cfg: RidgelineConfig, tokenizer, *, policy: PolicyWorker | None = None,
                     parallel: DataParallel | None = None) -> RefWorker | None:
    """The reference model (`trainer.ref.model.path`, the policy's by default) when a KL option
    needs one. It is loaded in float32, as the policy is: under autocast a float32 model keeps its
    residual stream and norms in float32 while a bf16-loaded one rounds them to bf16, so a bf16
    reference would differ from the very policy it copies (a step-1 KL of 1e-3 on SmolLM2, logits
    apart by bf16 steps) and the KL term would pull the policy toward rounding noise. Under FSDP2
    on a GPU both gather their shards in `param_dtype`, so there too they compute alike. With LoRA
    and the policy's own model as reference (`ref_is_policy_base`), the reference is the frozen base
    the policy wraps: `policy`'s model with its adapters switched off (on its ranks, in `parallel`,
    under FSDP2), no second copy loaded; another reference model (or other config overrides) is
    loaded on its own."""
    if not needs_ref(cfg):
        return None
    t = cfg.trainer
    parallel = parallel or single_process(cfg)
    autocast = training_autocast_dtype(training_precision(t), parallel.device)
    temperature = loss_temperature(cfg)
    spec = ref_spec(cfg)
    if ref_is_policy_base(cfg):
        if policy is None:
            raise ValueError("with trainer.policy.model.lora.rank > 0 the reference is the policy's base model: "
                             "build_ref_worker needs the policy worker (policy=...)")
        return BaseModelRefWorker(policy, t.micro_forward_batch_size_per_gpu, temperature, autocast,
                                  forward_options=forward_options(cfg))
    if spec.path != t.policy.model.path:
        check_same_tokenizer(spec, tokenizer, "trainer.ref.model.path")
    model = load_training_model(cfg, spec, torch.float32, tokenizer, parallel.device)
    return RefWorker(parallel.place(model), t.micro_forward_batch_size_per_gpu, temperature, autocast,
                     forward_options=forward_options(cfg), parallel=parallel)


def check_same_tokenizer(spec: ModelSpec, tokenizer, key: str) -> None:
    """Refuse the model at `key` (another one than the policy's) when its tokenizer maps tokens to
    other ids than the policy's `tokenizer`: its logprobs of the policy's token ids would be of other
    text. Only the vocabulary counts: chat templates and embedding rows past it may differ."""
    try:
        own = load_tokenizer(spec).get_vocab()
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{key}={spec.path}: its tokenizer, needed to check that it is the policy's, could not "
                             f"be loaded ({err}). Fix: a model folder or hub id with its tokenizer") from err
    policy = tokenizer.get_vocab()
    if own != policy:
        differ = sum(1 for token, i in own.items() if policy.get(token) != i)
        raise ModelLoadError(f"{key}={spec.path} has another tokenizer than the policy's ({len(own)} tokens "
                             f"against {len(policy)}, {differ} with another or no id): its logprobs of the policy's "
                             "token ids would be of other text. Fix: a model with the policy's tokenizer, or leave "
                             f"{key} at its default (the policy's model)")


def build_critic(cfg: RidgelineConfig, tokenizer, *, training_batches: int, parallel: DataParallel | None = None,
                 options: ForwardOptions | None = None) -> CriticWorker | None:
    """The value model and its worker, when `trainer.critic.model.path` names one. `parallel` and
    `training_batches` as for the policy; `options` defaults to the config's forward options. With
    `trainer.critic.model.lora.rank > 0` the backbone is wrapped with LoRA adapters (drawn from
    their own seed) while the value head, a fresh layer, trains fully: the optimizer holds both."""
    t, alg = cfg.trainer, cfg.trainer.algorithm
    spec = critic_spec(cfg)
    if spec is None:
        return None
    parallel = parallel or single_process(cfg)
    autocast = training_autocast_dtype(training_precision(t), parallel.device)
    model = load_value_model(spec, torch.float32, tokenizer, value_head_prefix=alg.value_head_prefix)
    backbone = model.backbone
    if not isinstance(backbone, PreTrainedModel):  # freshly loaded: no adapters yet
        raise TypeError(f"load_value_model gave a {type(backbone).__name__} backbone, not a transformers model")
    select_attention(backbone, parallel.device, training_max_tokens(cfg), bool(t.flash_attn))
    if t.gradient_checkpointing:
        model.enable_activation_checkpointing(use_reentrant=bool(t.gradient_checkpointing_use_reentrant))
    lora = lora_settings(cfg, "critic")
    if lora is not None:
        model.backbone = wrap(backbone, lora, seed=derive_seed(t.seed, "critic", "lora"))
    model = parallel.place(model)
    opt = t.critic.optimizer_config
    optimizer = build_optimizer(model, opt.lr, adam_betas(opt), opt.weight_decay)
    config = CriticTrainConfig(
        mini_batch_trajectories=t.critic_mini_batch_size * cfg.generator.n_samples_per_prompt,
        micro_batch_size=t.micro_train_batch_size_per_gpu,
        micro_forward_batch_size=t.micro_forward_batch_size_per_gpu,
        update_epochs=t.update_epochs_per_batch, value_clip=alg.value_clip,
        loss_reduction=alg.loss_reduction, max_seq_len=skyrl_max_seq_len(cfg), max_grad_norm=opt.max_grad_norm,
        autocast_dtype=autocast,
        nonfinite_loss=t.nonfinite_loss, forward_options=options or forward_options(cfg))
    worker = CriticWorker(model, config, optimizer, build_scheduler(optimizer, lr_schedule(cfg, "critic", training_batches)),
                          parallel)
    worker.offload_optimizer = offloads_optimizer(cfg, opt, parallel.device)
    return worker
