"""Checkpoints on the tiny preset: what a checkpoint holds, atomic writes and failures, the latest
pointer (SkyRL's latest_ckpt_global_step.txt, and the older `latest`) and pruning, SkyRL-written
checkpoints, refused resumes, non-finite losses and Ctrl-C."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal

import pytest
from pathlib import Path

import torch

from ridgeline.config import load_config
from ridgeline.errors import DiskFullError
from ridgeline.trainer import checkpoint
from ridgeline.trainer.checkpoint import CheckpointError
from ridgeline.trainer.run_lock import LOCK_FILE
from ridgeline.trainer.trainer import Trainer
from ridgeline.training.worker import NonFiniteLossError

# a critic, KL in the reward with an adaptive controller and reward scaling: every piece of
# algorithm state a checkpoint must carry
CRITIC = ["trainer.critic.model.path=tiny://llama", "trainer.algorithm.advantage_estimator=gae",
          "trainer.critic_mini_batch_size=16", "trainer.algorithm.use_kl_loss=false",
          "trainer.algorithm.use_kl_in_reward=true", "trainer.algorithm.kl_ctrl.type=adaptive",
          "trainer.algorithm.normalize_reward=true"]


def listing(root: Path) -> list[str]:
    """The names in a ckpt_path, without the run's lock file (ridgeline.trainer.run_lock)."""
    return sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE)


def tiny(out, *extra):
    return load_config(["+experiment=tiny", f"trainer.export_path={out}", "data.prepare.num_train=32",
                        "trainer.eval_before_train=false", "data.prepare.num_val=4", *extra])


@pytest.fixture(scope="module")
def critic_run(tmp_path_factory):
    """Two steps with a critic, checkpoints after each, plus the trainer as it ended."""
    out = tmp_path_factory.mktemp("ckpt")
    cfg = tiny(out, *CRITIC, "trainer.ckpt_interval=1")
    trainer = Trainer.from_config(cfg)
    trainer.train()
    return out, cfg, trainer


def test_a_checkpoint_holds_everything_and_loads_back_exactly(critic_run):
    out, cfg, done = critic_run
    root = out / "tiny" / "ckpts"
    assert (root / "latest_ckpt_global_step.txt").read_text() == "2"  # SkyRL's content: the step, no newline
    assert listing(root) == ["global_step_1", "global_step_2", "latest_ckpt_global_step.txt"]
    folder = root / "global_step_2"
    names = {p.name for p in folder.iterdir()}
    assert names == {"policy", "policy_optim.pt", "critic", "critic_optim.pt", "trainer_state.json", "rng_state.pt",
                     "config.yaml", "fingerprint.json", "COMPLETE"}  # no ref/: the reference never changed
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in (folder / "policy").iterdir()}
    assert (folder / "critic" / "value_head.safetensors").exists()
    fingerprint = json.loads((folder / "fingerprint.json").read_text())
    assert fingerprint["trainer.policy.model.path"] == "tiny://llama" and len(fingerprint["data.train_data"]) == 1

    resumed = Trainer.from_config(tiny(out, *CRITIC, "trainer.resume_mode=latest"))
    assert resumed.run.global_step == 2 and resumed.run.data_position == (1, 0) and resumed.run.run_id == done.run.run_id
    for a, b in [(done.workers.policy.model, resumed.workers.policy.model), (done.workers.critic.model, resumed.workers.critic.model),
                 (done.workers.policy.model, resumed.engine.model)]:
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(p, q), name
    for worker in ("policy", "critic"):
        sa, sb = getattr(done.workers, worker).optimizer.state_dict(), getattr(resumed.workers, worker).optimizer.state_dict()
        for key in sa["state"]:
            for k, v in sa["state"][key].items():
                assert torch.equal(v, sb["state"][key][k]), (worker, key, k)
        assert sa["param_groups"] == sb["param_groups"]
        assert getattr(done.workers, worker).scheduler.state_dict() == getattr(resumed.workers, worker).scheduler.state_dict()
    assert resumed.run.algorithm.kl_controller == done.run.algorithm.kl_controller
    assert done.run.algorithm.kl_controller.value != cfg.trainer.algorithm.kl_loss_coef  # it did adapt
    assert resumed.run.algorithm.reward_std == done.run.algorithm.reward_std
    assert done.run.algorithm.reward_std.count == 256
    assert torch.equal(torch.get_rng_state(), torch.load(folder / "rng_state.pt", weights_only=True)["torch"])


