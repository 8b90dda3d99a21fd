"""Where prompt rows come from: an entry of `data.train_data` / `data.val_data`, read as SkyRL-Train
0.3.1 reads it (`skyrl_train/dataset/dataset.py`):

    path/to/train.parquet         a parquet file
    path/to/train.json            JSON lines, or one JSON array of row objects
    path/to/train.jsonl           (`DataFrame.to_json(orient="records")` writes the latter)
    openai/gsm8k  or  name:split  anything else: `datasets.load_dataset(name)`, split `train` unless
    path/to/folder:test           named after a colon; a local dataset folder goes the same way

Rows come back raw (dicts); `schema.validate_row` checks them. A hub name is looked up with one
short request first, so an unreachable hub fails at once with one message naming the config key and
the name, not after minutes of retries; with `HF_HUB_OFFLINE=1` the local Hugging Face cache is
read instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import DatasetError

__all__ = ["FILE_SUFFIXES", "HUB_TIMEOUT_S", "SourceDigest", "file_digest", "is_data_file", "is_hub_dataset",
           "locate_hub_dataset", "parse_dataset_name", "read_rows", "rows_digest"]

FILE_SUFFIXES = (".parquet", ".json", ".jsonl")
HUB_TIMEOUT_S = 10.0   # seconds the hub may take to say whether a dataset exists


@dataclass(frozen=True)
class SourceDigest:
    """One source by content, for a resume's identity check: a file's bytes, or the rows of a
    dataset `load_dataset` read (canonical JSON). `file` is the entry as the config names it."""

    file: str
    size: int
    sha256: str


def is_data_file(spec: str | Path) -> bool:
    """An entry read as a local file (by its suffix), as opposed to a `load_dataset` name."""
    return Path(spec).suffix.lower() in FILE_SUFFIXES


def is_hub_dataset(spec: str | Path) -> bool:
    """An entry `load_dataset` reads from the Hugging Face Hub: no file, no local folder."""
    return not is_data_file(spec) and not Path(parse_dataset_name(str(spec))[0]).exists()


def locate_hub_dataset(spec: str, config_key: str | None = None) -> None:
    """Look a hub entry up without downloading it (one short request; nothing with
    HF_HUB_OFFLINE): a DatasetError naming `config_key` when the hub lacks it or cannot be reached."""
    import datasets

    where = f"{config_key} lists {spec!r}" if config_key else repr(spec)
    _check_hub_name(parse_dataset_name(spec)[0], where, bool(datasets.config.HF_HUB_OFFLINE))


def parse_dataset_name(spec: str) -> tuple[str, str]:
    """`name:split` -> (name, split), at the first colon as SkyRL splits it; no colon -> split
    `train` (SkyRL's default). A colon with nothing after it gives an empty split."""
    name, colon, split = str(spec).partition(":")
    return name, split if colon else "train"


def read_rows(spec: str | Path, config_key: str | None = None) -> list[dict[str, Any]]:
    """The raw rows of one entry (see the module docstring). `config_key` (e.g. `data.train_data`)
    is named in the messages about datasets that are not local files."""
    if is_data_file(spec):
        return _read_file(Path(spec))
    path = Path(spec)
    if path.is_file():
        raise DatasetError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; expected one of "
                           f"{', '.join(FILE_SUFFIXES)}, a dataset folder or a Hugging Face dataset name",
                           file=str(path))
    return _load_dataset(str(spec), config_key)


# ------------------------------------------------------------------------------------ local files
def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path} (resolved to {path.resolve()}). Fix: the path of an "
                           "existing file (relative paths are read from the folder the command runs in)",
                           file=str(path))
    if path.is_dir():
        raise DatasetError(f"dataset path is a directory, expected a file: {path} (list the files, e.g. "
                           f"{path / 'train.parquet'})", file=str(path))
    if path.suffix.lower() == ".parquet":
        return _read_parquet(path)
    try:
        data = path.read_bytes()
    except OSError as exc:  # permissions, a vanished file, an I/O error: the file, not the code
        raise DatasetError(f"{path}: could not read the file ({exc.strerror or exc})", file=str(path)) from exc
    return _read_json(path, _utf8_text(path, data))


