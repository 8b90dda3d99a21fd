"""Chats and preference pairs for `ridgeline sft` / `ridgeline dpo`, tokenized once up front.

A chat becomes one training sample in the batch layout (`TrainingBatch`): the prompt is every
token before the first trained assistant turn, the response the rest, and the loss mask is 1
exactly on the assistant turns' tokens as the chat template renders them: the content and the
end-of-turn token (the tokenizer's eos), not the role header the template writes before it nor
the separator after it. The spans come from the template itself: assistant turn k spans from
the end of `template(messages[:k], add_generation_prompt=True)` to the end-of-turn token of
`template(messages[:k+1])`, which must both be prefixes of the whole chat's rendering (a
template that rewrites earlier turns, e.g. dropping their reasoning, is refused by row).

Row formats (TRL's and NeMo RL's): SFT rows hold `messages` ([{role, content}, ...]) or a
`prompt` (text or chat) and a `response` (text); DPO rows hold a `prompt` (text or chat) and
`chosen` / `rejected` answers (text, or assistant messages). Column names are `sft.*_key` /
`dpo.*_key`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ridgeline.data.dataset import chat_template_ids
from ridgeline.data.schema import DatasetError
from ridgeline.data.sources import SourceDigest, file_digest, is_data_file, read_rows, rows_digest

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class TokenizedChat:
    """One sample: `prompt_ids` (before the first trained token), `response_ids` (the rest) and
    `loss_mask` (len(response_ids): 1 on assistant tokens)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class PreferencePair:
    chosen: TokenizedChat
    rejected: TokenizedChat


@dataclass(frozen=True)
class SFTColumns:
    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"


