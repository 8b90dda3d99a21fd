"""skyrl 0.4's example command lines (tests/data/skyrl_0_4_commands.json: the overrides of every
`examples/train/**/*.sh` that starts a training or generation entry point, its "source" says how they
were captured) pass Ridgeline's config check unchanged, or are refused in one sentence per feature this
build does not have (Megatron, sequence parallelism, MTP, INT4 QAT, routing replay, delta weight sync,
...). Model and data paths are the scripts' own: the check reads no file. SkyRL 0.4's own keys
(generator.inference_engine.*, trainer.log_path, max_training_steps, fully_async.enabled, ...) are
read as Ridgeline's without a line per key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ridgeline.config import load_config
from ridgeline.config.validate import ConfigError
from skyrl_commands import SKYRL_0_4_COMMANDS as COMMANDS

MEGATRON = "trainer.strategy=megatron: Megatron and DeepSpeed are not planned"

# every script -> the starts of the problems it must get, in order (None: accepted as it is). On a
# machine without CUDA (the default engine is then the embedded hf one).
EXPECTED: dict[str, tuple[str, ...] | None] = {
    'algorithms/cispo/run_cispo_gsm8k.sh': None,
    'algorithms/clip_cov_kl_cov/run_clip_cov.sh': None,
    'algorithms/clip_cov_kl_cov/run_kl_cov.sh': None,
    'algorithms/custom_advantage_estimator/run_custom_adv_est.sh': ('trainer.algorithm.advantage_estimator=simple_baseline is not a registered advantage estimator. Registered:',),
    'algorithms/custom_policy_loss/run_custom_policy_loss.sh': ('trainer.algorithm.policy_loss_type=reinforce is not a registered policy loss. Registered: cispo, clip_cov,',),
    'algorithms/dapo/run_dapo_aime_qwen3_4b_aime.sh': None,  # i31
    'algorithms/dapo/run_dapo_gsm8k.sh': None,  # i31
    'algorithms/dapo/run_dapo_qwen2.5_32b_aime.sh': ('trainer.policy.sequence_parallel_size=4: sequence parallelism is not built: FSDP2 shards the parameters,',),  # i31
    'algorithms/dapo/run_dapo_qwen2.5_math_7b_aime.sh': None,  # i31
    'algorithms/dapo/run_dapo_qwen3_1.7b_aime.sh': None,  # i31
    'algorithms/dapo/run_dapo_qwen3_1.7b_aime_fully_async.sh': None,  # i31
    'algorithms/dapo/run_dapo_qwen3_1.7b_aime_fully_async_onestep.sh': None,  # i31
    'algorithms/dapo/run_dapo_qwen3_30b_a3b_lora_megatron_aime.sh': (MEGATRON,),  # i31
    'algorithms/dapo/run_dapo_qwen3_30b_a3b_megatron_aime.sh': (MEGATRON,),  # i31
    'algorithms/drgrpo/run_drgrpo_gsm8k.sh': None,  # i31
    'algorithms/gspo/run_gspo_gsm8k.sh': None,
    'algorithms/maxrl/run_maxrl_gsm8k.sh': None,  # i31
    'algorithms/reinforce++/run_reinforce++.sh': None,
    'algorithms/rloo/run_rloo.sh': None,
    'algorithms/sapo/run_sapo_gsm8k.sh': None,
    'algorithms/sapo/run_sapo_qwen3_4b_aime.sh': None,
    'async/async_run_gsm8k.sh': None,
    'delta_weight_sync/disagg/run_gsm8k_qwen1p5b_s3.sh': ("generator.inference_engine.external_proxy_url=http://127.0.0.1:8080 asks for SkyRL's inference router in", 'generator.weight_sync_backend=delta,',),
    'delta_weight_sync/run_dapo_qwen3.5_35b_a3b_delta.sh': ('generator.weight_sync_backend=delta,', MEGATRON,),  # i31
    'delta_weight_sync/run_gsm8k_qwen1p5b_gcs.sh': ('generator.weight_sync_backend=delta,',),
    'delta_weight_sync/run_gsm8k_qwen1p5b_nfs.sh': ('generator.weight_sync_backend=delta,',),
    'delta_weight_sync/run_gsm8k_qwen1p5b_s3.sh': ('generator.weight_sync_backend=delta,',),
    'fully_async/fully_async_run_gsm8k.sh': None,  # i31
    'fully_async/fully_async_run_gsm8k_megatron_lora.sh': (MEGATRON,),  # i31
    'fully_async/sim_trainer/run_fully_async_sim_gsm8k_e2e.sh': ('trainer.fully_async.simulate_training=true, trainer.fully_async.simulate_training_step_seconds=5 ask for', "trainer.placement.colocate_policy_ref=true puts the reference on the policy's devices, but ref has 4 ranks",),  # i31
    'fully_async/sim_trainer/run_fully_async_sim_gsm8k_external.sh': ('trainer.fully_async.simulate_training=true, trainer.fully_async.simulate_training_step_seconds=5 ask for', "generator.inference_engine.external_proxy_url=http://127.0.0.1:8080 asks for SkyRL's inference router in", "trainer.placement.colocate_policy_ref=true puts the reference on the policy's devices, but ref has 4 ranks",),  # i31
    'geometry3k/run_geometry3k.sh': ('generator.vision_language_generator=true asks for vision-language rollouts (images in prompts), which are not',),  # i31
    'geometry3k/run_geometry3k_lora.sh': ('generator.vision_language_generator=true asks for vision-language rollouts (images in prompts), which are not',),  # i31
    'gptoss/run_gsm8k_gptoss.sh': None,
    'gsm8k/run_32b_gsm8k.sh': None,
    'gsm8k/run_generation_gsm8k.sh': None,
    'gsm8k/run_gsm8k.sh': None,
    'gsm8k/run_gsm8k_modal.sh': None,
    'gsm8k/run_gsm8k_pd.sh': ('generator.inference_engine.enable_pd=true, generator.inference_engine.num_prefill=2 ask for prefill/decode',),
    'livecodebench/run_lcb.sh': None,
    'llm_as_a_judge/run_llm_judge.sh': None,
    'lora/run_qwen2_5_0.5b_gsm8k_grpo_lora.sh': None,
    'lora/run_qwen2_5_0.5b_gsm8k_ppo_lora.sh': None,
    'megatron/run_fsdp_baseline.sh': None,
    'megatron/run_megatron.sh': (MEGATRON,),
    'megatron/run_megatron_dapo_mimo_7b_rl.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3.5_35b_a3b.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3.5_9b.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3.6_27b_lora.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3.6_35b_a3b_lora.sh': (MEGATRON, "trainer.use_sample_packing='' has the wrong type: expected a boolean, got a string.",),  # i31
    'megatron/run_megatron_dapo_qwen3.6_35b_a3b_lora_int4_qat.sh': ('trainer.policy.model.fake_int4_qat.enabled=true,', "trainer.fused_lm_head_logprob=true asks for Megatron's fused LM-head log-probs and vocab-parallel entropy,", MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3_235b_a22b_lora.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3_30b_a3b.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3_30b_a3b_lora.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3_4b.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_dapo_qwen3_4b_lora.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_grpo_glm4_7_30b.sh': (MEGATRON,),
    'megatron/run_megatron_lora_qwen3-0.6b.sh': (MEGATRON,),
    'megatron/run_megatron_lora_qwen3-30b-a3b.sh': (MEGATRON,),  # i31
    'megatron/run_megatron_moonlight.sh': (MEGATRON,),
    'megatron/run_megatron_nemotron_mini_4b.sh': (MEGATRON,),
    'megatron/run_megatron_qwen3-235b-a22b.sh': (MEGATRON,),
    'megatron/run_megatron_qwen3-30b-a3b.sh': (MEGATRON,),
    'megatron/run_megatron_qwen3.5.sh': (MEGATRON,),
    'megatron/run_megatron_qwen3.5_35b_a3b.sh': (MEGATRON,),
    'megatron/run_search_megatron.sh': (MEGATRON,),
    'mini_swe_agent/run_mini_swe_30B.sh': ("generator.miniswe_config_path, generator.miniswe_traj_dir are settings of SkyRL's mini-swe-agent example", 'trainer.policy.sequence_parallel_size=4: sequence parallelism is not built: FSDP2 shards the parameters,',),
    'mini_swe_agent/run_mini_swe_8B.sh': ("generator.miniswe_config_path, generator.miniswe_traj_dir are settings of SkyRL's mini-swe-agent example", 'trainer.policy.sequence_parallel_size=2: sequence parallelism is not built: FSDP2 shards the parameters,',),
    'models/run_qwen3.5_0.8b.sh': None,
    'moe/run_qwen1_5_MoE_A2_7B.sh': None,
    'multiply/run_multiply.sh': None,
    'nemotron_3/run_nemotron_3_nano_4b_gsm8k.sh': (MEGATRON,),
    'on_policy_distillation/run_on_policy_distill_math_qwen3_1.7b.sh': None,
    'on_policy_distillation/run_on_policy_distill_math_qwen3_4b.sh': None,
    'ppo/run_ppo.sh': None,
    'remote_inference_server/run_remote.sh': ("generator.inference_engine.external_proxy_url=http://127.0.0.1:8000 asks for SkyRL's inference router in",),
    'rlm/run_multi_paper_rlm.sh': ("generator.enable_child_agents, generator.train_child_trajectories are settings of SkyRL's RLM example", 'generator.step_wise_trajectories=true needs generator.use_conversation_multi_turn=true (SkyRL refuses it',),
    'router_replay/run_dapo_moonlight_16b_a3b.sh': ('generator.inference_engine.enable_return_routed_experts=true asks for MoE routing replay, which is not built.', MEGATRON,),
    'router_replay/run_moonlight16b_router_replay.sh': ('generator.inference_engine.enable_return_routed_experts=true asks for MoE routing replay, which is not built.', MEGATRON,),
    'search/run_search.sh': None,  # i31
    'search/run_search_fully_async.sh': None,  # i31
    'spec_decode/run_megatron_dapo_mimo_7b_rl_specdecode.sh': ('trainer.mtp.enabled=true, trainer.mtp.num_speculative_tokens=3, trainer.mtp.loss_weight=0.2 ask for', MEGATRON,),  # i31
    'spec_decode/run_megatron_dapo_qwen3.5_9b_specdecode.sh': ('trainer.mtp.enabled=true, trainer.mtp.num_speculative_tokens=3, trainer.mtp.loss_weight=1.0 ask for', MEGATRON,),  # i31
    'spec_decode/run_search_megatron_mimo_7b_specdecode.sh': ('trainer.mtp.enabled=true, trainer.mtp.num_speculative_tokens=3, trainer.mtp.loss_weight=0.5 ask for', MEGATRON,),  # i31
    'step_wise/run_skyrl_sql_step_wise.sh': None,
    'step_wise/run_skyrl_sql_step_wise_qwen3.sh': None,
    'text_to_sql/run_skyrl_sql.sh': None,
    'text_to_sql/run_skyrl_sql_conversation_format.sh': None,
    'text_to_sql/run_skyrl_sql_fp8.sh': None,  # i31
    'text_to_sql/run_skyrl_sql_megatron_lora.sh': (MEGATRON,),  # i31
    'text_to_sql/run_sql_fsdp.sh': None,
    'text_to_sql/run_sql_fsdp_2node.sh': ('trainer.policy.sequence_parallel_size=2: sequence parallelism is not built: FSDP2 shards the parameters,',),
    'tis_correction/run_dapo_tis.sh': None,  # i31
    'training_backends/fsdp/run_fsdp.sh': None,
    'training_backends/run_no_seq_pack.sh': None,
    'turn_level_rewards/run_gsm8k_multi_turn.sh': None,
    'visgym/run_visgym_from_instruct.sh': ('generator.vision_language_generator=true asks for vision-language rollouts (images in prompts), which are not', 'generator.engine_init_kwargs has max_model_len, which the embedded hf engine does not take (it takes',),  # i31
    'visgym/run_visgym_from_sft.sh': ('generator.vision_language_generator=true asks for vision-language rollouts (images in prompts), which are not', 'generator.engine_init_kwargs has max_model_len, which the embedded hf engine does not take (it takes',),  # i31
}


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """The outcomes above are those of a machine without CUDA (the default engine: hf)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_every_captured_script_has_an_expectation():
    assert sorted(EXPECTED) == sorted(COMMANDS)
    assert len(COMMANDS) == 98


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_skyrl_0_4_example_command_lines(script, caplog):
    overrides = COMMANDS[script]
    expected = EXPECTED[script]
    if expected is None:
        with caplog.at_level(logging.INFO, logger="ridgeline.config"):
            load_config(overrides)
        # both releases' names are read without a line per key on every run
        assert not [r for r in caplog.records if "later SkyRL release" in r.getMessage()]
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    problems = info.value.problems
    assert len(problems) == len(expected), problems
    for problem, start in zip(problems, expected):
        assert problem.startswith(start), problem
        # one verdict per refusal
        assert not ("not built" in problem and "not planned" in problem) or problem.startswith(
            "trainer.fused_lm_head_logprob"), problem


