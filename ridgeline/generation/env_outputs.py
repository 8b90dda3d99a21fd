"""What an environment hands back, checked before the generator uses it; long observations cut.

Environment code is user code, and its outputs reach the tokenizer, the reward tensors and the
dump files. Every value is checked here, in the worker thread that made the call (so a property
that raises or loops runs under the call's time limit, not in the generator's thread):

* reward: a real number (int, float, numpy scalar; a bool counts 0 / 1, as Python, SkyRL and
  skyrl-gym add it; not a string or None) that is finite and within float32's range, the dtype
  the training batch keeps rewards in (``10**400`` and ``1e39`` are refused, not turned into inf).
* done: a bool (numpy's too), or an integer 0 / 1.
* observations, and the prompt ``init`` returns: a list of messages, each a mapping with a
  ``role`` (a non-empty string) and a ``content`` string; other keys (``name``,
  ``tool_call_id``) must be strings too. ``role`` and those keys: at most 256 characters.
* metadata: a mapping (or None) that ``json.dumps(..., default=str)`` can write, as the eval dump
  does; ``get_metrics``: a mapping (or None).

A value that breaks a rule raises :class:`~ridgeline.envs.base.EnvOutputError` naming the field,
what came back and the fix.

The observation cap (``generator.max_observation_chars``): the messages of one step may hold at
most that many characters, counting each message's content, role and other keys, plus
``MESSAGE_OVERHEAD`` for the chat template's markup around it (so ten million empty messages are
not a way around it). Past the cap, messages are kept in order while they fit; the one that
crosses it keeps the part of its content that fits plus a note saying how much was cut, and later
messages are dropped. This happens before anything is tokenized. ``init`` may lengthen the row's
prompt by at most as much; a longer prompt is refused, not cut (it is the task).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ridgeline.envs.base import EnvOutputError, Message, StepOutput, exception_text, short_repr

# float32's largest finite value: rewards live in float32 tensors in the training batch
REWARD_LIMIT = 3.4028234663852886e38
FIELD_LIMIT = 256        # characters of a message's role and of any key other than content
MESSAGE_OVERHEAD = 32    # characters a message costs beyond its fields (the template's markup)
CAP_KEY = "generator.max_observation_chars"


@dataclass(frozen=True)
class Cut:
    """What the observation cap removed from one step's messages."""

    size: int      # the messages' size before (characters, as the cap counts them)
    chars: int     # content characters removed from the message that crossed the cap
    dropped: int   # later messages left out whole


@dataclass(frozen=True)
class CheckedStep:
    """A step's output that passed the checks: plain types only."""

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any]
    cut: Cut | None = None   # set when the observations were cut to the cap


def check_step(out: Any, max_chars: int | None) -> CheckedStep:
    """``env.step``'s return value checked field by field, observations cut to ``max_chars``."""
    if not isinstance(out, StepOutput):
        raise EnvOutputError("type", f"step returned {type(out).__name__} {short_repr(out)}, not a StepOutput. "
                                     "Fix: return StepOutput(observations, reward, done, metadata).")
    with _reading("step's output"):
        reward = check_reward(_field(out, "reward"))
        done = check_done(_field(out, "done"))
        observations = check_messages(_field(out, "observations"), "observations")
        metadata = check_metadata(_field(out, "metadata"))
    observations, cut = cap_messages(observations, max_chars)
    return CheckedStep(observations, reward, done, metadata, cut)