def test_a_failed_write_keeps_the_previous_checkpoint_and_stops_the_run(tmp_path, monkeypatch):
    trainer = Trainer.from_config(tiny(tmp_path, "trainer.ckpt_interval=1", "trainer.epochs=2"))
    save = torch.save

    def disk_full_on_the_second_checkpoint(obj, path, *args, **kwargs):
        if trainer.run.global_step == 2 and Path(path).name == "policy_optim.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_on_the_second_checkpoint)
    with pytest.raises(DiskFullError) as info:
        trainer.train()
    root = tmp_path / "tiny" / "ckpts"
    msg = str(info.value)
    assert str(root / "global_step_2") in msg and msg.startswith("no space left on device writing checkpoint")
    assert "global_step_1" in msg  # the checkpoint to resume from
    # temp folder removed, the pointer untouched
    assert listing(root) == ["global_step_1", "latest_ckpt_global_step.txt"]
    assert (root / "latest_ckpt_global_step.txt").read_text() == "1" and checkpoint.is_complete(root / "global_step_1")
    assert trainer.run.global_step == 2  # stopped right there


def test_incomplete_folders_are_never_loaded_and_the_pointer_wins(tmp_path):
    root = tmp_path / "ckpts"
    for step in (1, 2, 3):
        (root / f"global_step_{step}").mkdir(parents=True)
    for step in (1, 2):  # manifests listing no files: the pointer logic alone, no digests to check
        (root / f"global_step_{step}" / "COMPLETE").write_text('{"files": {}}')
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"  # 3 is incomplete, no pointer
    # the older pointer `latest`, as checkpoints written before SkyRL's file hold it
    (root / "latest").write_text("global_step_1\n")
    assert checkpoint.pointed_step(root) == 1 and checkpoint.latest_checkpoint(root) == root / "global_step_1"
    (root / "latest").write_text("global_step_3\n")  # names an incomplete folder: newest complete
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    # SkyRL's pointer, when there, is the one read
    (root / "latest_ckpt_global_step.txt").write_text("1")
    assert checkpoint.pointed_step(root) == 1 and checkpoint.latest_checkpoint(root) == root / "global_step_1"
    (root / "latest_ckpt_global_step.txt").write_text("3\n")
    assert checkpoint.latest_checkpoint(root) == root / "global_step_2"
    (root / "latest_ckpt_global_step.txt").write_text("global_step_1")
    with pytest.raises(CheckpointError, match="holds 'global_step_1', not a step number"):
        checkpoint.latest_checkpoint(root)
    (root / "latest_ckpt_global_step.txt").unlink()
    cfg = tiny(tmp_path, "trainer.resume_mode=from_path", f"trainer.resume_path={root}/global_step_3")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.find_resume_checkpoint(cfg)
    cfg = tiny(tmp_path, "trainer.resume_mode=from_path", f"trainer.resume_path={root}/global_step_9")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.find_resume_checkpoint(cfg)
    assert checkpoint.find_resume_checkpoint(tiny(tmp_path / "other", "trainer.resume_mode=latest")) is None
    # pruning counts complete checkpoints only and spares the protected one (the new one)
    assert checkpoint.prune(root, keep=1, protect=root / "global_step_1") == []
    (root / "global_step_4").mkdir()
    (root / "global_step_4" / "COMPLETE").write_text('{"files": {}}')
    assert [p.name for p in checkpoint.prune(root, keep=2)] == ["global_step_1"]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == \
        ["global_step_2", "global_step_3", "global_step_4", "latest"]


