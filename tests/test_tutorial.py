"""docs/tutorial.md runs: every ```bash block, in order, in one bash shell, in a scratch folder.

The blocks run as written with three visible changes (the tutorial says so at its top):
- `ridgeline train` and `ridgeline eval` get TINY_OVERRIDES appended (the tiny random model instead
  of SmolLM2, short answers), through a `ridgeline` shim first on PATH;
- the port 8001 becomes a free one;
- a block preceded by `<!-- tutorial-test: skip: REASON -->` is not run (the install; its pins are
  checked against the Makefile instead, below).
The scratch folder sits beside a link to the repository's `../shared`, so `../shared/data/gsm8k`
reads the same files as from the repository root.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from doc_blocks import REPO, Block, fenced_blocks, makefile_installs, pip_installs

TUTORIAL = REPO / "docs" / "tutorial.md"
SHARED = REPO.parent / "shared"

# what the test swaps in for SmolLM2: a tiny random Llama (512 positions, character tokens), so
# prompts are capped at 400 tokens (longer GSM8K questions are dropped) and answers at 8 tokens
TINY_OVERRIDES = (
    "trainer.policy.model.path=tiny://llama", "trainer.policy.model.gguf_file=null",
    "trainer.max_prompt_length=400", "generator.sampling_params.max_generate_length=8",
    "generator.eval_sampling_params.max_generate_length=8", "trainer.mixed_precision=fp32",
    "generator.model_dtype=float32",
)
TUTORIAL_PORT = "8001"


def ridgeline_shim(folder: Path) -> None:
    """A `ridgeline` command that runs this checkout's CLI, with TINY_OVERRIDES after the arguments
    of `train` and `eval`."""
    shim = folder / "ridgeline"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        f'case "$1" in train|eval) set -- "$@" {" ".join(shlex.quote(o) for o in TINY_OVERRIDES)} ;; esac\n'
        f'exec {shlex.quote(sys.executable)} -m ridgeline.cli "$@"\n')
    shim.chmod(0o755)


def script(blocks: list[Block], port: int) -> str:
    """One bash script: the blocks in order, each announced on stderr, stopping at the first failure."""
    parts = ["set -euo pipefail"]
    for block in blocks:
        if block.skip_reason is None:
            parts.append(f"echo '### tutorial.md line {block.line}' >&2")
            parts.append(block.code.replace(TUTORIAL_PORT, str(port)))
    return "\n".join(parts) + "\n"


def bash_blocks(text: str) -> list[Block]:
    return fenced_blocks(text, "bash")


def test_blocks_are_found_and_only_the_install_is_skipped():
    blocks = bash_blocks(TUTORIAL.read_text())
    assert len(blocks) >= 8
    skipped = [b for b in blocks if b.skip_reason]
    assert len(skipped) == 1 and "pip install" in skipped[0].code


def test_install_block_matches_makefile():
    """The tutorial's pip lines install what `make setup` installs, with the same pins and flags."""
    install = next(b for b in bash_blocks(TUTORIAL.read_text()) if b.skip_reason).code
    assert pip_installs(install) == makefile_installs()


@pytest.mark.skipif(not (SHARED / "data" / "gsm8k" / "train.jsonl").is_file(),
                    reason="../shared/data/gsm8k (GSM8K's jsonl files) is not on this machine")
@pytest.mark.skipif(importlib.util.find_spec("openai") is None,
                    reason="the tutorial's last step needs the openai client package (pip install openai)")
@pytest.mark.integration
def test_tutorial_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ridgeline_shim(bin_dir)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    blocks = bash_blocks(TUTORIAL.read_text())
    done = subprocess.run(["bash", "-c", script(blocks, free_port())], cwd=work, env=env, text=True,
                          capture_output=True, timeout=600)
    log = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0, log
    # what each step leaves behind, and what the client printed
    assert (work / "data" / "gsm8k" / "train_32.parquet").is_file()
    assert (work / "runs" / "gsm8k_tutorial" / "final_model" / "config.json").is_file()
    assert (work / "runs" / "gsm8k_tutorial" / "eval" / "aggregated_results.jsonl").is_file()
    assert (work / "exported" / "policy" / "model.safetensors").is_file()
    assert "LlamaForCausalLM" in done.stdout and "['gsm8k-tutorial']" in done.stdout, log
    for line in printed_lines(TUTORIAL.read_text()):
        assert line in done.stdout, f"the tutorial shows {line!r}, the commands did not print it\n{log}"


def printed_lines(text: str) -> list[str]:
    """The lines of every bare ``` block that directly follows a ```bash block: what the tutorial
    says those commands print (only deterministic output is shown that way)."""
    # a block of k lines opens on line L and closes on L + k + 1; its output opens after one blank line
    commands = {b.line + b.code.count("\n") + 4 for b in bash_blocks(text)}
    return [line for out in fenced_blocks(text, "") if out.line in commands for line in out.code.splitlines()]
