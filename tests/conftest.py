import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# the limit on a subprocess a test runs: it only turns a hang into a failure, so it is far above
# what a loaded 2-core machine takes (a tiny run there takes minutes, not the seconds of a quiet one)
HANG_GUARD_S = 1800


def _meminfo_gib() -> tuple[float, float]:
    """(total, available) memory of this machine, GiB (/proc/meminfo)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return tuple(int(fields[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable"))


def pytest_runtest_setup(item):
    """`@pytest.mark.needs_memory_gib(n)`: skip, saying why, unless n GiB are free beyond the 5 % that
    Ray's memory monitor keeps (it kills workers once 95 % of the machine's memory is used, whoever
    uses it): on a busy machine such a test would otherwise fail with its workers killed."""
    marker = item.get_closest_marker("needs_memory_gib")
    if marker is None:
        return
    need = float(marker.args[0])
    total, available = _meminfo_gib()
    usable = available - 0.05 * total
    if usable < need:
        pytest.skip(f"needs {need:g} GiB of free memory; this machine has {available:.1f} GiB available of "
                    f"{total:.1f} GiB ({usable:.1f} GiB usable before Ray's memory monitor kills at 95 % used)")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from ridgeline.models.tiny import build_char_tokenizer
    return build_char_tokenizer()


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    from ridgeline.models.tiny import build_tiny_model
    return build_tiny_model("llama", tiny_tokenizer, seed=0)


def chat_ids(tokenizer, text: str) -> list[int]:
    from ridgeline.data import encode_chat_prompt
    return encode_chat_prompt(tokenizer, [{"role": "user", "content": text}])


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`ridgeline serve` on tiny://llama (seed 42, fp32) as a child process, on a free port of
    127.0.0.1 unless `args` say otherwise: (process, url) once it listens."""
    cmd = [sys.executable, "-m", "ridgeline.cli", "serve", "trainer.policy.model.path=tiny://llama",
           "generator.model_dtype=float32", "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    deadline = time.time() + 120
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "listening on " in line:
            url = line.rsplit("listening on ", 1)[1].strip()
            # keep draining the server's log so it never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            proc.start_log = lines  # what it printed until it listened
            return proc, url
    proc.kill()
    raise RuntimeError("ridgeline serve did not start:\n" + "".join(lines))


@contextlib.contextmanager
def serving(*args: str):
    """`start_serve(*args)` for a `with` block: yields the url, stops the server after."""
    proc, url = start_serve(*args)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def served_engine():
    """The embedded engine on the weights `start_serve` loads (tiny://llama, seed 42, fp32), with
    its tokenizer: (engine, tokenizer)."""
    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
    tok = build_char_tokenizer()
    return HFEngine(build_tiny_model("llama", tok, seed=42), tok, dtype=torch.float32), tok


def in_thread(fn):
    """Run `fn` in a daemon thread; returns (thread, box): box gets ("ok", value) or ("error", exc)."""
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def wait_until_inside(thread: threading.Thread, function: str) -> None:
    """Return once ``thread``'s Python stack holds a frame of ``function`` (where the test expects it
    to block: on a lock, a condition), instead of sleeping and hoping it got there."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        frame = sys._current_frames().get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == function:
                return
            frame = frame.f_back
        assert thread.is_alive() and time.monotonic() < deadline, f"{thread.name} never reached {function}"
        time.sleep(0.005)
