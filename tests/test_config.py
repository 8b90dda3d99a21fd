"""Config loading and validation: defaults, presets, overrides, and the error messages."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from ridgeline.config import (
    CONFIG_DIR,
    ConfigError,
    base_config,
    default_backend,
    load_config,
    unbuilt_defaults,
    validate_config,
)
from ridgeline.config import support
from ridgeline.inference.types import SamplingParams
from conftest import HANG_GUARD_S

# overrides that make the base config runnable on the current build
RUNNABLE = ["trainer.strategy=single", "generator.backend=hf", "trainer.logger=console"]

HOME = os.environ.get("HOME", "")

# Every key promised by CONFIG_REFERENCE.md with its default ("$HOME" is expanded).
REFERENCE_DEFAULTS: list[tuple[str, object]] = [
    # data
    ("data.train_data", ["$HOME/data/gsm8k/train.parquet"]),
    ("data.val_data", ["$HOME/data/gsm8k/validation.parquet"]),
    # trainer (general)
    ("trainer.strategy", "fsdp2"),
    ("trainer.epochs", 1),
    ("trainer.update_epochs_per_batch", 1),
    ("trainer.train_batch_size", 1024),
    ("trainer.policy_mini_batch_size", 256),
    ("trainer.critic_mini_batch_size", 256),
    ("trainer.micro_train_batch_size_per_gpu", 1),
    ("trainer.micro_forward_batch_size_per_gpu", 1),
    ("trainer.update_ref_every_epoch", False),
    ("trainer.num_warmup_steps", 0),
    ("trainer.use_sample_packing", True),
    ("trainer.max_prompt_length", 512),
    ("trainer.gradient_checkpointing", True),
    ("trainer.seed", 42),
    ("trainer.eval_batch_size", 1024),
    ("trainer.eval_before_train", True),
    ("trainer.eval_interval", 5),
    ("trainer.resume_mode", "latest"),
    ("trainer.resume_path", None),
    ("trainer.ckpt_path", "$HOME/ckpts/"),
    ("trainer.max_ckpts_to_keep", -1),
    ("trainer.ckpt_interval", 10),
    ("trainer.hf_save_interval", -1),
    ("trainer.export_path", "$HOME/exports/"),
    ("trainer.project_name", "skyrl"),
    ("trainer.run_name", "test_run"),
    ("trainer.logger", "wandb"),
    ("trainer.dump_data_batch", False),
    ("trainer.dump_eval_results", True),
    # trainer.placement
    ("trainer.placement.colocate_all", True),
    ("trainer.placement.colocate_policy_ref", True),
    ("trainer.placement.colocate_critic_reward", False),
    ("trainer.placement.policy_num_nodes", 1),
    ("trainer.placement.policy_num_gpus_per_node", 4),
    ("trainer.placement.critic_num_nodes", 1),
    ("trainer.placement.critic_num_gpus_per_node", 4),
    ("trainer.placement.ref_num_nodes", 1),
    ("trainer.placement.ref_num_gpus_per_node", 4),
    ("trainer.placement.reward_num_nodes", 1),
    ("trainer.placement.reward_num_gpus_per_node", 4),
    # trainer.policy
    ("trainer.policy.model.path", "Qwen/Qwen2.5-1.5B-Instruct"),
    ("trainer.policy.optimizer_config.lr", 1.0e-6),
    ("trainer.policy.optimizer_config.adam_betas", [0.9, 0.999]),
    ("trainer.policy.optimizer_config.weight_decay", 1e-2),
    ("trainer.policy.optimizer_config.max_grad_norm", 1.0),
    ("trainer.policy.optimizer_config.offload_after_step", True),
    ("trainer.policy.optimizer_config.num_warmup_steps", 0),      # SkyRL 0.3.1
    ("trainer.policy.optimizer_config.scheduler", "constant_with_warmup"),
    ("trainer.policy.fsdp_config.cpu_offload", False),
    ("trainer.policy.fsdp_config.reshard_after_forward", True),
    ("trainer.policy.fsdp_config.fsdp_size", -1),
    ("trainer.policy.sequence_parallel_size", 1),
    ("trainer.policy.use_torch_compile", False),
    ("trainer.policy.record_memory", False),
    # trainer.critic
    ("trainer.critic.model.path", None),
    ("trainer.critic.optimizer_config.lr", 5.0e-6),
    ("trainer.critic.optimizer_config.adam_betas", [0.9, 0.999]),
    ("trainer.critic.optimizer_config.weight_decay", 1e-2),
    ("trainer.critic.optimizer_config.max_grad_norm", 1.0),
    ("trainer.critic.optimizer_config.offload_after_step", True),
    ("trainer.critic.optimizer_config.num_warmup_steps", 0),
    ("trainer.critic.optimizer_config.scheduler", "constant_with_warmup"),
    ("trainer.critic.fsdp_config.cpu_offload", False),
    ("trainer.critic.fsdp_config.reshard_after_forward", True),
    ("trainer.critic.fsdp_config.fsdp_size", -1),
    ("trainer.critic.sequence_parallel_size", 1),
    # trainer.ref
    ("trainer.ref.fsdp_config.cpu_offload", True),
    ("trainer.ref.fsdp_config.reshard_after_forward", True),
    ("trainer.ref.fsdp_config.fsdp_size", -1),
    ("trainer.ref.sequence_parallel_size", 1),
    # trainer.algorithm
    ("trainer.algorithm.advantage_estimator", "grpo"),
    ("trainer.algorithm.grpo_norm_by_std", True),
    ("trainer.algorithm.use_kl_estimator_k3", True),
    ("trainer.algorithm.use_abs_kl", False),
    ("trainer.algorithm.kl_estimator_type", None),
    ("trainer.algorithm.use_kl_in_reward", False),
    ("trainer.algorithm.use_kl_loss", True),
    ("trainer.algorithm.kl_loss_coef", 0.001),
    ("trainer.algorithm.kl_ctrl.type", "fixed"),
    ("trainer.algorithm.kl_ctrl.kl_target", 0.1),
    ("trainer.algorithm.kl_ctrl.horizon", 10000),
    ("trainer.algorithm.use_entropy_loss", False),
    ("trainer.algorithm.entropy_loss_coef", 0.01),
    ("trainer.algorithm.advantage_batch_normalize", False),
    ("trainer.algorithm.value_head_prefix", "value_head"),
    ("trainer.algorithm.ppo_loss_type", "regular"),
    ("trainer.algorithm.policy_loss_type", None),
    ("trainer.algorithm.loss_reduction", "token_mean"),
    ("trainer.algorithm.lambd", 1.0),
    ("trainer.algorithm.gamma", 1.0),
    ("trainer.algorithm.eps_clip_low", 0.2),
    ("trainer.algorithm.eps_clip_high", 0.2),
    ("trainer.algorithm.clip_ratio_c", 3.0),
    ("trainer.algorithm.value_clip", 0.2),
    ("trainer.algorithm.normalize_reward", True),
    ("trainer.algorithm.dynamic_sampling.type", None),
    ("trainer.algorithm.dynamic_sampling.max_sample_batches", 30),
    ("trainer.algorithm.dynamic_sampling.min_replace_ratio", 0.3),
    ("trainer.algorithm.use_tis", False),
    ("trainer.algorithm.tis_imp_ratio_cap", -1.0),
    # generator
    ("generator.model_dtype", "bfloat16"),
    ("generator.run_engines_locally", True),
    ("generator.num_inference_engines", 1),
    ("generator.weight_sync_backend", "nccl"),
    ("generator.weight_sync_timeout", 60),
    ("generator.inference_engine_tensor_parallel_size", 4),
    ("generator.inference_engine_pipeline_parallel_size", 1),   # SkyRL 0.3.1
    ("generator.inference_engine_expert_parallel_size", 1),     # SkyRL 0.3.1
    ("generator.inference_engine_data_parallel_size", 1),       # SkyRL 0.3.1
    ("generator.vllm_v1_disable_multiproc", True),              # SkyRL 0.3.1
    ("generator.fully_sharded_loras", False),                   # SkyRL 0.3.1
    ("generator.step_wise_trajectories", False),                # SkyRL 0.3.1
    ("generator.n_samples_per_prompt", 5),
    ("generator.async_engine", True),
    ("generator.batched", True),
    ("generator.max_input_length", 512),  # ${trainer.max_prompt_length}
    ("generator.enable_prefix_caching", True),
    ("generator.enable_chunked_prefill", True),
    ("generator.max_num_batched_tokens", 8192),
    ("generator.enforce_eager", False),
    ("generator.gpu_memory_utilization", 0.8),
    ("generator.max_num_seqs", 1024),
    ("generator.remote_inference_engine_urls", ["127.0.0.1:8001"]),
    ("generator.max_turns", 1),
    ("generator.override_existing_update_group", "auto"),
    ("generator.engine_init_kwargs", {}),
    ("generator.sampling_params.max_generate_length", 1024),
    ("generator.sampling_params.temperature", 1.0),
    ("generator.sampling_params.top_p", 1.0),
    ("generator.sampling_params.min_p", 0.0),
    ("generator.sampling_params.top_k", -1),
    ("generator.use_conversation_multi_turn", False),
    ("generator.chat_template.source", "name"),          # SkyRL 0.3.1
    ("generator.chat_template.name_or_path", None),
    ("generator.chat_template_kwargs", {}),
    ("generator.eval_sampling_params.max_generate_length", 1024),  # follows sampling_params
    ("generator.eval_sampling_params.temperature", 1.0),
    ("generator.eval_sampling_params.top_p", 1.0),
    ("generator.eval_sampling_params.min_p", 0.0),
    ("generator.eval_sampling_params.top_k", -1),
    ("generator.eval_n_samples_per_prompt", 1),
    ("generator.zero_reward_on_non_stop", False),
    ("generator.apply_overlong_filtering", False),
    # environment
    ("environment.env_class", "gsm8k"),
    # SkyRL 0.3.1's skyrl_gym_config/default.yaml (0.4's SkyRLGymConfig has the same values)
    ("environment.skyrl_gym", {"max_env_workers": 32, "text2sql": {"db_path": "/home/ray/default/sql_data"},
                               "llm_as_a_judge": {"model": "gpt-4o-mini", "base_url": None},
                               "search": {"log_requests": False, "search_url": "http://127.0.0.1:8000/retrieve",
                                          "topk": 3, "timeout": 30}}),
]

# SkyRL 0.4 keys with a field here (the rest of 0.4's keys: tests/test_skyrl_config_keys.py), with 0.4's defaults
LATER_DEFAULTS: list[tuple[str, object]] = [
    ("trainer.max_training_steps", None),
    ("trainer.log_path", "/tmp/skyrl-logs"),
    ("trainer.critic.fsdp_config.mixed_precision.buffer_dtype", "fp32"),
    ("trainer.critic.fsdp_config.mixed_precision.param_dtype", "bf16"),
    ("trainer.critic.fsdp_config.mixed_precision.reduce_dtype", "fp32"),
    ("trainer.policy.fsdp_config.mixed_precision.buffer_dtype", "fp32"),
    ("trainer.policy.fsdp_config.mixed_precision.param_dtype", "bf16"),
    ("trainer.policy.fsdp_config.mixed_precision.reduce_dtype", "fp32"),
    ("trainer.policy.torch_profiler_config.active", 1),
    ("trainer.policy.torch_profiler_config.activities", ["cpu", "cuda"]),
    ("trainer.policy.torch_profiler_config.enable", False),
    ("trainer.policy.torch_profiler_config.export_type", "chrome_trace"),
    ("trainer.policy.torch_profiler_config.profile_memory", False),
    ("trainer.policy.torch_profiler_config.ranks", [0]),
    ("trainer.policy.torch_profiler_config.record_shapes", True),
    ("trainer.policy.torch_profiler_config.repeat", 1),
    ("trainer.policy.torch_profiler_config.save_path", None),
    ("trainer.policy.torch_profiler_config.skip_first", 10),
    ("trainer.policy.torch_profiler_config.use_gzip", False),
    ("trainer.policy.torch_profiler_config.wait", 0),
    ("trainer.policy.torch_profiler_config.warmup", 1),
    ("trainer.policy.torch_profiler_config.with_flops", False),
    ("trainer.policy.torch_profiler_config.with_modules", False),
    ("trainer.policy.torch_profiler_config.with_stack", True),
    ("trainer.ref.fsdp_config.mixed_precision.buffer_dtype", "fp32"),
    ("trainer.ref.fsdp_config.mixed_precision.param_dtype", "bf16"),
    ("trainer.ref.fsdp_config.mixed_precision.reduce_dtype", "fp32"),
]


# Ridgeline extensions and their defaults
EXTENSION_DEFAULTS: list[tuple[str, object]] = [
    ("data.prepare", None),
    ("trainer.policy.model.gguf_file", None),
    ("trainer.critic.model.gguf_file", None),
    ("trainer.run_dir", "$HOME/exports//test_run"),
    ("trainer.max_steps", None),
    ("trainer.mixed_precision", "auto"),
    ("trainer.device", "auto"),
    ("trainer.flash_attn", True),
    # multi-process runs (docs/distributed.md)
    ("trainer.placement.timeout_s", 180),
    ("trainer.placement.actor_call_timeout_s", 3600),
    # remote engines (docs/engines.md)
    ("generator.remote_request_timeout_s", 600.0),
    ("generator.remote_max_retries", 3),
    # colocated GPU engines: CUDA IPC bucket size (SkyRL's name, beyond CONFIG_REFERENCE; docs/distributed.md)
    ("generator.weight_transfer_threshold_cuda_ipc_GB", 1.0),
    # checkpoints and faults (docs/checkpointing.md)
    ("trainer.resume_ignore_config_changes", False),
    ("trainer.ckpt_on_interrupt", False),
    ("trainer.async_mode", "sync"),             # docs/async.md
    ("trainer.nonfinite_loss", "skip"),
    ("trainer.check_memory", True),             # the memory estimate before loading (docs/troubleshooting.md)
    ("trainer.exports_per_run", False),         # SkyRL's shared export_path unless a preset asks (docs/checkpointing.md)
    # per-loss settings and DAPO overlong punishment (SkyRL's names, beyond CONFIG_REFERENCE)
    ("trainer.algorithm.cispo.cispo_eps_clip_low", 0.0),
    ("trainer.algorithm.cispo.cispo_eps_clip_high", 5.0),
    ("trainer.algorithm.clip_cov.clip_ratio", 0.0002),
    ("trainer.algorithm.clip_cov.clip_cov_lb", 1.0),
    ("trainer.algorithm.clip_cov.clip_cov_ub", 5.0),
    ("trainer.algorithm.kl_cov.kl_cov_frac", 0.2),
    ("trainer.algorithm.kl_cov.ppo_kl_coef", 1.0),
    ("trainer.algorithm.sapo.tau_pos", 1.0),
    ("trainer.algorithm.sapo.tau_neg", 1.05),
    ("trainer.algorithm.dro_beta", 0.05),   # Ridgeline's: the dro loss's beta (the Tinker API's)
    ("trainer.algorithm.overlong_buffer_len", None),
    ("trainer.algorithm.overlong_buffer_penalty_factor", 1.0),
    # user-registered algorithms and on-policy distillation (docs/algorithms.md)
    ("trainer.algorithm.algorithm_modules", []),
    ("trainer.algorithm.on_policy_distillation", False),
    # LoRA on the policy (SkyRL's names, beyond CONFIG_REFERENCE; docs/lora.md)
    ("trainer.policy.model.lora.rank", 0),
    ("trainer.policy.model.lora.alpha", 16.0),
    ("trainer.policy.model.lora.dropout", 0.0),
    ("trainer.policy.model.lora.target_modules", "all-linear"),
    # environments
    ("environment.step_timeout_s", 60.0),
    ("environment.max_env_error_fraction", 0.1),
    ("generator.max_observation_chars", 100_000),
    ("environment.env_modules", []),
    ("environment.reward_fn", None),
    ("environment.sandbox.allow_weak_isolation", False),
    ("environment.sandbox.packages", ["numpy"]),
    # `ridgeline sft` / `ridgeline dpo` (docs/sft_dpo.md)
    ("sft.messages_key", "messages"),
    ("sft.prompt_key", "prompt"),
    ("sft.response_key", "response"),
    ("sft.max_length", 2048),
    ("sft.eval_with_env", False),
    ("dpo.beta", 0.1),
    ("dpo.pairs", "file"),
    ("dpo.loss_type", "sigmoid"),
    ("dpo.prompt_key", "prompt"),
    ("dpo.chosen_key", "chosen"),
    ("dpo.rejected_key", "rejected"),
    ("dpo.max_length", 2048),
    # SkyRL 0.3.1 sampling keys beyond CONFIG_REFERENCE (docs/config.md), with SkyRL's defaults
    ("generator.sampling_params.repetition_penalty", 1.0),
    ("generator.sampling_params.logprobs", None),
    ("generator.sampling_params.stop", None),
    ("generator.eval_sampling_params.repetition_penalty", 1.0),
    ("generator.eval_sampling_params.logprobs", None),
    ("generator.eval_sampling_params.stop", None),
    ("generator.append_eos_token_after_stop_str_in_multi_turn", True),
    # further SkyRL 0.3.1 keys beyond CONFIG_REFERENCE
    ("trainer.sequence_parallel_backend", "ulysses"),
    ("trainer.algorithm.zero_variance_filter", False),
    ("trainer.algorithm.zero_variance_filter_tol", 1e-6),
    ("trainer.algorithm.temperature", None),
    ("trainer.algorithm.max_seq_len", None),
    # SkyRL 0.3.1's HTTP endpoint of a training run (docs/engines.md)
    ("generator.model_name", "Qwen/Qwen2.5-1.5B-Instruct"),  # ${trainer.policy.model.path}
    ("generator.enable_http_endpoint", False),
    ("generator.http_endpoint_host", "127.0.0.1"),
    ("generator.http_endpoint_port", 8000),
    # SkyRL 0.3.1 model keys (docs/config.md)
    ("trainer.policy.model_config_kwargs", {}),
    ("trainer.ref.model_config_kwargs", {}),
    ("trainer.critic.model_config_kwargs", {}),
    ("trainer.ref.model.path", "Qwen/Qwen2.5-1.5B-Instruct"),   # follows trainer.policy.model.path
    ("trainer.rope_scaling", None),
    ("trainer.rope_theta", None),
    ("generator.rope_scaling", None),                           # follow trainer.rope_*
    ("generator.rope_theta", None),
    ("trainer.bf16", True),
    ("trainer.disable_fast_tokenizer", False),
    ("trainer.gradient_checkpointing_use_reentrant", False),
    ("trainer.policy.model.lora.exclude_modules", None),
    ("trainer.policy.model.lora.init_method", "kaiming"),
    ("trainer.policy.model.lora.lora_sync_path", "/tmp/skyrl_lora_sync"),
    # SkyRL 0.3.1's fully asynchronous trainer's knobs (read with trainer.async_mode=fully_async; docs/async.md)
    ("trainer.fully_async.max_staleness_steps", 4),
    ("trainer.fully_async.num_parallel_generation_workers", 768),
    # LoRA on the critic's backbone (SkyRL 0.3.1's keys: the policy's but lora_sync_path; docs/lora.md)
    ("trainer.critic.model.lora.rank", 0),
    ("trainer.critic.model.lora.alpha", 16.0),
    ("trainer.critic.model.lora.dropout", 0.0),
    ("trainer.critic.model.lora.target_modules", "all-linear"),
    ("trainer.critic.model.lora.exclude_modules", None),
    ("trainer.critic.model.lora.init_method", "kaiming"),
    # SkyRL 0.4's off-policy correction, dppo and CISPO anchor keys, with 0.4's defaults (docs/algorithms.md)
    ("trainer.algorithm.off_policy_correction.tis_ratio_type", None),
    ("trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high", 2.0),
    ("trainer.algorithm.off_policy_correction.sequence_tis_ratio_clip_high", 5.0),
    ("trainer.algorithm.off_policy_correction.sequence_mask_metric", None),
    ("trainer.algorithm.off_policy_correction.geo_mask_high", 1.01),
    ("trainer.algorithm.off_policy_correction.geo_mask_low", 0.99),
    ("trainer.algorithm.off_policy_correction.product_mask_high", 2.0),
    ("trainer.algorithm.off_policy_correction.product_mask_low", 0.5),
    ("trainer.algorithm.off_policy_correction.outlier_token_is_threshold_low", None),
    ("trainer.algorithm.off_policy_correction.outlier_token_is_threshold_high", None),
    ("trainer.algorithm.off_policy_correction.token_mask_is_threshold_low", None),
    ("trainer.algorithm.off_policy_correction.token_mask_is_threshold_high", None),
    ("trainer.algorithm.cispo.cispo_anchor", "old"),
    ("trainer.algorithm.dppo.dppo_type", "binary_tv"),
    ("trainer.algorithm.dppo.delta_low", 0.2),
    ("trainer.algorithm.dppo.delta_high", 0.2),
]


def _expand(value):
    if isinstance(value, str):
        return value.replace("$HOME", HOME)
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    return info.value


@pytest.fixture(scope="module")
def runnable_cfg():
    return load_config(RUNNABLE)


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("key, meant", [
    ("trainer.polcy.optimizer_config.lr", "trainer.policy.optimizer_config.lr"),   # a misspelt section
    ("trainer.n_samples_per_prompt", "generator.n_samples_per_prompt"),            # the right name elsewhere
    ("generator.sampling_params.temprature", "generator.sampling_params.temperature"),
    ("trainer.epoch", "trainer.epochs"),
    # SkyRL keys with no counterpart here: a suggestion would name a key that means something else
    ("trainer.bf16", None), ("trainer.policy.model.lora.init_method", None), ("trainer.gpu_type", None),
    # the same name of a sibling model is another setting, and so is a name one word longer
    ("trainer.ref.model.lora.alpha", None), ("trainer.algorithm.zero_variance_filter_tol", None),
    ("generator.eval_sampling_params.additional_kwargs", None),
])
def test_suggestions_for_unknown_keys_only_name_keys_that_mean_the_same(key, meant):
    from ridgeline.config.validate import suggest_key
    assert suggest_key(key) == meant


def test_megatron_and_deepspeed_settings_are_named_once_with_their_backend():
    err = _error(RUNNABLE + ["trainer.policy.megatron_config.tensor_model_parallel_size=2",
                             "trainer.ref.megatron_config.context_parallel_size=1",
                             "deepspeed_config.train.zero_optimization.sub_group_size=1"])
    assert len(err.problems) == 2, err.problems
    assert ("trainer.policy.megatron_config, trainer.ref.megatron_config configure megatron, which is not planned "
            "(trainer.strategy=single)") in str(err)
    assert "deepspeed_config configure deepspeed, which is not planned" in str(err)
    err = _error(RUNNABLE + ["trainer.strategy=megatron", "trainer.policy.megatron_config.tensor_model_parallel_size=2"])
    assert len(err.problems) == 1 and err.problems[0].startswith("trainer.strategy=megatron: Megatron and DeepSpeed "
                                                                 "are not planned")
    assert "not built" not in err.problems[0]   # one verdict per refusal


def test_warmup_per_model_as_skyrl_0_3_1_sets_it():
    from ridgeline.training.build import warmup_steps
    cfg = load_config(RUNNABLE + ["trainer.policy.optimizer_config.num_warmup_steps=5"])
    assert warmup_steps(cfg, cfg.trainer.policy.optimizer_config) == 5
    cfg = load_config(RUNNABLE + ["trainer.num_warmup_steps=3"])  # the seed documents' key
    assert warmup_steps(cfg, cfg.trainer.policy.optimizer_config) == 3
    err = _error(RUNNABLE + ["trainer.policy.optimizer_config.num_warmup_steps=5", "trainer.num_warmup_steps=3"])
    assert "trainer.policy.optimizer_config.num_warmup_steps=5 and trainer.num_warmup_steps=3 both set" in str(err)


def test_every_schedule_transformers_builds_from_warmup_and_length_is_accepted_the_others_refused():
    from ridgeline.training.optim import LR_SCHEDULES
    for name in LR_SCHEDULES:
        load_config(RUNNABLE + [f"trainer.policy.optimizer_config.scheduler={name}",
                                f"trainer.critic.optimizer_config.scheduler={name}"])
    built = ("constant_with_warmup, constant, linear, cosine, cosine_with_restarts, polynomial or inverse_sqrt")
    key = "trainer.critic.optimizer_config.scheduler"
    err = _error(RUNNABLE + [f"{key}=reduce_lr_on_plateau"])
    assert err.problems == [f"{key}=reduce_lr_on_plateau needs a metric to step on, which SkyRL 0.3.1 does not pass "
                            f"to transformers' get_scheduler either: the schedules built are {built}. "
                            f"Fix: e.g. {key}=cosine."]
    assert "needs num_decay_steps" in str(_error(RUNNABLE + [f"{key}=warmup_stable_decay"]))
    assert "needs min_lr or min_lr_rate" in str(_error(RUNNABLE + [f"{key}=cosine_with_min_lr"]))
    err = _error(RUNNABLE + [f"{key}=cosin"])
    assert err.problems == [f"{key}=cosin is not a learning-rate schedule: the schedules built are transformers' "
                            f"{built}. Did you mean cosine? Fix: e.g. {key}=cosine."]
    key = "trainer.policy.optimizer_config.scheduler"
    err = _error(RUNNABLE + [f"{key}=constant", "trainer.num_warmup_steps=10"])
    assert err.problems == [f"{key}=constant has no warmup, so the policy's num_warmup_steps=10 would be ignored. "
                            f"Fix: {key}=constant_with_warmup, or num_warmup_steps=0."]
    err = _error(RUNNABLE + [f"{key}=polynomial", "trainer.policy.optimizer_config.lr=1e-7"])
    assert err.problems == [f"{key}=polynomial decays to transformers' lr_end=1e-07, which must be below "
                            f"trainer.policy.optimizer_config.lr=1e-07. Fix: a larger lr, or {key}=linear (decays to 0)."]


def test_later_skyrl_releases_renamed_keys_are_read_without_a_notice(caplog):
    """SkyRL's typed config moved the engine keys under generator.inference_engine and renamed
    use_sample_packing: read as the 0.3.1 keys, both releases' names quietly (no line per key per run)."""
    with caplog.at_level("INFO", logger="ridgeline.config.loader"):
        cfg = load_config(RUNNABLE + ["generator.inference_engine.num_engines=2",
                                      "generator.inference_engine.tensor_parallel_size=1",
                                      "generator.inference_engine.engine_init_kwargs.attn_implementation=eager",
                                      "trainer.remove_microbatch_padding=false"])
    assert cfg.generator.num_inference_engines == 2 and cfg.trainer.use_sample_packing is False
    assert cfg.generator.engine_init_kwargs["attn_implementation"] == "eager"
    assert "inference_engine" not in caplog.text
    cfg = load_config(RUNNABLE + ["generator.backend=vllm", "generator.inference_engine.data_parallel_size=2",
                                  "trainer.strategy=fsdp2", "trainer.placement.colocate_all=false"])
    assert cfg.generator.inference_engine_data_parallel_size == 2
    # a later key of a feature not built is refused naming it, without a misleading suggestion
    err = _error(RUNNABLE + ["generator.inference_engine.enable_return_routed_experts=true"])
    assert err.problems == ["generator.inference_engine.enable_return_routed_experts=true asks for MoE routing replay, "
                            "which is not built. Fix: remove it (at SkyRL 0.4's default it asks for nothing)."]
    # both names of one setting: fine when they agree, refused when they do not
    cfg = load_config(RUNNABLE + ["generator.inference_engine.num_engines=2", "generator.num_inference_engines=2"])
    assert cfg.generator.num_inference_engines == 2
    err = _error(RUNNABLE + ["generator.inference_engine.num_engines=2", "generator.num_inference_engines=4"])
    assert ("generator.inference_engine.num_engines=2 and generator.num_inference_engines=4 are the same setting"
            in str(err))


