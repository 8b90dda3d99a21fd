"""`ridgeline doctor` against the real SGLang install of .venv-sglang (its CPU backend)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang


def test_doctor_finds_sglang_on_its_cpu_backend_ready(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ridgeline.cli", "doctor", "+experiment=tiny", "generator.backend=sglang"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    import sglang

    assert f"ok           generator.backend: sglang {sglang.__version__} on SGLang's CPU backend" in done.stdout
    assert "ok           attention backend: torch_native (SGLang's CPU backend)" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("verdict: ready (generator.backend=sglang on CPU")
    assert done.returncode == 0, done.stdout + done.stderr
