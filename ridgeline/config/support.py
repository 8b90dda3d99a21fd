"""What crosses from other SkyRL releases, and defaults this build accepts without acting on them.

Which values a key may hold, and which are not built, is said by the key's field in
``ridgeline.config.schema``; this module holds what is not a property of one field.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from ridgeline.config.fields import show
from ridgeline.config.schema import RidgelineConfig, base_config

__all__ = ["RENAMED_KEYS", "DEPRECATED_KEYS", "EXAMPLE_KEYS", "renamed_key", "rename_origin", "UNREAD_KEYS",
           "DEFAULTS_NOT_ACTED_ON",
           "unbuilt_defaults"]

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


# SkyRL 0.3.1's own deprecated spellings (its base config keeps them, marked "use ... instead") -> the
# key that replaced them: accepted with the same one-line notice; null (their default: unset) sets nothing.
DEPRECATED_KEYS: dict[str, str] = {
    "trainer.target_modules": "trainer.policy.model.lora.target_modules",
    "trainer.exclude_modules": "trainer.policy.model.lora.exclude_modules",
}


# Keys SkyRL 0.3.1's example entry points add to the base config for a feature Ridgeline has built in
# (their scripts set them with '+') -> Ridgeline's key of the same meaning: read with the same notice.
EXAMPLE_KEYS: dict[str, str] = {
    # examples/algorithms/dapo/main_dapo.py's soft overlong punishment (also used by its flash_rl,
    # tis_correction, sapo and megatron DAPO scripts)
    "trainer.algorithm.overlong_buffer.len": "trainer.algorithm.overlong_buffer_len",
    "trainer.algorithm.overlong_buffer.penalty_factor": "trainer.algorithm.overlong_buffer_penalty_factor",
}


def renamed_key(key: str) -> str | None:
    """The key here that `key` names when it is a later SkyRL release's name, 0.3.1's deprecated
    spelling or a 0.3.1 example's own key; or None."""
    for table in (DEPRECATED_KEYS, EXAMPLE_KEYS, RENAMED_KEYS):
        if key in table:
            return table[key]
    for old, new in RENAMED_KEYS.items():
        if old.endswith(".") and key.startswith(old):
            return new + key[len(old):]
    return None


def rename_origin(key: str) -> str:
    """What kind of other name `key` is, for the notice and the both-set refusal."""
    if key in DEPRECATED_KEYS:
        return "SkyRL 0.3.1's deprecated spelling"
    if key in EXAMPLE_KEYS:
        return "the key of SkyRL 0.3.1's DAPO example entry point (examples/algorithms/dapo/main_dapo.py)"
    return "a later SkyRL release's name"


# keys SkyRL-Train 0.3.1's own example scripts pass (with '+') that 0.3.1 never reads: accepted with a
# one-line notice saying why they have no effect here either, and left out of the config
UNREAD_KEYS: dict[str, str] = {
    "generator.retokenize_chat_history": "SkyRL 0.3.1 never reads it (its step-wise loop re-renders the chat "
    "history every turn, whatever it says), and Ridgeline's turns are token-in/token-out: each turn's input holds "
    "the earlier turns' tokens as sampled, so a chat template that rewrites earlier turns (Qwen3 dropping their "
    "<think> blocks) does not change them (docs/multi_turn.md)",
}


# defaults that ask for something this build does not do (a changed value is acted on or refused)
DEFAULTS_NOT_ACTED_ON: dict[str, str] = {
    "generator.inference_engine_tensor_parallel_size": "the hf engine runs on one device; tensor "
    "parallelism is for vllm / sglang engines",
    "trainer.policy.model.lora.lora_sync_path": "engines receive the merged weights at every sync, not "
    "adapter files",
}


def unbuilt_defaults(cfg: RidgelineConfig) -> list[str]:
    """Lines naming the keys that ``cfg`` leaves at a default the run will not act on.

    The trainer logs these once at start so that no setting is silently ignored, e.g.
    ``generator.inference_engine_tensor_parallel_size=4 (default): the hf engine runs on one device ...``.
    """
    lines: list[str] = []
    for key, why in DEFAULTS_NOT_ACTED_ON.items():
        value = OmegaConf.select(OmegaConf.structured(cfg), key, throw_on_missing=False)
        if value is None or value != OmegaConf.select(base_config(), key):
            continue
        if key == "generator.inference_engine_tensor_parallel_size" and (
                cfg.generator.backend != "hf" or not cfg.generator.run_engines_locally):
            continue  # vllm / sglang / remote engines do act on it
        if key == "trainer.policy.model.lora.lora_sync_path" and not cfg.trainer.policy.model.lora.rank:
            continue  # without LoRA SkyRL does not use it either
        lines.append(f"{key}={show(value)} (default): {why}")
    return lines