@dataclass(frozen=True)
class PreferenceColumns:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], *, train_from: int = 0,
                  where: str = "chat") -> TokenizedChat:
    """`messages` as one sample whose loss mask covers the assistant turns at index >= `train_from`
    (DPO trains only the answer, never assistant turns of its prompt). `where` names the row in
    errors."""
    full = chat_template_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    eos = tokenizer.eos_token_id
    for k in range(train_from, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        head = chat_template_ids(tokenizer, messages[:k], add_generation_prompt=True)
        upto = chat_template_ids(tokenizer, messages[:k + 1], add_generation_prompt=False)
        if upto[:len(head)] != head or full[:len(upto)] != upto:
            raise DatasetError(f"{where}: the chat template does not render turn {k} (assistant) after the earlier "
                               "turns unchanged, so its tokens cannot be told apart (templates that rewrite earlier "
                               "turns, e.g. dropping their reasoning, do this). Fix: a chat template that renders "
                               "each turn the same whatever follows (generator.chat_template), or one-answer rows")
        span = upto[len(head):]
        # the content and its end-of-turn token; the separator the template writes after it is not trained
        end = len(head) + (len(span) - span[::-1].index(eos) if eos in span else len(span))
        mask[len(head):end] = [1] * (end - len(head))
    if 1 not in mask:
        raise DatasetError(f"{where}: no assistant turn to train on (roles: "
                           f"{[m['role'] for m in messages]}). Fix: end the chat with an assistant message")
    first = mask.index(1)
    return TokenizedChat(full[:first], full[first:], mask[first:])


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """`value` as a chat: a list of {role, content} string messages with known roles."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(f"{where}: expected a non-empty list of {{role, content}} messages, got "
                           f"{type(value).__name__}. Fix: e.g. [{{\"role\": \"user\", \"content\": \"...\"}}, "
                           "{\"role\": \"assistant\", \"content\": \"...\"}]")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}, message {i}: expected {{role, content}} with string values, got {m!r}. "
                               "Fix: every message needs a string role and content")
        if m["role"] not in ROLES:
            raise DatasetError(f"{where}, message {i}: role {m['role']!r} is not one of {', '.join(ROLES)}. "
                               "Fix: use the chat roles")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _as_chat(value: Any, role: str, where: str) -> list[dict[str, str]]:
    """Text as one `role` message, or a chat as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return check_messages(value, where)


def sft_chat(row: dict[str, Any], columns: SFTColumns, where: str) -> list[dict[str, str]]:
    if row.get(columns.messages) is not None:
        return check_messages(row[columns.messages], f"{where}, column {columns.messages!r}")
    if row.get(columns.prompt) is not None and isinstance(row.get(columns.response), str):
        return _as_chat(row[columns.prompt], "user", f"{where}, column {columns.prompt!r}") + \
            [{"role": "assistant", "content": row[columns.response]}]
    raise DatasetError(f"{where}: no {columns.messages!r} column and no {columns.prompt!r} + {columns.response!r} "
                       f"columns (it has {sorted(row)}). Fix: a chat in {columns.messages!r}, or prompt and response "
                       "text; other column names go in sft.messages_key / sft.prompt_key / sft.response_key")


def preference_pair(tokenizer: Any, row: dict[str, Any], columns: PreferenceColumns, where: str) -> PreferencePair:
    missing = [c for c in (columns.prompt, columns.chosen, columns.rejected) if row.get(c) is None]
    if missing:
        raise DatasetError(f"{where}: missing column(s) {missing} (it has {sorted(row)}). Fix: prompt, chosen and "
                           "rejected in every row; other names go in dpo.prompt_key / dpo.chosen_key / dpo.rejected_key")
    prompt = _as_chat(row[columns.prompt], "user", f"{where}, column {columns.prompt!r}")
    sides = []
    for column in (columns.chosen, columns.rejected):
        answer = _as_chat(row[column], "assistant", f"{where}, column {column!r}")
        sides.append(tokenize_chat(tokenizer, prompt + answer, train_from=len(prompt), where=f"{where}, {column}"))
    return PreferencePair(*sides)


def source_digest(spec: str, rows: list[dict[str, Any]]) -> SourceDigest:
    """A source by content, for the resume check: a file's bytes, else its rows."""
    return file_digest(spec) if is_data_file(spec) else rows_digest(spec, rows)


def load_examples(specs: Sequence[str], make, max_length: int, length, config_key: str,
                  no_signal=None) -> tuple[list[Any], list[SourceDigest]]:
    """Every row of `specs` through `make(row, where)`, those with `length(example) > max_length`
    dropped (counted in the log), and those `no_signal(example)` describes (a reason: the row
    cannot teach anything) dropped with a warning naming the first; their digests. DatasetError
    when none is left."""
    examples, digests, dropped, useless = [], [], 0, []
    for spec in specs:
        rows = read_rows(spec, config_key)
        digests.append(source_digest(str(spec), rows))
        for index, row in enumerate(rows):
            example = make(row, f"{spec}, row {index}")
            if length(example) > max_length:
                dropped += 1
                continue
            reason = no_signal(example) if no_signal is not None else None
            if reason:
                useless.append((f"{spec}, row {index}", reason))
                continue
            examples.append(example)
    if dropped:
        log.info("%s: %d of %d rows dropped: longer than %d tokens", config_key, dropped,
                 dropped + len(useless) + len(examples), max_length)
    if useless and examples:
        log.warning("%s: %d row(s) dropped: %s (first: %s)", config_key, len(useless), useless[0][1], useless[0][0])
    if not examples:
        why = (f": every row left is unusable, {useless[0][1]} (first: {useless[0][0]})" if useless else "")
        raise DatasetError(f"{config_key} ({', '.join(map(str, specs))}) holds no usable rows{why}. Fix: rows in the "
                           "expected format, shorter than the max_length key")
    return examples, digests


def load_sft_examples(specs: Sequence[str], tokenizer: Any, columns: SFTColumns, max_length: int,
                      config_key: str) -> tuple[list[TokenizedChat], list[SourceDigest]]:
    return load_examples(specs, lambda row, where: tokenize_chat(tokenizer, sft_chat(row, columns, where), where=where),
                         max_length, len, config_key)


def load_preference_pairs(specs: Sequence[str], tokenizer: Any, columns: PreferenceColumns, max_length: int,
                          config_key: str) -> tuple[list[PreferencePair], list[SourceDigest]]:
    return load_examples(specs, lambda row, where: preference_pair(tokenizer, row, columns, where), max_length,
                         lambda pair: max(len(pair.chosen), len(pair.rejected)), config_key, no_signal=_same_answers)


def _same_answers(pair: PreferencePair) -> str | None:
    # identical sides give every preference loss a zero gradient (DPO's sits at log 2 for ever)
    if pair.chosen == pair.rejected:
        return "their chosen and rejected answers are the same tokens, so a preference loss learns nothing from them"
    return None
