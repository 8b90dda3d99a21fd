"""What the current Ridgeline build acts on, as data.

Every key of the base config is accepted by name, but some features behind those keys are not
built yet. The tables here say which, so that validation can refuse a setting Ridgeline would
otherwise ignore, and the trainer can list the defaults it does not act on.

Rules applied by :func:`ridgeline.config.validate.validate_config`:

* ``SUPPORTED_VALUES[key]``: the key must hold one of these values (for a list value, every
  entry must). This applies even at the base default: the default ``trainer.strategy=fsdp2`` is
  refused until FSDP is built.
* ``NOT_YET[key]`` without an entry in ``SUPPORTED_VALUES``: the key is accepted at its base
  default and refused when changed. A key ending in ``.*`` covers every key below that prefix.
* ``HINTS[key]``: accepted with any value; an engine or strategy tuning knob the current build may
  not use.
* ``DEFAULTS_NOT_ACTED_ON[key]``: defaults of ``NOT_YET`` keys that ask for something the build
  does not do; :func:`unbuilt_defaults` lists the ones a config leaves in place so the trainer can
  log them once at start.

Issue numbers refer to Ridgeline's tracker.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "NOT_YET",
    "SUPPORTED_VALUES",
    "HINTS",
    "DEFAULTS_NOT_ACTED_ON",
    "KNOWN_ADVANTAGE_ESTIMATORS",
    "KNOWN_POLICY_LOSSES",
    "PREPARE_DATASETS",
    "not_yet_note",
    "unbuilt_defaults",
]

_SP = ("sequence parallelism is not built: FSDP2 shards the parameters, every rank holds whole "
       "sequences")

# dotted key (or prefix.*) -> what to use today / which issue brings it
NOT_YET: dict[str, str] = {
    # strategies, engines, trackers: only some values built
    "trainer.strategy": "single (one process) and fsdp2 / fsdp (FSDP2 ranks as Ray actors: gloo on "
    "CPU workers, NCCL on GPUs) are built; deepspeed and megatron are not planned",
    # placement and sharding
    "trainer.critic.sequence_parallel_size": _SP,
    "trainer.policy.sequence_parallel_size": _SP,
    "trainer.ref.sequence_parallel_size": _SP,
    "trainer.policy.use_torch_compile": "torch.compile is not built (on one CPU core it costs minutes of "
    "compilation per shape; docs/benchmarks.md)",
    "trainer.policy.record_memory": "CUDA memory snapshots are not built (memory/peak_gpu_gib is logged every "
    "step)",
    # dumps
    # generator / engines
    "generator.fully_sharded_loras": "engines get the policy's merged weights, never LoRA adapters (adapter-only "
    "weight sync is not built, docs/lora.md), so there are no LoRA layers for vLLM to shard",
}

# keys where only some values are built (checked even at the base default)
SUPPORTED_VALUES: dict[str, set[Any]] = {
    "trainer.strategy": {"single", "fsdp2", "fsdp"},
}

# accepted with any value; tuning hints the current build may not use
HINTS: dict[str, str] = {
    "generator.async_engine": "vllm engine mode; the hf engine is always synchronous",
    "generator.batched": "vllm/sglang request batching; the hf engine batches on its own",
    "generator.enable_prefix_caching": "vllm/sglang KV-cache option",
    "generator.enable_chunked_prefill": "vllm option",
    "generator.max_num_batched_tokens": "vllm scheduler option",
    "generator.enforce_eager": "vllm option (CUDA graphs off)",
    "generator.gpu_memory_utilization": "vllm/sglang KV-cache budget",
    "generator.max_num_seqs": "vllm/sglang scheduler option",
    "trainer.gradient_checkpointing": "activation recomputation; a memory option",
    "trainer.algorithm.clip_ratio_c": "read only by the dual_clip policy loss",
}

# defaults of NOT_YET keys that ask for something this build does not do
DEFAULTS_NOT_ACTED_ON: dict[str, str] = {
    "generator.inference_engine_tensor_parallel_size": "the hf engine runs on one device; tensor "
    "parallelism is for vllm / sglang engines",
}

# names SkyRL users may bring; refused with "not supported yet" until registered
KNOWN_ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "gae", "reinforce++")
KNOWN_POLICY_LOSSES: tuple[str, ...] = (
    "regular", "dual_clip", "gspo", "cispo", "clip_cov", "kl_cov", "sapo",
)

# Later SkyRL-Train releases' names (their typed config, `generator.inference_engine.*`, ...) -> the
# 0.3.1 key here: accepted with a one-line notice. A prefix entry (ending in ".") maps the keys below it.
RENAMED_KEYS: dict[str, str] = {
    "generator.inference_engine.model_dtype": "generator.model_dtype",
    "generator.inference_engine.run_engines_locally": "generator.run_engines_locally",
    "generator.inference_engine.num_engines": "generator.num_inference_engines",
    "generator.inference_engine.backend": "generator.backend",
    "generator.inference_engine.weight_sync_backend": "generator.weight_sync_backend",
    "generator.inference_engine.weight_transfer_threshold_cuda_ipc_GB": "generator.weight_transfer_threshold_cuda_ipc_GB",
    "generator.inference_engine.tensor_parallel_size": "generator.inference_engine_tensor_parallel_size",
    "generator.inference_engine.pipeline_parallel_size": "generator.inference_engine_pipeline_parallel_size",
    "generator.inference_engine.expert_parallel_size": "generator.inference_engine_expert_parallel_size",
    "generator.inference_engine.data_parallel_size": "generator.inference_engine_data_parallel_size",
    "generator.inference_engine.vllm_v1_disable_multiproc": "generator.vllm_v1_disable_multiproc",
    "generator.inference_engine.fully_sharded_loras": "generator.fully_sharded_loras",
    "generator.inference_engine.enable_prefix_caching": "generator.enable_prefix_caching",
    "generator.inference_engine.enable_chunked_prefill": "generator.enable_chunked_prefill",
    "generator.inference_engine.max_num_batched_tokens": "generator.max_num_batched_tokens",
    "generator.inference_engine.enforce_eager": "generator.enforce_eager",
    "generator.inference_engine.gpu_memory_utilization": "generator.gpu_memory_utilization",
    "generator.inference_engine.max_num_seqs": "generator.max_num_seqs",
    "generator.inference_engine.external_server_urls": "generator.remote_inference_engine_urls",
    "generator.inference_engine.engine_init_kwargs.": "generator.engine_init_kwargs.",
    "trainer.remove_microbatch_padding": "trainer.use_sample_packing",
}


def renamed_key(key: str) -> str | None:
    """The 0.3.1 key a later SkyRL release's `key` names, or None."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key]
    for old, new in RENAMED_KEYS.items():
        if old.endswith(".") and key.startswith(old):
            return new + key[len(old):]
    return None


