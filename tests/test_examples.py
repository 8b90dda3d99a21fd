"""Every example under examples/ runs its own run.sh for two steps, with the tiny random model in
place of its real one: the script, the preset, the data preparation, the environment and the
loop all as a user would run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S, REPO, SHARED

# Swap the example's model for the tiny one and keep everything small.
TINY = [
    "trainer.policy.model.path=tiny://llama",
    "trainer.policy.model.gguf_file=null",
    "trainer.mixed_precision=fp32",
    "generator.model_dtype=float32",
    "trainer.policy.optimizer_config.lr=1e-3",
    "trainer.eval_before_train=false",
    "generator.sampling_params.max_generate_length=8",
    "generator.eval_sampling_params.max_generate_length=8",
]

# example -> overrides that make its dataset two steps long
EXAMPLES: dict[str, list[str]] = {
    "gsm8k": ["+data.prepare.max_train=32", "+data.prepare.max_val=4", "trainer.train_batch_size=16",
              "trainer.policy_mini_batch_size=16", "trainer.micro_train_batch_size_per_gpu=16",
              "trainer.max_prompt_length=1024", "generator.n_samples_per_prompt=2"],
    "multiply": ["data.prepare.num_train=16", "data.prepare.num_val=4", "trainer.epochs=1"],
    "text2sql": ["+data.prepare.num_train=8", "data.prepare.num_val=4", "trainer.max_prompt_length=4096",
                 "generator.max_input_length=4096"],
    "code": ["data.prepare.num_train=8", "data.prepare.num_val=4", "generator.n_samples_per_prompt=2",
             "generator.sampling_params.max_generate_length=64"],
    "custom_reward": ["data.prepare.num_train=16", "data.prepare.num_val=4"],
    "custom_tool_env": ["data.prepare.num_train=16", "data.prepare.num_val=4"],
    "custom_algorithms": ["data.prepare.num_train=16", "data.prepare.num_val=4"],
}


def run_example(name: str, tmp_path: Path, *extra: str) -> list[dict]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    overrides = [*TINY, f"trainer.export_path={tmp_path}", *EXAMPLES[name], *extra]
    done = subprocess.run(["bash", str(REPO / "examples" / name / "run.sh"), *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = next(p for p in tmp_path.iterdir() if (p / "metrics.jsonl").exists())
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "policy/policy_loss" in r]


@pytest.mark.parametrize("name", ["multiply", "code", "custom_reward", "custom_tool_env", "custom_algorithms"])
@pytest.mark.integration
def test_example_runs(name: str, tmp_path: Path) -> None:
    rows = run_example(name, tmp_path)
    assert len(steps(rows)) == 2
    assert any("eval/all/pass_at_1" in r for r in rows)


@pytest.mark.integration
def test_multi_turn_examples_take_several_turns(tmp_path: Path) -> None:
    rows = steps(run_example("multiply", tmp_path, "generator.sampling_params.temperature=1.0"))
    # 8-token random answers are never right: every trajectory uses all 3 turns
    assert all(r["generate/avg_turns"] == 3.0 for r in rows)
    # engine and trainer agree on every sampled token (fp32); observation tokens are left out
    assert all(r["rollout/logprob_abs_diff_mean"] < 1e-4 for r in rows)
    assert all("environment/attempts" in r for r in rows)


@pytest.mark.integration
def test_text2sql_example_runs_real_sqlite(tmp_path: Path) -> None:
    rows = steps(run_example("text2sql", tmp_path))
    assert len(rows) == 2
    assert all(r["environment/sql_calls"] >= 0 for r in rows)
    assert (tmp_path / "example_text2sql" / "data" / "databases" / "shop.sqlite").exists()


@pytest.mark.skipif(not (SHARED / "data" / "gsm8k" / "train.jsonl").exists(), reason="needs ../shared GSM8K files")
@pytest.mark.integration
def test_gsm8k_example_runs_on_the_shared_files(tmp_path: Path) -> None:
    data = tmp_path / "gsm8k_data"
    rows = steps(run_example("gsm8k", tmp_path, f"data.train_data=[{data}/train.parquet]",
                             f"data.val_data=[{data}/validation.parquet]", f"data.prepare.output_dir={data}",
                             f"+data.prepare.input_dir={SHARED / 'data' / 'gsm8k'}"))
    assert len(rows) == 2
