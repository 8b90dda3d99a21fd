"""The `code` env (stdin/stdout tests in the sandbox) and the synthetic code dataset preparer."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time

import pytest
from sandbox_helpers import PROGRAM_GUARD_S

from ridgeline.data import PromptDataset
from ridgeline.data.prepare_code import TEMPLATES, prepare_code
from ridgeline.envs import make
# Importing the module registers "code" (ridgeline.envs does it too once wired).
from ridgeline.envs.code import CodeEnv, extract_program, outputs_match, parse_test_cases

SUM_CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}, {"input": "0 0", "output": "0\n"}]
SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"
FAST = {"timeout_s": PROGRAM_GUARD_S}  # programs that end on their own: a hang guard (sandbox_helpers)


def code_env(cases=SUM_CASES, **settings):
    return make("code", extras={"reward_spec": {"method": "rule", "ground_truth": cases}}, **{**FAST, **settings})


def respond(program: str, prose: str = "Here is my solution.") -> str:
    return f"{prose}\n\n```python\n{program}\n```\n"


def test_correct_program_scores_one():
    env = code_env()
    assert isinstance(env, CodeEnv)
    out = env.step(respond(SUM_PROGRAM))
    assert out.reward == 1.0 and out.done and out.observations == []
    assert out.metadata["cases_passed"] == 3 and out.metadata["first_failure"] is None
    assert out.metadata["parsed"] == SUM_PROGRAM
    assert env.get_metrics() == {"solved": 1.0, "pass_fraction": 1.0, "cases_passed": 3.0, "timeouts": 0.0,
                                 "runtime_errors": 0.0, "blocked": 0.0, "no_code": 0.0}


def test_wrong_program_scores_zero_and_stops_at_first_failure():
    env = code_env()
    out = env.step(respond("a, b = map(int, input().split())\nprint(a - b)"))
    assert out.reward == 0.0
    assert out.metadata["first_failure"] == 0 and out.metadata["failure"] == "wrong_answer"
    assert out.metadata["cases_run"] == 1  # stopped early


def test_partial_credit_gives_fraction_and_runs_all_cases():
    program = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"  # fails only case 1
    env = code_env(partial_credit=True)
    out = env.step(respond(program))
    assert out.reward == pytest.approx(2 / 3)
    assert out.metadata["cases_run"] == 3 and out.metadata["first_failure"] == 1
    assert env.get_metrics()["pass_fraction"] == pytest.approx(2 / 3)
    assert code_env(max_cases=1).step(respond(program)).reward == 1.0  # only the first case is run


def test_runtime_error_is_reported():
    env = code_env()
    out = env.step(respond("raise SystemExit(input().split()[5])"))
    assert out.reward == 0.0 and out.metadata["failure"] == "runtime_error"
    assert "IndexError" in out.metadata["stderr_tail"]
    assert env.get_metrics()["runtime_errors"] == 1.0


def test_no_code_block_scores_zero_with_metric():
    for text in ("The answer is print(a+b).", "```cpp\nint main(){}\n```", "```python\nprint(1)\n", "```python\n\n```"):
        env = code_env()
        out = env.step(text)
        assert out.reward == 0.0 and out.metadata["no_code"] is True
        assert env.get_metrics()["no_code"] == 1.0 and env.get_metrics()["solved"] == 0.0


def test_hostile_programs_score_zero_and_the_env_returns_normally():
    env = code_env()
    out = env.step(respond("import os\nwhile True:\n    os.fork()"))
    assert out.reward == 0.0 and out.metadata["failure"].startswith("blocked")
    assert env.get_metrics()["blocked"] == 1.0
    env = code_env(timeout_s=0.5)  # the limit under test: the step returning is the event
    out = env.step(respond("while True:\n    pass"))
    assert out.reward == 0.0 and out.metadata["killed_reason"] in ("wall_timeout", "cpu_limit")
    assert env.get_metrics()["timeouts"] == 1.0
    out = code_env(memory_mb=256).step(respond("x = ' ' * 10**10"))
    assert out.reward == 0.0 and out.metadata["killed_reason"] == "memory"


def test_total_timeout_stops_starting_cases():
    env = code_env(timeout_s=0.3, partial_credit=True, total_timeout_s=0.5)
    out = env.step(respond("import time\ntime.sleep(10)"))
    assert out.reward == 0.0 and out.metadata["cases_run"] < 3
    assert out.metadata["outcomes"][0] == "wall_timeout"


def test_extraction_picks_the_last_python_block():
    text = (f"First try:\n```python\nprint('wrong')\n```\nAn example run:\n```text\n3\n```\n"
            f"Fixed:\n```python\n{SUM_PROGRAM}\n```\nDone.")
    assert extract_program(text) == SUM_PROGRAM
    assert code_env().step(text).reward == 1.0
    # Untagged block as fallback, but a tagged python block wins over a later untagged one.
    assert extract_program("```\nprint(1)\n```") == "print(1)"
    assert extract_program("```py\nprint(1)\n```\n```\nprint(2)\n```") == "print(1)"
    assert extract_program("```Python3 main.py\nprint(3)\n```") == "print(3)"


def test_extraction_never_raises_on_garbage():
    garbage = ["", "```", "``````", "`" * 100_000, "```\n" * 50_000, "```python" * 30_000, "\x00\ufffd```\n\x00\n```",
               "```python\n" + "x" * 100_000]
    start = time.thread_time()  # CPU seconds of this thread: linear or not, whatever else runs
    for text in garbage:
        extract_program(text)
    assert time.thread_time() - start < 2
    env = code_env()
    for text in (None, 12, "```\n```"):
        assert env.step(text).reward == 0.0


def test_output_comparison_ignores_trailing_whitespace_only():
    assert outputs_match("1 2  \n3\n\n\n", "1 2\n3")
    assert outputs_match("a\r\nb\r\n", "a\nb\n")
    assert not outputs_match(" 1\n", "1\n")
    assert not outputs_match("1\n\n2", "1\n2")


def test_ground_truth_as_json_string_and_validation():
    env = code_env(cases=json.dumps(SUM_CASES))
    assert env.step(respond(SUM_PROGRAM)).reward == 1.0
    for bad in ("not json", "[]", [], [{"input": "1"}], [{"input": 1, "output": "2"}],
                [{"input": "", "output": "", "testtype": "functional"}]):
        with pytest.raises(ValueError):
            code_env(cases=bad)
    with pytest.raises(ValueError):
        make("code", extras={})
    with pytest.raises(TypeError):
        code_env(timeout=3)  # typo in a setting fails loudly
    assert parse_test_cases('[{"input": "x", "output": "y", "testtype": "stdin"}]')[0].output == "y"


# ------------------------------------------------------------------------------ the preparer


def run_in_process(program: str, stdin: str) -> str:
    """Run trusted reference code in this process (fast) to check every row's expected outputs."""
    out = io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(program, "<solution>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdin = old_stdin
    return out.getvalue()


def test_prepare_code_writes_loadable_parquet_whose_solutions_score_one(tmp_path):
    paths = prepare_code(tmp_path, num_train=40, num_val=10, seed=1)
    assert set(paths) == {"train", "validation"}
    train, val = PromptDataset(paths["train"]), PromptDataset(paths["validation"])
    assert len(train) == 40 and len(val) == 10
    seen_templates = {}
    for row in list(train) + list(val):
        assert row.env_class == "code" and row.data_source == "synthetic_code"
        assert row.prompt[0]["role"] == "user" and "```python" in row.prompt[0]["content"]
        cases = parse_test_cases(row.reward_spec["ground_truth"])
        assert 3 <= len(cases) <= 5
        for case in cases:
            assert outputs_match(run_in_process(row.extra_info["solution"], case.input), case.output)
        seen_templates.setdefault(row.extra_info["template"], row)
    assert len(seen_templates) >= len(TEMPLATES) - 2  # 50 rows cover (nearly) every template
    # And through the real env and sandbox (a few templates; each case is one subprocess).
    for row in list(seen_templates.values())[:4]:
        env = make(row.env_class, extras=row.extras, **FAST)
        assert env.step(respond(row.extra_info["solution"])).reward == 1.0, row.extra_info


def test_prepare_code_is_deterministic_and_validation_independent_of_num_train(tmp_path):
    a = prepare_code(tmp_path / "a", num_train=5, num_val=4, seed=3)
    b = prepare_code(tmp_path / "b", num_train=5, num_val=4, seed=3)
    c = prepare_code(tmp_path / "c", num_train=9, num_val=4, seed=3)
    assert a["train"].read_bytes() == b["train"].read_bytes()
    rows = lambda p: [(r.prompt, r.reward_spec) for r in PromptDataset(p)]  # noqa: E731
    assert rows(a["validation"]) == rows(c["validation"])
    assert rows(a["train"]) != rows(prepare_code(tmp_path / "d", num_train=5, num_val=4, seed=4)["train"])
    with pytest.raises(ValueError):
        prepare_code(tmp_path / "e", num_train=0)