def test_resume_goes_through_skyrls_pointer_file_alone(critic_run, tmp_path):
    """A ckpt_path holding only SkyRL's layout (latest_ckpt_global_step.txt + global_step_N/):
    resume_mode=latest loads the step the file names, not the newest folder."""
    out, _, _ = critic_run
    ckpts = tmp_path / "ckpts"
    for step in (1, 2):
        shutil.copytree(out / "tiny" / "ckpts" / f"global_step_{step}", ckpts / f"global_step_{step}")
    (ckpts / "latest_ckpt_global_step.txt").write_text("1")
    data = out / "tiny" / "data"
    resumed = Trainer.from_config(tiny(out, *CRITIC, "trainer.resume_mode=latest", f"trainer.ckpt_path={ckpts}",
                                       f"trainer.run_dir={tmp_path / 'run'}", f"trainer.export_path={tmp_path / 'run'}", f"data.train_data=[{data}/train.parquet]",
                                       f"data.val_data=[{data}/validation.parquet]"))
    assert resumed.run.global_step == 1 and resumed.run.data_position == (0, 1)
    assert resumed.checkpointer.last == ckpts / "global_step_1"


def _copy_of(critic_run, tmp_path) -> tuple[Path, list[str]]:
    """The critic run's checkpoints copied into tmp_path (to damage them), and the overrides of a
    run in tmp_path that resumes from them."""
    out, _, _ = critic_run
    root = tmp_path / "ckpts"
    shutil.copytree(out / "tiny" / "ckpts", root, ignore=shutil.ignore_patterns(LOCK_FILE))
    data = out / "tiny" / "data"
    return root, [*CRITIC, f"trainer.ckpt_path={root}", f"trainer.run_dir={tmp_path / 'run'}",
                  f"trainer.export_path={tmp_path / 'run'}", f"data.train_data=[{data}/train.parquet]",
                  f"data.val_data=[{data}/validation.parquet]"]


def _zero_4k(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(4096))


@pytest.mark.parametrize("damage, said", [
    ("zeroed", "policy/model.safetensors: its content differs from the sha256 recorded when it was written"),
    ("truncated", "policy/model.safetensors: 1000 bytes, "),
    ("no_state", "trainer_state.json: missing"),
])
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumes(critic_run, tmp_path, caplog, damage, said):
    """Before: 4 KB zeroed in the weights resumed silently (no digests), cut weights raised
    SafetensorError, a missing trainer_state.json FileNotFoundError; none fell back."""
    root, overrides = _copy_of(critic_run, tmp_path)
    newest = root / "global_step_2"
    manifest = json.loads((newest / "COMPLETE").read_text())
    assert manifest["global_step"] == 2 and set(manifest["files"]) >= {
        "policy/model.safetensors", "policy_optim.pt", "trainer_state.json", "rng_state.pt", "critic/value_head.safetensors"}
    weights = newest / "policy" / "model.safetensors"
    if damage == "zeroed":
        _zero_4k(weights)
    elif damage == "truncated":
        os.truncate(weights, 1000)
    else:
        (newest / "trainer_state.json").unlink()
    caplog.set_level("INFO")
    resumed = Trainer.from_config(tiny(tmp_path, *overrides, "trainer.resume_mode=latest"))
    try:
        assert resumed.run.global_step == 1 and resumed.checkpointer.last == root / "global_step_1"
        assert f"checkpoint {newest} (step 2) is damaged: {said}" in caplog.text
        assert (f"resuming from the newest intact checkpoint {root / 'global_step_1'} (step 1) instead"
                in caplog.text)
    finally:
        resumed.close()


