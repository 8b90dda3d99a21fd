"""Issue 21's newcomer frictions, one test (or more) each: the user gets what they asked for or one
clear sentence, never a silent substitute. Runs are the real loop on the tiny preset.

1: environment.env_class over the rows' env_class    3: data.prepare re-applied, trainer.max_steps
5: doctor checks models and data; library noise off  6: no 4-GPU noise in other errors; eval --checkpoint
7: docs/config.md names every preset                 8: --cfg job, presets in --help, --version,
                                                        "step 7/20, ETA", the report named last
"""

import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ridgeline.cli import main
from ridgeline.config import ConfigError, load_config
from ridgeline.config.loader import list_experiments
from ridgeline.data.prepare_run import MANIFEST
from ridgeline.entrypoints.run import run_training, summary_lines
from ridgeline.tracking.trackers import read_metrics
from ridgeline.trainer.builders import EnvironmentCheckError, prepare_data
from conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
SHOUT = '''
from ridgeline.envs import SingleTurnEnv, register


@register("shout")
class Shout(SingleTurnEnv):
    """Every answer scores 0.25: a reward no preset env gives."""

    def score(self, action: str) -> float:
        return 0.25
'''


def tiny(out, *extra):
    return ["+experiment=tiny", f"trainer.export_path={out}", *extra]


@pytest.fixture(scope="module")
def shout_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "shout.py"
    path.write_text(SHOUT)
    return path


@pytest.fixture(scope="module")
def shout_run(tmp_path_factory, shout_module):
    """Three steps of the tiny preset with environment.env_class=shout (a user's env): two batches
    per epoch, so trainer.max_steps=3 crosses into the second epoch."""
    out = tmp_path_factory.mktemp("shout")
    cfg = load_config(tiny(out, f"environment.env_modules=[{shout_module}]", "environment.env_class=shout",
                           "data.prepare.num_train=32", "trainer.max_steps=3"))
    summary = run_training(cfg)
    return out, cfg, summary, read_metrics(out / "tiny" / "metrics.jsonl")


# ---------------------------------------------------------------------------------- friction 1
def test_1_config_env_class_reaches_the_prepared_rows_and_trains(shout_run):
    out, _, _, rows = shout_run
    table = pq.read_table(out / "tiny" / "data" / "train.parquet").to_pylist()
    assert {row["env_class"] for row in table} == {"shout"}
    steps = [r for r in rows if "reward/avg_raw_reward" in r]
    assert [r["reward/avg_raw_reward"] for r in steps] == [0.25, 0.25, 0.25]  # shout's reward, not arithmetic's


def test_1_a_chosen_env_class_no_row_uses_is_said(tmp_path, shout_module, caplog, capsys):
    """User files whose rows name their own env: the rows win, as in SkyRL, and one warning says so
    (at start and in `ridgeline doctor`) with the ways to make the config's env apply."""
    from ridgeline.data import PromptDataset, prepare_arithmetic
    from ridgeline.trainer.builders import check_environments

    files = prepare_arithmetic(tmp_path / "data", num_train=16, num_val=4)  # rows name arithmetic
    given = tiny(tmp_path, f"environment.env_modules=[{shout_module}]", "environment.env_class=shout",
                 "data.prepare=null", f"data.train_data=[{files['train']}]", f"data.val_data=[{files['validation']}]")
    cfg = load_config(given)
    check_environments(cfg.environment, cfg.data, cfg.generator.max_turns,
                       {"data.train_data": PromptDataset([files["train"]])}, None)
    assert caplog.messages == [
        f"environment.env_class=shout applies to no row: every row of {files['train']} names its own env_class "
        "(arithmetic), and a row's env_class wins, as in SkyRL (environment.env_class is the env of rows without "
        "one). To train on shout: an env_class column saying shout in the data"]
    assert main(["doctor", *given]) == 0
    assert re.search(r"\nwarn +environments: environment.env_class=shout applies to no row", capsys.readouterr().out)
    # SkyRL's default is no choice: rows of other envs with env_class left at gsm8k run without a word
    caplog.clear()
    cfg = load_config(tiny(tmp_path, "environment.env_class=gsm8k"))
    check_environments(cfg.environment, cfg.data, cfg.generator.max_turns,
                       {"data.train_data": PromptDataset([files["train"]])}, None)
    assert caplog.messages == []


