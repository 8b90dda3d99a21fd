"""What the config sections are made of: the ``setting`` field, the problem report, value text.

A section is a dataclass whose fields are ``setting(default, ...)``: the dataclass gives the type
and the default (OmegaConf turns it into a typed node), the metadata says which values are allowed
or built. A section's ``check(at, report)`` holds its rules between keys, each with its "Fix:".
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["setting", "Report", "show", "one_of", "divisor_text", "Section"]


def setting(default: Any, *, choices: tuple[Any, ...] = (), built: tuple[Any, ...] = (), not_built: str = "",
            example: str = "") -> Any:
    """A config field. ``choices``: the values the key may hold. ``not_built``: why a value this build
    does not act on is refused; with ``built`` (values that are built) it applies to every other
    value, the default included, else to any change of the default. ``example``: a value to show in a
    fix when the default is no example (null)."""
    meta = {"choices": choices, "built": built, "not_built": not_built, "example": example}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """A config section: its rules between keys. ``at`` is the section's dotted key.

    A value set after the section is built is typed as the loader types it (OmegaConf's rules: a
    number is a fine string, "many" is no integer), and a name that is not a key is refused, so a
    misspelt key or a wrong type set by code fails where it is set, not where it is read."""

    def check(self, at: str, report: "Report") -> None:
        """Add a problem to ``report`` for every rule this section's values break."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:  # not while the dataclass's __init__ sets the fields
            value = _typed_value(type(self), name, value)
        elif dataclasses.is_dataclass(self) and name not in {f.name for f in dataclasses.fields(self)}:
            raise AttributeError(f"{type(self).__name__} has no key {name!r}")
        object.__setattr__(self, name, value)


@functools.lru_cache(maxsize=None)
def _section_node(cls: type) -> Any:
    """An OmegaConf tree of ``cls`` whose nodes type a value the way the loader does."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(cls)


def _typed_value(cls: type, name: str, value: Any) -> Any:
    """``value`` as field ``name`` of ``cls`` holds it; OmegaConf's ValidationError when it cannot."""
    if isinstance(value, Section) or section_type(field_type(cls, name)) is not None:
        if not isinstance(value, section_type(field_type(cls, name)) or ()):
            from omegaconf import ValidationError
            raise ValidationError(f"{cls.__name__}.{name} is a section: {type(value).__name__} cannot replace it")
        return value
    from omegaconf import OmegaConf

    node = _section_node(cls).copy()  # the cached tree stays as it is (no other thread sees this one)
    node[name] = value
    held = node._get_node(name)
    return OmegaConf.to_container(held, resolve=False) if OmegaConf.is_config(held) else held._value()


@dataclass
class Report:
    """The problems of one config, one paragraph each, in the order found.

    ``bad`` holds the keys whose value was refused on its own (unknown, wrong type, not a choice,
    not built): the rules between keys then read a stand-in value there, so a rule's problem that
    names a bad key says nothing new and is left out."""

    problems: list[str] = field(default_factory=list)
    bad: set[str] = field(default_factory=set)
    _first: int = 0  # problems[:_first] name features this build does not have

    def refuse(self, key: str, text: str, *, first: bool = False) -> None:
        """A value that is wrong on its own; ``first``: a feature not built, listed before the rest
        (it explains what follows)."""
        if first:
            self.problems.insert(self._first, text)
            self._first += 1
        else:
            self.problems.append(text)
        self.bad.add(key)

    def add(self, text: str) -> None:
        """A rule between keys that does not hold (its text names the keys it read)."""
        if not any(_names(text, key) for key in self.bad):
            self.problems.append(text)


def _names(text: str, key: str) -> bool:
    start = text.find(key)
    while start != -1:
        end = start + len(key)
        if end == len(text) or not (text[end].isalnum() or text[end] == "_"):
            return True
        start = text.find(key, end)
    return False


# --------------------------------------------------------------------------- the schema as data


def section_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # the schema's classes never change; resolving their string annotations was 40% of a load_config
    return typing.get_type_hints(cls)


def field_type(cls: type, name: str) -> Any:
    return _type_hints(cls)[name]


def section_type(tp: Any) -> type | None:
    """The section dataclass a field of type ``tp`` holds, or None for a value."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def is_free_form(tp: Any) -> bool:
    """A map whose keys are the user's (``Dict[str, Any]``, optional or not)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    return any(typing.get_origin(a) in (dict, typing.Dict) for a in args)


# --------------------------------------------------------------------------- value text


def show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if (value == "" or value.strip() != value or " " in value) else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return str(value)


def one_of(values: Iterable[Any]) -> str:
    items = [show(v) for v in values]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


def divisor_text(n: int) -> str:
    divs = [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []
    if len(divs) > 8:
        return ", ".join(str(d) for d in divs[:5]) + ", ... or " + str(divs[-1])
    return one_of(divs)
