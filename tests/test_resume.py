"""Exact resume, for real: a run killed with SIGKILL and started again with the same command logs,
for every step after its checkpoint, exactly (==) the metrics of an uninterrupted run; a resume at
an epoch boundary neither skips nor repeats the next epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ridgeline.config import load_config
from ridgeline.trainer.trainer import Trainer
from ridgeline.trainer.run_lock import LOCK_FILE

# 8 steps of 16 prompts, a checkpoint after each, resume from the newest one
KILLED = ["+experiment=tiny", "data.prepare.num_train=128", "data.prepare.num_val=8", "trainer.ckpt_interval=1",
          "trainer.resume_mode=latest", "trainer.logger=jsonl"]
# 2 epochs of 2 steps; the reference model becomes the policy after epoch 1
EPOCHS = ["+experiment=tiny", "data.prepare.num_train=32", "data.prepare.num_val=4", "trainer.epochs=2",
          "trainer.update_ref_every_epoch=true", "trainer.ckpt_interval=1", "trainer.eval_before_train=false"]


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics rows without the measured ones (timings, throughput, process memory), and without
    the rows that hold nothing else: the timings of a step's checkpoint are logged after it is
    written, in a row of their own that a kill may land before (docs/logging.md)."""
    kept = [{k: v for k, v in row.items()
             if not k.startswith(("timing/", "throughput/", "memory/")) and not k.endswith("_seconds")} for row in rows]
    return [row for row in kept if len(row) > 1]


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "policy/policy_loss" in r]


def kill_after_step_2(command: list[str], run_dir: Path, log_file: Path) -> None:
    """Start `command`, SIGKILL it once step 2 is in `run_dir`'s metrics.jsonl: the process is
    then writing checkpoint 2 (its temp folder is left behind, never loaded) or already in step 3
    (its rows, if any, are cut on resume). It waits for that row however long a loaded machine
    takes (no deadline: a kill before step 2 would test nothing); a run that ends first fails."""
    metrics = run_dir / "metrics.jsonl"
    with open(log_file, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        while proc.poll() is None:
            if metrics.exists() and any(s >= 2 for s in train_steps(
                    [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")])):
                break
            time.sleep(0.005)  # polling for the row, not timing anything
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, log_file.read_text()[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("uninterrupted")
    Trainer.from_config(load_config([*KILLED, f"trainer.export_path={out}"])).train()
    return read_rows(out / "tiny")


@pytest.mark.integration
def test_a_killed_run_resumes_exactly(uninterrupted, tmp_path):
    command = [sys.executable, "-m", "ridgeline.cli", "train", *KILLED, f"trainer.export_path={tmp_path}"]
    run_dir = tmp_path / "tiny"
    kill_after_step_2(command, run_dir, tmp_path / "first.log")
    killed_at = max(train_steps(read_rows(run_dir)))
    assert 2 <= killed_at < 8
    assert (run_dir / "ckpts" / "latest_ckpt_global_step.txt").read_text().isdigit()

    again = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_from = int(again.stderr.split("resumed from ")[1].split("global_step_")[1].split(":")[0])
    assert 1 <= resumed_from <= killed_at
    rows = read_rows(run_dir)
    steps = train_steps(rows)
    assert steps == list(range(1, 9))  # every step once: rows after the checkpoint were cut, then redone
    assert comparable(rows) == comparable(uninterrupted)  # exactly, eval rows included
    assert not [p for p in (run_dir / "ckpts").iterdir()
                if p.name.startswith(".") and p.name != LOCK_FILE]  # no temp folder left


class Recording(Trainer):
    """Remembers the prompts of every step."""

    def train_step(self, rows):
        self.seen = getattr(self, "seen", {})
        self.seen[self.run.global_step] = [r.prompt[-1]["content"] for r in rows]
        return super().train_step(rows)


@pytest.mark.integration
def test_a_resume_at_an_epoch_boundary_trains_the_next_epoch_once(tmp_path):
    full = Recording.from_config(load_config([*EPOCHS, f"trainer.export_path={tmp_path / 'full'}"]))
    full.train()
    ckpts = tmp_path / "full" / "tiny" / "ckpts"
    assert not (ckpts / "global_step_1" / "ref").exists() and (ckpts / "global_step_2" / "ref").exists()

    resumed = Recording.from_config(load_config([*EPOCHS, f"trainer.export_path={tmp_path / 'resumed'}",
                                                 "trainer.resume_mode=from_path",
                                                 f"trainer.resume_path={ckpts / 'global_step_2'}"]))
    assert resumed.run.global_step == 2 and resumed.run.data_position == (1, 0) and resumed.run.ref_updated
    resumed.train()
    assert sorted(resumed.seen) == [3, 4]
    assert {k: full.seen[k] for k in (3, 4)} == resumed.seen  # epoch 2, neither skipped nor repeated
    assert set(full.seen[1] + full.seen[2]) == set(full.seen[3] + full.seen[4])  # each epoch: every prompt
    after = comparable([r for r in read_rows(tmp_path / "full" / "tiny") if r["step"] > 2])
    assert comparable(read_rows(tmp_path / "resumed" / "tiny")) == after  # the reference came back too
