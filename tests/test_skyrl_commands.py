"""SkyRL-Train 0.3.1's own example command lines (tests/data/skyrl_0_3_1_commands.json: the Hydra
overrides of a representative set of `skyrl-train/examples/**/run_*.sh`, shell defaults expanded)
pass Ridgeline's config check unchanged, or are refused in one sentence naming the feature this
build does not have. Model and data paths are the scripts' own: the check reads no file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ridgeline.config import load_config
from ridgeline.config.validate import ConfigError

COMMANDS = json.loads((Path(__file__).parent / "data" / "skyrl_0_3_1_commands.json").read_text())["commands"]

# script -> the start of the one problem it must get (None: accepted as it is)
EXPECTED = {
    "gsm8k/run_gsm8k.sh": None,
    "ppo/run_ppo.sh": None,
    "algorithms/rloo/run_rloo.sh": None,
    "algorithms/cispo/run_cispo_gsm8k.sh": None,
    "remote_inference_engine/run_remote.sh": None,
    "turn_level_rewards/run_gsm8k_multi_turn.sh": None,
    "training_backends/fsdp/run_fsdp.sh": None,
    "text_to_sql/run_skyrl_sql.sh": None,          # stop strings, the text2sql env's db_path
    "search/run_search.sh": None,                  # per-model warmup, search env settings
    "step_wise/run_skyrl_sql_step_wise.sh": None,  # generator.step_wise_trajectories=true
    # + its +generator.retokenize_chat_history=true, which 0.3.1 never reads: ignored with a notice
    "step_wise/run_skyrl_sql_step_wise_qwen3.sh": None,
    "megatron/run_megatron.sh": "trainer.strategy=megatron is not supported yet",
    "training_backends/deepspeed/run_deepspeed.sh": "trainer.strategy=deepspeed is not supported yet",
    "lora/run_qwen2_5_0.5b_gsm8k_grpo_lora.sh": "trainer.policy.model.lora.rank=32 with trainer.strategy=fsdp2",
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_skyrl_example_command_lines(script):
    overrides = COMMANDS[script]
    expected = EXPECTED[script]
    if expected is None:
        load_config(overrides)
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith(expected), info.value.problems[0]


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
