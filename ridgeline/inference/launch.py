"""Start an inference server as a child process and wait until it answers `/health`.

Used by `make test-vllm` and `bench/vllm_cpu.py` (vLLM's CPU build on 127.0.0.1), and handy for
scripts that bring their own servers for `generator.run_engines_locally=false`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import requests

WORKER_EXTENSION = "ridgeline.inference.vllm_worker.RidgelineWorkerExtension"


def vllm_server_command(model_folder: str, port: int, *extra: str, dtype: str = "float32",
                        max_model_len: int = 512, python: str = sys.executable) -> list[str]:
    """A vLLM OpenAI-compatible server with Ridgeline's worker extension (for weight updates).

    The module is started directly: the `vllm serve` entry point fails for the CPU build, whose
    distribution is named `vllm-cpu`."""
    # A token budget no batch of ours exceeds: vllm-cpu 0.32 crashes its engine ("CPU Generator does
    # not use offset") when it splits the prefill of a request that carries a seed, as every
    # Ridgeline request does (it rewinds the sampler's generator with a CUDA-only call).
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_folder, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
            "--max-num-batched-tokens", "65536", "--worker-extension-cls", WORKER_EXTENSION, *extra]


VLLM_CPU_ENV = {"VLLM_SERVER_DEV_MODE": "1",     # /collective_rpc, /sleep, /reset_prefix_cache
                "VLLM_CPU_KVCACHE_SPACE": "1",   # GiB of KV cache: plenty for tests
                "OMP_NUM_THREADS": "1"}


class ServerProcess:
    """A server child process; `url` once it answers `/health`; `stop()` terminates it."""

    def __init__(self, command: list[str], url: str, env: dict[str, str] | None = None,
                 timeout_s: float = 300.0):
        self.url = url
        self.log: list[str] = []
        self.proc = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        # drain the output so the child never blocks on a full pipe; keep it for error messages
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n" + "".join(self.log[-60:]))
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server at {url} did not answer /health in {timeout_s:g} s:\n" + "".join(self.log[-60:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
