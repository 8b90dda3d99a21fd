"""The prompt-row schema (SkyRL layout) and its validation.

A row is::

    data_source: str                         # groups metrics, e.g. "openai/gsm8k"
    prompt:      [{"role": ..., "content": ...}, ...]   # roles system/user/assistant
    env_class:   str                         # registered env name, e.g. "gsm8k"
    reward_spec: {"method": "rule", "ground_truth": ...}   # optional: the env reads what it needs
    extra_info:  {...}                       # anything, passed through

Every column other than ``prompt`` and ``env_class`` reaches the env as
``extras``, as in SkyRL (skyrl-gym's ``aime`` reads ``reward_model``, not
``reward_spec``); an env that needs a column the row lacks is refused when
the run checks its rows' envs. Rows are validated when a dataset is loaded, not when a batch
happens to hit a bad one hours into training, and errors name the file,
row and column so the fix is obvious.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ridgeline.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["PromptRow", "DatasetError", "validate_row", "arrow_schema", "ROLES"]

ROLES = ("system", "user", "assistant")

_PROMPT_EXPECTED = "expected a non-empty list of {role, content} messages"


class DatasetError(UserError, ValueError):
    """A dataset file or row does not match the expected schema.

    Attributes:
        file: the file the problem is in.
        index: 0-based row index, or None for file-level problems.
        problems: (column, message) pairs; column is None when the problem is
            not about a single column (e.g. an unparseable JSON line).
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        index: int | None = None,
        problems: list[tuple[str | None, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.file = file
        self.index = index
        self.problems = list(problems or [])

    @property
    def column(self) -> str | None:
        """The first offending column, if any."""
        return self.problems[0][0] if self.problems else None

    def under_key(self, config_key: str | None) -> "DatasetError":
        """This error with the config key that lists the source in front (`data.train_data: ...`),
        once; itself without a key."""
        if config_key is None or str(self).startswith(config_key):
            return self
        return DatasetError(f"{config_key}: {self}", file=self.file, index=self.index, problems=self.problems)


@dataclass
class PromptRow:
    """One validated dataset row.

    ``extras`` holds every column except ``prompt`` and ``env_class`` (so it
    includes data_source, reward_spec and extra_info); it is what the env
    receives.
    """

    data_source: str
    prompt: list[dict[str, str]]
    env_class: str
    reward_spec: dict[str, Any] | None   # None: the row has no reward_spec (its env reads other columns)
    extra_info: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _got(value: Any) -> str:
    """'got <type>' plus a short preview of the value, for error messages."""
    preview = repr(value)
    if len(preview) > 60:
        preview = preview[:57] + "..."
    if value is None or isinstance(value, (dict, list, tuple)) and not value:
        return f"got {preview}"
    return f"got {_type_name(value)} {preview}"


def _as_dict(value: Any) -> dict[str, Any] | None:
    """Mapping -> dict. Also accepts Arrow map columns, which read back as (key, value) pairs."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (list, tuple)) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        try:
            return {str(k): v for k, v in value}
        except TypeError:
            return None
    return None


def _as_list(value: Any) -> list[Any] | None:
    """list/tuple/numpy array (pandas-read parquet) -> list; anything else -> None."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if type(value).__name__ == "ndarray" and hasattr(value, "tolist"):
        return list(value)
    return None


def _check_prompt(value: Any) -> tuple[list[dict[str, str]] | None, str | None]:
    messages = _as_list(value)
    if messages is None:
        return None, f"{_PROMPT_EXPECTED}, {_got(value)}"
    if not messages:
        return None, f"{_PROMPT_EXPECTED}, got an empty list"
    cleaned: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        as_dict = _as_dict(message)
        if as_dict is None:
            return None, f"{_PROMPT_EXPECTED}; message {i} {_got(message)}"
        role, content = as_dict.get("role"), as_dict.get("content")
        if role not in ROLES:
            return None, f"message {i}: expected role to be one of {', '.join(ROLES)}, got {role!r}"
        if not isinstance(content, str):
            return None, f"message {i} ({role}): expected content to be a string, {_got(content)}"
        cleaned.append({"role": role, "content": content})
    return cleaned, None


def validate_row(
    row: Any,
    *,
    file: str | Path,
    index: int,
    default_env_class: str | None = None,
) -> PromptRow:
    """Check one raw row and turn it into a :class:`PromptRow`.

    All problems in the row are collected and raised together as one
    :class:`DatasetError` whose message names the file, the row index and
    each offending column, and says what was expected.

    Defaults: a missing/None ``env_class`` becomes ``default_env_class``;
    a missing/None ``extra_info`` becomes ``{}``; a missing/None
    ``data_source`` becomes the file's stem (so per-source metrics still
    have a name). ``reward_spec``, when present, must be a dict; a row
    without one is fine for an env that reads other columns.
    """
    where = f"{file} row {index}"
    if not isinstance(row, Mapping):
        raise DatasetError(
            f"{where}: expected a row object with columns, {_got(row)}",
            file=str(file),
            index=index,
            problems=[(None, f"expected a row object, {_got(row)}")],
        )

    problems: list[tuple[str | None, str]] = []

    prompt, err = _check_prompt(row.get("prompt")) if "prompt" in row else (None, f"{_PROMPT_EXPECTED}, got nothing (column missing)")
    if err:
        problems.append(("prompt", err))

    data_source = row.get("data_source")
    if data_source is None:
        data_source = Path(str(file)).name.split(".")[0] or "unknown"
    elif not isinstance(data_source, str) or not data_source:
        problems.append(("data_source", f"expected a non-empty string, {_got(data_source)}"))

    env_class = row.get("env_class")
    if env_class is None:
        env_class = default_env_class
        if env_class is None:
            problems.append(("env_class", "missing, and no default env class was given"))
    elif not isinstance(env_class, str) or not env_class:
        problems.append(("env_class", f"expected a non-empty string (a registered env name), {_got(env_class)}"))

    reward_spec: dict[str, Any] | None = None
    expected_spec = "expected a dict like {'method': 'rule', 'ground_truth': ...}"
    if row.get("reward_spec") is not None:
        reward_spec = _as_dict(row["reward_spec"])
        if reward_spec is None:
            problems.append(("reward_spec", f"{expected_spec}, {_got(row['reward_spec'])}"))
        elif reward_spec.get("method") is not None and not isinstance(reward_spec["method"], str):
            problems.append(("reward_spec", f"expected 'method' to be a string, {_got(reward_spec['method'])}"))

    extra_info: dict[str, Any] | None = {}
    if row.get("extra_info") is not None:
        extra_info = _as_dict(row["extra_info"])
        if extra_info is None:
            problems.append(("extra_info", f"expected a dict, {_got(row['extra_info'])}"))

    if problems:
        lines = [f"column {col!r}: {msg}" if col else msg for col, msg in problems]
        if len(lines) == 1:
            message = f"{where}, {lines[0]}"
        else:
            message = f"{where} has {len(lines)} problems:\n  " + "\n  ".join(lines)
        raise DatasetError(message, file=str(file), index=index, problems=problems)

    assert prompt is not None and extra_info is not None
    assert isinstance(env_class, str) and isinstance(data_source, str)
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
    extras["data_source"] = data_source
    if reward_spec is not None:
        extras["reward_spec"] = reward_spec
    extras["extra_info"] = extra_info
    return PromptRow(
        data_source=data_source,
        prompt=prompt,
        env_class=env_class,
        reward_spec=reward_spec,
        extra_info=extra_info,
        extras=extras,
    )


def arrow_schema(extra_info_fields: Sequence[tuple[str, Any]] = ()) -> "pa.Schema":
    """Arrow schema for prompt rows, with typed nested columns.

    Nested list/struct columns (rather than JSON strings) are what SkyRL,
    ``datasets`` and pandas produce and expect, so files we write can be
    used by those tools and vice versa. ``extra_info_fields`` are
    (name, pyarrow type) pairs for the ``extra_info`` struct.
    """
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("env_class", pa.string()),
            ("reward_spec", pa.struct([("method", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct(list(extra_info_fields))),
        ]
    )
