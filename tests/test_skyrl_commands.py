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
