"""Environments that return junk, raise, hang or flood cannot take the generator down; parsers of
model text run in linear time.

Every hostile env runs through the real Generator and the tiny model, next to a well-behaved env:
the run goes on, the hostile trajectories cost reward 0 (or have their observation cut), the
failure is counted in its metric and logged once (two hostile trajectories of the same case, one
log line)."""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping

import pytest
from conftest import HANG_GUARD_S

from ridgeline.envs import Env, StepOutput, ToolCallError, register
from ridgeline.envs.tools import parse_tool_call
from ridgeline.generation.env_outputs import (MESSAGE_OVERHEAD, REWARD_LIMIT, Cut, cap_messages, check_done,
                                               check_reward)
from ridgeline.generation.env_steps import EnvRunner
from ridgeline.generation.generator import Generator
from ridgeline.generation.types import GeneratorInput, TrajectoryID
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import SamplingParams

# a released event: threads left waiting on it (the hung calls) end when the module's tests do
RELEASE = threading.Event()


def _hang() -> None:
    # until the module's tests end: a generate() that waited for a hung call would never return in
    # time to pass (its rewards and metrics come out wrong after this guard), so no test times anything
    RELEASE.wait(600.0)


class RaisingReward(StepOutput):
    """A StepOutput whose reward is computed, and fails."""

    def __init__(self) -> None:   # no dataclass fields set: `reward` below is a property
        self.observations, self.done, self.metadata = [], True, {}

    @property
    def reward(self) -> float:   # type: ignore[override]
        raise RuntimeError("reward server down")


def _circular() -> dict:
    data: dict = {}
    data["self"] = data
    return data


# case -> what step returns (a StepOutput or anything else)
STEP_CASES = {
    "reward_huge_int": lambda: StepOutput([], 10**400, True),
    "reward_inf": lambda: StepOutput([], math.inf, True),
    "reward_nan": lambda: StepOutput([], math.nan, True),
    "reward_beyond_float32": lambda: StepOutput([], 1e39, True),
    "reward_str": lambda: StepOutput([], "1.0", True),
    "reward_none": lambda: StepOutput([], None, True),
    "reward_property_raises": RaisingReward,
    "observations_str": lambda: StepOutput("try again", 0.0, False),
    "observations_none": lambda: StepOutput(None, 0.0, False),
    "observation_without_role": lambda: StepOutput([{"content": "try again"}], 0.0, False),
    "observation_content_not_str": lambda: StepOutput([{"role": "user", "content": 42}], 0.0, False),
    "observation_content_none": lambda: StepOutput([{"role": "user", "content": None}], 0.0, False),
    "observation_not_a_dict": lambda: StepOutput(["try again"], 0.0, False),
    "observation_role_huge": lambda: StepOutput([{"role": "u" * 10_000, "content": "x"}], 0.0, False),
    "metadata_str": lambda: StepOutput([], 1.0, True, "parsed: 7"),
    "metadata_circular": lambda: StepOutput([], 1.0, True, _circular()),
    "metadata_tuple_key": lambda: StepOutput([], 1.0, True, {("a", "b"): 1}),
    "done_str": lambda: StepOutput([], 1.0, "false"),
    "done_float": lambda: StepOutput([], 1.0, 0.5),
    "returns_dict": lambda: {"observations": [], "reward": 1.0, "done": True},
    "returns_none": lambda: None,
    "returns_tuple": lambda: ([], 1.0, True, {}),
}
# case -> (metric, field of the log line) for the step cases
STEP_FIELDS = {name: name.split("_")[0] for name in STEP_CASES}
STEP_FIELDS.update({"observation_without_role": "observations", "observation_content_not_str": "observations",
                    "observation_content_none": "observations", "observation_not_a_dict": "observations",
                    "observation_role_huge": "observations", "returns_dict": "type", "returns_none": "type",
                    "returns_tuple": "type"})