def test_skyrl_0_3_1_deprecated_lora_keys_are_read_as_the_policys_with_a_notice(caplog):
    """trainer.target_modules / exclude_modules: 0.3.1 keeps them, deprecated in favour of
    trainer.policy.model.lora.*; read as those, null (their default) sets nothing, both set is refused."""
    lora = "trainer.policy.model.lora"
    with caplog.at_level("INFO", logger="ridgeline.config.loader"):
        cfg = load_config(RUNNABLE + ["trainer.target_modules=[q_proj,v_proj]", "trainer.exclude_modules=null"])
    assert list(cfg.trainer.policy.model.lora.target_modules) == ["q_proj", "v_proj"]
    assert cfg.trainer.policy.model.lora.exclude_modules is None and "target_modules" not in vars(cfg.trainer)
    assert "target_modules" not in caplog.text   # read quietly
    err = _error(RUNNABLE + ["trainer.exclude_modules=[k_proj]", f"{lora}.exclude_modules=[q_proj]"])
    assert err.problems == [f"trainer.exclude_modules=[k_proj] and {lora}.exclude_modules=[q_proj] are the same "
                            "setting (SkyRL 0.3.1's deprecated spelling and the key that replaced it) and disagree. "
                            "Fix: keep one of them."]


def test_the_dapo_examples_overlong_buffer_keys_are_read_as_ridgelines(caplog):
    """SkyRL's DAPO entry point adds +trainer.algorithm.overlong_buffer.{len,penalty_factor}; Ridgeline
    has the same punishment built in under overlong_buffer_len / overlong_buffer_penalty_factor."""
    alg = "trainer.algorithm"
    with caplog.at_level("INFO", logger="ridgeline.config.loader"):
        cfg = load_config(RUNNABLE + ["generator.sampling_params.max_generate_length=64",
                                      f"+{alg}.overlong_buffer.len=16", f"+{alg}.overlong_buffer.penalty_factor=0.5"])
    assert (cfg.trainer.algorithm.overlong_buffer_len, cfg.trainer.algorithm.overlong_buffer_penalty_factor) == (16, 0.5)
    assert "overlong_buffer" not in caplog.text   # read quietly
    err = _error(RUNNABLE + [f"+{alg}.overlong_buffer.len=16", f"{alg}.overlong_buffer_len=8"])
    assert err.problems == [f"{alg}.overlong_buffer.len=16 and {alg}.overlong_buffer_len=8 are the same setting (the "
                            "key of SkyRL 0.3.1's DAPO example entry point (examples/algorithms/dapo/main_dapo.py) and "
                            "Ridgeline's) and disagree. Fix: keep one of them."]


