"""tests/gpu: checks that need a CUDA GPU, run by `make test-gpu` on a GPU machine (docs/gpu.md).

Every test here carries the `gpu` marker, which the default suite deselects. Without CUDA they are
all skipped with the reason below, so `pytest tests/gpu -m gpu` on a CPU machine still collects
(imports) every one of them. The `figures` fixture gathers what the checks measure
(gpu_figures.py).
"""

from pathlib import Path

import pytest
import torch
from .gpu_figures import Figures

HERE = Path(__file__).parent
NO_CUDA = ("needs a CUDA GPU, and torch.cuda.is_available() is False here: run `make test-gpu` "
           "on a GPU machine (docs/gpu.md)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def figures() -> Figures:
    return Figures(device=torch.cuda.get_device_name())
