"""The single-turn generator: token-in/token-out, rewards, and what a broken environment costs."""

import logging

import pytest

from ridgeline.envs import SingleTurnEnv, register
from ridgeline.generation.generator import SingleTurnGenerator
from ridgeline.generation.truncation import TruncationPolicy, apply_truncation_policy
from ridgeline.generation.types import GeneratorInput, TrajectoryID
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import SamplingParams


class Explodes(SingleTurnEnv):
    def score(self, action: str) -> float:
        raise RuntimeError("reward server down")


class ReturnsNaN(SingleTurnEnv):
    def score(self, action: str) -> float:
        return float("nan")


register("test_explodes", Explodes, overwrite=True)
register("test_nan", ReturnsNaN, overwrite=True)

ROW = {"reward_spec": {"method": "rule", "ground_truth": "7"}, "data_source": "t"}


def _input(env_classes, max_tokens=3):
    n = len(env_classes)
    return GeneratorInput(prompts=[[{"role": "user", "content": "What is 3 + 4?"}]] * n, env_classes=env_classes,
                          env_extras=[ROW] * n, trajectory_ids=[TrajectoryID("u", i) for i in range(n)],
                          sampling_params=SamplingParams(max_generate_length=max_tokens))


def test_outputs_are_token_in_token_out_and_in_input_order(tiny_model, tiny_tokenizer):
    gen = SingleTurnGenerator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer,
                              env_settings={"arithmetic": {"format_score": 0.5}})
    out = gen.generate(_input(["arithmetic"] * 4), seed=0)
    assert len(out.response_ids) == len(out.rewards) == len(out.rollout_logprobs) == 4
    for ids, text, lps, mask in zip(out.response_ids, out.responses, out.rollout_logprobs, out.loss_masks):
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == text
        assert len(lps) == len(ids) == len(mask)
    assert out.prompt_token_ids[0] == gen.encode_prompt([{"role": "user", "content": "What is 3 + 4?"}])
    assert set(out.rewards) <= {0.0, 0.5, 1.0}


def test_a_raising_or_nan_environment_costs_only_its_trajectory(tiny_model, tiny_tokenizer, caplog):
    gen = SingleTurnGenerator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer)
    with caplog.at_level(logging.ERROR):
        out = gen.generate(_input(["test_explodes", "test_nan", "test_explodes", "arithmetic"]), seed=0)
    assert out.rewards[:3] == [0.0, 0.0, 0.0]
    assert out.metrics["generate/env_errors"] == 3.0
    # logged once per environment class, with the traceback
    logged = [r for r in caplog.records if "The trajectory gets reward 0" in r.getMessage()]
    assert len(logged) == 2 and "reward server down" in caplog.text


def test_zero_reward_on_non_stop(tiny_model, tiny_tokenizer):
    """The generator keeps the environment's reward of a truncated response; the truncation
    policy's first rule zeroes it."""
    settings = {"arithmetic": {"format_score": 1.0, "correct_score": 1.0}}
    gen = SingleTurnGenerator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer, env_settings=settings)
    out = gen.generate(_input(["arithmetic"] * 8, max_tokens=2), seed=5)
    strict = apply_truncation_policy(out.stop_reasons, [len(r) for r in out.response_ids], out.rewards, out.loss_masks,
                                     TruncationPolicy(zero_reward_on_non_stop=True), training=False)
    for reason, loose, tight in zip(out.stop_reasons, out.rewards, strict.rewards):
        assert tight == (loose if reason == "stop" else 0.0)
    assert strict.metrics["generate/zeroed_non_stop"] == sum(
        r != "stop" and x != 0 for r, x in zip(out.stop_reasons, out.rewards))
    if not any(r != "stop" and x != 0 for r, x in zip(out.stop_reasons, out.rewards)):
        pytest.fail("test input produced no truncated rewarded response; pick another seed")


