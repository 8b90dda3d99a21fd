"""Code generation with stdin/stdout tests (LiveCodeBench / CodeContests style).

The response's program (the last ```python fenced block; an untagged ``` block if there is no
python one) runs once per test case in :func:`ridgeline.envs.sandbox.run_python` (bubblewrap; the
env refuses to build where no sandbox can run unless ``environment.sandbox.allow_weak_isolation``
says otherwise: docs/security.md), fed the case's
``input`` on stdin; a case passes when the program exits cleanly and its stdout equals the case's
``output`` up to trailing whitespace (per line and at the end).

Reward: 1.0 when every case passes, else 0.0 (cases stop at the first failure, which saves time);
with ``partial_credit`` the fraction of cases passed (all cases run). No code block: 0.0.

Test cases come from ``reward_spec.ground_truth``: a list of ``{"input": str, "output": str}``, or
that list as a JSON string (what parquet files hold). A malformed ground truth fails when the env is
built, because it would otherwise silently score every response 0.0.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from .base import SingleTurnEnv
from .registry import register
from .sandbox import SandboxLimits, SandboxResult, current_isolation, run_python

__all__ = ["CodeEnv", "CodeEvaluation", "TestCase", "extract_program", "outputs_match", "parse_test_cases"]

_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})
_STDERR_TAIL_CHARS = 1000


@dataclass(frozen=True)
class TestCase:
    """One stdin/stdout case."""

    __test__ = False  # not a pytest test class, despite the name

    input: str
    output: str


@dataclass
class CodeEvaluation:
    """What happened when the program ran (for metadata and metrics)."""

    num_cases: int
    no_code: bool = False
    passed: int = 0
    run: int = 0
    timeouts: int = 0
    runtime_errors: int = 0
    blocked: bool = False
    first_failure: int | None = None
    failure: str | None = None  # "wrong_answer", "runtime_error", or the sandbox's killed_reason
    stderr_tail: str = ""
    duration_s: float = 0.0
    outcomes: list[str] = field(default_factory=list)


def _fence(line: str) -> str | None:
    """The info string if ``line`` opens or closes a ``` fence ("" for a bare fence), else None."""
    stripped = line.strip()
    if not stripped.startswith("```"):
        return None
    return stripped[3:].strip()


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each closed ``` block. One linear pass over the lines, so adversarial
    text (thousands of backticks) cannot make it slow, unlike a backtracking regex."""
    blocks: list[tuple[str, str]] = []
    info: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        fence = _fence(line)
        if info is None:
            if fence is not None:
                info, body = fence, []
        elif fence == "":
            blocks.append((info, "\n".join(body)))
            info = None
        else:
            body.append(line)
    return blocks  # an unclosed last block (a response cut off mid-program) is not taken


def extract_program(text: str) -> str | None:
    """The last ```python (or ```py / ```python3) block; else the last untagged ``` block; else None.

    Blocks tagged with another language (```cpp, ```text) are never run as Python. Never raises.
    """
    if not isinstance(text, str) or "```" not in text:
        return None
    blocks = _fenced_blocks(text)
    for wanted in (lambda tag: tag.split()[0].lower() in _PYTHON_TAGS if tag else False, lambda tag: tag == ""):
        for info, body in reversed(blocks):
            if wanted(info):
                return body if body.strip() else None
    return None


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def outputs_match(actual: str, expected: str) -> bool:
    """Equal after stripping trailing whitespace of every line and at the end (``\\r\\n`` == ``\\n``)."""
    return _normalize_output(actual) == _normalize_output(expected)


def parse_test_cases(raw: Any, env_name: str = "code") -> list[TestCase]:
    """Test cases from ``reward_spec.ground_truth`` (a list of dicts, or a JSON string of one).

    Raises ValueError with the offending case when the ground truth is not usable.
    """
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{env_name} env: reward_spec.ground_truth is not valid JSON ({exc})") from None
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"{env_name} env: reward_spec.ground_truth must be a non-empty list of "
                         f"{{'input': str, 'output': str}} test cases, got {type(raw).__name__}")
    cases = []
    for index, case in enumerate(raw):
        if not isinstance(case, dict) or not isinstance(case.get("input"), str) or not isinstance(case.get("output"), str):
            raise ValueError(f"{env_name} env: test case {index} must be {{'input': str, 'output': str}}, got {case!r:.200}")
        if case.get("testtype", "stdin") != "stdin":
            raise ValueError(f"{env_name} env: test case {index} has testtype {case['testtype']!r}; "
                             "only stdin/stdout tests are supported")
        cases.append(TestCase(input=case["input"], output=case["output"]))
    return cases