def test_the_fully_async_knobs_are_read_in_fully_async_mode_and_refused_when_changed_without_it():
    cfg = load_config(RUNNABLE + ["trainer.fully_async.max_staleness_steps=4"])
    assert (cfg.trainer.fully_async.max_staleness_steps, cfg.trainer.fully_async.num_parallel_generation_workers) == (4, 768)
    assert cfg.trainer.async_mode == "sync"
    err = _error(RUNNABLE + ["trainer.fully_async.max_staleness_steps=2"])
    assert err.problems == ["trainer.fully_async.max_staleness_steps=2 is read only by the fully asynchronous trainer "
                            "(SkyRL's examples.fully_async.main_async), and trainer.async_mode=sync. Fix: add "
                            "trainer.async_mode=fully_async, or drop trainer.fully_async.max_staleness_steps."]


@pytest.mark.parametrize("overrides, key, words", [
    (["trainer.bf16=false", "trainer.mixed_precision=bf16"], "trainer.bf16", "say the same thing and disagree"),
    (["trainer.rope_scaling={factor: 2.0}"], "trainer.rope_scaling", "a map naming its rope_type"),
    (["generator.rope_theta=0"], "generator.rope_theta", "the positive RoPE base frequency"),
    (["trainer.policy.model.lora.init_method=pissa"], "trainer.policy.model.lora.init_method", "rewrites the base"),
    (["trainer.policy.model.lora.init_method=eva"], "trainer.policy.model.lora.init_method", "a pass over training"),
    (["trainer.policy.model.lora.init_method=xavier"], "trainer.policy.model.lora.init_method", "Megatron"),
    (["trainer.policy.model.lora.init_method=orthogonal", "trainer.policy.model.lora.rank=5"],
     "trainer.policy.model.lora.init_method", "needs an even"),
    (["trainer.policy.model.lora.exclude_modules=[]"], "trainer.policy.model.lora.exclude_modules", "must be null"),
    (["trainer.policy.model.lora.lora_sync_path=/data/lora"], "trainer.policy.model.lora.lora_sync_path",
     "merged weights"),
    (["trainer.ref.model.path=''"], "trainer.ref.model.path", "is empty"),
])
def test_bad_model_keys_are_refused_naming_the_key(overrides, key, words):
    err = _error(RUNNABLE + overrides)
    assert len(err.problems) == 1 and err.problems[0].startswith(key) and words in err.problems[0], err.problems
    assert "Fix: " in err.problems[0]