def test_a_damaged_checkpoint_named_by_path_or_alone_is_refused(critic_run, tmp_path):
    root, overrides = _copy_of(critic_run, tmp_path)
    _zero_4k(root / "global_step_2" / "policy_optim.pt")
    cfg = tiny(tmp_path, *overrides, "trainer.resume_mode=from_path", f"trainer.resume_path={root / 'global_step_2'}")
    with pytest.raises(CheckpointError, match=r"trainer.resume_path: checkpoint .*global_step_2 \(step 2\) is damaged: "
                                              r"policy_optim.pt: its content differs .* Fix: name another"):
        checkpoint.find_resume_checkpoint(cfg)
    with pytest.raises(CheckpointError, match="cannot load: checkpoint .*global_step_2 .* is damaged"):
        checkpoint.export_checkpoint(root / "global_step_2", tmp_path / "out")
    (root / "global_step_1" / "rng_state.pt").unlink()
    with pytest.raises(CheckpointError) as info:  # nothing intact: not a silent start at step 0
        checkpoint.find_resume_checkpoint(tiny(tmp_path, *overrides, "trainer.resume_mode=latest"))
    assert str(info.value).startswith(f"every checkpoint in {root} is damaged:\n  - checkpoint {root / 'global_step_2'}")
    assert f"{root / 'global_step_1'} (step 1) is damaged: rng_state.pt: missing" in str(info.value)


def test_a_resume_keeps_the_checkpoints_own_timing_row(tmp_path):
    """Before: the row of step 2's checkpoint timings (logged after the checkpoint counted its rows)
    was cut with the rows of the steps redone."""
    folder = tmp_path / "ckpts" / "global_step_2"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"run_dir": str(tmp_path), "global_step": 2,
                                                           "metrics_rows": 2}))
    rows = [{"step": 1, "policy/policy_loss": 0.5}, {"step": 2, "policy/policy_loss": 0.25},
            {"step": 2, "timing/save_checkpoints": 0.1, "timing/elapsed": 9.0},
            {"step": 3, "policy/policy_loss": 0.125}, {"step": 3, "timing/save_checkpoints": 0.1}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "poli')  # cut by the kill
    checkpoint.prepare_metrics(tmp_path, folder)
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == rows[:3]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows[3:]))  # killed before the timings
    checkpoint.prepare_metrics(tmp_path, folder)
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == rows[:2]


def test_a_run_removes_what_a_killed_final_model_write_left(tmp_path):
    """Before: a kill while final_model was written left .tmp_final_model_* behind for good."""
    run_dir = tmp_path / "tiny"
    left = [run_dir / ".tmp_final_model_0badf00d", run_dir / ".tmp_final_critic_0badf00d",
            run_dir / ".trash_final_model_0badf00d"]
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (run_dir / ".metrics.jsonl.0badf00d.tmp").write_text("{}\n")
    Trainer.from_config(tiny(tmp_path, "data.prepare.num_train=16")).train()
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE) == []
    assert (run_dir / "final_model" / "model.safetensors").is_file()


def test_a_checkpoint_skyrl_wrote_is_recognised_and_refused(tmp_path):
    """SkyRL-Train's own checkpoints (trainer_state.pt, FSDP shards, no COMPLETE): the pointer's step
    is read, and loading is refused in one sentence with the fix, whichever way it is named."""
    root = tmp_path / "ckpts"
    for step in (2, 3):
        folder = root / f"global_step_{step}"
        (folder / "policy").mkdir(parents=True)
        for name in ("trainer_state.pt", "data.pt", "policy/model_world_size_1_rank_0.pt"):
            (folder / name).write_bytes(b"\0")
    (root / "latest_ckpt_global_step.txt").write_text("3")
    assert checkpoint.pointed_step(root) == 3 and checkpoint.written_by_skyrl(root / "global_step_3")
    expected = r"global_step_3, a checkpoint written by SkyRL-Train \(step 3;.*Fix: start afresh"
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.find_resume_checkpoint(tiny(tmp_path, "trainer.resume_mode=latest", f"trainer.ckpt_path={root}"))
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.find_resume_checkpoint(tiny(tmp_path, "trainer.resume_mode=from_path",
                                               f"trainer.resume_path={root}/global_step_3"))
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.export_checkpoint(root, tmp_path / "exported")


