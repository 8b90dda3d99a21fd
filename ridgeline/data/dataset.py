"""Prompt datasets: load, validate, filter and batch SkyRL-format rows.

Sources (files, dataset folders, hub `name:split`) are read by `sources.read_rows`. Everything is
read and validated up front: a bad row should stop a run before any GPU time is spent, with a
message naming file/row/column.
Batching uses a torch-free RNG keyed on (seed, epoch) so a resumed run can
regenerate exactly the order it was in and skip the batches already done.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .schema import DatasetError, PromptRow, validate_row
from .sources import SourceDigest, file_digest, is_data_file, read_rows, rows_digest

__all__ = ["PromptDataset", "epoch_order", "write_parquet"]

logger = logging.getLogger(__name__)


def encode_chat_prompt(tokenizer: Any, prompt: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat-templated prompt with the assistant turn opened: exactly what the
    generator sends to the engine, so length checks here agree with generation."""
    return chat_template_ids(tokenizer, prompt, add_generation_prompt=True)


def chat_template_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The chat template's token ids for `messages`, as a flat list."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    # transformers >= 5 returns a BatchEncoding by default, older versions a list of ids.
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if encoded and isinstance(encoded[0], (list, tuple)):
        encoded = encoded[0]
    return list(encoded)


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    """Independent stream per (seed, epoch); hashing avoids seed+epoch collisions
    such as (seed=1, epoch=0) == (seed=0, epoch=1)."""
    digest = hashlib.sha256(f"ridgeline-batches:{int(seed)}:{int(epoch)}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The shuffled order of `size` rows in `epoch`: a function of (seed, epoch, size) only, so a
    resumed run regenerates it and skips the batches already done."""
    order = list(range(size))
    _epoch_rng(seed, epoch).shuffle(order)
    return order


class PromptDataset(Sequence[PromptRow]):
    """Validated prompt rows from one or more sources: .parquet / .json / .jsonl files, dataset
    folders or hub `name:split` names (`sources.read_rows`).

    Args:
        files: the sources (a single one is accepted too); rows keep their order.
        default_env_class: env for rows whose ``env_class`` is missing/None.
        max_prompt_tokens: `trainer.max_prompt_length`: with ``tokenizer``, drop rows whose chat-templated
            prompt (with generation prompt) is longer; the count is in
            ``num_dropped_too_long`` and logged as a warning.
        tokenizer: a Hugging Face tokenizer with a chat template.
        config_key: the config key listing the sources (e.g. ``data.train_data``), named in
            front of every error message.

    Raises:
        DatasetError: a file is missing/unreadable, a row is invalid (all
            problems of the first bad row are reported), or no rows remain.
    """

    def __init__(
        self,
        files: Sequence[str | Path] | str | Path,
        *,
        default_env_class: str = "gsm8k",
        max_prompt_tokens: int | None = None,
        tokenizer: Any = None,
        config_key: str | None = None,
    ) -> None:
        if isinstance(files, (str, Path)):
            files = [files]
        self.files: list[str] = [str(f) for f in files]
        self.default_env_class = default_env_class
        self.max_prompt_tokens = max_prompt_tokens
        self.num_dropped_too_long = 0
        self._loaded_digests: dict[str, SourceDigest] = {}  # sources that are not files, by their rows
        try:
            rows, origins = self._load(config_key)
            if max_prompt_tokens is not None and tokenizer is not None:
                rows, origins = self._drop_long(rows, origins, tokenizer, max_prompt_tokens)
        except DatasetError as err:
            keyed = err.under_key(config_key)
            if keyed is err:
                raise
            raise keyed from err
        self._rows = rows
        self._origins = origins

    def _load(self, config_key: str | None) -> tuple[list[PromptRow], list[tuple[str, int]]]:
        """Every validated row of the sources, with its (source, row index)."""
        if not self.files:
            raise DatasetError("no dataset files given. Fix: list at least one file or dataset name")
        rows: list[PromptRow] = []
        origins: list[tuple[str, int]] = []
        for file in self.files:
            raw_rows = read_rows(file, config_key)
            if not is_data_file(file):
                self._loaded_digests[file] = rows_digest(file, raw_rows)
            for index, raw in enumerate(raw_rows):
                rows.append(validate_row(raw, file=file, index=index, default_env_class=self.default_env_class))
                origins.append((file, index))
        if not rows:
            raise DatasetError(f"dataset has no rows: {', '.join(self.files)}. Fix: files with at least one row")
        return rows, origins

    def _drop_long(self, rows: list[PromptRow], origins: list[tuple[str, int]], tokenizer: Any,
                   max_prompt_tokens: int) -> tuple[list[PromptRow], list[tuple[str, int]]]:
        """The rows whose chat-templated prompt fits `max_prompt_tokens` (the others are counted)."""
        keep = [len(_prompt_ids(tokenizer, row, origin)) <= max_prompt_tokens for row, origin in zip(rows, origins)]
        kept = [row for row, k in zip(rows, keep) if k]
        self.num_dropped_too_long = len(rows) - len(kept)
        # the limit is the user's trainer.max_prompt_length (every caller passes it): named as the key they set
        if self.num_dropped_too_long:
            logger.warning("dropped %d of %d prompts longer than trainer.max_prompt_length=%d tokens (chat template "
                           "and generation prompt included; files: %s)",
                           self.num_dropped_too_long, len(rows), max_prompt_tokens, ", ".join(self.files))
        if not kept:
            raise DatasetError(f"all {len(rows)} prompts are longer than trainer.max_prompt_length={max_prompt_tokens} "
                               f"tokens (chat template and generation prompt included; files: "
                               f"{', '.join(self.files)}). Fix: raise trainer.max_prompt_length")
        return kept, [origin for origin, k in zip(origins, keep) if k]

        self._rows = rows
        self._origins = origins

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> PromptRow:  # type: ignore[override]
        return self._rows[index]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self._rows)

    def __repr__(self) -> str:
        return f"PromptDataset(files={self.files!r}, rows={len(self)})"

    def digests(self) -> list[SourceDigest]:
        """Each source by content (a file's bytes, hashed now; a loaded dataset's rows), for the
        checkpoint fingerprint: moving a file keeps its digest, editing it does not."""
        return [self._loaded_digests.get(file) or file_digest(file) for file in self.files]

    def origin(self, index: int) -> tuple[str, int]:
        """(source, 0-based row index in it) of row ``index``, for messages about that row."""
        return self._origins[index]

    def data_sources(self) -> list[str]:
        """Distinct ``data_source`` values, in order of first appearance."""
        return list(dict.fromkeys(row.data_source for row in self._rows))

    def num_batches(self, batch_size: int, *, drop_last: bool = True) -> int:
        """How many batches one epoch of :meth:`batches` yields."""
        _check_batch_size(batch_size)
        full, rest = divmod(len(self._rows), batch_size)
        return full if drop_last or not rest else full + 1

    def batches(
        self,
        batch_size: int,
        *,
        seed: int,
        epoch: int,
        drop_last: bool = True,
        skip_batches: int = 0,
    ) -> Iterator[list[PromptRow]]:
        """Shuffled batches for one epoch; the order depends only on (seed, epoch, len).

        ``skip_batches`` resumes mid-epoch by skipping the first batches of
        that same order. With ``drop_last`` a trailing partial batch is
        dropped; a batch size larger than the dataset is then an error
        (the epoch would be empty). Arguments are checked when called, not
        on first iteration.
        """
        _check_batch_size(batch_size)
        if drop_last and batch_size > len(self._rows):
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({len(self._rows)} rows) "
                "and drop_last=True, so an epoch would have no batches"
            )
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        return self._chunks(epoch_order(len(self._rows), seed, epoch), batch_size, drop_last, skip_batches)

    def _chunks(
        self, order: Sequence[int], batch_size: int, drop_last: bool, skip_batches: int
    ) -> Iterator[list[PromptRow]]:
        for start in range(skip_batches * batch_size, len(order), batch_size):
            indices = order[start : start + batch_size]
            if drop_last and len(indices) < batch_size:
                return
            yield [self._rows[i] for i in indices]


def _prompt_ids(tokenizer: Any, row: PromptRow, origin: tuple[str, int]) -> list[int]:
    """`encode_chat_prompt` of one row; a chat template that refuses its messages (a Jinja
    `raise_exception`, e.g. "roles must alternate") is a DatasetError naming the row."""
    from jinja2 import TemplateError

    try:
        return encode_chat_prompt(tokenizer, row.prompt)
    except TemplateError as exc:
        file, index = origin
        raise DatasetError(f"{file} row {index}, column 'prompt': the chat template refuses these messages "
                           f"({type(exc).__name__}: {exc}). Fix: the row's messages, or a chat template that "
                           "takes them (generator.chat_template)", file=file, index=index,
                           problems=[("prompt", str(exc))]) from exc


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def write_parquet(rows: Sequence[dict[str, Any]], path: str | Path, schema: Any) -> Path:
    """Write rows to ``path`` with an explicit Arrow schema, atomically.

    Written to a temporary sibling and renamed, so an interrupted prepare
    never leaves a truncated file that looks valid.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(list(rows), schema=schema)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path