def test_model_keys_take_skyrl_values():
    cfg = load_config(RUNNABLE + [
        "trainer.policy.model_config_kwargs.attention_dropout=0.1", "+trainer.critic.model_config_kwargs.rms_norm_eps=1e-5",
        "trainer.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}",
        "trainer.rope_theta=1000000", "trainer.ref.model.path=Qwen/Qwen2.5-7B-Instruct", "trainer.bf16=false",
        "trainer.policy.model.lora.exclude_modules=.*lm_head", "trainer.policy.model.lora.init_method=gaussian"])
    assert cfg.generator.rope_scaling["factor"] == 4.0 and cfg.generator.rope_theta == 1000000  # follow the trainer's
    assert cfg.trainer.critic.model_config_kwargs["rms_norm_eps"] == 1e-5
    from ridgeline.config import unbuilt_defaults
    assert not any("lora_sync_path" in line for line in unbuilt_defaults(cfg))  # no LoRA: nothing to say
    lora = load_config(RUNNABLE + ["trainer.policy.model.lora.rank=8"])
    assert any(line.startswith("trainer.policy.model.lora.lora_sync_path=/tmp/skyrl_lora_sync: ")
               for line in unbuilt_defaults(lora))


def test_features_not_built_are_named_before_other_problems():
    """One sentence each for what this build does not have (Megatron, sequence parallelism), listed
    before the unrelated problems, whose messages may follow from them."""
    err = _error(RUNNABLE + ["trainer.epochs=0", "trainer.strategy=megatron", "trainer.policy.sequence_parallel_size=2"])
    assert {p.split("=")[0] for p in err.problems[:2]} == {"trainer.strategy", "trainer.policy.sequence_parallel_size"}
    assert "sequence parallelism is not built" in str(err) and "Megatron and DeepSpeed are not planned" in str(err)
    assert any(p.startswith("trainer.epochs=0") for p in err.problems[2:])


