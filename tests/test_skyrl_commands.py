"""SkyRL-Train 0.3.1's own example command lines (tests/data/skyrl_0_3_1_commands.json: the Hydra
overrides of every `skyrl-train/examples/**/*run_*.sh`, shell defaults expanded)
pass Ridgeline's config check unchanged, or are refused in one sentence naming the feature this
build does not have. Model and data paths are the scripts' own: the check reads no file."""

from __future__ import annotations

from pathlib import Path

import pytest

from ridgeline.config import load_config
from ridgeline.config.validate import ConfigError
from skyrl_commands import SKYRL_COMMANDS

COMMANDS = SKYRL_COMMANDS

MEGATRON = ("trainer.strategy=megatron: Megatron and DeepSpeed are not planned",)
DEEPSPEED = ("trainer.strategy=deepspeed: Megatron and DeepSpeed are not planned",)
SP = "trainer.policy.sequence_parallel_size={}: sequence parallelism is not built"
MINISWE = "generator.miniswe_config_path, generator.miniswe_traj_dir are settings of SkyRL's mini-swe-agent example"
TBENCH = "terminal_bench_config is a setting of SkyRL's Terminal-Bench example generator"

# every script -> the starts of the problems it must get, in order (None: accepted as it is). Scripts
# that run their own entry point are here too: their overrides are the ones a user brings.
EXPECTED: dict[str, tuple[str, ...] | None] = {
    "algorithms/cispo/run_cispo_gsm8k.sh": None,
    "algorithms/clip_cov_kl_cov/run_clip_cov.sh": None,
    "algorithms/clip_cov_kl_cov/run_kl_cov.sh": None,
    # the user's module that registers the name is one added override (tests/test_user_algorithms.py)
    "algorithms/custom_advantage_estimator/run_custom_adv_est.sh": (
        "trainer.algorithm.advantage_estimator=simple_baseline is not a registered advantage estimator",),
    "algorithms/custom_policy_loss/run_custom_policy_loss.sh": (
        "trainer.algorithm.policy_loss_type=reinforce is not a registered policy loss",),
    "algorithms/dapo/run_dapo_aime_qwen3_4b_aime.sh": None,   # +trainer.algorithm.overlong_buffer.* read as ours
    "algorithms/dapo/run_dapo_gsm8k.sh": None,
    "algorithms/dapo/run_dapo_qwen2.5_32b_aime.sh": (SP.format(4),),
    "algorithms/dapo/run_dapo_qwen2.5_math_7b_aime.sh": None,
    "algorithms/dapo/run_dapo_qwen3_1.7b_aime.sh": None,
    "algorithms/drgrpo/run_drgrpo_gsm8k.sh": None,
    "algorithms/reinforce++/run_reinforce++.sh": None,
    "algorithms/rloo/run_rloo.sh": None,
    "algorithms/sapo/run_sapo_gsm8k.sh": None,
    "algorithms/sapo/run_sapo_qwen3_4b_aime.sh": None,
    "async/async_run_gsm8k.sh": None,   # synchronous; +experiment=one_step_off_policy for its entry point
    "flash_rl/run_dapo_gsm8k_flashrl_0.5b_fp8.sh": None,
    "flash_rl/run_dapo_gsm8k_flashrl_0.5b_int8.sh": None,
    "flash_rl/run_dapo_gsm8k_flashrl_32b_int8.sh": None,
    "flash_rl/run_dapo_repro_flashrl_0.5b_int8.sh": None,
    "flash_rl/run_dapo_repro_flashrl_32b_int8.sh": None,
    # with +experiment=fully_async (SkyRL's entry point examples.fully_async.main_async) it loads: test_async.py
    "fully_async/async_run_gsm8k.sh": ("trainer.fully_async.num_parallel_generation_workers=1280 is read only by the "
                                       "fully asynchronous trainer",),
    "gptoss/run_gsm8k_gptoss.sh": None,
    "gsm8k/run_32b_gsm8k.sh": None,
    "gsm8k/run_generation_gsm8k.sh": None,
    "gsm8k/run_gsm8k.sh": None,
    "gsm8k/run_gsm8k_modal.sh": None,
    # 4 x 5 = 20 samples per optimizer step over 8 ranks: shares padded to 3 (SkyRL floors them to 2 and
    # takes 5 optimizer steps of 16 samples instead of 4 of 20)
    "livecodebench/run_lcb.sh": None,
    "llm_as_a_judge/run_llm_judge.sh": None,
    "lora/run_qwen2_5_0.5b_gsm8k_grpo_lora.sh": None,   # LoRA under FSDP2
    "lora/run_qwen2_5_0.5b_gsm8k_ppo_lora.sh": None,    # and on the critic
    "megatron/run_fsdp_baseline.sh": None,
    "megatron/run_megatron.sh": MEGATRON,
    "megatron/run_megatron_dapo_qwen3_4b.sh": MEGATRON,
    "megatron/run_megatron_dapo_qwen3_4b_lora.sh": MEGATRON,
    "megatron/run_megatron_lora_qwen3-0.6b.sh": MEGATRON,
    "megatron/run_megatron_lora_qwen3-30b-a3b.sh": MEGATRON,
    "megatron/run_megatron_moonlight.sh": MEGATRON,
    "megatron/run_megatron_qwen3-235b-a22b.sh": MEGATRON,
    "megatron/run_megatron_qwen3-30b-a3b.sh": MEGATRON,
    "megatron/run_search_megatron.sh": MEGATRON,
    "mini_swe_agent/run_mini_swe_30B.sh": (MINISWE, SP.format(4)),
    "mini_swe_agent/run_mini_swe_8B.sh": (MINISWE, SP.format(2)),
    "moe/run_qwen1_5_MoE_A2_7B.sh": None,
    "multiply/run_multiply.sh": None,
    # no_op and importance_sampling are built in; +experiment=on_policy_distillation makes the run
    # SkyRL's distillation (tests/test_distillation.py), without it the trainer warns
    "on_policy_distillation/run_on_policy_distill_math_qwen3_1.7b.sh": None,
    "on_policy_distillation/run_on_policy_distill_math_qwen3_4b.sh": None,
    "ppo/run_ppo.sh": None,
    "remote_inference_engine/run_remote.sh": None,
    "search/run_search.sh": None,                  # per-model warmup, search env settings
    "search/run_search_conversation_format.sh": None,
    "step_wise/run_skyrl_sql_step_wise.sh": None,  # generator.step_wise_trajectories=true
    # + its +generator.retokenize_chat_history=true, which 0.3.1 never reads: ignored with a notice
    "step_wise/run_skyrl_sql_step_wise_qwen3.sh": None,
    "terminal_bench/run_tbench.sh": (TBENCH,),
    "terminal_bench/run_tbench_gen.sh": (TBENCH,),
    "text_to_sql/run_skyrl_sql.sh": None,          # stop strings, the text2sql env's db_path
    "text_to_sql/run_skyrl_sql_conversation_format.sh": None,
    "text_to_sql/run_skyrl_sql_megatron_lora.sh": MEGATRON,
    "text_to_sql/run_sql_deepspeed.sh": DEEPSPEED,
    "text_to_sql/run_sql_fsdp.sh": None,
    "text_to_sql/run_sql_fsdp_2node.sh": (SP.format(2),),
    "tis_correction/run_dapo_tis.sh": None,
    "training_backends/deepspeed/run_deepspeed.sh": DEEPSPEED,
    "training_backends/fsdp/run_fsdp.sh": None,
    "training_backends/fsdp/run_fsdp2.sh": None,
    # (SkyRL refuses its micro-batches of 8 over shares of 5 too; here they would run as one of 5)
    "training_backends/run_no_seq_pack.sh": DEEPSPEED,
    "turn_level_rewards/run_gsm8k_multi_turn.sh": None,
}