class HostileEnv(Env):
    """What goes wrong is the row's `case` (extras); anything not named behaves."""

    default_max_turns = 2

    def __init__(self, extras=None, **settings):
        super().__init__(extras, **settings)
        self.case = self.extras["case"]
        if self.case == "init_hangs_in_constructor":
            _hang()

    def init(self, prompt):
        if self.case == "init_raises":
            raise ConnectionError("cannot reach the task server")
        if self.case == "init_hangs":
            _hang()
        if self.case == "init_returns_str":
            return "What is 3 + 4?"
        if self.case == "init_bad_message":
            return [{"role": "user", "content": ["What", "is", "3 + 4?"]}], {}
        if self.case == "init_floods":
            return [{"role": "user", "content": "x" * 200_000}], {}
        return prompt, {}

    def step(self, action):
        self.next_turn()
        if self.case in STEP_CASES:
            return STEP_CASES[self.case]()
        if self.case == "step_hangs":
            _hang()
        if self.case == "huge_observation" and self.turns == 1:
            return StepOutput([{"role": "user", "content": "y" * 10_000_000}], 0.5, False)
        if self.case == "big_observation" and self.turns == 1:
            return StepOutput([{"role": "user", "content": "y" * 150_000}], 0.5, False)
        return StepOutput([], 1.0, True, {"parsed": "7"})

    def get_metrics(self):
        if self.case == "get_metrics_hangs":
            _hang()
        if self.case == "get_metrics_raises":
            raise RuntimeError("metrics store down")
        if self.case == "get_metrics_returns_list":
            return [("calls", 1)]
        return {"calls": float(self.turns)}

    def aggregate_metrics(self, episodes):
        if self.case == "aggregate_metrics_hangs":
            _hang()
        if self.case == "aggregate_metrics_raises":
            raise RuntimeError("cannot combine")
        return super().aggregate_metrics(episodes)

    def close(self):
        if self.case == "close_hangs":
            _hang()
        if self.case == "close_raises":
            raise OSError("sandbox already gone")


class GoodEnv(Env):
    def step(self, action):
        self.next_turn()
        return StepOutput([], 1.0, True, {"parsed": "7"})

    def get_metrics(self):
        return {"calls": 1.0}


register("test_hostile", HostileEnv, overwrite=True)
register("test_good", GoodEnv, overwrite=True)

LIMIT_S = 1.0   # the environment call time limit of these tests: long enough for a good env on a busy machine


@pytest.fixture(scope="module", autouse=True)
def _release_hung_calls():
    yield
    RELEASE.set()


def _run(tiny_model, tiny_tokenizer, case: str, *, max_turns: int = 2, **kwargs):
    """Two trajectories of the hostile `case`, one of a good env; returns the output."""
    gen = Generator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer, max_turns=max_turns,
                    runner=EnvRunner(max_workers=4, timeout_s=LIMIT_S), **kwargs)
    classes = ["test_hostile", "test_hostile", "test_good"]
    inp = GeneratorInput(prompts=[[{"role": "user", "content": "What is 3 + 4?"}]] * 3, env_classes=classes,
                         env_extras=[{"case": case}] * 3, trajectory_ids=[TrajectoryID("u", i) for i in range(3)],
                         sampling_params=SamplingParams(max_generate_length=4))
    return gen.generate(inp, seed=0)