def test_the_base_config_itself_passes_validation():
    """SkyRL's defaults: fsdp2 on 4 policy GPUs, colocated with 1 engine of tensor parallelism 4."""
    cfg = load_config([])
    assert cfg.trainer.strategy == "fsdp2" and cfg.generator.inference_engine_tensor_parallel_size == 4


def test_base_config_loads_with_runnable_overrides(runnable_cfg):
    assert runnable_cfg.trainer.strategy == "single"
    assert runnable_cfg.generator.backend == "hf"
    assert runnable_cfg.trainer.logger == "console"
    assert "hydra" not in vars(runnable_cfg) and "defaults" not in vars(runnable_cfg)


@pytest.mark.parametrize("key,default", REFERENCE_DEFAULTS + EXTENSION_DEFAULTS + LATER_DEFAULTS)
def test_every_reference_key_has_its_default(runnable_cfg, key, default):
    overridden = {o.split("=")[0] for o in RUNNABLE}
    source = base_config() if key in overridden else OmegaConf.structured(runnable_cfg)
    value = _plain(OmegaConf.select(source, key, default="<absent>"))
    assert value == _expand(default), key
    assert type(value) is type(_expand(default)) or isinstance(value, float) and default == value


def test_schema_holds_no_key_outside_reference_and_extensions():
    from ridgeline.config.schema import leaf_fields

    promised = {k for k, _ in REFERENCE_DEFAULTS + EXTENSION_DEFAULTS + LATER_DEFAULTS} | {"generator.backend"}
    assert {key for key, _, _ in leaf_fields()} == promised


def test_backend_default_is_resolver():
    node = base_config().generator._get_node("backend")._value()
    assert node == "${ridgeline.default_backend:}"
    import torch

    expected = "vllm" if torch.cuda.is_available() else "hf"
    assert default_backend() == expected
    cfg = OmegaConf.create({"b": "${ridgeline.default_backend:}"})
    assert cfg.b == expected


def test_env_interpolation_resolves(runnable_cfg):
    assert runnable_cfg.trainer.ckpt_path == f"{HOME}/ckpts/"
    assert runnable_cfg.data.train_data[0].startswith(HOME + "/")


def test_missing_env_var_names_the_key(monkeypatch):
    monkeypatch.delenv("HOME", raising=False)
    err = _error(RUNNABLE)
    assert "trainer.ckpt_path" in str(err)
    assert "HOME" in str(err)


def test_interpolations_follow_overrides():
    cfg = load_config(RUNNABLE + ["trainer.max_prompt_length=100",
                                  "generator.sampling_params.max_generate_length=64",
                                  "trainer.run_name=abc"])
    assert cfg.generator.max_input_length == 100
    assert cfg.generator.eval_sampling_params.max_generate_length == 64
    assert cfg.trainer.run_dir.endswith("/abc")


def test_numeric_name_becomes_string():
    cfg = load_config(RUNNABLE + ["trainer.run_name=2024"])
    assert cfg.trainer.run_name == "2024"


def test_presets_and_free_form_maps():
    cfg = load_config(["+experiment=example_gsm8k"])
    assert cfg.trainer.strategy == "single" and cfg.generator.backend == "hf"
    assert cfg.data.prepare["dataset"] == "gsm8k"
    assert cfg.data.prepare["output_dir"] == f"{HOME}/data/gsm8k"
    cfg = load_config(RUNNABLE + ["+environment.skyrl_gym.text2sql.db_path=/tmp/db"])
    assert cfg.environment.skyrl_gym["text2sql"]["db_path"] == "/tmp/db"


def test_every_preset_loads():
    names = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    assert "example_gsm8k" in names
    # on_policy_distillation holds the algorithm's keys only: it needs a teacher (tests/test_distillation.py)
    needs = {"on_policy_distillation": ["trainer.ref.model.path=tiny://llama-small"]}
    for name in names:
        load_config([f"+experiment={name}", *needs.get(name, [])])


def test_unknown_preset_lists_presets():
    err = _error(RUNNABLE + ["+experiment=example_gsm"])
    assert "+experiment=example_gsm8k" in str(err)


def test_validate_config_accepts_loaded_config(runnable_cfg):
    validate_config(runnable_cfg)


# --------------------------------------------------------------------------- errors


def test_unknown_key_suggests_closest():
    err = _error(RUNNABLE + ["+trainer.algorithm.advantage_estimater=grpo"])
    assert "trainer.algorithm.advantage_estimater" in str(err)
    assert "trainer.algorithm.advantage_estimator" in str(err)


def test_unknown_key_without_plus_is_ours_not_hydras():
    err = _error(RUNNABLE + ["trainer.algorithm.advantage_estimatr=grpo"])
    assert "did you mean trainer.algorithm.advantage_estimator" in str(err)
    err = _error(RUNNABLE + ["trainer.n_samples_per_prompt=4"])
    assert "generator.n_samples_per_prompt" in str(err)


def test_free_form_keys_are_set_without_plus_as_skyrl_scripts_write_them():
    cfg = load_config(RUNNABLE + ["generator.backend=vllm", "generator.engine_init_kwargs.attention_backend=fa3",
                                  "environment.skyrl_gym.text2sql.db_path=/data/sql"])
    assert cfg.generator.engine_init_kwargs["attention_backend"] == "fa3"
    assert cfg.environment.skyrl_gym["text2sql"]["db_path"] == "/data/sql"
    # and the usual checks still apply to what was set
    err = _error(RUNNABLE + ["generator.engine_init_kwargs.attention_backend=fa3"])
    assert "generator.engine_init_kwargs has attention_backend, which the embedded hf engine does not take" in str(err)


def test_wrong_type():
    err = _error(RUNNABLE + ["trainer.train_batch_size=abc"])
    assert "trainer.train_batch_size=abc" in str(err)
    assert "integer" in str(err)
    err = _error(RUNNABLE + ["trainer.eval_before_train=1"])
    assert "trainer.eval_before_train" in str(err) and "boolean" in str(err)


def test_int_accepted_for_float_and_logger_list():
    cfg = load_config(RUNNABLE + ["trainer.policy.optimizer_config.lr=1",
                                  "trainer.logger=[console,jsonl]"])
    assert cfg.trainer.policy.optimizer_config.lr == 1


def test_bad_choice_suggests():
    err = _error(RUNNABLE + ["trainer.algorithm.loss_reduction=token_men"])
    assert "trainer.algorithm.loss_reduction=token_men" in str(err)
    assert "token_mean" in str(err)


def test_mini_batch_must_divide_train_batch():
    err = _error(RUNNABLE + ["trainer.train_batch_size=8", "trainer.policy_mini_batch_size=3"])
    msg = str(err)
    assert "trainer.policy_mini_batch_size=3" in msg and "trainer.train_batch_size=8" in msg
    assert "1, 2, 4 or 8" in msg


def test_uneven_rank_shares_and_micro_batches_are_accepted():
    """A share that does not split over the ranks is padded (tests/test_ray.py: rank_shares) and a
    smaller last micro-batch accumulates exactly (tests/test_training.py): neither is refused."""
    load_config(RUNNABLE + ["trainer.train_batch_size=8", "trainer.policy_mini_batch_size=4",
                            "generator.n_samples_per_prompt=5", "trainer.micro_train_batch_size_per_gpu=3"])
    load_config(RUNNABLE + ["trainer.strategy=fsdp2", "trainer.train_batch_size=8", "trainer.policy_mini_batch_size=1",
                            "generator.n_samples_per_prompt=2"])


def test_mini_batch_larger_than_train_batch():
    err = _error(RUNNABLE + ["trainer.train_batch_size=4", "trainer.policy_mini_batch_size=8"])
    assert "larger than trainer.train_batch_size=4" in str(err)


def test_kl_loss_and_kl_in_reward_exclusive():
    err = _error(RUNNABLE + ["trainer.algorithm.use_kl_in_reward=true"])
    assert any("use_kl_loss=true and trainer.algorithm.use_kl_in_reward=true" in p
               for p in err.problems)


def test_gae_needs_a_critic_and_a_critic_needs_gae():
    err = _error(RUNNABLE + ["trainer.algorithm.advantage_estimator=gae"])
    assert "advantage_estimator=gae needs a critic" in str(err)
    assert "Fix: trainer.critic.model.path=" in str(err)
    err = _error(RUNNABLE + ["trainer.critic.model.path=tiny://llama"])
    assert "advantage_estimator=grpo never reads its values" in str(err)
    load_config(RUNNABLE + ["trainer.algorithm.advantage_estimator=gae", "trainer.critic.model.path=tiny://llama"])


def test_critic_batch_sizes_are_checked_when_a_critic_exists():
    err = _error(RUNNABLE + ["trainer.algorithm.advantage_estimator=gae", "trainer.critic.model.path=tiny://llama",
                             "trainer.critic_mini_batch_size=300"])
    assert "trainer.critic_mini_batch_size=300 does not divide trainer.train_batch_size=1024" in str(err)


