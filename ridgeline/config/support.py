"""What crosses from other SkyRL releases, and defaults this build accepts without acting on them.

Which values a key may hold, and which are not built, is said by the key's field in
``ridgeline.config.schema``; this module holds what is not a property of one field.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ridgeline.config.fields import show
from ridgeline.config.schema import RidgelineConfig

__all__ = ["RENAMED_KEYS", "DEPRECATED_KEYS", "EXAMPLE_KEYS", "renamed_key", "rename_origin", "UNREAD_KEYS",
           "VALUE_RENAMES", "LaterKey", "LATER_KEYS", "LATER_VALUES", "later_key", "later_key_refusal",
           "later_key_notice",
           "DEFAULTS_NOT_ACTED_ON", "unbuilt_defaults"]

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
    "generator.inference_engine.engine_init_kwargs": "generator.engine_init_kwargs",
    "generator.inference_engine.engine_init_kwargs.": "generator.engine_init_kwargs.",
    "generator.inference_engine.async_engine": "generator.async_engine",
    "trainer.remove_microbatch_padding": "trainer.use_sample_packing",
}


# SkyRL 0.4 keys that pick, by their value, what a Ridgeline key picks: key -> {value: (Ridgeline key,
# its value)}; a value not listed is the 0.4 default, which asks for nothing
VALUE_RENAMES: dict[str, dict[Any, tuple[str, Any]]] = {
    # 0.4 turns the fully asynchronous trainer on by a key (0.3.1 by its entry point)
    "trainer.fully_async.enabled": {True: ("trainer.async_mode", "fully_async")},
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


@dataclass(frozen=True)
class LaterKey:
    """A SkyRL 0.4 key without a field here. At its 0.4 `default` it asks for nothing and is dropped;
    another value is refused naming `feature` (`refused`), or accepted and named once in the run's
    notice with `why` it has no effect here."""
    default: Any
    feature: str = ""   # refused: the sentence part naming what is not built (or not planned)
    why: str = ""       # accepted: why the value changes nothing here


def _refused(feature: str, keys: dict[str, Any]) -> dict[str, LaterKey]:
    return {key: LaterKey(default, feature=feature) for key, default in keys.items()}


def _no_effect(why: str, keys: dict[str, Any]) -> dict[str, LaterKey]:
    return {key: LaterKey(default, why=why) for key, default in keys.items()}


def _roles(suffixes: dict[str, Any], roles: tuple[str, ...] = ("policy", "ref", "critic"),
           section: str = "model.") -> dict[str, Any]:
    return {f"trainer.{role}.{section}{k}": v for role in roles for k, v in suffixes.items()}


_IE = "generator.inference_engine."
_FAKE_INT4 = {"fake_int4_qat.enabled": False, "fake_int4_qat.bf16_base_path": None, "fake_int4_qat.group_size": 32,
              "fake_int4_qat.q_min": -8.0, "fake_int4_qat.scale_divisor": 7.5, "fake_int4_qat.symmetric": True}
_ENGINE_LORA = {"lora.max_loras": 1, "lora.max_cpu_loras": None, "lora.share_expert_adapters": True,
                "lora.sync_mode": "disk"}

DELTA_SYNC = "delta weight sync (checkpoint deltas through a shared folder or an object store), which is not built"

# values of keys here that only SkyRL 0.4 has, for a feature not built: named with that feature's keys
LATER_VALUES: dict[tuple[str, Any], str] = {("generator.weight_sync_backend", "delta"): DELTA_SYNC}

# SkyRL 0.4's keys for features not built here and its knobs that change nothing here (walked, with
# every other 0.4 key, by tests/test_skyrl_config_keys.py). Megatron's own sections
# (*.megatron_config.*) are named once with their backend by validation.
LATER_KEYS: dict[str, LaterKey] = {
    **_refused("multi-token prediction (MTP), which is not built", {
        "trainer.mtp.enabled": False, "trainer.mtp.loss_weight": 0.1, "trainer.mtp.num_speculative_tokens": 1}),
    **_refused("fake INT4 quantization-aware training, which is not built", _roles(_FAKE_INT4)),
    **_refused(DELTA_SYNC,
               {_IE + "delta_weight_sync." + k: v for k, v in {
                   "checkpoint_load_format": "vllm_multi_thread_safetensors", "cloud_download_workers": 4,
                   "local_checkpoint_dir": None, "max_file_size_in_gb": 1.0,
                   "multi_thread_safetensors_max_workers": 8, "publish_num_workers": None,
                   "publish_staging_dir": None, "sync_dir": None}.items()}),
    **_refused("prefill/decode disaggregated engines, which are not built", {
        _IE + "enable_pd": False, _IE + "num_prefill": 0, _IE + "prefill_init_kwargs": {},
        _IE + "decode_init_kwargs": {}}),
    **_refused("SkyRL's inference router in front of the servers, which is not built (remote engines are "
               "reached at generator.remote_inference_engine_urls)", {
                   _IE + "external_proxy_url": None, _IE + "router_init_kwargs": {}}),
    **_refused("speculative decoding in the engines, which is not built", {_IE + "speculative_config": None}),
    **_refused("MoE routing replay, which is not built", {_IE + "enable_return_routed_experts": False}),
    **_refused("sample-support replay, which is not built", {
        _IE + "enable_return_sample_support_set": False, "trainer.algorithm.enable_sample_support_replay": False}),
    **_refused("FP8 weight sync, which is not built (engines take the weights in their own dtype)", {
        _IE + "fp8_weight_sync_mode": None}),
    **_refused("vision-language rollouts (images in prompts), which are not built", {
        "generator.vision_language_generator": False}),
    **_refused("prefix-aware merging of step-wise samples, which is not built", {
        "generator.merge_stepwise_output": False}),
    **_refused("token-budget micro-batches, which are not built (micro-batches count samples)", {
        "trainer.max_tokens_per_microbatch": -1}),
    **_refused("Megatron's fused LM-head log-probs and vocab-parallel entropy, which are not planned (Megatron is "
               "not planned)", {
                   "trainer.fused_lm_head_logprob": False, "trainer.fused_lm_head_logprob_backend": "torch",
                   "trainer.vocab_entropy_chunk_size": 0, "trainer.vocab_entropy_chunk_memory_mb": 512}),
    **_refused("inference-only policy workers, which are not built", {"trainer.policy.inference_only_init": False}),
    **_refused("SkyRL's simulated trainer (examples/train/fully_async/sim_trainer), which is not built", {
        "trainer.fully_async.simulate_training": False, "trainer.fully_async.simulate_training_step_seconds": 30.0,
        "trainer.fully_async.simulate_weight_sync_seconds": 0.0}),
    **_refused("drawing fully asynchronous mini-batches until they are full of groups with signal, which is not "
               "built (dynamic sampling: trainer.algorithm.dynamic_sampling.type=filter)", {
                   "trainer.fully_async.sample_full_batch": False}),
    **_refused("sampling settings passed through to the engine unchecked, which are not built (each sampling key "
               "is checked and mapped for every engine)", {
                   "generator.sampling_params.additional_kwargs": None,
                   "generator.eval_sampling_params.additional_kwargs": None}),
    **_refused("LoRA adapters served by the engines, which are not built (engines get merged weights)",
               {**_roles(_ENGINE_LORA, roles=("policy", "critic")),
                "trainer.critic.model.lora.lora_sync_path": "/tmp/skyrl_lora_sync"}),
    **_refused("LoRA on the reference, which is not planned (the reference is frozen; with a LoRA policy it is the "
               "policy's base)", _roles({"lora.rank": 0, "lora.alpha": 16, "lora.dropout": 0.0,
                                         "lora.target_modules": "all-linear", "lora.exclude_modules": None,
                                         "lora.init_method": "kaiming", "lora.lora_sync_path": "/tmp/skyrl_lora_sync",
                                         **_ENGINE_LORA}, roles=("ref",))),
    **_no_effect("Ridgeline loads every model as a causal LM (AutoModelForCausalLM), the language model only", {
        "trainer.policy.language_model_only": False, "trainer.ref.language_model_only": False,
        _IE + "language_model_only": False}),
    **_no_effect("FSDP2 here shards each decoder layer of the model (transformers' _no_split_modules)", _roles(
        {"wrap_policy": {}}, section="fsdp_config.")),
    **_no_effect("a CUDA allocator setting: Ridgeline's processes keep PyTorch's allocator configuration", {
        "trainer.use_expandable_segments": True, _IE + "use_expandable_segments": False}),
    **_no_effect("Ray's GPU monitor and vLLM's Prometheus stats are not started here (memory/peak_gpu_gib is "
                 "logged every step)", {"trainer.enable_ray_gpu_monitor": True,
                                        _IE + "enable_ray_prometheus_stats": True}),
    **_no_effect("the prefix cache of every engine is reset at each weight sync, so no cache block outlives its "
                 "policy version", {"generator.use_cache_salt": True,
                                    "trainer.fully_async.clear_kv_cache_on_weight_sync": False,
                                    _IE + "offload_kv_for_weight_sync": False}),
    **_no_effect("Ridgeline starts vLLM's workers itself (an engine per Ray actor, or in the trainer's process)", {
        _IE + "distributed_executor_backend": "ray"}),
    **_no_effect("the engines answer under the policy's model path (ridgeline serve takes --served-model-name)", {
        _IE + "served_model_name": None}),
    **_no_effect("examples are not printed or uploaded as tables: batch and eval dumps (trainer.dump_data_batch, "
                 "dump_eval_results) hold every sample", {
                     "trainer.print_example_interval": 1, "trainer.log_example_interval": -1,
                     "trainer.num_logger_eval_samples": -1, "trainer.num_logger_train_samples": -1}),
    **_no_effect("prompts are read into memory by the trainer's process and batched there, without DataLoader "
                 "workers", {"data.dataloader.num_workers": None, "data.dataloader.persistent_workers": False}),
    **_no_effect("Weights & Biases runs are named by trainer.project_name / run_name, without tags",
                 {"trainer.tags": None}),
    **_no_effect("old log-probs come from the same mini-batches and micro-batches as the training step either way",
                 {"trainer.recompute_old_logprobs_per_minibatch": True}),
    **_no_effect("log-probs come from the chunked LM head (training/lm_head.py), whose chunks are sized by the "
                 "trainer", {"trainer.logprobs_chunk_size": 1024}),
}


def later_key(key: str) -> LaterKey | None:
    """The entry of `key` (or of the free-form map it sits in) in LATER_KEYS; or None."""
    if key in LATER_KEYS:
        return LATER_KEYS[key]
    parent = key.rpartition(".")[0]
    while parent:
        entry = LATER_KEYS.get(parent)
        if entry is not None and isinstance(entry.default, dict):
            return LaterKey({}, feature=entry.feature, why=entry.why)  # a key inside the map: never its default
        parent = parent.rpartition(".")[0]
    return None


def later_key_refusal(settings: list[str], feature: str) -> str:
    """One sentence for every setting of one feature not built (`settings`: 'key=value' each)."""
    one = len(settings) == 1
    return (f"{', '.join(settings)} {'asks' if one else 'ask'} for {feature}. Fix: remove "
            f"{'it' if one else 'them'} (at SkyRL 0.4's default {'it asks' if one else 'they ask'} for nothing).")


def later_key_notice(settings: dict[str, str]) -> str:
    """The run's one line for SkyRL 0.4 settings accepted without effect (`settings`: 'key=value' -> why)."""
    return "SkyRL 0.4 settings without effect here: " + "; ".join(f"{s} ({why})" for s, why in settings.items())


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


