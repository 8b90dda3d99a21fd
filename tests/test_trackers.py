"""Trackers (console, jsonl, tensorboard, wandb offline, mlflow file store), the failure guard,
training-batch dumps and progress bars. Every backend writes real files that are read back."""

from __future__ import annotations

import glob
import io
import json
import time
import logging
import math
from pathlib import Path

import pytest
import torch

from ridgeline.errors import UserError
from ridgeline.tracking.trackers import (TRACKER_NAMES, GuardedTracker, build_trackers, disabled_trackers,
                                         read_metrics)

STEP_METRICS = [
    {"reward/avg_raw_reward": 0.25, "policy/policy_loss": -0.01, "policy/policy_kl": 0.002,
     "eval/all/pass_at_1": 0.5, "timing/step": 1.5, "throughput/tokens_per_second": 12345.0},
    {"reward/avg_raw_reward": 0.5, "policy/policy_loss": 0.02, "policy/policy_kl": float("nan"),
     "timing/step": 1.25, "throughput/tokens_per_second": 23456.0},
    {"reward/avg_raw_reward": 0.75, "policy/policy_loss": 0.03, "policy/policy_kl": float("inf"),
     "eval/gsm8k@v2/pass_at_1": 0.75, "timing/step": 1.0, "throughput/tokens_per_second": 34567.0},
]


def log_steps(trackers, metrics=STEP_METRICS, first_step=1):
    for offset, row in enumerate(metrics):
        for tracker in trackers:
            tracker.log(dict(row), first_step + offset)