def _logged(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_a_bad_step_output_costs_its_trajectory_and_is_logged_once(tiny_model, tiny_tokenizer, caplog, case):
    with caplog.at_level(logging.ERROR):
        out = _run(tiny_model, tiny_tokenizer, case)
    assert out.rewards[:2] == [0.0, 0.0]
    assert out.rewards[2] == 1.0 and out.step_metadata[2] == {"parsed": "7"}   # the good env is untouched
    assert out.metrics["generate/env_bad_outputs"] == 2.0 and out.metrics["generate/env_errors"] == 2.0
    lines = _logged(caplog, "environment test_hostile: step returned a bad output")
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    message = lines[0].getMessage()
    assert "Fix:" in message and "The trajectory gets reward 0" in message and len(message) < 1500
    field = STEP_FIELDS[case]
    assert field in message or (field == "type" and "StepOutput" in message)
    json.dumps(out.step_metadata)   # what an eval dump writes


def test_metadata_that_fails_when_read_is_a_bad_output(tiny_model, tiny_tokenizer, caplog):
    class Exploding(Mapping):
        def __getitem__(self, key):
            return "7"

        def __len__(self):
            return 1

        def __iter__(self):
            raise RuntimeError("lazy metadata failed")

    STEP_CASES["metadata_items_raise"] = lambda: StepOutput([], 1.0, True, Exploding())
    try:
        out = _run(tiny_model, tiny_tokenizer, "metadata_items_raise")
    finally:
        del STEP_CASES["metadata_items_raise"]
    assert out.rewards[:2] == [0.0, 0.0] and out.metrics["generate/env_bad_outputs"] == 2.0
    assert "lazy metadata failed" in caplog.text


@pytest.mark.parametrize("case, metric, text", [
    ("init_raises", "generate/env_errors", "init raised: ConnectionError: cannot reach the task server"),
    ("init_returns_str", "generate/env_bad_outputs", "init returned a bad output: init returned str"),
    ("init_bad_message", "generate/env_bad_outputs", "init returned a bad output: prompt[0]['content'] is list"),
    ("init_floods", "generate/env_bad_outputs", "init lengthened the prompt by"),
    ("init_hangs", "generate/env_timeouts", "init timed out"),
    ("init_hangs_in_constructor", "generate/env_timeouts", "init timed out"),
    ("step_hangs", "generate/env_timeouts", "step timed out"),
])
def test_init_and_step_failures_cost_the_trajectory(tiny_model, tiny_tokenizer, caplog, case, metric, text):
    with caplog.at_level(logging.ERROR):
        out = _run(tiny_model, tiny_tokenizer, case)  # returns although the hung calls never end
    assert out.rewards[:2] == [0.0, 0.0] and out.rewards[2] == 1.0
    assert out.metrics[metric] == 2.0
    assert len(_logged(caplog, text)) == 1, caplog.text
    if case.startswith("init"):
        assert out.response_ids[:2] == [[], []]   # never sampled


@pytest.mark.parametrize("case, metric, text", [
    ("get_metrics_hangs", "generate/env_timeouts", "get_metrics timed out"),
    ("get_metrics_raises", "generate/env_errors", "get_metrics raised: RuntimeError: metrics store down"),
    ("get_metrics_returns_list", "generate/env_bad_outputs", "get_metrics returned a bad output"),
    ("aggregate_metrics_hangs", "generate/env_timeouts", "aggregate_metrics timed out"),
    ("aggregate_metrics_raises", "generate/env_errors", "aggregate_metrics raised"),
    ("close_hangs", "generate/env_timeouts", "close timed out"),
    ("close_raises", "generate/env_errors", "close raised: OSError: sandbox already gone"),
])
def test_metrics_and_close_failures_are_counted_and_the_reward_stands(tiny_model, tiny_tokenizer, caplog, case,
                                                                       metric, text):
    with caplog.at_level(logging.ERROR):
        out = _run(tiny_model, tiny_tokenizer, case)  # returns although the hung calls never end
    assert out.rewards == [1.0, 1.0, 1.0]
    # aggregate_metrics is called once for the class, the others once per env
    assert out.metrics[metric] == (1.0 if case.startswith("aggregate") else 2.0)
    lines = _logged(caplog, text)
    assert len(lines) == 1 and "The reward stands" in lines[0].getMessage(), caplog.text
    if case.startswith(("get_metrics", "aggregate")):
        assert out.metrics["environment/calls"] == 1.0   # only the good env's episode, or its class
        assert "environment/test_hostile/calls" not in out.metrics


def test_a_10_mb_observation_is_cut_before_it_is_tokenized(tiny_model, tiny_tokenizer, caplog):
    start = time.process_time()
    with caplog.at_level(logging.WARNING):
        out = _run(tiny_model, tiny_tokenizer, "huge_observation", max_input_length=256)
    # tokenizing the 10 MB took ~17 s of CPU with this tokenizer (40+ s with a BPE one); 100 000
    # characters take a tenth of a second (CPU seconds of this process: the same on a busy machine)
    assert time.process_time() - start < 5.0
    assert out.metrics["generate/observations_truncated"] == 2.0
    assert out.metrics["generate/context_full"] == 2.0   # 100 000 characters still do not fit 256 tokens
    assert out.rewards[:2] == [0.5, 0.5]   # the turn's reward stands: cutting is not a failure
    lines = _logged(caplog, "was cut to generator.max_observation_chars=100000")
    assert len(lines) == 1 and "10000036 characters" in lines[0].getMessage()   # + "user" + 32 of markup


def test_a_cut_observation_reaches_the_model_with_a_note(tiny_model, tiny_tokenizer):
    out = _run(tiny_model, tiny_tokenizer, "huge_observation", max_observation_chars=80)
    assert out.metrics["generate/observations_truncated"] == 2.0 and out.metrics["generate/context_full"] == 0.0
    observation = tiny_tokenizer.decode([t for t, m in zip(out.response_ids[0], out.loss_masks[0]) if m == 0])
    kept = 80 - MESSAGE_OVERHEAD - len("user")
    assert observation == "y" * kept + f"\n[... {10_000_000 - kept} characters cut: the observation exceeded 80 " \
                                       "characters]"
    assert out.rewards[0][-1] == 1.0   # the second turn ran and ended the episode
    capped = _run(tiny_model, tiny_tokenizer, "big_observation", max_input_length=64)
    unlimited = _run(tiny_model, tiny_tokenizer, "big_observation", max_observation_chars=None, max_input_length=64)
    assert capped.metrics["generate/observations_truncated"] == 2.0
    assert unlimited.metrics["generate/observations_truncated"] == 0.0   # null: no cap, as SkyRL


# ------------------------------------------------------------------------------------ the checks
def test_rewards_must_be_finite_float32_numbers_and_done_a_bool():
    np = pytest.importorskip("numpy")
    assert check_reward(1) == 1.0 and check_reward(np.float32(0.5)) == 0.5 and check_reward(-REWARD_LIMIT) < 0
    # a bool is a number to Python, SkyRL and skyrl-gym (`answer == truth` scores 1 or 0)
    assert (check_reward(True), check_reward(False), check_reward(np.bool_(True))) == (1.0, 0.0, 1.0)
    for bad in ("1", None, 10**400, 2**2000, math.nan, -math.inf, 1e39, [1.0]):
        with pytest.raises(ValueError, match="reward"):
            check_reward(bad)
    assert check_done(True) is True and check_done(np.bool_(False)) is False and check_done(1) is True
    for bad in ("false", 0.0, 2, None, np.array([True])):
        with pytest.raises(ValueError, match="done"):
            check_done(bad)


def test_the_cap_keeps_messages_in_order_and_cuts_the_one_that_crosses_it():
    message = {"role": "user", "content": "a" * 100}
    size = MESSAGE_OVERHEAD + 4 + 100
    assert cap_messages([message] * 3, 3 * size) == ([message] * 3, None)
    kept, cut = cap_messages([message] * 3, size + 50)
    assert cut == Cut(size=3 * size, chars=100 - (50 - MESSAGE_OVERHEAD - 4), dropped=1)
    assert kept[0] == message and kept[1]["content"].startswith("a" * 14 + "\n[... 86 characters cut")
    # many empty messages count their template markup: at most cap / 32 of them are kept
    kept, cut = cap_messages([{"role": "u", "content": ""}] * 200_000, 100_000)
    assert len(kept) == 100_000 // (MESSAGE_OVERHEAD + 1) and cut.dropped == 200_000 - len(kept)
    # the first message always stays (cut to nothing), so the model sees why
    kept, cut = cap_messages([message], 10)
    assert len(kept) == 1 and kept[0]["content"].startswith("\n[... 100 characters cut")


def test_a_skyrl_gym_env_gets_the_same_checks(tiny_model, tiny_tokenizer, caplog):
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    class Sloppy(BaseTextEnv):
        def __init__(self, env_config, extras={}):
            super().__init__()

        def step(self, action):
            return BaseTextEnvStepOutput(observations=None, reward="1", done="false", metadata=None)

    skyrl_gym.register(id="test_sloppy_gym", entry_point=Sloppy)
    try:
        gen = Generator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer,
                        runner=EnvRunner(max_workers=2, timeout_s=5.0))
        inp = GeneratorInput(prompts=[[{"role": "user", "content": "hi"}]] * 2, env_classes=["test_sloppy_gym"] * 2,
                             env_extras=[{}] * 2, trajectory_ids=[TrajectoryID("u", i) for i in range(2)],
                             sampling_params=SamplingParams(max_generate_length=2))
        with caplog.at_level(logging.ERROR):
            out = gen.generate(inp, seed=0)
    finally:
        skyrl_gym.registry.pop("test_sloppy_gym", None)
    assert out.rewards == [0.0, 0.0] and out.metrics["generate/env_bad_outputs"] == 2.0
    assert len(_logged(caplog, "step returned a bad output: reward '1' is of type str")) == 1


