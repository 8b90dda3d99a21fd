"""Tool use for environments: declare tools as methods, read the model's calls, run them.

Declaring tools::

    class Calculator(ToolGroup):
        @tool
        def add(self, a: float, b: float) -> float:
            \"\"\"Add two numbers.

            Args:
                a: the first number.
                b: the second number.
            \"\"\"
            return a + b

``Calculator().tool_specs()`` gives the function specs (OpenAI/Hermes shape: name, description,
JSON-schema parameters) built from the annotations and the Google-style docstring, and
``describe()`` a system-prompt text listing them.

Calls use the Hermes/Qwen format, which Qwen-family chat templates and most open tool-calling
models are trained on::

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

Only the last call in a reply is read (one call per turn keeps the turn structure simple and
the reward unambiguous). Parsing is lenient about what models actually emit: whitespace, a
missing closing tag (generation often stops at ``</tool_call>``), a code fence, one stray
character after the JSON (typically an extra ``}``), and ``arguments`` sent as a JSON string.
Anything else malformed raises :class:`ToolCallError`, whose message is meant to be shown to
the model. Running a tool never raises: errors come back as ``"Error: <Type>: <message>"``.

:class:`ToolEnv` is the multi-turn base: tool calls are executed and answered with a
``<tool_response>`` message; a reply without a tool call is the final answer, rewarded by
:meth:`ToolEnv.final_reward`.
"""

from __future__ import annotations

import inspect
import json
import re
import string
import types
import typing
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, Union, overload

from .base import Env, Message, StepOutput

