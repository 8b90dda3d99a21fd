"""Token ids back to text: one sequence at a time (`decode` is typed for batches of sequences too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """`ids` as text."""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"{type(tokenizer).__name__}.decode of one sequence returned {type(text).__name__}, not text")
    return text