# datasets `data.prepare.dataset` can name
PREPARE_DATASETS: set[str] = {"arithmetic", "code", "gsm8k", "multiply", "text2sql"}


def not_yet_note(key: str) -> str | None:
    """The NOT_YET note covering dotted ``key`` (exact entry or a ``prefix.*`` entry)."""
    if key in NOT_YET:
        return NOT_YET[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        note = NOT_YET.get(".".join(parts[:i]) + ".*")
        if note is not None:
            return note
    return None


def _base_defaults() -> DictConfig:
    from ridgeline.config.validate import base_config

    return base_config()


def unbuilt_defaults(cfg: DictConfig) -> list[str]:
    """Lines naming the not-built keys that ``cfg`` leaves at a default the run will not act on.

    The trainer logs these once at start so that no setting is silently ignored, e.g.
    ``generator.weight_sync_backend=nccl (default): weights reach the embedded engine ...``.
    """
    base = _base_defaults()
    lines: list[str] = []
    for key, why in DEFAULTS_NOT_ACTED_ON.items():
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=False)
            default = OmegaConf.select(base, key, throw_on_missing=False)
        except Exception:  # an unresolvable value is reported by validation, not here
            continue
        if value is None or value != default:
            continue
        if key == "generator.inference_engine_tensor_parallel_size" and (
                OmegaConf.select(cfg, "generator.backend") != "hf"
                or OmegaConf.select(cfg, "generator.run_engines_locally") is False):
            continue  # vllm / sglang / remote engines do act on it
        lines.append(f"{key}={_show(value)} (default): {why}")
    return lines


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