__all__ = [
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "ToolGroup",
    "ToolResult",
    "describe_tools",
    "parse_tool_call",
    "tool",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_CALL_OPEN = "<tool_call>"
_CALL_CLOSE = "</tool_call>"
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_FENCE = "```"


class ToolCallError(ValueError):
    """The model's tool call could not be used; ``str(error)`` says why, for the model to read."""


@dataclass
class ToolCall:
    """A parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What running a call produced: the text for the model, and whether it is an error."""

    output: str
    error: bool = False


# --- declaring tools ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ToolMark:
    name: str | None
    description: str | None


_MARK_ATTR = "__ridgeline_tool__"


@overload
def tool(func: _F) -> _F: ...
@overload
def tool(*, name: str | None = None, description: str | None = None) -> Callable[[_F], _F]: ...


def tool(func: Any = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Mark a :class:`ToolGroup` method as a tool: ``@tool`` or ``@tool(name=..., description=...)``.

    The tool's name defaults to the method name and its description to the docstring's text
    before any ``Args:``/``Returns:`` section.
    """

    def mark(f: _F) -> _F:
        setattr(f, _MARK_ATTR, _ToolMark(name, description))
        return f

    return mark(func) if func is not None else mark


_SIMPLE_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    set: "array",
    frozenset: "array",
    dict: "object",
}


def _json_schema(annotation: Any) -> dict[str, Any]:
    """JSON schema for a parameter annotation; {} when it has no JSON equivalent (any value)."""
    if annotation in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: optional-ness is expressed by "required"
            return _json_schema(options[0])
        return {"anyOf": [_json_schema(a) for a in options]}
    if origin is Literal:
        schema: dict[str, Any] = {"enum": list(args)}
        kinds = {_SIMPLE_TYPES.get(type(a)) for a in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin in (list, tuple, set, frozenset, Sequence):
        schema = {"type": "array"}
        if args and (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)):
            item = _json_schema(args[0])
            if item:
                schema["items"] = item
        return schema
    if origin in (dict, Mapping):
        return {"type": "object"}
    return {}


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) from a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description: list[str] = []
    arguments: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arguments_indent = 0
    for line in lines:
        header = _SECTION.match(line.strip()) if not line.startswith(" ") else None
        if header:
            section, current = header.group(1), None
            continue
        if section is None:
            description.append(line)
        elif section in ("Args", "Arguments", "Parameters", "Params") and line.strip():
            # An argument line sits at the section's first indent level; deeper lines continue it.
            indent = len(line) - len(line.lstrip())
            match = _ARG_LINE.match(line.strip())
            if match and (current is None or indent <= arguments_indent):
                current, arguments_indent = match.group("name"), indent
                arguments[current] = match.group("text").strip()
            elif current is not None:
                arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    return "\n".join(description).strip(), arguments


def _tool_spec(name: str, method: Callable[..., Any], description: str | None) -> dict[str, Any]:
    doc_description, arg_docs = _parse_docstring(inspect.getdoc(method))
    try:
        hints = typing.get_type_hints(method)
    except Exception:  # unresolvable forward references: fall back to no types
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(method).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema = dict(_json_schema(hints.get(param.name, param.annotation)))
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    return {
        "name": name,
        "description": description if description is not None else doc_description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }


# --- reading calls ------------------------------------------------------------------------------


def parse_tool_call(text: str | None) -> ToolCall | None:
    """The last ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``.

    Returns None when there is no ``<tool_call>`` tag; raises :class:`ToolCallError` when the
    last one is malformed. Does not check that the tool exists (see
    :meth:`ToolGroup.parse_call`).
    """
    if not isinstance(text, str):
        return None
    start = text.rfind(_CALL_OPEN)
    if start < 0:
        return None
    body_start = start + len(_CALL_OPEN)
    end = text.find(_CALL_CLOSE, body_start)
    body = (text[body_start:] if end < 0 else text[body_start:end]).strip()
    body = _unfence(body)
    if not body:
        raise ToolCallError(
            'empty tool call; write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
        )
    try:
        payload, stop = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the tool call is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ToolCallError("the tool call's JSON is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than int() converts
        raise ToolCallError(f"the tool call's JSON holds a value that cannot be read: {str(exc)[:120]}") from None
    # Tolerate one stray character after the JSON (usually a doubled closing brace), no more:
    # a longer tail means the model wrote something we would be guessing about.
    tail = body[stop:].strip()
    if len(tail) > 1:
        raise ToolCallError(f"unexpected text after the tool call's JSON object: {tail[:40]!r}")
    if not isinstance(payload, dict):
        raise ToolCallError(f"the tool call must be a JSON object with \"name\" and \"arguments\", got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError('the tool call has no "name" (a string naming the tool)')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolCallError(f'"arguments" is a string but not valid JSON: {exc.msg}') from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name=name.strip(), arguments=arguments)


def _unfence(body: str) -> str:
    """The text inside a Markdown code fence (```json ... ```) around ``body``, stripped; ``body``
    as it is when it is not fenced. Plain string operations, not a regex: a pattern with
    ``[A-Za-z]*\\s*...\\s*```$`` backtracks cubically on a long fence that is never closed."""
    if len(body) < 2 * len(_FENCE) or not (body.startswith(_FENCE) and body.endswith(_FENCE)):
        return body
    return body[len(_FENCE):-len(_FENCE)].lstrip(string.ascii_letters).strip()   # the language tag goes


def _check_known(call: ToolCall | None, names: Sequence[str]) -> ToolCall | None:
    if call is not None and call.name not in names:
        available = ", ".join(names) or "(none)"
        raise ToolCallError(f"unknown tool {call.name!r}; available tools: {available}")
    return call


def describe_tools(specs: Sequence[Mapping[str, Any]]) -> str:
    """System-prompt text that lists ``specs`` and explains the call format."""
    listing = "\n".join(json.dumps({"type": "function", "function": dict(spec)}, ensure_ascii=False) for spec in specs)
    return (
        "You have access to the following tools, described as JSON function signatures:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To use a tool, reply with a JSON object naming it and giving its arguments inside "
        "<tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n</tool_call>\n'
        "Only one tool call per reply is run (the last one); its result comes back inside "
        "<tool_response></tool_response> tags."
    )


def _to_text(value: Any) -> str:
    """Tool return value -> text for the model: strings as they are, JSON for data."""
    if isinstance(value, str):
        return value
    if value is None:
        return "(no output)"
    if isinstance(value, (dict, list, tuple, bool, int, float)):
        try:
            return json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):  # circular structures and the like
            return str(value)
    return str(value)


# --- tool groups --------------------------------------------------------------------------------


class ToolGroup:
    """A set of tools: the methods decorated with :func:`tool`.

    Subclasses may keep state (a database connection, a sandbox); :class:`ToolEnv` makes one
    instance per episode. Outputs longer than ``max_output_chars`` are cut, so a tool that
    prints a whole table cannot flood the context.
    """

    max_output_chars: int = 4000
    _tools: ClassVar[dict[str, str]] = {}  # tool name -> method name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        marks: dict[str, _ToolMark] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                mark = getattr(value, _MARK_ATTR, None)
                if isinstance(mark, _ToolMark):
                    marks[attr] = mark
                else:
                    marks.pop(attr, None)  # overridden without @tool: no longer a tool
        tools: dict[str, str] = {}
        for attr, mark in marks.items():
            name = mark.name or attr
            if not _TOOL_NAME.fullmatch(name):
                raise TypeError(f"{cls.__name__}.{attr}: tool name {name!r} must be letters, digits, _ . -")
            if name in tools:
                raise TypeError(f"{cls.__name__}: two tools named {name!r} ({tools[name]} and {attr})")
            tools[name] = attr
        cls._tools = tools

    def __init__(self, *, max_output_chars: int | None = None) -> None:
        if max_output_chars is not None:
            if max_output_chars < 1:
                raise ValueError(f"max_output_chars must be at least 1, got {max_output_chars}")
            self.max_output_chars = max_output_chars

    def tool_names(self) -> list[str]:
        return list(self._tools)

    def close(self) -> None:
        """Release resources (connections, sandboxes); :meth:`ToolEnv.close` calls it. Default: nothing."""

    def tool_specs(self) -> list[dict[str, Any]]:
        """Function specs of the tools: ``{"name", "description", "parameters": {JSON schema}}``."""
        specs = []
        for name, attr in self._tools.items():
            method = getattr(self, attr)
            mark: _ToolMark = getattr(method, _MARK_ATTR)
            specs.append(_tool_spec(name, method, mark.description))
        return specs

    def describe(self) -> str:
        """System-prompt text listing this group's tools and the call format."""
        return describe_tools(self.tool_specs())

    def parse_call(self, text: str | None) -> ToolCall | None:
        """The last tool call in ``text`` (None if there is none); :class:`ToolCallError` if it is
        malformed or names a tool this group does not have."""
        return _check_known(parse_tool_call(text), self.tool_names())

    def run(self, call: ToolCall) -> ToolResult:
        """Run ``call``; never raises. Errors (unknown tool, bad arguments, an exception in the
        tool) come back as ``ToolResult("Error: ...", error=True)``."""
        attr = self._tools.get(call.name)
        if attr is None:
            available = ", ".join(self._tools) or "(none)"
            return self._result(f"Error: unknown tool {call.name!r}; available tools: {available}", error=True)
        method = getattr(self, attr)
        problem = _argument_problem(call, inspect.signature(method))
        if problem is not None:
            return self._result(f"Error: {problem}", error=True)
        try:
            return self._result(_to_text(method(**call.arguments)), error=False)
        except Exception as exc:  # any bug or bad input in the tool is the model's feedback, not a crash
            return self._result(f"Error: {type(exc).__name__}: {exc}", error=True)

    def execute(self, call: ToolCall) -> str:
        """Run ``call`` and return the text for the model (see :meth:`run`)."""
        return self.run(call).output

    def _result(self, text: str, *, error: bool) -> ToolResult:
        limit = self.max_output_chars
        if len(text) > limit:
            text = f"{text[:limit]}\n... [truncated {len(text) - limit} characters]"
        return ToolResult(text, error)


def _argument_problem(call: ToolCall, signature: inspect.Signature) -> str | None:
    """Why ``call.arguments`` cannot be passed to a tool with ``signature``; None if they can."""
    if not isinstance(call.arguments, dict) or not all(isinstance(k, str) for k in call.arguments):
        return f"arguments for tool {call.name!r} must be a JSON object"
    params = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [n for n in named if params[n].default is params[n].empty and n not in call.arguments]
    unknown = [] if takes_any else [k for k in call.arguments if k not in named]
    problems = []
    if missing:
        problems.append("missing required argument(s) " + ", ".join(repr(n) for n in missing))
    if unknown:
        problems.append("unexpected argument(s) " + ", ".join(repr(k) for k in unknown))
    if not problems:
        return None
    expected = ", ".join(named) or "none"
    return f"tool {call.name!r}: {'; '.join(problems)} (arguments: {expected})"


# --- the env ------------------------------------------------------------------------------------


class ToolEnv(Env):
    """Multi-turn env where the model may call tools before giving its final answer.

    Each step counts a turn. A reply with a tool call gets the tool's output as one
    ``observation_role`` message, ``"<tool_response>\\n...\\n</tool_response>"``, reward
    :meth:`tool_reward` (default 0) and ``done=False``; a malformed call or a failing tool is
    answered the same way with an ``"Error: ..."`` text, so the model can correct itself. A
    reply without a tool call ends the episode with :meth:`final_reward`; so does any reply on
    the last allowed turn, whose tool call (if any) is not run.

    Tools: the ``tool_groups`` class attribute (ToolGroup classes, instantiated per env, or
    instances, shared) or the ``tool_groups`` constructor argument. With
    ``add_tools_to_prompt`` (default True), :meth:`init` appends the tool listing to the system
    prompt (adding one if the prompt has none).

    Metrics per episode: ``tool_calls`` (replies that attempted a call, malformed ones included),
    ``tool_errors`` (those answered with an error) and ``turns``.

    Note: Qwen-style chat templates wrap messages of role "tool" in <tool_response> tags
    themselves; with ``observation_role = "tool"`` override :meth:`format_tool_response` to
    return the bare output.
    """

    default_max_turns: ClassVar[int] = 5
    tool_groups: ClassVar[Sequence[type[ToolGroup] | ToolGroup]] = ()
    observation_role: ClassVar[str] = "user"
    add_tools_to_prompt: ClassVar[bool] = True
    answer_instructions: ClassVar[str] = "When you have the final answer, reply without a tool call."

    def __init__(self, extras: dict[str, Any] | None = None, *,
                 tool_groups: Sequence[ToolGroup] | None = None, **settings: Any) -> None:
        super().__init__(extras, **settings)
        chosen = tool_groups if tool_groups is not None else type(self).tool_groups
        self.groups: list[ToolGroup] = [g() if isinstance(g, type) else g for g in chosen]
        self._owner: dict[str, ToolGroup] = {}
        for group in self.groups:
            for name in group.tool_names():
                if name in self._owner:
                    raise ValueError(f"{type(self).__name__}: tool {name!r} is defined by more than one tool group")
                self._owner[name] = group
        self.tool_calls = 0
        self.tool_errors = 0

    @abstractmethod
    def final_reward(self, action: str) -> float:
        """Reward for the reply that ends the episode. Must not raise on arbitrary text."""

    def tool_reward(self, call: ToolCall | None, result: ToolResult) -> float:
        """Reward for a tool turn (``call`` is None when the call was malformed). Default 0."""
        return 0.0

    def format_tool_response(self, output: str) -> str:
        return f"<tool_response>\n{output}\n</tool_response>"

    def step_metadata(self) -> dict[str, Any]:
        """Extra metadata added to every step (e.g. the ground truth)."""
        return {}

    def tool_specs(self) -> list[dict[str, Any]]:
        return [spec for group in self.groups for spec in group.tool_specs()]

    def system_prompt(self) -> str:
        """The text :meth:`init` adds to the system prompt."""
        return f"{describe_tools(self.tool_specs())}\n{self.answer_instructions}".strip()

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        if not self.add_tools_to_prompt or not self.groups:
            return prompt, {}
        messages = [dict(m) for m in prompt]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{self.system_prompt()}"
        else:
            messages.insert(0, {"role": "system", "content": self.system_prompt()})
        return messages, {}

    def parse_call(self, text: str) -> ToolCall | None:
        """The last tool call in ``text``; :class:`ToolCallError` if malformed or unknown."""
        return _check_known(parse_tool_call(text), list(self._owner))

    def step(self, action: str) -> StepOutput:
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        last = self.next_turn()
        call: ToolCall | None = None
        error: ToolCallError | None = None
        try:
            call = self.parse_call(action)
        except ToolCallError as exc:
            error = exc
        metadata: dict[str, Any] = {"turn": self.turns}
        metadata.update(self.step_metadata())
        if last or (call is None and error is None):
            return StepOutput(observations=[], reward=self.final_reward(action), done=True, metadata=metadata)

        result = self._owner[call.name].run(call) if call is not None else ToolResult(f"Error: {error}", error=True)
        self.tool_calls += 1
        self.tool_errors += int(result.error)
        metadata["tool_call"] = None if call is None else {"name": call.name, "arguments": call.arguments}
        metadata["tool_error"] = result.error
        message = {"role": self.observation_role, "content": self.format_tool_response(result.output)}
        return StepOutput(observations=[message], reward=self.tool_reward(call, result), done=False,
                          metadata=metadata)

    def get_metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "tool_errors": float(self.tool_errors),
                "turns": float(self.turns)}

    def close(self) -> None:
        for group in self.groups:
            group.close()
