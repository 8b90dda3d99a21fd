"""The `ridgeline` command restarts itself on tcmalloc (ridgeline.allocator): a real re-exec in a
subprocess, checked from inside the restarted process."""

from __future__ import annotations

import os
import subprocess
import sys

from ridgeline.allocator import find_tcmalloc
from conftest import HANG_GUARD_S

# What the restarted process sees: its allocator and the LD_PRELOAD its own children would get.
PROBE = ("from ridgeline.allocator import active_allocator, reexec_with_tcmalloc\n"
         "reexec_with_tcmalloc()\n"
         "import os\n"
         "print(active_allocator(), os.environ.get('LD_PRELOAD', '<unset>'), flush=True)\n")


def probe(**env: str) -> tuple[str, str]:
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RIDGELINE_ALLOCATOR", "RIDGELINE_TCMALLOC")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=HANG_GUARD_S,
                         check=True)
    allocator, preload = out.stdout.split()
    return allocator, preload


def test_the_command_runs_on_tcmalloc_when_found_and_hides_the_preload_from_children():
    expected = "tcmalloc" if find_tcmalloc() else "system"
    assert probe() == (expected, "<unset>")


def test_the_system_allocator_on_request():
    assert probe(RIDGELINE_ALLOCATOR="system") == ("system", "<unset>")


def test_a_missing_library_falls_back_to_the_system_allocator(tmp_path):
    assert probe(RIDGELINE_TCMALLOC=str(tmp_path / "no-such-lib.so")) == ("system", "<unset>")


def test_the_users_own_preload_is_given_back_to_children():
    # ld.so ignores (with a warning) a preload it cannot find; the value must survive the restart
    assert probe(LD_PRELOAD="libridgeline-test-absent.so")[1] == "libridgeline-test-absent.so"


def test_main_in_process_never_restarts(tmp_path):
    """Callers of `ridgeline.cli.main` (tests, benchmarks, notebooks) keep their process."""
    from ridgeline import cli
    assert cli.main(["prepare", "arithmetic", "--output", str(tmp_path / "d"), "--num-train", "4", "--num-val", "2"]) == 0