def test_every_extracted_script_has_an_expectation():
    assert sorted(EXPECTED) == sorted(COMMANDS)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_skyrl_example_command_lines(script):
    overrides = COMMANDS[script]
    expected = EXPECTED[script]
    if expected is None:
        load_config(overrides)
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    problems = info.value.problems
    assert len(problems) == len(expected), problems
    for problem, start in zip(problems, expected):
        assert problem.startswith(start), problem


GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
# what this machine lacks, and the sizes of a test: appended after the script's own overrides
ON_THIS_MACHINE = [
    "trainer.strategy=single", "generator.backend=hf",           # no GPUs, no vLLM
    "trainer.policy.model.path=tiny://llama", "trainer.mixed_precision=fp32", "generator.model_dtype=float32",
    "trainer.epochs=1", "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2",
    "trainer.micro_forward_batch_size_per_gpu=10", "trainer.micro_train_batch_size_per_gpu=10",
    "trainer.eval_batch_size=4", "trainer.max_prompt_length=1024", "generator.sampling_params.max_generate_length=8",
    "trainer.logger=jsonl",
]


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="../shared/data/gsm8k is not beside the checkout")
def test_skyrl_gsm8k_command_line_runs_and_logs_skyrl_metric_names(tmp_path):
    """SkyRL's run_gsm8k.sh, its overrides unchanged but for the model, the data files, the devices and
    the sizes, trains on the tiny model here and logs under SkyRL's metric names."""
    from ridgeline.data import prepare_gsm8k
    from ridgeline.entrypoints.run import run_training
    from ridgeline.tracking.trackers import read_metrics

    files = prepare_gsm8k(tmp_path / "data", input_dir=GSM8K_DIR, max_train=4, max_val=4)
    cfg = load_config(COMMANDS["gsm8k/run_gsm8k.sh"] + ON_THIS_MACHINE + [
        f"data.train_data=['{files['train']}']", f"data.val_data=['{files['validation']}']",
        f"trainer.ckpt_path={tmp_path / 'ckpts'}", f"trainer.export_path={tmp_path / 'exports'}"])
    assert cfg.trainer.ckpt_interval == 10 and cfg.generator.n_samples_per_prompt == 5  # the script's own
    run_training(cfg)
    rows = read_metrics(tmp_path / "exports" / "gsm8k_test" / "metrics.jsonl")
    names = set().union(*(row.keys() for row in rows))
    for name in ("trainer/global_step", "trainer/epoch", "reward/avg_raw_reward", "reward/avg_pass_at_5",
                 "reward/mean_positive_reward", "generate/avg_num_tokens", "loss/avg_raw_advantages",
                 "policy/policy_loss", "policy/policy_kl", "policy/raw_grad_norm", "policy/policy_lr",
                 "timing/step", "timing/generate", "timing/sync_weights", "eval/all/avg_score",
                 "eval/all/pass_at_1"):
        assert name in names, name
    assert max(row.get("trainer/global_step", 0) for row in rows) == 2