# ---------------------------------------------------------------------------------- friction 3
def test_3_max_steps_caps_the_run_across_epochs(shout_run):
    _, _, summary, rows = shout_run
    assert summary["steps"] == 3
    assert [r["step"] for r in rows if "reward/avg_raw_reward" in r] == [1, 2, 3]


def test_3_max_steps_must_be_a_positive_number_of_steps(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.max_steps=0 must be null \(train trainer.epochs passes over the "
                                          r"data\) or a whole number of steps >= 1. Fix: e.g. trainer.max_steps=20"):
        load_config(tiny(tmp_path, "trainer.max_steps=0"))


def _prepare(overrides: list[str]) -> None:
    cfg = load_config(overrides)
    prepare_data(cfg.data, cfg.environment)


def test_3_a_changed_data_prepare_is_applied_and_said(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ridgeline.data.prepare_run")
    train = tmp_path / "tiny" / "data" / "train.parquet"
    _prepare(tiny(tmp_path, "data.prepare.num_train=32"))
    assert pq.read_metadata(train).num_rows == 32
    written = train.stat().st_mtime_ns
    _prepare(tiny(tmp_path, "data.prepare.num_train=32"))  # same settings: kept
    assert train.stat().st_mtime_ns == written
    _prepare(tiny(tmp_path, "data.prepare.num_train=48"))
    assert pq.read_metadata(train).num_rows == 48
    assert (f"data.prepare changed since the files in {tmp_path}/tiny/data were written "
            "(num_train: 32 -> 48): writing them again") in caplog.text
    assert json.loads((train.parent / MANIFEST).read_text())["num_train"] == 48


def test_3_files_not_written_by_data_prepare_are_kept_with_a_warning(tmp_path, caplog):
    _prepare(tiny(tmp_path, "data.prepare.num_train=32"))
    (tmp_path / "tiny" / "data" / MANIFEST).unlink()  # as an older Ridgeline or the user left them
    _prepare(tiny(tmp_path, "data.prepare.num_train=48"))
    assert pq.read_metadata(tmp_path / "tiny" / "data" / "train.parquet").num_rows == 32
    assert "data.prepare (dataset arithmetic) was not applied: the data files exist already" in caplog.text
    assert "Fix: delete them" in caplog.text


def test_3_an_option_the_dataset_does_not_take_is_refused(tmp_path):
    from ridgeline.data import DatasetError

    with pytest.raises(DatasetError, match=r"data.prepare.num_trian is not an option of the arithmetic dataset"):
        _prepare(tiny(tmp_path, "+data.prepare.num_trian=32"))


# ---------------------------------------------------------------------------------- friction 5
def test_5_doctor_fails_a_missing_data_file_and_a_hub_model_it_cannot_reach(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no hub: the model id must be in the cache
    code = main(["doctor", *tiny(tmp_path, "data.prepare=null", f"data.train_data=[{tmp_path}/missing.parquet]",
                                 "trainer.policy.model.path=nobody/no-such-model")])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"FAIL +trainer.policy.model.path: trainer.policy.model.path=nobody/no-such-model: no such "
                     r"local folder .*HF_HUB_OFFLINE is set but the local Hugging Face cache", out)
    assert re.search(rf"FAIL +data.train_data: .*{tmp_path}/missing.parquet", out)
    assert out.splitlines()[-1].startswith("verdict: NOT READY: trainer.policy.model.path=nobody/no-such-model")


def test_5_doctor_reads_the_data_and_builds_the_envs_before_ready(shout_run, shout_module, capsys):
    out, *_ = shout_run
    code = main(["doctor", *tiny(out, f"environment.env_modules=[{shout_module}]", "environment.env_class=shout",
                                 "data.prepare.num_train=32")])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "tiny://llama: built in memory from its name (no files)" in text
    assert f"{out}/tiny/data/train.parquet: 32 rows read and checked" in text
    assert f"{out}/tiny/data/validation.parquet: 16 rows read and checked" in text
    assert "environments: shout: each builds, starts and closes on the rows read" in text
    assert text.splitlines()[-1].startswith("verdict: ready")


def test_5_library_noise_is_silenced_once(monkeypatch):
    from ridgeline import library_noise

    monkeypatch.setattr(library_noise, "_done", False)
    monkeypatch.delenv("RIDGELINE_DEBUG", raising=False)
    levels = {name: logging.getLogger(name).level for name in library_noise.QUIET_LOGGERS}
    try:
        with warnings.catch_warnings(record=True) as seen:  # the filters are put back on leaving
            library_noise.silence_library_noise()
            warnings.warn_explicit("`x` is deprecated", FutureWarning, "modeling_utils.py", 1,
                                   module="transformers.modeling_utils")
            warnings.warn_explicit("a warning of the user's", FutureWarning, "mine.py", 1, module="mine")
        assert [str(w.message) for w in seen] == ["a warning of the user's"]
        for name in ("huggingface_hub", "matplotlib", "transformers"):
            assert not logging.getLogger(name).isEnabledFor(logging.WARNING), name
        assert logging.getLogger("ridgeline").isEnabledFor(logging.WARNING)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


# ---------------------------------------------------------------------------------- friction 6
def test_6_a_misspelled_preset_comes_without_the_base_configs_gpu_rules():
    with pytest.raises(ConfigError) as info:
        load_config(["+experiment=quickstrat", "generator.inference_engine_tensor_parallel_size=1", "trainer.epochs=abc"])
    text = str(info.value)
    assert "Could not find 'experiment/quickstrat'. Did you mean +experiment=quickstart?" in text
    assert "trainer.epochs=abc has the wrong type" in text
    assert "colocate_all" not in text and "num_inference_engines" not in text


@pytest.mark.integration
def test_6_a_bare_train_says_only_what_stops_it(tmp_path):
    """The base config's 4-GPU defaults are noted only once a run is built: a run that cannot start
    ends with its one message."""
    proc = subprocess.run([sys.executable, "-m", "ridgeline.cli", "train"], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, cwd=tmp_path,
                          env={**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ridgeline: trainer.policy.model.path=Qwen/Qwen2.5-1.5B-Instruct: "
                                                   "no such local folder"), proc.stderr
    assert "colocate" not in proc.stderr and "not acted on" not in proc.stderr


def test_6_eval_checkpoint_reads_the_runs_own_config(shout_run, capsys):
    out, *_ = shout_run
    # no preset, no env: the run's config.yaml names shout, its module and its export path
    assert main(["eval", "--checkpoint", str(out / "tiny" / "final_model")]) == 0
    printed = capsys.readouterr().out
    dump = out / "tiny" / "dumped_evals" / "eval_only"   # the run's folder: the tiny preset's exports_per_run
    assert f"in {dump}" in printed
    metrics = json.loads((dump / "aggregated_results.jsonl").read_text().splitlines()[-1])
    assert metrics["eval/all/avg_score"] == 0.25  # shout's reward
    saved = load_config([], run_config=dump / "config.yaml")
    assert saved.environment.env_class == "shout" and saved.trainer.policy.model.path == str(out / "tiny" / "final_model")


# ---------------------------------------------------------------------------------- friction 7
def test_7_config_docs_name_every_preset_and_no_built_algorithm_as_unsupported():
    text = (REPO / "docs" / "config.md").read_text()
    assert [name for name in list_experiments() if f"`{name}`" not in text] == []
    for line in text.splitlines():
        if "not supported yet" in line:
            assert not re.search(r"\b(rloo|gae|reinforce\+\+|gspo|cispo|ppo)\b", line), line


# ---------------------------------------------------------------------------------- friction 8
def test_8_train_prints_the_config_with_cfg_job(tmp_path, capsys):
    assert main(["train", "+experiment=tiny", "--cfg", "job", f"trainer.export_path={tmp_path}"]) == 0
    text = capsys.readouterr().out
    assert "env_class: arithmetic" in text and f"export_path: {tmp_path}" in text
    assert main(["train", "--cfg", "job", "-p", "trainer.algorithm", "+experiment=tiny"]) == 0
    assert capsys.readouterr().out.startswith("advantage_estimator: grpo\n")
    assert not (tmp_path / "tiny").exists()  # printed, nothing run


@pytest.mark.integration
def test_8_train_help_lists_the_presets_and_version_answers():
    helped = subprocess.run([sys.executable, "-m", "ridgeline.cli", "train", "--help"], capture_output=True,
                            text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert helped.returncode == 0
    assert [name for name in list_experiments() if f"\n  {name} " not in helped.stdout] == []
    version = subprocess.run([sys.executable, "-m", "ridgeline.cli", "--version"], capture_output=True, text=True,
                             timeout=HANG_GUARD_S, cwd=REPO)
    assert version.returncode == 0
    assert re.fullmatch(r"ridgeline \S+ \(Python [\d.]+, torch \S+, transformers \S+.*\); configs follow "
                        r"SkyRL-Train 0.3.1\n", version.stdout)


def test_8_step_line_and_the_overall_bar(monkeypatch):
    from ridgeline.tracking.progress import StepLog, run_progress, step_line

    assert step_line(7, 20, 62.0, 7) == "step 7/20 (35%), 1m02s elapsed, ETA 1m55s"
    assert step_line(8, 20, 30.0, 2) == "step 8/20 (40%), 0m30s elapsed, ETA 3m00s"  # resumed at 6
    assert step_line(0, 20, 0.0, 0) == "step 0/20 (0%), 0m00s elapsed, ETA ?"
    assert step_line(1, 3, 7300.0, 1) == "step 1/3 (33%), 2h01m elapsed, ETA 4h03m"
    monkeypatch.setenv("RIDGELINE_PROGRESS", "1")
    screen = io.StringIO()
    with run_progress(20, done=6, stream=screen) as bar:
        bar.update(reward=0.5)
    assert bar.visible and re.search(r"step .*7/20.*ETA.*reward=0\.5", screen.getvalue())
    monkeypatch.setenv("RIDGELINE_PROGRESS", "0")
    with run_progress(3, stream=io.StringIO()) as bar:
        assert isinstance(bar, StepLog)


@pytest.mark.integration
def test_8_a_run_from_the_console_command(tmp_path):
    """`ridgeline train` as a user runs it: no library warnings between the table's lines, the
    overall step line, and the report named on the last line."""
    proc = subprocess.run([sys.executable, "-m", "ridgeline.cli", "train", *tiny(tmp_path, "data.prepare.num_train=16",
                                                                                  "trainer.max_steps=1")],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == f"report: {tmp_path}/tiny/report.html"
    assert "step 1/1 (100%)" in proc.stderr
    for noise in ("Warning", "font cache", "deprecated", "Retry"):
        assert noise not in proc.stderr + proc.stdout, noise


def test_8_summary_names_the_report_last():
    lines = summary_lines({"eval_before": {"eval/all/pass_at_1": 0.25, "eval/all/accuracy": 0.125},
                           "eval_after": {"eval/all/pass_at_1": 0.5, "eval/all/accuracy": 0.375},
                           "steps": 3, "wall_seconds": 12.4, "final_model": "runs/tiny/final_model",
                           "plot": "runs/tiny/reward.png", "report": "runs/tiny/report.html"})
    assert lines == ["held-out (greedy): pass@1 0.250 -> 0.500, solved 0.125 -> 0.375",
                     "3 steps in 12 s; final model: runs/tiny/final_model; reward plot: runs/tiny/reward.png",
                     "report: runs/tiny/report.html"]