def check_init(out: Any, prompt: list[Message], max_chars: int | None) -> list[Message]:
    """The prompt ``env.init`` returned (its metadata is not used), checked; it may be longer
    than the row's ``prompt`` by at most ``max_chars``."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise EnvOutputError("type", f"init returned {type(out).__name__} {short_repr(out)}, not a pair. "
                                     "Fix: return (prompt messages, metadata dict).")
    with _reading("prompt init returned"):
        messages = check_messages(out[0], "prompt")
    added = messages_size(messages) - messages_size(prompt)
    if max_chars is not None and added > max_chars:
        raise EnvOutputError("prompt", f"init lengthened the prompt by {added} characters, more than "
                                       f"{CAP_KEY}={max_chars}. Fix: a shorter prompt, or raise {CAP_KEY}.")
    return messages


def check_metrics(out: Any) -> dict[str, Any]:
    """``env.get_metrics()`` (or ``aggregate_metrics``): a mapping (None counts as empty), copied."""
    with _reading("metrics"):
        return _mapping(out, "metrics", "return a dict of numbers, e.g. {'tool_calls': 2}")


def check_reward(value: Any) -> float:
    numpy = sys.modules.get("numpy")   # only an env that imported numpy can return a numpy bool
    if numpy is not None and isinstance(value, numpy.bool_):
        value = bool(value)
    if not isinstance(value, numbers.Real):   # bool is an int: `answer == truth` scores 1 / 0
        raise EnvOutputError("reward", f"reward {short_repr(value)} is of type {type(value).__name__}, not a "
                                       "number. Fix: return a float, e.g. float(correct).")
    try:
        reward = float(value)
    except (OverflowError, ValueError, TypeError) as exc:
        raise EnvOutputError("reward", f"reward {short_repr(value)} does not fit a float ({exc}). "
                                       "Fix: return a float within +-3.4e38.") from None
    if not math.isfinite(reward) or abs(reward) > REWARD_LIMIT:
        raise EnvOutputError("reward", f"reward {short_repr(value)} is not a finite float32 (the training "
                                       "batch's dtype). Fix: return a float within +-3.4e38.")
    return reward


def check_done(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    numpy = sys.modules.get("numpy")   # only an env that imported numpy can return a numpy bool
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise EnvOutputError("done", f"done {short_repr(value)} of type {type(value).__name__} is not a bool. "
                                 "Fix: return done=True or done=False.")


def check_messages(value: Any, field: str) -> list[Message]:
    """A list of chat messages, copied as plain dicts of plain strings."""
    if not isinstance(value, (list, tuple)):
        raise EnvOutputError(field, f"{field} is {type(value).__name__} {short_repr(value)}, not a list of "
                                    "messages. Fix: a list of {'role': ..., 'content': ...} dicts ([] for none).")
    return [_message(m, field, i) for i, m in enumerate(value)]


def _message(value: Any, field: str, index: int) -> Message:
    where = f"{field}[{index}]"
    if not isinstance(value, Mapping):
        raise EnvOutputError(field, f"{where} is {type(value).__name__} {short_repr(value)}, not a dict. "
                                    "Fix: {'role': 'user', 'content': '...'}.")
    message: Message = {}
    for key, text in value.items():
        if not isinstance(key, str) or not isinstance(text, str):
            raise EnvOutputError(field, f"{where}[{short_repr(key)}] is {type(text).__name__} "
                                        f"{short_repr(text)}; every key and value of a message must be a "
                                        "string. Fix: e.g. {'role': 'user', 'content': str(result)}.")
        if key != "content" and len(text) > FIELD_LIMIT:
            raise EnvOutputError(field, f"{where}[{key!r}] holds {len(text)} characters; a message's fields "
                                        f"other than content are at most {FIELD_LIMIT}. Fix: put the text in "
                                        "content.")
        message[str.__str__(key)] = str.__str__(text)   # plain str, not a subclass with its own methods
    if not message.get("role") or "content" not in message:
        raise EnvOutputError(field, f"{where} has keys {sorted(message)}; a message needs a non-empty 'role' "
                                    "and a 'content'. Fix: {'role': 'user', 'content': '...'}.")
    return message


def check_metadata(value: Any) -> dict[str, Any]:
    """A mapping that the eval dump (`json.dumps(..., default=str)`) can write, copied."""
    metadata = _mapping(value, "metadata", "metadata={} or a dict such as {'parsed': answer}")
    try:
        json.dumps(metadata, default=str)
    except Exception as exc:  # circular data, keys json cannot write, a __str__ that raises
        raise EnvOutputError("metadata", f"metadata {short_repr(metadata)} cannot be written as JSON "
                                         f"({exception_text(exc, 120)}). Fix: strings, "
                                         "numbers, lists and dicts with string keys.") from None
    return metadata


def _mapping(value: Any, field: str, fix: str) -> dict[str, Any]:
    """``value`` as a plain dict: None counts as empty, anything but a mapping is refused."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise EnvOutputError(field, f"{field} is {type(value).__name__} {short_repr(value)}, not a dict. Fix: {fix}.")
    return dict(value)


def message_size(message: Message) -> int:
    """Characters a message counts against the cap: its fields plus the template's markup (a checked
    message holds strings only; the row's own prompt is measured the same way)."""
    return MESSAGE_OVERHEAD + sum(len(text) for text in message.values() if isinstance(text, str))


def messages_size(messages: list[Message]) -> int:
    return sum(message_size(m) for m in messages)


def cap_messages(messages: list[Message], max_chars: int | None) -> tuple[list[Message], Cut | None]:
    """``messages`` within ``max_chars`` (see the module docstring), and what was cut (None: nothing)."""
    size = messages_size(messages)
    if max_chars is None or size <= max_chars:
        return messages, None
    kept: list[Message] = []
    room = max_chars
    for message in messages:
        cost = message_size(message)
        if cost <= room:
            kept.append(message)
            room -= cost
            continue
        content = message["content"]
        keep = max(0, room - (cost - len(content)))
        cut_chars = 0
        if keep > 0 or not kept:   # the first message always stays, so the model sees the note
            cut_chars = len(content) - keep
            note = f"\n[... {cut_chars} characters cut: the observation exceeded {max_chars} characters]"
            kept.append({**message, "content": content[:keep] + note})
        return kept, Cut(size=size, chars=cut_chars, dropped=len(messages) - len(kept))
    raise AssertionError("unreachable: the messages exceed the cap, so one of them crosses it")


def _field(out: StepOutput, name: str) -> Any:
    """One attribute of a StepOutput, read once: a subclass may compute it (and raise)."""
    try:
        return getattr(out, name)
    except Exception as exc:
        raise EnvOutputError(name, f"reading the step's {name} raised {exception_text(exc, 120)}. "
                                   "Fix: return a plain StepOutput.") from None


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Anything but an EnvOutputError raised while reading user objects (a mapping whose items()
    fails, a str subclass that breaks len) is a bad output too, not a crash of the generator."""
    try:
        yield
    except EnvOutputError:
        raise
    except Exception as exc:
        raise EnvOutputError("type", f"reading the {what} raised {exception_text(exc, 120)}. "
                                     "Fix: return plain dicts, lists and strings.") from None


__all__ = ["CAP_KEY", "CheckedStep", "Cut", "FIELD_LIMIT", "MESSAGE_OVERHEAD", "REWARD_LIMIT", "cap_messages",
           "check_done", "check_init", "check_messages", "check_metadata", "check_metrics", "check_reward",
           "check_step", "message_size", "messages_size"]
