"""Random-weight builds of real architectures: `random://NAME[?key=value&...]`.

The shapes are those of public checkpoints (the table below, from their `config.json`), the
weights are drawn from a seed, and nothing is downloaded: a machine without a model hub (a bare
GPU machine, CI) gets the real compute and memory of SmolLM2-135M or Qwen2.5-0.5B. The tokenizer
is the local character tokenizer of tiny.py; its ~100 ids fit inside any of these vocabularies,
so the embedding and the LM head keep their real sizes (rows no character uses still cost their
memory and the head its FLOPs). A random model samples over its whole vocabulary, and ids outside
the tokenizer decode to nothing, so rewards are mostly 0: these models measure speed and memory,
they do not learn a task.

Overrides after `?` change entries of the table (`random://smollm2-135m?num_hidden_layers=2`),
for a cheap run of the same layer shapes. Hydra needs such a path quoted:
`'trainer.policy.model.path="random://smollm2-135m?num_hidden_layers=2"'`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase, Qwen2Config)

SCHEME = "random://"

Value = int | float | bool


@dataclass(frozen=True)
class Architecture:
    config_class: type[PretrainedConfig]
    hyper: dict[str, Value]   # the checkpoint's hyper-parameters; token ids come from the tokenizer


# From each checkpoint's config.json (HuggingFaceTB/SmolLM2-135M, Qwen/Qwen2.5-0.5B).
ARCHITECTURES: dict[str, Architecture] = {
    # 134.5M parameters (the embedding, tied with the head, is 28.3M of them)
    "smollm2-135m": Architecture(LlamaConfig, dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, initializer_range=0.041666666666666664,
        tie_word_embeddings=True)),
    # 494.0M parameters (embedding 136.1M); Qwen2 puts biases on the q/k/v projections
    "qwen2.5-0.5b": Architecture(Qwen2Config, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, initializer_range=0.02,
        tie_word_embeddings=True)),
}


def is_random_path(path: str) -> bool:
    return path.startswith(SCHEME)


def parse_random_path(path: str) -> tuple[str, dict[str, Value]]:
    """`random://NAME?key=value&key=value` -> (NAME, {key: value}). Values are read as int, then
    float, then true/false; only keys of NAME's table may be overridden."""
    if not is_random_path(path):
        raise ValueError(f"model path {path!r} is not a {SCHEME} path")
    name, _, query = path[len(SCHEME):].partition("?")
    if name not in ARCHITECTURES:
        raise ValueError(f"model path {path!r}: unknown architecture {name!r}; available: {sorted(ARCHITECTURES)}")
    overrides: dict[str, Value] = {}
    for item in filter(None, query.split("&")):
        key, eq, text = item.partition("=")
        if not eq or key not in ARCHITECTURES[name].hyper:
            raise ValueError(f"model path {path!r}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{sorted(ARCHITECTURES[name].hyper)}")
        overrides[key] = _parse_value(path, key, text)
    return name, overrides


def _parse_value(path: str, key: str, text: str) -> Value:
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"model path {path!r}: {key}={text!r} is not a number, true or false")


def random_config(path: str, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The architecture's config with the overrides of `path`, speaking `tokenizer`'s special ids."""
    name, overrides = parse_random_path(path)
    arch = ARCHITECTURES[name]
    hyper = {**arch.hyper, **overrides}
    if hyper["vocab_size"] < len(tokenizer):
        raise ValueError(f"model path {path!r}: vocab_size={hyper['vocab_size']} is smaller than the "
                         f"tokenizer's {len(tokenizer)} ids")
    return arch.config_class(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **hyper)


def build_random_model(path: str, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """The model of `path` with weights drawn from `seed` (float32, on the CPU: the same seed gives
    the same weights on every machine; the caller casts and moves it)."""
    return seeded_model(random_config(path, tokenizer), seed)


def seeded_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A causal LM of `config` with float32 weights drawn from `seed` on the CPU. Seeded locally,
    so building a model never disturbs the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