def test_update_ref_every_epoch_needs_a_kl_option():
    err = _error(RUNNABLE + ["trainer.update_ref_every_epoch=true", "trainer.algorithm.use_kl_loss=false"])
    assert "update_ref_every_epoch=true refreshes the reference model, but no KL option" in str(err)
    load_config(RUNNABLE + ["trainer.update_ref_every_epoch=true"])


def test_kl_in_reward_with_adaptive_controller():
    base = RUNNABLE + ["trainer.algorithm.use_kl_loss=false", "trainer.algorithm.use_kl_in_reward=true",
                       "trainer.algorithm.kl_ctrl.type=adaptive"]
    load_config(base)
    err = _error(base + ["trainer.algorithm.kl_ctrl.kl_target=0", "trainer.algorithm.kl_ctrl.horizon=-1"])
    assert len(err.problems) == 2 and "adaptive KL controller" in str(err)
    err = _error(base + ["trainer.algorithm.kl_ctrl.type=pid"])
    assert "kl_ctrl.type=pid is not a valid choice" in str(err)


def test_dynamic_sampling_settings():
    load_config(RUNNABLE + ["trainer.algorithm.dynamic_sampling.type=filter"])
    err = _error(RUNNABLE + ["trainer.algorithm.dynamic_sampling.type=filter", "generator.n_samples_per_prompt=1",
                             "trainer.algorithm.dynamic_sampling.max_sample_batches=0"])
    assert "a group of generator.n_samples_per_prompt=1 never does" in str(err)
    assert "max_sample_batches=0 must be at least 1" in str(err)
    err = _error(RUNNABLE + ["trainer.algorithm.dynamic_sampling.type=replace",
                             "trainer.algorithm.dynamic_sampling.min_replace_ratio=1.5"])
    assert "min_replace_ratio=1.5 must be in [0, 1]" in str(err)


def test_overlong_buffer_must_fit_the_generation_budget():
    load_config(RUNNABLE + ["trainer.algorithm.overlong_buffer_len=256"])
    err = _error(RUNNABLE + ["trainer.algorithm.overlong_buffer_len=2048",
                             "trainer.algorithm.overlong_buffer_penalty_factor=-1"])
    assert "overlong_buffer_len=2048 must be null (off) or a whole number of tokens from 1 to " \
           "generator.sampling_params.max_generate_length=1024" in str(err)
    assert "overlong_buffer_penalty_factor=-1" in str(err)


@pytest.mark.parametrize("loss,override,words", [
    ("dual_clip", "trainer.algorithm.clip_ratio_c=1.0", "greater than 1"),
    ("cispo", "trainer.algorithm.cispo.cispo_eps_clip_high=-1", "0 or more"),
    ("clip_cov", "trainer.algorithm.clip_cov.clip_ratio=0", "in (0, 1]"),
    ("clip_cov", "trainer.algorithm.clip_cov.clip_cov_lb=6.0", "must be below clip_cov_ub=5.0"),
    ("kl_cov", "trainer.algorithm.kl_cov.kl_cov_frac=2", "in (0, 1]"),
    ("sapo", "trainer.algorithm.sapo.tau_neg=0", "greater than 0"),
])
def test_settings_of_the_chosen_loss_are_checked(loss, override, words):
    load_config(RUNNABLE + [f"trainer.algorithm.policy_loss_type={loss}"])
    err = _error(RUNNABLE + [f"trainer.algorithm.policy_loss_type={loss}", override])
    assert words in str(err) and override.split("=")[0] in str(err)
    # another loss does not read them
    load_config(RUNNABLE + ["trainer.algorithm.policy_loss_type=regular", override])


def test_numbers_out_of_range():
    err = _error(RUNNABLE + ["generator.sampling_params.top_p=0", "trainer.epochs=0",
                             "generator.sampling_params.top_k=0",
                             "trainer.algorithm.eps_clip_low=1.0",
                             "trainer.policy.optimizer_config.lr=0"])
    msg = str(err)
    for key in ("generator.sampling_params.top_p", "trainer.epochs",
                "generator.sampling_params.top_k", "trainer.algorithm.eps_clip_low",
                "trainer.policy.optimizer_config.lr"):
        assert key in msg
    assert len(err.problems) == 5


def test_skyrl_sampling_keys_are_read_and_checked():
    cfg = load_config(RUNNABLE + ["generator.sampling_params.stop=['</sql>','</solution>']",
                                  "generator.sampling_params.repetition_penalty=1.1",
                                  "generator.eval_sampling_params.logprobs=3",
                                  "generator.append_eos_token_after_stop_str_in_multi_turn=false"])
    assert SamplingParams.from_config(cfg.generator.sampling_params) == SamplingParams(
        repetition_penalty=1.1, stop=("</sql>", "</solution>"), logprobs=None)
    assert SamplingParams.from_config(cfg.generator.eval_sampling_params).logprobs == 3
    assert cfg.generator.append_eos_token_after_stop_str_in_multi_turn is False

    err = _error(RUNNABLE + ["generator.sampling_params.stop='</sql>'",
                             "generator.eval_sampling_params.stop=['']",
                             "generator.sampling_params.logprobs=-1",
                             "generator.eval_sampling_params.logprobs=true",
                             "generator.sampling_params.repetition_penalty=0"])
    assert err.problems == [  # wrong types first (the schema's), then the values of the right type
        "generator.sampling_params.stop=</sql> has the wrong type: expected null or a list of strings, got a string. "
        "Fix: generator.sampling_params.stop=<list>, e.g. \"generator.sampling_params.stop=['</answer>']\" (quoted "
        "for the shell).",
        "generator.eval_sampling_params.logprobs=true has the wrong type: expected null or an integer, got a boolean. "
        "Fix: generator.eval_sampling_params.logprobs=<integer>, e.g. generator.eval_sampling_params.logprobs=5.",
        "generator.sampling_params.repetition_penalty=0.0 must be greater than 0 (1.0 is off; above 1 discourages "
        "repeating tokens). Fix: e.g. generator.sampling_params.repetition_penalty=1.0.",
        "generator.sampling_params.logprobs=-1 must be null or a whole number N >= 0: the engine then also returns "
        "the N most likely tokens of each position. Fix: generator.sampling_params.logprobs=null or e.g. "
        "generator.sampling_params.logprobs=5.",
        "generator.eval_sampling_params.stop=[''] must be null or a list of non-empty stop strings. Fix: e.g. "
        "\"generator.eval_sampling_params.stop=['</answer>']\" (quoted for the shell).",
    ]


def test_cuda_ipc_bucket_threshold_must_be_positive():
    err = _error(RUNNABLE + ["generator.weight_transfer_threshold_cuda_ipc_GB=0"])
    assert err.problems == ["generator.weight_transfer_threshold_cuda_ipc_GB=0.0 must be a positive number of GiB (the "
                            "largest CUDA IPC bucket of a colocated weight sync). Fix: e.g. "
                            "generator.weight_transfer_threshold_cuda_ipc_GB=1.0."]
    cfg = load_config(RUNNABLE + ["generator.weight_transfer_threshold_cuda_ipc_GB=2"])  # an int is a float here
    assert cfg.generator.weight_transfer_threshold_cuda_ipc_GB == 2


# --------------------------------------------------------------------------- not built yet


def test_base_defaults_are_checked_as_a_multi_process_run():
    """The base default strategy is fsdp2 (SkyRL's): 4 policy ranks colocated with engines whose
    devices are counted as engines x tensor parallelism; one engine of TP 1 does not fit, and the
    message says how to fix it."""
    err = _error(["generator.inference_engine_tensor_parallel_size=1"])
    msg = str(err)
    assert "trainer.placement.colocate_all=true shares the policy's 4 devices" in msg
    assert "Fix: generator.num_inference_engines=4, or trainer.placement.colocate_all=false" in msg
    assert "trainer.logger" not in msg  # every tracker is built; wandb runs offline without a key


