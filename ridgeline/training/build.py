"""Building the policy and reference workers from the config: one code for the single process
(`ridgeline.trainer`) and for every FSDP2 rank (`ridgeline.distributed.ray_workers`)."""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch
from omegaconf import DictConfig

from ridgeline.algorithms import resolve_kl_estimator
from ridgeline.models.forward import enable_activation_checkpointing, prefer_eager_attention
from ridgeline.models.loading import ModelSpec, cpu_has_fast_bf16, load_model, policy_spec
from ridgeline.models.lora import lora_settings, wrap
from ridgeline.models.value_model import load_value_model
from ridgeline.training.critic_worker import CriticTrainConfig, CriticWorker
from ridgeline.training.forward_path import ForwardOptions
from ridgeline.training.optim import build_optimizer, build_scheduler
from ridgeline.training.worker import BaseModelRefWorker, PolicyTrainConfig, PolicyWorker, RefWorker


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    if mixed_precision == "fp32":
        return None
    if mixed_precision == "bf16":
        return torch.bfloat16
    fast = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else cpu_has_fast_bf16()
    return torch.bfloat16 if fast else None


def training_max_tokens(cfg: DictConfig) -> int:
    """The longest row a training forward can see: the longest prompt (or multi-turn input) plus
    the longest generation."""
    g = cfg.generator
    return max(int(cfg.trainer.max_prompt_length), int(g.max_input_length)) + int(g.sampling_params.max_generate_length)


def load_training_model(cfg: DictConfig, spec: ModelSpec, dtype: torch.dtype, tokenizer):
    """A model for the training-side workers: eager attention on a CPU when rows are short
    (`prefer_eager_attention`: SDPA's CPU kernel is slower there)."""
    model = load_model(spec, dtype, tokenizer)
    prefer_eager_attention(model, training_max_tokens(cfg))
    return model


def forward_options(cfg: DictConfig) -> ForwardOptions:
    """`trainer.use_sample_packing`: micro-batches whose rows do not share a prompt run packed
    (ridgeline.training.forward_path has the rule and its measurements)."""
    return ForwardOptions(sample_packing=bool(cfg.trainer.use_sample_packing))


def policy_train_config(cfg: DictConfig, data_parallel: int = 1) -> PolicyTrainConfig:
    """The policy worker's settings; with `data_parallel` ranks each holds 1/data_parallel of every
    mini-batch (validation made the division exact)."""
    t, g, alg = cfg.trainer, cfg.generator, cfg.trainer.algorithm
    return PolicyTrainConfig(
        mini_batch_size=t.policy_mini_batch_size * g.n_samples_per_prompt // data_parallel,
        micro_batch_size=t.micro_train_batch_size_per_gpu,
        micro_forward_batch_size=t.micro_forward_batch_size_per_gpu,
        update_epochs=t.update_epochs_per_batch,
        temperature=g.sampling_params.temperature,
        policy_loss=alg.policy_loss_type or alg.ppo_loss_type,
        loss_reduction=alg.loss_reduction,
        algorithm=alg,
        use_kl_loss=alg.use_kl_loss, kl_loss_coef=alg.kl_loss_coef,
        kl_estimator=resolve_kl_estimator(alg.kl_estimator_type, alg.use_kl_estimator_k3, alg.use_abs_kl),
        use_entropy_loss=alg.use_entropy_loss, entropy_loss_coef=alg.entropy_loss_coef,
        max_grad_norm=t.policy.optimizer_config.max_grad_norm,
        autocast_dtype=training_autocast_dtype(t.mixed_precision),
        nonfinite_loss=t.nonfinite_loss,
        forward_options=forward_options(cfg),
    )


ModelHook = Callable[[torch.nn.Module], torch.nn.Module]


