"""Convert GSM8K into Ridgeline/SkyRL prompt rows.

Writes ``train.parquet`` (GSM8K train) and ``validation.parquet`` (GSM8K
test). The prompt asks for the final answer after "####", which is exactly
what the "gsm8k" env (skyrl-gym's) rewards, and the ground truth is the number after
"####" in the reference solution with thousands separators removed, as text.
``env_class="gsm8k_lenient"`` names Ridgeline's lenient reader in the rows instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .dataset import write_parquet
from .schema import DatasetError, arrow_schema
from .sources import HUB_TIMEOUT_S

__all__ = ["prepare_gsm8k", "gsm8k_row", "gsm8k_ground_truth", "GSM8K_INSTRUCTION", "HUB_ID"]

HUB_ID = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# Source split -> output file. GSM8K has no validation split; its test split is ours.
_SPLITS = {"train": "train", "test": "validation"}

_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _extra_info_fields() -> list[tuple[str, Any]]:
    import pyarrow as pa

    return [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]


def gsm8k_ground_truth(answer: str) -> str | None:
    """The number after the last "####" of a reference solution, commas removed; None if absent."""
    if "####" not in answer:
        return None
    text = answer.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")
    return text if _NUMBER.fullmatch(text) else None


def gsm8k_row(question: str, answer: str, *, split: str, index: int,
              env_class: str = "gsm8k") -> dict[str, Any] | None:
    """One prompt row from a GSM8K record, or None if its answer has no "####" number."""
    ground_truth = gsm8k_ground_truth(answer)
    if ground_truth is None:
        return None
    return {
        "data_source": HUB_ID,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "env_class": env_class,
        "reward_spec": {"method": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def _rows(records: Iterable[Mapping[str, Any]], *, split: str, source: str, env_class: str) -> list[dict[str, Any]]:
    rows = []
    for index, record in enumerate(records):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DatasetError(
                f"{source} row {index}: expected string 'question' and 'answer' fields, "
                f"got keys {sorted(record)}",
                file=source,
                index=index,
            )
        row = gsm8k_row(question, answer, split=split, index=index, env_class=env_class)
        if row is None:
            raise DatasetError(
                f"{source} row {index}, column 'answer': expected the solution to end with "
                f"'#### <number>', got ...{answer[-40:]!r}",
                file=source,
                index=index,
                problems=[("answer", "no '#### <number>'")],
            )
        rows.append(row)
    return rows


def _read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"GSM8K input file not found: {path}", file=str(path))
    records: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path} line {line_number}: invalid JSON: {exc.msg}", file=str(path), index=len(records)
                ) from exc
            if not isinstance(record, dict):
                raise DatasetError(
                    f"{path} line {line_number}: expected a JSON object, got {type(record).__name__}",
                    file=str(path),
                    index=len(records),
                )
            records.append(record)
    return records


_LOCAL_FIX = ("Fix: a folder holding GSM8K's train.jsonl and test.jsonl (records {\"question\", \"answer\"}) as "
              "`ridgeline prepare gsm8k --input DIR` or data.prepare.input_dir=DIR, or HF_HUB_OFFLINE=1 to read "
              "openai/gsm8k from the local Hugging Face cache")


def _load_from_hub() -> Any:
    """``datasets.load_dataset("openai/gsm8k", "main")``, or one DatasetError with the fix."""
    import datasets  # slow import; only needed for the hub path
    from huggingface_hub import HfApi

    offline = bool(datasets.config.HF_HUB_OFFLINE)
    if not offline:
        try:
            HfApi().dataset_info(HUB_ID, timeout=HUB_TIMEOUT_S)
        except Exception as exc:  # the transport's own errors: no network, DNS, timeout, proxy, 5xx
            raise DatasetError(f"GSM8K is read from the Hugging Face Hub ({HUB_ID}), which could not be reached "
                               f"({type(exc).__name__}). {_LOCAL_FIX}.", file=HUB_ID) from None
    try:
        return datasets.load_dataset(HUB_ID, "main")
    except Exception as exc:  # load_dataset raises many types (the cache, the hub, formats)
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face Hub"
        raise DatasetError(f"GSM8K could not be loaded from {where}: {type(exc).__name__}: {exc}. {_LOCAL_FIX}.",
                           file=HUB_ID) from None


def prepare_gsm8k(output_dir: str | Path, input_dir: str | Path | None = None, *, max_train: int | None = None,
                  max_val: int | None = None, env_class: str = "gsm8k") -> dict[str, Path]:
    """Write GSM8K ``train.parquet`` and ``validation.parquet`` into ``output_dir``.

    ``max_train`` / ``max_val`` keep only the first rows of each split (quick runs, tests);
    ``env_class`` is the environment the rows name (``gsm8k_lenient`` for Ridgeline's reader).

    With ``input_dir``, reads local ``train.jsonl`` and ``test.jsonl``
    (records ``{"question", "answer"}``); otherwise downloads
    ``openai/gsm8k`` (config "main") with ``datasets``, after one short request that tells an
    unreachable hub at once (no minutes of retries).
    ``extra_info.split`` keeps the original GSM8K split name ("train" /
    "test"). Returns ``{"train": path, "validation": path}``.
    """
    output_dir = Path(output_dir)
    if input_dir is not None:
        input_dir = Path(input_dir)
        sources = {
            split: (_read_jsonl_records(input_dir / f"{split}.jsonl"), str(input_dir / f"{split}.jsonl"))
            for split in _SPLITS
        }
    else:
        hub = _load_from_hub()
        sources = {split: (hub[split], f"{HUB_ID} {split}") for split in _SPLITS}

    schema = arrow_schema(_extra_info_fields())
    written: dict[str, Path] = {}
    for split, name in _SPLITS.items():
        records, source = sources[split]
        rows = _rows(records, split=split, source=source, env_class=env_class)
        limit = max_train if name == "train" else max_val
        rows = rows if limit is None else rows[:limit]
        written[name] = write_parquet(rows, output_dir / f"{name}.parquet", schema)
    return written