def test_checkpoint_keys_are_checked():
    err = _error(RUNNABLE + ["trainer.resume_mode=from_path", "trainer.ckpt_interval=-3",
                             "trainer.max_ckpts_to_keep=0", "trainer.hf_save_interval=-5",
                             "trainer.nonfinite_loss=ignore"])
    msg = str(err)
    assert "trainer.resume_mode=from_path loads the checkpoint named by trainer.resume_path" in msg
    assert "trainer.ckpt_interval=-3 must be -1 or 0 (off) or a whole number N >= 1" in msg
    assert "trainer.max_ckpts_to_keep=0 must be -1 (keep all)" in msg
    assert "trainer.hf_save_interval=-5 must be -1 or 0 (off)" in msg
    # 0 is SkyRL's other spelling of off (0.4's scripts write ckpt_interval=0, eval_interval=0)
    cfg = load_config(RUNNABLE + ["trainer.ckpt_interval=0", "trainer.hf_save_interval=0", "trainer.eval_interval=0"])
    assert (cfg.trainer.ckpt_interval, cfg.trainer.hf_save_interval, cfg.trainer.eval_interval) == (0, 0, 0)
    assert "trainer.nonfinite_loss=ignore is not a valid choice" in msg
    assert len(err.problems) == 5 and msg.count("Fix:") == 5
    for mode in ("none", "latest"):
        load_config(RUNNABLE + [f"trainer.resume_mode={mode}"])
    # SkyRL's scripts write null for "start fresh" (its docs: null / "none"): accepted, and no resume
    from ridgeline.trainer.checkpoint import find_resume_checkpoint
    assert find_resume_checkpoint(load_config(RUNNABLE + ["trainer.resume_mode=null"])) is None
    load_config(RUNNABLE + ["trainer.resume_mode=from_path", "trainer.resume_path=/ckpts/global_step_10",
                            "trainer.ckpt_interval=1", "trainer.max_ckpts_to_keep=3", "trainer.hf_save_interval=5",
                            "trainer.nonfinite_loss=stop", "trainer.ckpt_on_interrupt=true",
                            "trainer.resume_ignore_config_changes=true"])


def test_multi_turn_keys_are_accepted():
    load_config(RUNNABLE + ["generator.max_turns=3", "generator.use_conversation_multi_turn=true"])