def build_policy_worker(cfg: DictConfig, tokenizer, *, shard: ModelHook | None = None,
                        worker_cls: type[PolicyWorker] = PolicyWorker, data_parallel: int = 1) -> PolicyWorker:
    """The policy model (float32 master weights) with its optimizer and schedule. With
    `trainer.policy.model.lora.rank > 0` the model is wrapped with LoRA adapters (after activation
    checkpointing is set up, which peft needs to know) and the optimizer holds only the adapters.
    `shard` (FSDP2) runs after that and before the optimizer is built, so the optimizer holds the
    sharded parameters."""
    t = cfg.trainer
    model = load_training_model(cfg, policy_spec(cfg), torch.float32, tokenizer)
    if t.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.config.use_cache = False
    lora = lora_settings(cfg)
    if lora is not None:
        model = wrap(model, lora, seed=t.seed)
    if shard is not None:
        model = shard(model)
    opt = t.policy.optimizer_config
    optimizer = build_optimizer(model, opt.lr, tuple(opt.adam_betas), opt.weight_decay)
    return worker_cls(model, policy_train_config(cfg, data_parallel), optimizer,
                      build_scheduler(optimizer, t.num_warmup_steps))


def needs_ref(cfg: DictConfig) -> bool:
    alg = cfg.trainer.algorithm
    return bool(alg.use_kl_loss or alg.use_kl_in_reward)


def build_ref_worker(cfg: DictConfig, tokenizer, *, policy: PolicyWorker | None = None,
                     shard: ModelHook | None = None, worker_cls: type[RefWorker] = RefWorker) -> RefWorker | None:
    """The reference model when a KL option needs one. It only runs forward passes, so it is
    loaded in the training compute dtype. With LoRA the reference is the frozen base the policy
    wraps: `policy`'s own model with its adapters switched off, no second copy loaded."""
    if not needs_ref(cfg):
        return None
    t = cfg.trainer
    autocast = training_autocast_dtype(t.mixed_precision)
    if lora_settings(cfg) is not None:
        if policy is None:
            raise ValueError("with trainer.policy.model.lora.rank > 0 the reference is the policy's base model: "
                             "build_ref_worker needs the policy worker (policy=...)")
        return BaseModelRefWorker(policy.model, t.micro_forward_batch_size_per_gpu,
                                  cfg.generator.sampling_params.temperature, autocast,
                                  forward_options=forward_options(cfg))
    model = load_training_model(cfg, policy_spec(cfg), autocast or torch.float32, tokenizer)
    if shard is not None:
        model = shard(model)
    return worker_cls(model, t.micro_forward_batch_size_per_gpu, cfg.generator.sampling_params.temperature, autocast,
                      forward_options=forward_options(cfg))


def build_critic(cfg: DictConfig, tokenizer, *, shard: ModelHook | None = None,
                 worker_cls: type[CriticWorker] = CriticWorker,
                 options: ForwardOptions | None = None, data_parallel: int = 1) -> CriticWorker | None:
    """The value model and its worker, when `trainer.critic.model.path` names one. `shard`,
    `worker_cls`, `options` and `data_parallel` as for the policy (`options` defaults to the
    config's forward options)."""
    t, alg = cfg.trainer, cfg.trainer.algorithm
    if t.critic.model.path is None:
        return None
    autocast = training_autocast_dtype(t.mixed_precision)
    spec = ModelSpec(path=t.critic.model.path, gguf_file=t.critic.model.get("gguf_file"), seed=t.seed)
    model = load_value_model(spec, torch.float32, tokenizer, value_head_prefix=alg.value_head_prefix)
    prefer_eager_attention(model.backbone, training_max_tokens(cfg))
    if t.gradient_checkpointing:
        model.enable_activation_checkpointing()
    if shard is not None:
        model = shard(model)
    opt = t.critic.optimizer_config
    optimizer = build_optimizer(model, opt.lr, tuple(opt.adam_betas), opt.weight_decay)
    config = CriticTrainConfig(
        mini_batch_size=t.critic_mini_batch_size * cfg.generator.n_samples_per_prompt // data_parallel,
        micro_batch_size=t.micro_train_batch_size_per_gpu,
        micro_forward_batch_size=t.micro_forward_batch_size_per_gpu,
        update_epochs=t.update_epochs_per_batch, value_clip=alg.value_clip,
        loss_reduction=alg.loss_reduction, max_grad_norm=opt.max_grad_norm, autocast_dtype=autocast,
        nonfinite_loss=t.nonfinite_loss, forward_options=options or forward_options(cfg))
    return worker_cls(model, config, optimizer, build_scheduler(optimizer, t.num_warmup_steps))