def _utf8_text(path: Path, data: bytes) -> str:
    """`data` decoded as UTF-8 (a byte-order mark is not data); DatasetError naming the line, the
    row and the byte where it is not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = data[:exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        if data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):  # one JSON array: rows are not lines
            row, where = None, f"{path} line {line}"
        else:  # JSON lines: the rows (non-blank lines) before it
            row = sum(1 for text in before.split(b"\n")[:-1] if text.strip())
            where = f"{path} row {row} (line {line})"
        raise DatasetError(
            f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}). Fix: save the file as "
            f"UTF-8 (e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}; JSON files must be "
            "UTF-8)", file=str(path), index=row, problems=[(None, "not UTF-8 text")]) from None


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: could not read parquet file: {exc}", file=str(path)) from exc
    # pandas.DataFrame.to_parquet may store the index as an extra column; it is not data.
    index_columns = [name for name in table.column_names if name.startswith("__index_level_")]
    if index_columns:
        table = table.drop_columns(index_columns)
    return table.to_pylist()


# a \uD800-\uDFFF escape: JSON may write half of a surrogate pair alone, which no tokenizer can encode
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The field (`where` + keys / indices) of the first string in `value` holding a lone
    surrogate (not UTF-8 encodable), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where} (character {exc.start}: {value[exc.start]!r})"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, f"{where}[{key!r}]" if where else str(key))
        if found:
            return found
    return None


def _check_surrogates(path: Path, text: str, rows: list[Any], lines: list[int] | None) -> None:
    """DatasetError naming the row (and line) and field of a string holding a lone surrogate: JSON
    reads `"\ud800"` fine, but the tokenizer fails on it with a TypeError far from the file."""
    if not _SURROGATE_ESCAPE.search(text):
        return
    for index, row in enumerate(rows):
        field = _lone_surrogate(row, "")
        if field:
            where = f"{path} row {index}" + (f" (line {lines[index]})" if lines else "")
            raise DatasetError(f"{where}, column {field}: a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
                               "which is no character and no tokenizer encodes. Fix: write the character itself, or "
                               "both halves of its surrogate pair", file=str(path), index=index,
                               problems=[(field, "a lone surrogate")])


def _read_json(path: Path, text: str) -> list[dict[str, Any]]:
    """JSON lines (one row object per line), or a whole file holding one JSON array of rows: the
    two layouts `datasets.load_dataset("json", ...)` reads for SkyRL, whatever the suffix."""
    if text.lstrip().startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} (a JSON array): invalid JSON at line {exc.lineno}, column {exc.colno}: "
                               f"{exc.msg}", file=str(path), problems=[(None, f"invalid JSON: {exc.msg}")]) from exc
        _check_surrogates(path, text, array if isinstance(array, list) else [], None)
        return array
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    # split on "\n" only: str.splitlines also splits on U+2028 and other characters JSON strings may hold
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # tolerate blank lines, e.g. a trailing newline
        try:
            rows.append(json.loads(line))
            lines.append(line_number)
        except json.JSONDecodeError as exc:
            index = len(rows)
            raise DatasetError(
                f"{path} row {index} (line {line_number}): invalid JSON: {exc.msg} at column {exc.colno} "
                "(expected JSON lines, one row object per line, or one JSON array of rows)",
                file=str(path), index=index, problems=[(None, f"invalid JSON: {exc.msg}")]) from exc
    _check_surrogates(path, text, rows, lines)
    return rows


# ------------------------------------------------------------------------------------ load_dataset
def _load_dataset(spec: str, config_key: str | None) -> list[dict[str, Any]]:
    """`datasets.load_dataset(name)[split]` as rows, for a local dataset folder or a hub name."""
    import datasets

    where = f"{config_key} lists {spec!r}" if config_key else repr(spec)
    name, split = parse_dataset_name(spec)
    if not split:
        raise DatasetError(f"{where}: nothing after the colon. Fix: name:split (e.g. {name}:test), or {name} for "
                           "its train split", file=spec)
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    if not Path(name).exists():
        _check_hub_name(name, where, offline)
    try:
        loaded = datasets.load_dataset(name, keep_in_memory=True)
    except Exception as exc:  # load_dataset raises many types (missing files, bad formats, the hub)
        hint = (" HF_HUB_OFFLINE is set, so only the local Hugging Face cache was read: load it once where the "
                "hub is reachable, or point the key at local files." if offline else "")
        raise DatasetError(f"{where}: datasets.load_dataset({name!r}) failed: {type(exc).__name__}: {exc}.{hint}",
                           file=spec) from None
    if split not in loaded:
        raise DatasetError(f"{where}: the dataset {name!r} has no split {split!r}; its splits: "
                           f"{', '.join(loaded)}. Fix: {name}:{next(iter(loaded))}", file=spec)
    return loaded[split].to_list()


def _check_hub_name(name: str, where: str, offline: bool) -> None:
    """Refuse, in one sentence each, a name that is no path and no hub id, a dataset the hub does
    not have (or gates), and a hub that does not answer within HUB_TIMEOUT_S."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    local = (f"neither a local {', '.join(FILE_SUFFIXES)} file nor a dataset folder (no such path: "
             f"{Path(name).resolve()})")
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise DatasetError(f"{where}: {local}, nor a Hugging Face dataset name", file=name) from None
    if offline:
        return  # load_dataset reads the local cache only, and fails at once when it is not there
    try:
        HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise DatasetError(f"{where}: the Hugging Face dataset {name!r} is gated: log in (`hf auth login` or "
                           "HF_TOKEN) with an account that has access", file=name) from None
    except RepositoryNotFoundError:
        raise DatasetError(f"{where}: {local}, and the Hugging Face Hub has no dataset {name!r}", file=name) from None
    except Exception as exc:  # the transport's own errors: no network, DNS, timeout, proxy, 5xx
        raise DatasetError(
            f"{where}: {local}, and the Hugging Face Hub could not be reached to load {name!r} "
            f"({type(exc).__name__}: {exc}). Fix: point the key at local files or a dataset folder, or set "
            "HF_HUB_OFFLINE=1 to read the dataset from the local Hugging Face cache", file=name) from None


# ------------------------------------------------------------------------------------ identity
def file_digest(path: str | Path) -> SourceDigest:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return SourceDigest(file=str(path), size=os.path.getsize(path), sha256=h.hexdigest())


def rows_digest(spec: str, rows: list[dict[str, Any]]) -> SourceDigest:
    data = json.dumps(rows, sort_keys=True, ensure_ascii=False, default=str).encode()
    return SourceDigest(file=str(spec), size=len(data), sha256=hashlib.sha256(data).hexdigest())
