import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


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