# ------------------------------------------------------------------------------------ the parsers
def test_tool_calls_nested_or_with_giant_numbers_are_answered_not_raised():
    with pytest.raises(ToolCallError, match="nested too deeply"):
        parse_tool_call("<tool_call>" + "[" * 100_000)
    with pytest.raises(ToolCallError, match="cannot be read"):
        parse_tool_call('<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 10_000 + "}}")
    assert parse_tool_call('<tool_call>```json\n{"name": "add", "arguments": {}}\n```</tool_call>').name == "add"


N = 1_000_000
# name -> (setup, the call): about 1 MB of adversarial model text for each reader of model text in
# ridgeline/envs (the SQL envs' readers have their own tests). Each was quadratic or worse where the
# old code is noted.
REDOS_CASES = {
    # old: 8 s at 10 kB, 90 s at 40 kB (the leading and the sign's \s* split every run of spaces)
    "normalize_number spaces after a sign": ("from ridgeline.envs.rewards import normalize_number as f",
                                             "f('-' + ' ' * N + 'x')"),
    "normalize_number spaces after the number": ("from ridgeline.envs.rewards import normalize_number as f",
                                                 "f('5' + ' ' * N + 'x')"),
    # old: 6 s at 10 kB, 79 s at 40 kB
    "extract_hash_answer spaces after ####": ("from ridgeline.envs.rewards import extract_hash_answer as f",
                                              "f('####' + ' ' * N + 'x')"),
    "extract_hash_answer spaces after a sign": ("from ridgeline.envs.rewards import extract_hash_answer as f",
                                                "f('#### -' + ' ' * N + 'x')"),
    # old: through normalize_number, 69 s at 40 kB
    "answers_equal": ("from ridgeline.envs.rewards import answers_equal as f", "f('-' + ' ' * N + '5x', '5')"),
    "extract_last_number": ("from ridgeline.envs.rewards import extract_last_number as f",
                            "f('1,234,5' * (N // 7)); f('-$' * (N // 2)); f('1.' * (N // 2))"),
    "extract_boxed": ("from ridgeline.envs.rewards import extract_boxed as f",
                      "f('\\\\boxed ' * (N // 7)); f('\\\\boxed{' * (N // 7)); f('{' * N)"),
    # old: quadratic, each "\boxed{" scanned to the end (1 s at 40 kB)
    "first_boxed (multiply)": ("from ridgeline.envs.skyrl_rules import first_boxed as f",
                               "f('\\\\boxed{' * (N // 7))"),
    "first_hash_answer (gsm8k)": ("from ridgeline.envs.skyrl_rules import first_hash_answer as f",
                                  "f('#### ' * (N // 5)); f('#### -' * (N // 6)); f('####' * (N // 4))"),
    # old: cubic, 160 s at 8 kB (an unclosed fence: language tag, spaces)
    "parse_tool_call unclosed fence": ("from ridgeline.envs.tools import parse_tool_call as f, ToolCallError",
                                       "try: f('<tool_call>```' + 'a' * (N // 2) + ' ' * (N // 2) + 'x')\n"
                                       "except ToolCallError: pass"),
    "parse_tool_call many tags": ("from ridgeline.envs.tools import parse_tool_call as f, ToolCallError",
                                  "try: f('<tool_call>' * (N // 11))\nexcept ToolCallError: pass"),
}
# and the envs that read answers, end to end, each on every text above
for _env in ("gsm8k", "gsm8k_lenient", "gsm8k_multi_turn", "multiply", "multiply_lenient", "arithmetic"):
    REDOS_CASES[f"env {_env}"] = (
        "from ridgeline import envs",
        "for text in ('####' + ' ' * N + 'x', '#### -' + ' ' * N + 'x', '\\\\boxed{' * (N // 7), "
        "'\\\\boxed{-' + ' ' * N + 'x}', '-$' * (N // 2), '1,234,5' * (N // 7)):\n"
        f"    envs.make({_env!r}, extras={{'reward_spec': {{'ground_truth': '7'}}}}, max_turns=2).step(text)")
BOUND_S = 5.0   # CPU seconds per case; each takes at most ~1 s here, the old code hours


@pytest.fixture(scope="module")
def redos_seconds() -> dict[str, float]:
    """Each case's CPU seconds, timed in one child process (a quadratic regex holds the GIL, so only
    a process can be stopped when one runs for hours, as the old code's did): the kernel stops it
    past its CPU budget (RLIMIT_CPU), whatever else the machine runs; the wall clock is a hang guard."""
    budget = int(BOUND_S * len(REDOS_CASES) + 10)
    lines = [f"N = {N}", "import json, resource, time",
             f"resource.setrlimit(resource.RLIMIT_CPU, ({budget}, {budget}))"]
    for name, (setup, call) in REDOS_CASES.items():
        lines += [setup, "t = time.process_time()", call,
                  f"print(json.dumps([{name!r}, time.process_time() - t]), flush=True)"]
    try:
        done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True,
                              timeout=HANG_GUARD_S)
        stdout = done.stdout
        # stopped at its CPU budget: the cases that did not print are reported below
        assert done.returncode in (0, -signal.SIGXCPU, -signal.SIGKILL), done.stderr[-2000:]
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    return dict(json.loads(line) for line in stdout.splitlines())


@pytest.mark.parametrize("name", sorted(REDOS_CASES))
def test_parsers_of_model_text_are_linear_on_a_megabyte_of_adversarial_text(redos_seconds, name):
    assert name in redos_seconds, f"{name}: did not finish (the child process was stopped)"
    assert redos_seconds[name] < BOUND_S, textwrap.shorten(f"{name}: {redos_seconds[name]:.1f} s", 80)