@pytest.fixture()
def wandb_offline(monkeypatch, tmp_path):
    """wandb with no network and nothing written outside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


@pytest.fixture()
def mlflow_local(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # undone after the test


# --------------------------------------------------------------------------- building, jsonl
def test_unknown_tracker_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        build_trackers(["console", "neptune"], tmp_path)
    assert "'neptune'" in str(err.value)
    for name in TRACKER_NAMES:
        assert name in str(err.value)


def test_jsonl_is_always_written_and_keeps_old_call_shape(tmp_path):
    trackers = build_trackers(["jsonl"], tmp_path)  # positional form used before issue 5
    assert [t.name for t in trackers] == ["jsonl"]
    log_steps(trackers)
    for tracker in trackers:
        tracker.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward/avg_raw_reward"] == 0.25
    assert rows[1]["policy/policy_kl"] is None and rows[2]["policy/policy_kl"] is None  # NaN, inf -> null


def test_single_name_string_and_duplicates(tmp_path, capsys):
    trackers = build_trackers("console", tmp_path)
    assert [t.name for t in trackers] == ["jsonl", "console"]
    assert [t.name for t in build_trackers(["console", "console", "jsonl"], tmp_path / "b")] == ["jsonl", "console"]


def test_read_metrics_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


# --------------------------------------------------------------------------- console
def test_console_table_headers(capsys):
    from ridgeline.tracking.console import ConsoleTracker

    console = ConsoleTracker(header_every=3)
    console.log({"eval/all/pass_at_1": 0.5, "timing/eval": 2.0}, 0)
    for step in range(1, 6):
        console.log({"reward/avg_raw_reward": 0.1 * step, "reward/accuracy": 0.5, "policy/raw_grad_norm": 1e-5,
                     "throughput/tokens_per_second": 12345.6, "generate/env_errors": 3.0}, step)
    lines = capsys.readouterr().out.splitlines()
    headers = [line.split() for line in lines if line.split()[0] == "step"]
    # step 0: eval columns only; step 1 adds columns (header again); every 3 rows after that
    assert headers[0] == ["step", "eval@1", "s/eval"]
    assert headers[1] == ["step", "reward", "acc", "eval@1", "gnorm", "s/eval", "tok/s"]
    assert len(headers) == 3
    row = next(line.split() for line in lines if line.split()[0] == "1")
    assert row == ["1", "0.1", "0.5", "-", "1.00e-05", "-", "12346"]
    assert "env_errors" not in "\n".join(lines)  # details stay out of the table
    assert len({len(line) for line in lines[2:]}) == 1  # headers and rows line up


# --------------------------------------------------------------------------- tensorboard
def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = build_trackers(["tensorboard"], tmp_path)
    log_steps(trackers)
    for tracker in trackers:
        tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"reward/avg_raw_reward", "policy/policy_kl", "eval/gsm8k@v2/pass_at_1"} <= set(tags)
    rewards = [(e.step, e.value) for e in acc.Scalars("reward/avg_raw_reward")]
    assert rewards == [(1, 0.25), (2, 0.5), (3, 0.75)]
    kl = [e.value for e in acc.Scalars("policy/policy_kl")]
    assert kl[0] == pytest.approx(0.002) and math.isnan(kl[1]) and math.isinf(kl[2])


def test_tensorboard_resume_hides_steps_logged_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = build_trackers(["tensorboard"], tmp_path)
    log_steps(first)                        # steps 1-3; say the checkpoint was at step 1
    for tracker in first:
        tracker.close()
    again = build_trackers(["tensorboard"], tmp_path, resume_step=1)
    log_steps(again, [{"reward/avg_raw_reward": 0.9}], first_step=2)
    for tracker in again:
        tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/avg_raw_reward")] == [(1, 0.25), (2, pytest.approx(0.9))]


# --------------------------------------------------------------------------- wandb
def wandb_records(path: Path):
    """Records of a `.wandb` file: a 7-byte header, then LevelDB-log style chunks of 32 KiB
    blocks, each chunk `crc(4) length(2) type(1) data` (type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_files(tmp_path, wandb_offline):
    config = {"trainer": {"seed": 3, "algorithm": {"advantage_estimator": "grpo"}}}
    trackers = build_trackers(["wandb"], tmp_path, project_name="proj", run_name="my-run", config=config,
                              run_id="rid123")
    assert trackers[1].tracker.mode == "offline"
    log_steps(trackers)
    for tracker in trackers:
        tracker.close()
    assert not disabled_trackers(trackers)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*-rid123" / "run-rid123.wandb"))
    assert len(files) == 1
    # wandb's service process writes the file; under a loaded CPU its last records can land a moment
    # after finish() returns, so read until the run record and all three steps are there
    deadline = time.monotonic() + 20
    while True:
        history, run = {}, None
        for record in wandb_records(Path(files[0])):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history[items["_step"]] = items
        if (run is not None and len(history) == 3) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert run is not None, "no run record in the offline wandb file"
    assert (run.project, run.display_name, run.run_id) == ("proj", "my-run", "rid123")
    assert json.loads({u.key: u.value_json for u in run.config.update}["trainer"])["seed"] == 3
    assert sorted(history) == [1, 2, 3]
    assert history[3]["reward/avg_raw_reward"] == 0.75
    assert history[3]["eval/gsm8k@v2/pass_at_1"] == 0.75
    assert history[2]["throughput/tokens_per_second"] == 23456


def test_wandb_mode_defaults_to_offline_without_a_key(tmp_path, monkeypatch):
    from ridgeline.tracking import wandb_tracker
    from ridgeline.tracking.wandb_tracker import resolve_wandb_mode

    home = {"HOME": str(tmp_path)}
    assert resolve_wandb_mode(home) == "offline"
    assert resolve_wandb_mode({**home, "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_wandb_mode({**home, "WANDB_MODE": "online"}) == "online"
    assert resolve_wandb_mode({**home, "WANDB_MODE": "dryrun"}) == "offline"   # wandb's older name
    with pytest.raises(UserError, match="WANDB_MODE='onlin' is not a W&B mode"):
        resolve_wandb_mode({**home, "WANDB_MODE": "onlin"})
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    monkeypatch.setattr(wandb_tracker, "_reachable", lambda host, port, timeout: False)
    assert resolve_wandb_mode(home) == "offline"          # a key but no network
    monkeypatch.setattr(wandb_tracker, "_reachable", lambda host, port, timeout: host == "api.wandb.ai")
    assert resolve_wandb_mode(home) == "online"
    assert resolve_wandb_mode({"HOME": str(tmp_path / "none"), "WANDB_API_KEY": "k"}) == "online"


# --------------------------------------------------------------------------- mlflow
def test_mlflow_key_sanitising():
    from ridgeline.tracking.mlflow_tracker import mlflow_key

    assert mlflow_key("reward/avg_raw_reward") == "reward/avg_raw_reward"
    assert mlflow_key("eval/gsm8k@v2/pass_at_1") == "eval/gsm8k_v2/pass_at_1"
    assert mlflow_key("/a//b/../c(d),e:") == "a/b/_/c_d__e_"
    assert len(mlflow_key("k" * 400)) == 250


def test_mlflow_file_store_and_resume(tmp_path, mlflow_local):
    from mlflow.tracking import MlflowClient

    config = {"trainer": {"seed": 3, "logger": ["console", "mlflow"], "long": "x" * 2000}, "odd@key": 1}
    trackers = build_trackers(["mlflow"], tmp_path, project_name="proj", run_name="my-run", config=config,
                              run_id="job-1")
    log_steps(trackers)
    for tracker in trackers:
        tracker.close()
    assert not disabled_trackers(trackers)
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params["trainer.seed"] == "3"
    assert run.data.params["trainer.logger"] == "['console', 'mlflow']"
    assert run.data.params["odd_key"] == "1"
    assert len(run.data.params["trainer.long"]) == 500
    history = client.get_metric_history(run_id, "reward/avg_raw_reward")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.value for m in client.get_metric_history(run_id, "eval/gsm8k_v2/pass_at_1")] == [0.75]
    assert [m.step for m in client.get_metric_history(run_id, "policy/policy_kl")] == [1]  # nan/inf dropped

    # a resumed job with the same run id continues the same MLflow run
    again = build_trackers(["mlflow"], tmp_path, project_name="proj", run_name="my-run", config=config,
                           run_id="job-1")
    log_steps(again, STEP_METRICS[:1], first_step=4)
    for tracker in again:
        tracker.close()
    assert (tmp_path / "mlflow_run_id").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "reward/avg_raw_reward")] == [1, 2, 3, 4]
    # a different job in the same folder gets its own run
    other = build_trackers(["mlflow"], tmp_path, project_name="proj", run_name="other", run_id="job-2")
    assert other[1].tracker.run_id != run_id
    for tracker in other:
        tracker.close()


