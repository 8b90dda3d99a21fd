"""Stop strings for the embedded engine: each row's response is detokenized as it grows, and a row
stops at the token that completes one of the stop strings (vLLM's rule, which SkyRL relies on).

Only the response counts: a stop string in the prompt, or one spanning the end of the prompt and
the start of the response, does not stop. The text is the response decoded on its own with special
tokens skipped, the text the environment is given. After each token only the new characters, plus
the `len(stop) - 1` characters before them, are searched, so a string is found once, at the token
that completes it; when one token completes several, the first in the `stop` list wins (vLLM's
order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ridgeline.models.text import decode_text

INCOMPLETE = "\ufffd"  # what a decoder prints for a byte sequence that is not a whole character yet


@dataclass
class _RowText:
    """The incremental detokenizer of one row (the usual prefix / read offsets): `text` holds the
    characters of `ids[:read]`; `ids[prefix:read]` is decoded again with each new token as context,
    so a token's leading space or a character split over several byte tokens comes out right."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix: int = 0
    read: int = 0


class StopStringMatcher:
    """`push(row, token)` after each sampled token; returns the stop string it completed, or None."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], rows: int):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.tokenizer = tokenizer
        self.stop = stop
        self.rows = [_RowText() for _ in range(rows)]

    def push(self, row: int, token: int) -> str | None:
        state = self.rows[row]
        state.ids.append(token)
        new = self._new_text(state)
        if not new:
            return None
        # a match must end inside the new characters: start at most len(s) - 1 characters before them
        for s in self.stop:
            start = max(0, len(state.text) - len(new) - len(s) + 1)
            if state.text.find(s, start) != -1:
                return s
        return None

    def _new_text(self, state: _RowText) -> str:
        before = decode_text(self.tokenizer, state.ids[state.prefix:state.read], skip_special_tokens=True)
        after = decode_text(self.tokenizer, state.ids[state.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""  # a special token, or part of a character: wait for more tokens
        new = after[len(before):]
        state.text += new
        state.prefix, state.read = state.read, len(state.ids)
        return new