def test_max_ckpts_to_keep_prunes_after_the_pointer_moves(tmp_path):
    root = tmp_path / "tiny" / "ckpts"
    (root / ".tmp_global_step_3_0123abcd").mkdir(parents=True)  # left by a run killed while writing
    (root / "latest").write_text("global_step_3\n")  # the older pointer: replaced by SkyRL's file
    Trainer.from_config(tiny(tmp_path, "trainer.ckpt_interval=1", "trainer.max_ckpts_to_keep=1",
                             "trainer.epochs=2")).train()
    assert listing(root) == ["global_step_4", "latest_ckpt_global_step.txt"]
    assert (root / "latest_ckpt_global_step.txt").read_text() == "4"


def test_resuming_another_run_is_refused_unless_told(critic_run, tmp_path, caplog):
    out, _, _ = critic_run
    with pytest.raises(CheckpointError) as info:
        Trainer.from_config(tiny(out, *CRITIC, "trainer.resume_mode=latest", "trainer.seed=7",
                                 f"data.train_data=[{out}/tiny/data/train.parquet,{out}/tiny/data/validation.parquet]"))
    msg = str(info.value)
    assert "refusing to resume" in msg and "trainer.seed: 42 -> 7" in msg and "data.train_data" in msg
    assert "trainer.resume_ignore_config_changes=true" in msg
    with pytest.raises(CheckpointError, match="trainer.policy.model.path: 'tiny://llama' -> 'tiny://llama-small'"):
        Trainer.from_config(tiny(out, *CRITIC, "trainer.resume_mode=latest",
                                 "trainer.policy.model.path=tiny://llama-small"))
    # another reference model, or model config overrides, make another run too (SkyRL 0.3.1's model keys)
    with pytest.raises(CheckpointError) as info:
        Trainer.from_config(tiny(out, *CRITIC, "trainer.resume_mode=latest", "trainer.ref.model.path=tiny://llama-small",
                                 "trainer.critic.model_config_kwargs.rms_norm_eps=0.001", "trainer.rope_theta=5000"))
    changes = str(info.value).split("wrote it:\n")[1].split("\nFix:")[0].splitlines()
    assert changes == ["  - trainer.ref.model.path: None -> 'tiny://llama-small'",
                       "  - trainer.rope_theta: None -> 5000.0",
                       "  - trainer.critic.model_config_kwargs.rms_norm_eps: None -> 0.001"]
    # told to go on: warned; other changes (lr) are allowed, logged, and take effect
    caplog.set_level("INFO")
    trainer = Trainer.from_config(tiny(out, *CRITIC, "trainer.resume_mode=latest", "trainer.seed=7",
                                       "trainer.resume_ignore_config_changes=true",
                                       "trainer.policy.optimizer_config.lr=0.5"))
    assert trainer.run.global_step == 2
    assert "although the run differs" in caplog.text and "trainer.policy.optimizer_config.lr: 0.01 -> 0.5" in caplog.text
    assert trainer.workers.policy.optimizer.param_groups[0]["lr"] == 0.5 == trainer.workers.policy.scheduler.get_last_lr()[0]
    assert trainer.workers.policy.optimizer.state_dict()["state"][0]["step"] == 2  # moments kept


def _nan_loss(fn):
    def wrapped(*args, **kwargs):
        loss, metrics = fn(*args, **kwargs)
        return loss * float("nan"), metrics
    return wrapped