# --------------------------------------------------------------------------- failure guard
def test_failing_backend_is_disabled_once_and_others_keep_logging(tmp_path, caplog, capsys):
    trackers = build_trackers(["console", "tensorboard"], tmp_path)
    board = next(t for t in trackers if t.name == "tensorboard")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    board.tracker.writer.add_scalar = broken
    with caplog.at_level(logging.WARNING, logger="ridgeline.tracking"):
        log_steps(trackers)
        for tracker in trackers:
            tracker.close()
    warnings = [r for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(warnings) == 1 and "disk full" in warnings[0].getMessage()
    assert isinstance(board, GuardedTracker) and board.disabled and board.dropped == 3
    assert disabled_trackers(trackers) == {"tensorboard": "OSError: disk full"}
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    assert capsys.readouterr().out.count("\n") >= 4  # the console printed a header and 3 rows


def test_build_failure_closes_the_trackers_already_built(tmp_path, monkeypatch):
    from ridgeline.tracking import trackers as trackers_module

    closed = []
    real_make = trackers_module._make

    def make(name, *args):
        if name == "mlflow":
            raise RuntimeError("no server")
        tracker = real_make(name, *args)
        tracker.close = lambda: closed.append(name)
        return tracker

    monkeypatch.setattr(trackers_module, "_make", make)
    with pytest.raises(RuntimeError, match="no server"):
        build_trackers(["console", "mlflow"], tmp_path)
    assert closed == ["console"]


# --------------------------------------------------------------------------- dumps
def test_dump_training_batch_rows(tmp_path, tiny_tokenizer):
    from ridgeline.data import encode_chat_prompt
    from ridgeline.tracking.dumps import dump_training_batch
    from ridgeline.training.batch import build_training_batch

    tok = tiny_tokenizer
    prompts = [encode_chat_prompt(tok, [{"role": "user", "content": text}]) for text in ("1+1?", "what is 12*3?")]
    answer = tok.encode("2<|im_end|>", add_special_tokens=False)
    turn = tok.encode("call", add_special_tokens=False) + tok.encode("OBS", add_special_tokens=False) \
        + tok.encode("36<|im_end|>", add_special_tokens=False)
    turn_mask = [1] * 4 + [0] * 3 + [1] * 3
    batch = build_training_batch(prompts, [answer, turn], [[1] * len(answer), turn_mask], [1.0, [0.0] * 9 + [0.5]],
                                 ["u0", "u1"], None, tok.pad_token_id)
    batch.advantages = batch.response_mask * torch.tensor([[0.5], [-0.5]])
    path = dump_training_batch(batch, tok, tmp_path / "dumped_data" / "global_step_7_training_input.jsonl", 7)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    first, second = rows
    assert first["step"] == 7 and first["uid"] == "u0"
    assert first["prompt"].endswith("user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert first["response"] == "2<|im_end|>"
    assert first["reward"] == 1.0 and first["response_tokens"] == 2
    assert first["loss_mask"] == {"sum": 2.0, "length": 2}
    assert first["advantages"] == {"sum": 1.0, "mean": 0.5, "length": 2}
    assert "trained_response" not in first
    assert second["response"] == "callOBS36<|im_end|>"
    assert second["loss_mask"] == {"sum": 7.0, "length": 10}
    assert second["rewards"]["sum"] == 0.5 and second["reward"] == 0.5
    assert second["trained_response"] == "call[3 tokens not trained]36<|im_end|>"
    assert "what is 12*3?" in second["prompt"] and "<|im_end|><|im_end|>" not in second["prompt"]


# --------------------------------------------------------------------------- progress bars
class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_off_a_terminal(monkeypatch, capfd):
    from ridgeline.tracking.progress import progress

    monkeypatch.delenv("RIDGELINE_PROGRESS", raising=False)
    stream = io.StringIO()
    with progress(10, "generate", stream=stream) as bar:
        for _ in range(4):
            bar.update()
        bar.update(3)
        bar.set_postfix(reward=0.5)
    assert (bar.n, bar.total, bar.visible) == (7, 10, False)
    assert stream.getvalue() == ""
    with progress(5, "default stream") as bar:  # pytest's stderr is not a terminal
        bar.update(5)
    assert bar.n == 5 and capfd.readouterr() == ("", "")


def test_progress_on_a_terminal_and_env_override(monkeypatch):
    from ridgeline.tracking.progress import progress, progress_enabled

    monkeypatch.delenv("RIDGELINE_PROGRESS", raising=False)
    terminal = FakeTerminal()
    with progress(3, "train", stream=terminal) as bar:
        bar.update(3)
    assert bar.visible and bar.n == 3 and "train" in terminal.getvalue()
    monkeypatch.setenv("RIDGELINE_PROGRESS", "0")
    assert not progress_enabled(FakeTerminal())
    quiet = FakeTerminal()
    with progress(3, "train", stream=quiet) as bar:
        bar.update()
    assert quiet.getvalue() == "" and bar.n == 1
    monkeypatch.setenv("RIDGELINE_PROGRESS", "1")
    forced = io.StringIO()
    with progress(2, "forced", stream=forced, leave=True) as bar:
        bar.update(2)
    assert "forced" in forced.getvalue() and "2/2" in forced.getvalue()