# settings the run cannot act on in the form it takes (a refused value is refused by validation instead)
DEFAULTS_NOT_ACTED_ON: dict[str, str] = {
    "generator.inference_engine_tensor_parallel_size": "the hf engine runs on one device; tensor "
    "parallelism is for vllm / sglang engines",
    "trainer.policy.model.lora.lora_sync_path": "engines receive the merged weights at every sync, not "
    "adapter files",
    "generator.async_engine": "Ridgeline's vllm engine takes each turn's requests in one LLM.generate call (vLLM "
    "schedules them together); its AsyncLLMEngine is not used",
    "generator.batched": "the generator has one agent loop, which sends each turn's requests of the whole batch "
    "to the engine together, whatever batched says",
    "trainer.fully_async.num_parallel_generation_workers": "one step's batch (train_batch_size prompt groups) is "
    "generated at a time, so more groups in flight add no concurrency (docs/async.md)",
}


def unbuilt_defaults(cfg: RidgelineConfig) -> list[str]:
    """Lines naming the settings of ``cfg`` the run will not act on as they say.

    The trainer logs these once at start so that no setting is silently ignored, e.g.
    ``generator.inference_engine_tensor_parallel_size=4: the hf engine runs on one device ...``.
    """
    g, t, lora = cfg.generator, cfg.trainer, cfg.trainer.policy.model.lora
    acted_on_as_is = {
        # vllm / sglang / remote engines do act on it
        "generator.inference_engine_tensor_parallel_size": (g.backend != "hf" or not g.run_engines_locally
                                                           or g.inference_engine_tensor_parallel_size == 1),
        # without LoRA SkyRL does not use it either; a changed value is refused by validation
        "trainer.policy.model.lora.lora_sync_path": not lora.rank,
        # false, or an engine that is not vLLM, asks for nothing more
        "generator.async_engine": not g.async_engine or g.backend != "vllm" or not g.run_engines_locally,
        # true (the default) is what happens
        "generator.batched": g.batched,
        # read only by the fully asynchronous trainer; up to one batch of groups is what it runs
        "trainer.fully_async.num_parallel_generation_workers": t.async_mode != "fully_async"
        or t.fully_async.num_parallel_generation_workers <= t.train_batch_size,
    }
    return [f"{key}={show(functools.reduce(getattr, key.split('.'), cfg))}: {why}"
            for key, why in DEFAULTS_NOT_ACTED_ON.items() if not acted_on_as_is[key]]