def test_a_nonfinite_loss_is_dropped_before_backward(tmp_path, monkeypatch):
    from ridgeline.training import critic_worker
    trainer = Trainer.from_config(tiny(tmp_path, *CRITIC))
    trainer.workers.policy.policy_loss_fn = _nan_loss(trainer.workers.policy.policy_loss_fn)
    monkeypatch.setattr(critic_worker, "value_loss", _nan_loss(critic_worker.value_loss))
    before = {k: v.clone() for k, v in trainer.workers.policy.model.state_dict().items()}
    critic_before = {k: v.clone() for k, v in trainer.workers.critic.model.state_dict().items()}
    backward_losses = []
    backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward",
                        lambda t, *a, **k: backward_losses.append(float(t)) or backward(t, *a, **k))
    rows = next(trainer.train_data.batches(16, seed=0, epoch=0))
    trainer.run.global_step = 1
    metrics = trainer.train_step(rows)
    assert metrics["policy/skipped_steps"] == 1.0 and metrics["critic/skipped_steps"] == 1.0
    # the critic checks before its backward; the policy once per optimizer step, after its
    # micro-batches' backward (issue 36): the gradients it let through are dropped below
    assert backward_losses and all(math.isnan(v) for v in backward_losses)
    for model, saved in [(trainer.workers.policy.model, before), (trainer.workers.critic.model, critic_before)]:
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), name
        assert all(p.grad is None for p in model.parameters())
    assert trainer.workers.policy.optimizer.state_dict()["state"] == {}  # no optimizer step either


def test_a_nonfinite_loss_stops_the_run_when_asked(tmp_path):
    trainer = Trainer.from_config(tiny(tmp_path, "trainer.nonfinite_loss=stop"))
    trainer.workers.policy.policy_loss_fn = _nan_loss(trainer.workers.policy.policy_loss_fn)
    with pytest.raises(NonFiniteLossError, match=r"step 1: policy loss is nan \(trainer.nonfinite_loss=stop\)"):
        trainer.train()
    assert all(p.grad is None for p in trainer.workers.policy.model.parameters())


class CtrlCAt(Trainer):
    """Receives SIGINT (as from Ctrl-C) in the middle of step `at`, or raises KeyboardInterrupt
    right there with `raise_now`."""
    at, raise_now = 2, False

    def train_step(self, rows):
        if self.run.global_step == self.at:
            if self.raise_now:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        return super().train_step(rows)


def test_ctrl_c_finishes_the_step_then_checkpoints_it(tmp_path):
    trainer = CtrlCAt.from_config(tiny(tmp_path, "trainer.ckpt_on_interrupt=true", "trainer.epochs=2"))
    handler = signal.getsignal(signal.SIGINT)
    root = tmp_path / "tiny" / "ckpts"
    with pytest.raises(KeyboardInterrupt) as info:
        trainer.train()
    # the line the command prints (the tiny preset resumes: resume_mode=latest)
    assert str(info.value) == (f"stopped after step 2: checkpoint {root / 'global_step_2'} written; the same command "
                               "resumes from global_step_2")
    assert listing(root) == ["global_step_2", "latest_ckpt_global_step.txt"]
    assert trainer.run.global_step == 2 and signal.getsignal(signal.SIGINT) is handler
    steps = [json.loads(line)["step"] for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    resumed = Trainer.from_config(tiny(tmp_path, "trainer.resume_mode=latest", "trainer.epochs=2"))
    assert resumed.run.global_step == 2 and resumed.run.data_position == (1, 0)


def test_an_interrupt_inside_a_step_saves_no_half_done_state(tmp_path, caplog):
    CtrlCAt.raise_now = True
    try:
        trainer = CtrlCAt.from_config(tiny(tmp_path, "trainer.ckpt_on_interrupt=true", "trainer.epochs=2"))
        with pytest.raises(KeyboardInterrupt) as info:
            trainer.train()
    finally:
        CtrlCAt.raise_now = False
    assert listing(tmp_path / "tiny" / "ckpts") == []  # the folder is locked (it may be written), holds nothing
    assert str(info.value) == ("stopped inside step 2: its half-done update is not saved; no checkpoint to resume "
                               "from, the same command starts over")