def test_environment_modules_and_reward_fn_are_checked(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def score(text, extras):\n    return float('42' in text)\n")
    load_config(RUNNABLE + [f"environment.reward_fn={module}:score", f"environment.env_modules=[{module}]"])
    err = _error(RUNNABLE + [f"environment.reward_fn={module}:nope", "environment.env_modules=[no_such_module_x]",
                             "environment.skyrl_gym.max_env_workers=-1", "environment.step_timeout_s=0"])
    msg = str(err)
    assert "environment.reward_fn=" in msg and "has no function 'nope'" in msg
    assert "environment.env_modules" in msg and "no_such_module_x" in msg
    assert "environment.skyrl_gym.max_env_workers=-1 must be a whole number >= 0" in msg and "environment.step_timeout_s=0" in msg
    assert len(err.problems) == 4


def test_code_time_limits_too_short_to_start_a_program_are_refused():
    """Before: environment.skyrl_gym.code.timeout_s=0.001 was accepted, and every reward was 0."""
    load_config(RUNNABLE + ["+environment.skyrl_gym.code.timeout_s=2", "+environment.skyrl_gym.code.total_timeout_s=30"])
    err = _error(RUNNABLE + ["+environment.skyrl_gym.code.timeout_s=0.001",
                             "+environment.skyrl_gym.code.total_timeout_s=fast"])
    assert err.problems == [
        "environment.skyrl_gym.code.timeout_s=0.001 must be a number of seconds >= 1: a sandboxed program takes "
        "~0.1-0.3 s just to start, so a shorter limit fails every test case and every reward is 0. Fix: e.g. "
        "environment.skyrl_gym.code.timeout_s=10 (the default).",
        "environment.skyrl_gym.code.total_timeout_s=fast must be a number of seconds >= 1: a sandboxed program "
        "takes ~0.1-0.3 s just to start, so a shorter limit fails every test case and every reward is 0. Fix: e.g. "
        "environment.skyrl_gym.code.total_timeout_s=60, or no total_timeout_s (no limit per step)."]


def test_changed_not_yet_key_is_refused_and_default_accepted():
    err = _error(RUNNABLE + ["trainer.policy.sequence_parallel_size=2", "trainer.policy.use_torch_compile=true"])
    msg = str(err)
    assert "trainer.policy.sequence_parallel_size=2: sequence parallelism is not built" in msg
    assert "trainer.policy.use_torch_compile=true: torch.compile is not built" in msg
    load_config(RUNNABLE + ["trainer.placement.colocate_all=true",
                            "generator.inference_engine_tensor_parallel_size=1"])


def test_engine_parallelism_is_checked_per_backend():
    g = "generator.inference_engine"
    err = _error(RUNNABLE + [f"{g}_pipeline_parallel_size=2", f"{g}_data_parallel_size=2",
                             f"{g}_expert_parallel_size=2", "generator.vllm_v1_disable_multiproc=false"])
    assert err.problems == [
        "generator.vllm_v1_disable_multiproc=false runs a vLLM engine core in a child process, but the engines here "
        "are generator.backend=hf, which have no vLLM engine core. Fix: generator.vllm_v1_disable_multiproc=true "
        "(the default)."] + [
        f"{g}_{kind}_parallel_size=2: the embedded hf engine runs on one device. Fix: {g}_{kind}_parallel_size=1, "
        "or a vllm / sglang engine (generator.backend=vllm or sglang)." for kind in ("pipeline", "data", "expert")]
    remote = RUNNABLE + ["generator.run_engines_locally=false", "generator.backend=vllm"]
    err = _error(remote + [f"{g}_pipeline_parallel_size=2"])
    assert err.problems == [f"{g}_pipeline_parallel_size=2 sizes engines Ridgeline starts, but "
                            "generator.run_engines_locally=false uses servers started elsewhere, with their own "
                            f"parallelism. Fix: {g}_pipeline_parallel_size=1, and start the servers with the "
                            "parallelism they need."]
    assert "generator.vllm_v1_disable_multiproc=false runs a vLLM engine core in a child process, but the engines " \
        "here are on remote servers" in str(_error(remote + ["generator.vllm_v1_disable_multiproc=false"]))
    err = _error(RUNNABLE + ["generator.fully_sharded_loras=true"])
    assert err.problems[0].startswith("generator.fully_sharded_loras=true: adapter-only weight sync is not built: "
                                      "engines get the policy's merged weights, never LoRA adapters")
    fsdp2 = ["trainer.strategy=fsdp2", "trainer.logger=console", "trainer.placement.colocate_all=false"]
    load_config(fsdp2 + ["generator.backend=vllm", "generator.vllm_v1_disable_multiproc=false"])
    for backend in ("vllm", "sglang"):
        load_config(fsdp2 + [f"generator.backend={backend}", f"{g}_pipeline_parallel_size=2", f"{g}_data_parallel_size=2",
                             f"{g}_expert_parallel_size=1"])
        load_config(fsdp2 + [f"generator.backend={backend}", f"{g}_tensor_parallel_size=4", f"{g}_expert_parallel_size=4"])
        err = _error(fsdp2 + [f"generator.backend={backend}", f"{g}_tensor_parallel_size=4", f"{g}_expert_parallel_size=2"])
        assert err.problems == [f"{g}_expert_parallel_size=2 must equal {g}_tensor_parallel_size=4 (SkyRL's rule: "
                                "expert = data x tensor, and data is 1): the experts are sharded over the "
                                f"tensor-parallel ranks. Fix: {g}_expert_parallel_size=4, or 1 to turn expert "
                                "parallelism off."]
        err = _error(fsdp2 + [f"generator.backend={backend}", f"{g}_tensor_parallel_size=2",
                              f"{g}_expert_parallel_size=4", f"{g}_data_parallel_size=2"])
        assert err.problems[0].startswith(f"{g}_expert_parallel_size=4 with {g}_data_parallel_size=2: expert "
                                          "parallelism over data-parallel ranks needs vLLM's data-parallel group")
        err = _error(RUNNABLE + [f"generator.backend={backend}", f"{g}_data_parallel_size=2"])
        assert err.problems == [f"{g}_data_parallel_size=2 runs 2 engine processes per engine, but "
                                "trainer.strategy=single runs one engine inside the trainer's process. Fix: "
                                f"trainer.strategy=fsdp2 (engines as Ray actors), or {g}_data_parallel_size=1."]


def test_engine_settings_are_checked_per_backend():
    err = _error(RUNNABLE + ["+generator.engine_init_kwargs.attention_backend=flashinfer",
                             "generator.inference_engine_tensor_parallel_size=2"])
    msg = str(err)
    assert "generator.engine_init_kwargs has attention_backend, which the embedded hf engine does not take" in msg
    # any tensor-parallel size with the hf engine (SkyRL's default 4, a script's 2) is said once at start
    assert len(err.problems) == 1
    for tp in (2, 4):
        cfg = load_config(RUNNABLE + [f"generator.inference_engine_tensor_parallel_size={tp}"])
        assert [line for line in unbuilt_defaults(cfg) if "tensor_parallel" in line] == [
            f"generator.inference_engine_tensor_parallel_size={tp}: the hf engine runs on one device; tensor "
            "parallelism is for vllm / sglang engines"]
    load_config(RUNNABLE + ["+generator.engine_init_kwargs.attn_implementation=sdpa"])
    for backend in ("vllm", "sglang"):  # their engines take any kwargs and any tensor-parallel size
        load_config(RUNNABLE + [f"generator.backend={backend}", "generator.inference_engine_tensor_parallel_size=2",
                                "+generator.engine_init_kwargs.attention_backend=fa3"])
        cfg = load_config(RUNNABLE + [f"generator.backend={backend}"])  # the default tp=4 is acted on
        assert not any("tensor_parallel" in line for line in unbuilt_defaults(cfg))
    load_config(RUNNABLE + ["generator.run_engines_locally=false",
                            "generator.remote_inference_engine_urls=['127.0.0.1:8001','http://10.0.0.2:30000']"])
    err = _error(RUNNABLE + ["generator.run_engines_locally=false", "generator.remote_inference_engine_urls=[]"])
    assert "generator.remote_inference_engine_urls=[] must list the servers" in str(err)
    err = _error(RUNNABLE + ["generator.backend=remote"])
    assert "generator.backend=remote" in str(err)


def test_every_tracker_is_accepted():
    load_config(RUNNABLE[:-1] + ["trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]", "trainer.dump_data_batch=true"])
    err = _error(RUNNABLE[:-1] + ["trainer.logger=[console,comet]"])
    assert "comet" in str(err)


def test_hints_accept_any_value():
    load_config(RUNNABLE + ["generator.gpu_memory_utilization=0.5", "generator.async_engine=false",
                            "trainer.gradient_checkpointing=false"])


def test_unregistered_estimator_names_the_registered_ones():
    err = _error(RUNNABLE + ["trainer.algorithm.advantage_estimator=grop"])
    assert "trainer.algorithm.advantage_estimator=grop is not a registered advantage estimator. Did you mean grpo?" \
        in str(err)
    err = _error(RUNNABLE + ["trainer.algorithm.advantage_estimator=no_such_module_x:fn"])
    assert "advantage_estimator=no_such_module_x:fn could not be imported (ModuleNotFoundError" in str(err)


def test_registered_names_come_from_the_registry(monkeypatch):
    import ridgeline.algorithms as algorithms

    class Stub:
        def names(self):
            return ["grpo", "my_estimator"]

        def __contains__(self, name):
            return name in self.names()

    monkeypatch.setattr(algorithms, "ADVANTAGE_ESTIMATORS", Stub(), raising=False)
    load_config(RUNNABLE + ["trainer.algorithm.advantage_estimator=my_estimator"])


def test_policy_loss_names_checked():
    err = _error(RUNNABLE + ["trainer.algorithm.policy_loss_type=regularr"])
    assert "trainer.algorithm.policy_loss_type=regularr" in str(err)


def test_unbuilt_defaults_lists_ignored_defaults(runnable_cfg):
    lines = unbuilt_defaults(runnable_cfg)
    # checkpoints are built: their defaults are acted on
    assert not any(line.startswith(("trainer.ckpt_interval", "trainer.resume_mode")) for line in lines)
    assert any(line.startswith("generator.inference_engine_tensor_parallel_size=4") for line in lines)
    cfg = load_config(RUNNABLE + ["generator.inference_engine_tensor_parallel_size=1"])
    assert not any(line.startswith("generator.inference_engine_tensor_parallel_size") for line in unbuilt_defaults(cfg))


def test_support_tables_name_real_keys():
    from ridgeline.config.schema import all_keys

    for key in support.DEFAULTS_NOT_ACTED_ON:
        assert key in all_keys(), key
    for old, new in support.RENAMED_KEYS.items():
        assert new.rstrip(".") in all_keys(), old


# --------------------------------------------------------------------------- all at once


def test_all_problems_reported_at_once():
    err = _error(RUNNABLE + ["trainer.train_batch_size=abc", "generator.max_turns=0",
                             "+trainer.algorithm.advantage_estimater=grpo",
                             "trainer.algorithm.kl_estimator_type=k4"])
    msg = str(err)
    for key in ("trainer.train_batch_size", "generator.max_turns",
                "trainer.algorithm.advantage_estimater", "trainer.algorithm.kl_estimator_type"):
        assert key in msg
    assert len(err.problems) == 4
    assert msg.startswith("Invalid Ridgeline config (4 problems)")


def test_bad_syntax_and_bad_value_reported_together():
    err = _error(RUNNABLE + ["trainer.epochs", "generator.n_samples_per_prompt=0"])
    assert "'trainer.epochs' cannot be parsed" in str(err)
    assert "generator.n_samples_per_prompt=0" in str(err)


def test_preset_without_plus():
    err = _error(RUNNABLE + ["experiment=example_gsm8k"])
    assert "+experiment=example_gsm8k" in str(err)


def test_load_inside_running_hydra_app(tmp_path):
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(version_base="1.3", config_dir=str(tmp_path)):
        cfg = load_config(RUNNABLE)
        assert cfg.trainer.strategy == "single"
        assert GlobalHydra.instance().is_initialized()


# --------------------------------------------------------------------------- the typed schema


def test_loaded_config_is_typed(runnable_cfg):
    """load_config returns RidgelineConfig's typed tree: sections are the schema's dataclasses, and a
    value of the wrong type set afterwards is refused by OmegaConf."""
    from omegaconf import ValidationError

    from ridgeline.config.schema.trainer import TrainerConfig
    assert OmegaConf.get_type(runnable_cfg.trainer) is TrainerConfig
    cfg = load_config(RUNNABLE)
    with pytest.raises(ValidationError):
        cfg.trainer.epochs = "many"
    cfg.trainer.run_name = 7  # a number is a fine name: text in a string field
    assert cfg.trainer.run_name == "7"


def test_a_hand_made_config_gets_the_defaults_and_every_problem():
    """validate_config types any composed config: missing keys take their defaults, and unknown keys,
    wrong types and rules are all reported in one pass."""
    cfg = OmegaConf.create({"trainer": {"strategy": "single", "logger": "console", "epochs": 2},
                            "generator": {"backend": "hf"}})
    typed = validate_config(cfg)
    assert typed.trainer.epochs == 2 and typed.trainer.train_batch_size == 1024
    bad = OmegaConf.create({"trainer": {"strategy": "single", "logger": "console", "epochs": "two", "epoch": 1,
                                        "policy": 5, "eval_before_train": 1},
                            "generator": {"backend": "hf", "n_samples_per_prompt": 0}})
    err = pytest.raises(ConfigError, validate_config, bad).value
    assert [p.split(" ")[0] for p in err.problems] == [
        "trainer.epochs=two", "trainer.epoch=1", "trainer.policy=5", "trainer.eval_before_train=1",
        "generator.n_samples_per_prompt=0"]
    assert "trainer.epochs=two has the wrong type: expected an integer, got a string. Fix: trainer.epochs=<integer>, " \
           "e.g. the default trainer.epochs=1." in err.problems
    assert "did you mean trainer.epochs?" in err.problems[1]
    assert "trainer.policy=5 replaces a section with an integer" in err.problems[2]


def test_a_rule_over_a_refused_value_is_not_reported_again():
    """A key refused on its own holds a stand-in while the rules run; a rule naming it says nothing new."""
    err = _error(RUNNABLE + ["trainer.train_batch_size=abc", "trainer.policy_mini_batch_size=3"])
    assert len(err.problems) == 1 and err.problems[0].startswith("trainer.train_batch_size=abc has the wrong type")


def test_the_hydra_app_composes_the_schema_defaults():
    """`python -m ridgeline.entrypoints.main_base --cfg all` prints the composed config (Hydra's own
    flags run the Hydra app, whose primary config is the schema's defaults in Hydra's config store)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "ridgeline.entrypoints.main_base", "--cfg", "all",
                          "+experiment=tiny", "trainer.epochs=3"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    composed = OmegaConf.create(out.stdout)
    assert composed.trainer.epochs == 3 and composed.trainer.policy.optimizer_config.lr > 0
    assert "hydra" in composed  # Hydra's app, not the loader


def test_main_base_cfg_job_reads_skyrl_0_4_names():
    """`main_base --cfg job` prints what the loader makes of the line, as a run would read it: 0.4's
    `generator.inference_engine.*` names and new keys, `--package` picking one node."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "ridgeline.entrypoints.main_base", "--cfg", "job", "+experiment=tiny",
                          "generator.inference_engine.backend=hf", "trainer.max_training_steps=3", "-p", "trainer"],
                         capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    trainer = OmegaConf.create(out.stdout)
    assert trainer.max_training_steps == 3 and "generator" not in trainer


def test_dro_beta_is_a_schema_key_and_a_negative_one_is_refused():
    assert load_config(RUNNABLE).trainer.algorithm.dro_beta == 0.05   # the Tinker docs' example value
    assert "trainer.algorithm.dro_beta=-0.1 must not be negative" in str(
        _error([*RUNNABLE, "trainer.algorithm.dro_beta=-0.1"]))
