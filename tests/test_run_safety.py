"""Runs that cannot corrupt each other or leave half-written models (issue 19, item 5): the run
folders are locked (a second command stops at once, naming the first's pid and host; a dead
holder never blocks), and final_model / exports are written whole or not at all, a full disk
named as such. The full disk is real: a small tmpfs (root only; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from ridgeline.config import load_config
from ridgeline.trainer.run_lock import LOCK_FILE, RunLock, RunLockedError
from ridgeline.trainer.trainer import Trainer
from ridgeline.tracking.trackers import read_metrics

RIDGELINE_TRAIN = [sys.executable, "-m", "ridgeline.cli", "train"]
TINY = ["+experiment=tiny", "data.val_data=[]", "trainer.eval_before_train=false"]


def holder(folder: Path) -> subprocess.Popen:
    """Another process holding the lock on `folder` (until killed); returns once it holds it."""
    code = ("import sys, time; from ridgeline.trainer.run_lock import RunLock; "
            f"RunLock.acquire({{'trainer.run_dir': {str(folder)!r}}}); print('locked', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.integration
def test_a_second_ridgeline_train_on_the_same_run_dir_stops_at_once(tmp_path):
    """Before: the second command moved the first's metrics.jsonl aside, rewrote its config.yaml,
    resumed from its checkpoints and deleted its temp checkpoints."""
    common = [*TINY, f"trainer.export_path={tmp_path}", "trainer.ckpt_interval=1", "trainer.resume_mode=latest"]
    run_dir = tmp_path / "tiny"
    first = subprocess.Popen([*RIDGELINE_TRAIN, *common], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while f'"pid": {first.pid}' not in _read(run_dir / LOCK_FILE):
            assert first.poll() is None, "the first run ended without taking the lock"
            time.sleep(0.1)  # polling for the lock note, not timing anything
        # held still while the second runs: it cannot finish first however slow the machine, and a
        # stopped process keeps its lock
        first.send_signal(signal.SIGSTOP)
        try:
            second = subprocess.run([*RIDGELINE_TRAIN, *common, "trainer.seed=7"], capture_output=True, text=True,
                                    timeout=1800)  # a hang guard: a second command that waited would never end
        finally:
            first.send_signal(signal.SIGCONT)
        out, err = first.communicate()
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert second.stderr.startswith(f"ridgeline: trainer.run_dir={run_dir} is in use by another ridgeline command: "
                                    f"pid {first.pid} on host {socket.gethostname()}")
    assert "Fix:" in second.stderr
    # the first finished untouched: every step logged once, its own config, a final model that loads
    assert first.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "policy/policy_loss" in r] == \
        list(range(1, 11))
    assert "seed: 42" in (run_dir / "config.yaml").read_text()
    assert not list(run_dir.glob("metrics.jsonl.*"))
    AutoModelForCausalLM.from_pretrained(run_dir / "final_model")


def assert_free(folder: Path) -> None:
    """No process (this one included) holds `folder`'s lock."""
    probe = subprocess.run([sys.executable, "-c", "from ridgeline.trainer.run_lock import RunLock; "
                            f"RunLock.acquire({{'trainer.run_dir': {str(folder)!r}}})"], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_the_lock_names_its_holder_and_a_dead_holder_never_blocks(tmp_path):
    other = holder(tmp_path)
    try:
        with pytest.raises(RunLockedError) as info:
            RunLock.acquire({"trainer.run_dir": tmp_path})
        assert f"pid {other.pid} on host {socket.gethostname()}" in str(info.value)
    finally:
        other.send_signal(signal.SIGKILL)  # the way a run dies without cleaning up
        other.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == other.pid  # its note is still there
    lock = RunLock.acquire({"trainer.run_dir": tmp_path})  # ... and does not block
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_run_sharing_another_runs_ckpt_path_is_refused(tmp_path):
    """Two runs writing global_step_N into one ckpt_path (SkyRL's default ~/ckpts/ is shared) would
    prune and resume each other's checkpoints."""
    ckpts = tmp_path / "shared_ckpts"
    other = holder(ckpts)
    try:
        cfg = load_config([*TINY, f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                           f"trainer.ckpt_path={ckpts}", "trainer.ckpt_interval=1"])
        with pytest.raises(RunLockedError, match=rf"trainer.ckpt_path={ckpts} is in use .* pid {other.pid}"):
            Trainer.from_config(cfg)
        assert not (tmp_path / "tiny" / "config.yaml").exists()  # refused before writing anything
        assert_free(tmp_path / "tiny")  # and it let go of the run_dir it had locked first
    finally:
        other.kill()
        other.wait()


def test_the_lock_is_reentrant_within_one_process(tmp_path):
    first = RunLock.acquire({"trainer.run_dir": tmp_path})
    second = RunLock.acquire({"trainer.run_dir": tmp_path, "trainer.ckpt_path": tmp_path})  # one folder, once
    assert second.folders == [tmp_path.resolve()]
    first.release()
    with pytest.raises(AssertionError, match="RunLockedError"):
        assert_free(tmp_path)  # still held by `second`
    second.release()
    second.release()  # idempotent
    assert_free(tmp_path)


@pytest.fixture()
def read_only(tmp_path):
    """A read-only tmpfs: writes there fail with EROFS, as on a read-only mount (chmod does not stop root)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({made.stderr.strip()}): it needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("key", ["trainer.run_dir", "trainer.ckpt_path"])
@pytest.mark.integration
def test_a_run_folder_on_a_read_only_filesystem_is_one_message(tmp_path, read_only, key):
    """Before: OSError: [Errno 30] Read-only file system, a traceback."""
    folder = read_only / "run"
    extra = ([f"trainer.export_path={read_only}"] if key == "trainer.run_dir" else
             [f"trainer.export_path={tmp_path}", f"trainer.ckpt_path={folder}", "trainer.ckpt_interval=1"])
    proc = subprocess.run([*RIDGELINE_TRAIN, *TINY, *extra], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    shown = read_only / "tiny" if key == "trainer.run_dir" else folder
    message = proc.stderr[proc.stderr.index("ridgeline: "):]
    assert message.startswith(f"ridgeline: {key}={shown} cannot be written: Read-only file system (EROFS) at "), message
    assert "Fix: " in message


# ------------------------------------------------------------------------ a full disk, for real
@pytest.fixture()
def small_disk(tmp_path):
    """A 200 KiB tmpfs: room for a run's config and metrics, not for a model (the tiny one is 340 KiB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}): a full disk needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("what", ["final_model", "export"])
@pytest.mark.integration
def test_a_full_disk_leaves_no_half_written_model_and_says_so(tmp_path, small_disk, what):
    """Before: a traceback, and a final_model/ holding config.json without weights."""
    from ridgeline.data import prepare_arithmetic

    data = prepare_arithmetic(tmp_path / "data", num_train=16, num_val=4)["train"]
    extra = ["trainer.hf_save_interval=1"] if what == "export" else []
    proc = subprocess.run([*RIDGELINE_TRAIN, *TINY, f"trainer.export_path={small_disk}", f"data.train_data=[{data}]",
                           "data.prepare=null", *extra], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    target = small_disk / "tiny" / ("final_model" if what == "final_model" else "global_step_1")
    message = proc.stderr[proc.stderr.index("ridgeline: "):]
    assert message.startswith(f"ridgeline: no space left on device writing "
                              f"{'the final model' if what == 'final_model' else 'the step-1 export'} to {target} (")
    assert "Fix: free disk space" in message
    assert not target.exists()
    assert not [p.name for p in small_disk.rglob(".tmp_*")]  # nothing half-written left behind
