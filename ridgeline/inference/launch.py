"""Start an inference server as a child process and wait until it answers `/health`.

Used by `make test-vllm` / `make test-sglang` and `bench/vllm_cpu.py` / `bench/sglang_cpu.py` (vLLM's
CPU build and SGLang's CPU backend on 127.0.0.1), and handy for scripts that bring their own
servers for `generator.run_engines_locally=false`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import requests

from ridgeline.inference.sglang_engine import SGLANG_CPU_ENV, SGLANG_CPU_KWARGS

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


def sglang_server_command(model_folder: str, port: int, *extra: str, dtype: str = "float32",
                          context_length: int = 512, cuda: bool = False, python: str = sys.executable) -> list[str]:
    """SGLang's server (`python -m sglang.launch_server`) on 127.0.0.1; without `cuda`, with the flags
    of its CPU backend (`sglang_engine.SGLANG_CPU_KWARGS`, the in-process engine's settings) and
    `SGLANG_CPU_SERVER_ENV` in its environment. `extra` flags come last (SGLang takes the last of a
    repeated flag)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_folder, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--context-length", str(context_length)]
    if not cuda:
        for key, value in SGLANG_CPU_KWARGS.items():
            flag = "--" + key.replace("_", "-")
            cmd += [flag] if value is True else [flag, str(value)]
    return cmd + list(extra)


SGLANG_CPU_SERVER_ENV = {**SGLANG_CPU_ENV, "OMP_NUM_THREADS": "1"}


class ServerProcess:
    """A server child process; `url` once it answers `/health`; `stop()` terminates it."""

    def __init__(self, command: list[str], url: str, env: dict[str, str] | None = None,
                 timeout_s: float = 300.0):
        self.url = url
        self.log: list[str] = []
        # a session of its own: the servers start worker processes, stopped with it as one group
        self.proc = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        # drain the output so the child never blocks on a full pipe; keep it for error messages
        output = self.proc.stdout
        if output is None:  # stdout=PIPE above
            raise RuntimeError("the server process has no output pipe")
        threading.Thread(target=lambda: self.log.extend(output), daemon=True).start()
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
        """Terminate the server and its worker processes (its process group); kill them after 30 s."""
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass  # the group is gone already
