"""Tiny models for smoke runs and tests: a character-level tokenizer built locally and a small,
randomly initialised Llama. Nothing is downloaded; everything is reproducible from a seed.

The tokenizer speaks ChatML like SmolLM2 (`<|im_start|>role\\n...<|im_end|>`), and, like SmolLM2,
uses `<|im_end|>` as both eos and pad, so the tiny path exercises the same masking rules as the
real model (mask by attention mask, never by pad id).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

from ridgeline.models.architectures import seeded_model

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]
# Every printable ASCII character is one token; a prompt never hits <unk> for English/arithmetic.
CHARACTERS = list(string.printable[:-2])  # drop \x0b \x0c

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> LlamaConfig kwargs (vocab size is filled from the tokenizer)
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    # head_dim 64 (hidden 128 / 2 heads): vLLM's CPU attention kernels need it (16 fails there)
    "llama-h64": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024),
    "llama-small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def tiny_config(name: str, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The config of `tiny://NAME`, speaking `tokenizer`'s ids."""
    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {name!r}; available: {sorted(TINY_CONFIGS)}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **TINY_CONFIGS[name],
    )


def build_tiny_model(name: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    return seeded_model(tiny_config(name, tokenizer), seed)