def test_outputs_carry_their_trajectory_ids(tiny_model, tiny_tokenizer):
    gen = SingleTurnGenerator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer)
    inp = _input(["arithmetic"] * 3)
    inp.trajectory_ids = [TrajectoryID("b", 0), TrajectoryID("a", 0), TrajectoryID("a", 1)]
    out = gen.generate(inp, seed=0)
    assert out.trajectory_ids == inp.trajectory_ids and out.uids == ["b", "a", "a"]
    assert out.select([2, 0]).trajectory_ids == [TrajectoryID("a", 1), TrajectoryID("b", 0)]
    inp.trajectory_ids = inp.trajectory_ids[:2]
    with pytest.raises(ValueError, match="2 trajectory_ids for 3 prompts"):
        gen.generate(inp, seed=0)


def test_each_distinct_prompt_is_chat_templated_once_per_batch(tiny_model, tiny_tokenizer):
    """A GRPO group sends one prompt n times: the generator templates it once and gives every
    trajectory its own copy of the ids (equal to templating each alone)."""
    calls = []

    class Counting(SingleTurnGenerator):
        def encode_prompt(self, messages):
            calls.append(messages[-1]["content"])
            return super().encode_prompt(messages)

    gen = Counting(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer)
    questions = ["What is 3 + 4?", "What is 1 + 1?"]
    prompts = [[{"role": "user", "content": q}] for q in questions for _ in range(4)]
    inp = GeneratorInput(prompts=prompts, env_classes=["arithmetic"] * 8, env_extras=[ROW] * 8,
                         trajectory_ids=[TrajectoryID(str(i // 4), i % 4) for i in range(8)],
                         sampling_params=SamplingParams(max_generate_length=2))
    out = gen.generate(inp, seed=0)
    assert sorted(calls) == sorted(questions)
    for prompt, ids in zip(prompts, out.prompt_token_ids):
        assert ids == SingleTurnGenerator.encode_prompt(gen, prompt)
    assert out.prompt_token_ids[0] is not out.prompt_token_ids[1]



@pytest.mark.parametrize("name, rendered", [
    ("qwen3_with_thinking", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhello"
     "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3_without_thinking", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
     "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"),
])
def test_skyrl_named_chat_templates(tmp_path, name, rendered):
    """SkyRL's two template names: Qwen3's turns with earlier reasoning kept, or dropped as Qwen3's own
    template drops it; both end with the assistant header the model answers after."""
    from ridgeline.config import load_config
    from ridgeline.data import encode_chat_prompt
    from ridgeline.models.loading import configure_chat_template
    from ridgeline.models.tiny import build_char_tokenizer

    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", f"generator.chat_template.name_or_path={name}"])
    tok = build_char_tokenizer()
    configure_chat_template(tok, cfg.generator)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"},
                {"role": "user", "content": "again"}]
    assert tok.decode(encode_chat_prompt(tok, messages)) == rendered


def test_skyrl_chat_template_settings_shape_every_rendering(tmp_path):
    """generator.chat_template (source=file) replaces the model's template and
    generator.chat_template_kwargs fixes its variables, for prompts and length checks alike."""
    from ridgeline.config import load_config
    from ridgeline.config.validate import ConfigError
    from ridgeline.data import encode_chat_prompt
    from ridgeline.models.loading import configure_chat_template
    from ridgeline.models.tiny import build_char_tokenizer

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}{% if shout %}!{% endif %}]{{ m['content'] }}"
                        "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "generator.chat_template.source=file",
                       f"generator.chat_template.name_or_path={template}", "generator.chat_template_kwargs.shout=true"])
    tok = build_char_tokenizer()
    configure_chat_template(tok, cfg.generator)
    ids = encode_chat_prompt(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "[user!]hi>"
    # the model's own template with a variable only (ChatML ignores unknown variables)
    tok = build_char_tokenizer()
    configure_chat_template(tok, load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}",
                                              "generator.chat_template_kwargs.enable_thinking=false"]).generator)
    assert tok.decode(encode_chat_prompt(tok, [{"role": "user", "content": "hi"}])) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ConfigError, match="qwen3_thinking is not a named chat template: the names are "
                                          "qwen3_with_thinking or qwen3_without_thinking"):
        load_config(["+experiment=tiny", "generator.chat_template.name_or_path=qwen3_thinking"])
    with pytest.raises(ConfigError, match="needs the path of a Jinja template file that exists"):
        load_config(["+experiment=tiny", "generator.chat_template.source=file"])