def test_skyrl_0_4_and_0_3_1_names_in_one_config():
    """Both releases' keys in one command line: each read once, quietly; agreeing duplicates are fine."""
    cfg = load_config([
        "trainer.strategy=single", "trainer.logger=console", "generator.inference_engine.backend=hf",
        "generator.inference_engine.tensor_parallel_size=1", "generator.num_inference_engines=1",
        "generator.inference_engine.num_engines=1", "generator.async_engine=false",
        "generator.inference_engine.engine_init_kwargs={\"attn_implementation\": \"eager\"}",
        "trainer.max_training_steps=3", "trainer.log_path=/tmp/skyrl-logs-test", "trainer.eval_interval=0",
        "trainer.fully_async.enabled=false", "generator.chat_template_kwargs={reasoning_effort:'low'}"])
    g = cfg.generator
    assert (g.backend, g.inference_engine_tensor_parallel_size, g.num_inference_engines) == ("hf", 1, 1)
    assert dict(g.engine_init_kwargs) == {"attn_implementation": "eager"}
    assert dict(g.chat_template_kwargs) == {"reasoning_effort": "low"}
    assert (cfg.trainer.max_training_steps, cfg.trainer.log_path) == (3, "/tmp/skyrl-logs-test")
    assert cfg.trainer.async_mode == "sync"
    assert load_config(["trainer.strategy=single", "trainer.logger=console", "generator.backend=hf",
                        "trainer.train_batch_size=256", "trainer.policy_mini_batch_size=256",
                        "trainer.fully_async.enabled=true"]).trainer.async_mode == "fully_async"