@register("code")
class CodeEnv(SingleTurnEnv):
    """Single-turn code env: run the response's Python program against stdin/stdout test cases.

    Settings (``environment.skyrl_gym.code``):
        timeout_s: wall-clock limit per test case (also the CPU limit), default 10.
        memory_mb: address-space limit of the program, default 512.
        partial_credit: reward = fraction of cases passed (all cases run), default False.
        max_cases: run at most this many cases (the first ones), default all.
        total_timeout_s: stop starting new cases after this many seconds in one step (the rest
            count as failed), default none. Keep it below ``environment.step_timeout_s``.
    """

    accepted_settings = ("timeout_s", "memory_mb", "partial_credit", "max_cases", "total_timeout_s")

    def __init__(self, extras: dict[str, Any] | None = None, *, timeout_s: float = 10.0, memory_mb: int = 512,
                 partial_credit: bool = False, max_cases: int | None = None, total_timeout_s: float | None = None,
                 **settings: Any) -> None:
        super().__init__(extras, **settings)
        spec = self.extras.get("reward_spec")
        if not isinstance(spec, dict) or spec.get("ground_truth") is None:
            raise ValueError("code env needs extras['reward_spec']['ground_truth'] (a list of "
                             f"{{'input', 'output'}} test cases, or its JSON); got reward_spec={spec!r:.200}")
        cases = parse_test_cases(spec["ground_truth"])
        if max_cases is not None:
            if int(max_cases) < 1:
                raise ValueError(f"code env: max_cases must be >= 1, got {max_cases}")
            cases = cases[: int(max_cases)]
        self.cases: list[TestCase] = cases
        self.partial_credit = bool(partial_credit)
        self.total_timeout_s = None if total_timeout_s is None else float(total_timeout_s)
        self.limits = SandboxLimits(wall_seconds=float(timeout_s), cpu_seconds=float(timeout_s), memory_mb=int(memory_mb))
        # Resolved (and cached) when the env is built, so a machine without a sandbox stops the run
        # before training (the trainer builds every env once up front) rather than scoring 0.
        self.isolation = current_isolation()
        self.evaluation: CodeEvaluation | None = None

    def parse(self, action: str) -> str | None:
        return extract_program(action)

    def score(self, action: str) -> float:
        self.evaluation = self._evaluate(extract_program(action))
        result = self.evaluation
        if result.no_code:
            return 0.0
        if self.partial_credit:
            return result.passed / result.num_cases
        return 1.0 if result.passed == result.num_cases else 0.0

    def _evaluate(self, program: str | None) -> CodeEvaluation:
        result = CodeEvaluation(num_cases=len(self.cases))
        if program is None:
            result.no_code = True
            return result
        start = time.monotonic()
        for index, case in enumerate(self.cases):
            if self.total_timeout_s is not None and time.monotonic() - start >= self.total_timeout_s:
                self._record_failure(result, index, "total_timeout", "")
                break
            run = run_python(program, case.input, self.limits, self.isolation)
            outcome = self._outcome(run, case)
            result.run += 1
            result.outcomes.append(outcome)
            if outcome == "passed":
                result.passed += 1
                continue
            result.timeouts += run.killed_reason in ("wall_timeout", "cpu_limit")
            result.runtime_errors += outcome == "runtime_error"
            result.blocked = result.blocked or outcome.startswith("blocked")
            self._record_failure(result, index, outcome, run.stderr)
            if not self.partial_credit:
                break
        result.duration_s = time.monotonic() - start
        return result

    @staticmethod
    def _outcome(run: SandboxResult, case: TestCase) -> str:
        if run.killed_reason is not None:
            return run.killed_reason
        if run.exit_code != 0:
            return "runtime_error"
        return "passed" if outputs_match(run.stdout, case.output) else "wrong_answer"

    @staticmethod
    def _record_failure(result: CodeEvaluation, index: int, outcome: str, stderr: str) -> None:
        if result.first_failure is None:
            result.first_failure = index
            result.failure = outcome
            result.stderr_tail = stderr[-_STDERR_TAIL_CHARS:]

    def step_metadata(self) -> dict[str, Any]:
        result = self.evaluation
        if result is None:
            return {}
        return {
            "num_cases": result.num_cases,
            "cases_run": result.run,
            "cases_passed": result.passed,
            "no_code": result.no_code,
            "first_failure": result.first_failure,
            "failure": result.failure,
            "killed_reason": result.failure if result.failure not in (None, "wrong_answer", "runtime_error") else None,
            "stderr_tail": result.stderr_tail,
            "outcomes": list(result.outcomes),
            "duration_s": round(result.duration_s, 3),
            "isolation": self.isolation.name,
        }

    def get_metrics(self) -> dict[str, float]:
        """Per episode: ``solved`` (all cases passed), ``pass_fraction``, ``cases_passed`` (count),
        ``timeouts`` (cases hitting the wall/CPU limit), ``runtime_errors``, ``blocked`` (1.0 if the
        sandbox blocked an action), ``no_code`` (1.0 if no code block was found)."""
        result = self.evaluation
        if result is None:
            return {}
        return {
            "solved": float(not result.no_code and result.passed == result.num_cases),
            "pass_fraction": result.passed / result.num_cases,
            "cases_passed": float(result.passed),
            "timeouts": float(result.timeouts),
            "runtime_errors": float(result.runtime_errors),
            "blocked": float(result.blocked),
            "no_code": float(result.no_code),
        }
