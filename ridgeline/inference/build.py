"""Pick and build the inference engine a config asks for (`generator.backend`,
`generator.run_engines_locally`). Heavy engines are imported only when asked for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ridgeline.inference.types import InferenceEngine

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from transformers import PreTrainedTokenizerBase

    from ridgeline.config.schema import RidgelineConfig
    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.models.lora import MaybeAdapted

log = logging.getLogger(__name__)


def build_engine(cfg: RidgelineConfig, tokenizer: PreTrainedTokenizerBase,
                 model: MaybeAdapted | None = None) -> InferenceEngine:
    """The engine for `cfg`: remote servers, or a local hf / vllm / sglang engine.

    `model` is the policy model already in this process: the embedded engine copies it instead of
    loading the weights again (vLLM and SGLang load the model folder themselves). A LoRA policy
    is copied with its adapters merged in: engines run plain weights under the base model's names."""
    g = cfg.generator
    if not g.run_engines_locally:
        from ridgeline.inference.remote import RemoteEngine, RemoteSettings
        from ridgeline.models.loading import engine_spec

        overrides = engine_spec(cfg).config_overrides
        if overrides:  # the servers loaded their model themselves: nothing here reaches their config
            log.warning("remote engines run the model config their servers started with: %s must be given to them "
                        "there", ", ".join(f"{o.key}={o.value}" for o in overrides))
        return RemoteEngine(RemoteSettings.from_config(cfg))
    if g.backend == "vllm":
        from ridgeline.inference.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(cfg, tokenizer)
    if g.backend == "sglang":
        from ridgeline.inference.sglang_engine import SGLangEngine

        return SGLangEngine.from_config(cfg, tokenizer)
    return build_hf_engine(cfg, tokenizer, model)


def build_hf_engine(cfg: RidgelineConfig, tokenizer: PreTrainedTokenizerBase,
                    model: MaybeAdapted | None = None) -> HFEngine:
    """The embedded engine on the policy `model` (a copy) or, without one, on the model the config
    names. Its model config is `engine_spec`'s (`generator.rope_*`); when that differs from the
    policy's (`trainer.rope_*`), the engine's model is built from its own config and takes the
    policy's weights (RoPE has no weights, so they fit)."""
    import torch

    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.models.device import resolve_device
    from ridgeline.models.loading import engine_dtype, engine_spec, load_model, load_state_into, policy_spec
    from transformers import PreTrainedModel

    from ridgeline.models.lora import merged_copy

    g = cfg.generator
    spec = engine_spec(cfg)
    # engines run plain weights: a LoRA policy (peft's wrapper, not a PreTrainedModel) merged, in a copy
    plain = model if model is None or isinstance(model, PreTrainedModel) else merged_copy(model)
    if plain is None or not spec.builds_same_model(policy_spec(cfg)):
        own = load_model(spec, torch.float32, tokenizer)
        if plain is not None:
            load_state_into(own, plain.state_dict())
        plain = own
    if g.inference_engine_tensor_parallel_size != 1:
        log.info("generator.inference_engine_tensor_parallel_size=%s is not used: the embedded hf engine "
                 "runs on one device", g.inference_engine_tensor_parallel_size)
    device = resolve_device(cfg.trainer.device)
    return HFEngine(plain, tokenizer, dtype=engine_dtype(g.model_dtype, device), max_num_seqs=g.max_num_seqs,
                    attn_implementation=g.engine_init_kwargs.get("attn_implementation"), device=device)