def test_skyrl_0_4_settings_without_effect_are_said_in_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="ridgeline.config.loader"):
        load_config(["trainer.strategy=single", "trainer.logger=console", "generator.backend=hf",
                     "trainer.use_expandable_segments=false", "generator.use_cache_salt=false",
                     "generator.inference_engine.distributed_executor_backend=mp",
                     "trainer.policy.language_model_only=true"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("SkyRL 0.4 settings without effect here: "), lines
    for key in ("trainer.use_expandable_segments=false", "generator.use_cache_salt=false",
                "generator.inference_engine.distributed_executor_backend=mp", "trainer.policy.language_model_only=true"):
        assert key in lines[0]


GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
# what this machine lacks, and the sizes of a test: appended after the script's own overrides
ON_THIS_MACHINE = [
    "trainer.strategy=single", "generator.inference_engine.backend=hf",   # no GPUs, no vLLM
    "generator.inference_engine.tensor_parallel_size=1",
    "trainer.policy.model.path=tiny://llama", "trainer.mixed_precision=fp32",
    "generator.inference_engine.model_dtype=float32",
    "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2",
    "trainer.micro_forward_batch_size_per_gpu=10", "trainer.micro_train_batch_size_per_gpu=10",
    "trainer.eval_batch_size=4", "trainer.max_prompt_length=1024", "generator.sampling_params.max_generate_length=8",
    "trainer.logger=jsonl", "trainer.eval_before_train=false",
]


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="../shared/data/gsm8k is not beside the checkout")
def test_skyrl_0_4_gsm8k_command_line_trains_with_its_log_path_and_profiler(tmp_path, caplog):
    """skyrl 0.4's run_gsm8k.sh, its overrides unchanged but for the model, data, devices and sizes, runs
    through `python -m ridgeline.entrypoints.main_base`'s path (`ridgeline train`): trainer.log_path gets
    the infra log, trainer.max_training_steps caps the run (20 epochs of 2 batches -> 2 steps), and
    torch_profiler_config writes a Chrome trace of the second policy step."""
    from ridgeline import cli
    from ridgeline.data import prepare_gsm8k
    from ridgeline.tracking.trackers import read_metrics

    files = prepare_gsm8k(tmp_path / "data", input_dir=GSM8K_DIR, max_train=4, max_val=4)
    logs, traces = tmp_path / "infra-logs", tmp_path / "traces"
    overrides = COMMANDS["gsm8k/run_gsm8k.sh"] + ON_THIS_MACHINE + [
        f"data.train_data=['{files['train']}']", f"data.val_data=['{files['validation']}']",
        f"trainer.ckpt_path={tmp_path / 'ckpts'}", f"trainer.export_path={tmp_path / 'exports'}",
        f"trainer.log_path={logs}", "trainer.max_training_steps=2",
        "trainer.policy.torch_profiler_config.enable=true", f"trainer.policy.torch_profiler_config.save_path={traces}",
        "trainer.policy.torch_profiler_config.skip_first=0",   # step 1 warms up, step 2 is recorded
        "trainer.policy.torch_profiler_config.activities=[cpu]"]
    assert "trainer.log_path=/tmp/skyrl-logs" in COMMANDS["gsm8k/run_gsm8k.sh"]   # the script's own, replaced here
    caplog.set_level(logging.INFO)   # the command's own level (pytest's root logger stops at WARNING)
    assert cli.main(["train", *overrides]) == 0
    rows = read_metrics(tmp_path / "exports" / "gsm8k_test" / "metrics.jsonl")
    assert max(row.get("trainer/global_step", 0) for row in rows) == 2
    (infra,) = logs.glob("infra-*.log")
    text = infra.read_text()
    assert text and all(line.split(" ")[3].startswith(("ridgeline.inference", "ridgeline.models", "ridgeline.training",
                                                       "ridgeline.distributed")) for line in text.splitlines()
                        if line[:2].isdigit()), text
    assert [p.name.endswith(".pt.trace.json") for p in traces.iterdir()] == [True]


def test_0_4_algorithm_settings_reach_the_code():
    """`max_seq_len` (Dr. GRPO's divisor), `temperature` (the loss's logit scale) and
    `zero_variance_filter_tol` (equal returns for the filter) are read where SkyRL 0.4 reads them."""
    from ridgeline.trainer.dynamic_sampling import signal_groups
    from ridgeline.training.build import loss_temperature, skyrl_max_seq_len

    base = ["+experiment=tiny", "generator.sampling_params.temperature=0.7"]
    default = load_config(base)
    assert loss_temperature(default) == 0.7
    assert skyrl_max_seq_len(default) == default.generator.max_input_length + \
        default.generator.sampling_params.max_generate_length
    set_ = load_config(base + ["trainer.algorithm.temperature=1.0", "trainer.algorithm.max_seq_len=1536"])
    assert loss_temperature(set_) == 1.0 and skyrl_max_seq_len(set_) == 1536
    uids, rewards = ["a", "a", "b", "b"], [0.5, 0.5 + 1e-9, 0.0, 1.0]
    assert signal_groups(uids, rewards) == ["a", "b"]                       # exact equality: 1e-9 apart differs
    assert signal_groups(uids, rewards, default.trainer.algorithm.zero_variance_filter_tol) == ["b"]
