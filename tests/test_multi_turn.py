"""The multi-turn agent loop: exact token-in/token-out in both observation modes, per-turn
rewards, context limits, and environments that raise, hang or return junk."""

from __future__ import annotations

import threading
import time

import pytest

from ridgeline.envs import Env, StepOutput, register
from ridgeline.generation.env_steps import EnvCallFailure, EnvRunner
from ridgeline.generation.generator import Generator
from ridgeline.generation.types import GeneratorInput, TrajectoryID
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import SamplingParams
from ridgeline.models.tiny import CHARACTERS
from ridgeline.seeding import derive_seed
from ridgeline.trainer.metrics import passes
from ridgeline.training.batch import build_training_batch


class CountingEnv(Env):
    """Turn k (1-based) earns 0.1 * k and answers with the observation "obs<k>"; ends at max_turns."""

    default_max_turns = 3

    def step(self, action: str) -> StepOutput:
        last = self.next_turn()
        return StepOutput(observations=[] if last else [{"role": "user", "content": f"obs{self.turns}"}],
                          reward=0.1 * self.turns, done=last)

    def get_metrics(self) -> dict[str, float]:
        return {"turns_taken": float(self.turns)}


# set when the module's tests end: the calls left hanging on it then return
RELEASE = threading.Event()


@pytest.fixture(scope="module", autouse=True)
def _release_hung_calls():
    yield
    RELEASE.set()


class HangingEnv(Env):
    def step(self, action: str) -> StepOutput:
        RELEASE.wait(600)  # "for ever": a generate() that waited for it would not return in time to pass
        return StepOutput([], 1.0, True)


class BrokenInitEnv(Env):
    def init(self, prompt):
        raise RuntimeError("cannot reach the task server")

    def step(self, action: str) -> StepOutput:
        return StepOutput([], 1.0, True)


class JunkEnv(Env):
    def step(self, action: str):
        return {"reward": 1.0}  # not a StepOutput


register("test_counting", CountingEnv, overwrite=True)
register("test_hanging", HangingEnv, overwrite=True)
register("test_broken_init", BrokenInitEnv, overwrite=True)
register("test_junk", JunkEnv, overwrite=True)


class RecordingEngine(HFEngine):
    """The real engine, keeping every request and output so the test can check the token layout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list, list]] = []
        self.seeds: list[int | None] = []

    def generate(self, requests, seed=None):
        outputs = super().generate(requests, seed=seed)
        self.calls.append(([list(r.prompt_token_ids) for r in requests], outputs))
        self.seeds.append(seed)
        return outputs


def _input(env_classes, max_tokens=4, **params):
    n = len(env_classes)
    return GeneratorInput(prompts=[[{"role": "user", "content": "What is 3 + 4?"}]] * n, env_classes=env_classes,
                          env_extras=[{"data_source": "t"}] * n, trajectory_ids=[TrajectoryID("u", i) for i in range(n)],
                          sampling_params=SamplingParams(max_generate_length=max_tokens, **params))


def _generator(tiny_model, tokenizer, **kwargs):
    engine = RecordingEngine(tiny_model, tokenizer)
    return engine, Generator(engine, tokenizer, runner=EnvRunner(max_workers=4, timeout_s=1.0), **kwargs)


def _check_layout(engine, out, tokenizer, conversation: bool, append_eos: bool = True) -> None:
    """Rebuild every trajectory from what the engine was asked and answered, turn by turn: the
    training sequence must be prompt + sampled ids + observation ids, position by position. A
    response that ended on a stop string gets the eos appended in conversation mode (SkyRL's
    append_eos_token_after_stop_str_in_multi_turn), and keeps its last token in raw mode."""
    eos = tokenizer.eos_token_id
    n = len(out.response_ids)
    rebuilt = [[] for _ in range(n)]
    masks = [[] for _ in range(n)]
    logprobs = [[] for _ in range(n)]
    live = list(range(n))
    for turn, (inputs, outputs) in enumerate(engine.calls):
        assert len(inputs) == len(live)
        for row, engine_input, result in zip(live, inputs, outputs):
            # the engine saw exactly the prompt plus everything so far, never re-encoded text
            assert engine_input == out.prompt_token_ids[row] + rebuilt[row]
            rebuilt[row] += result.response_ids
            masks[row] += [1] * len(result.response_ids)
            logprobs[row] += result.logprobs
            eos_after_stop = [eos] if conversation and append_eos and result.matched_stop is not None else []
            last_turn = turn == len(engine.calls) - 1 or turn == 2
            if last_turn:
                rebuilt[row] += eos_after_stop
                masks[row] += [0] * len(eos_after_stop)
                logprobs[row] += [0.0] * len(eos_after_stop)
                continue
            obs_text = f"obs{turn + 1}"
            if conversation:
                closing = eos_after_stop if result.stop_reason == "stop" else [eos]
                obs = closing + tokenizer.encode(f"\n<|im_start|>user\n{obs_text}<|im_end|>\n<|im_start|>assistant\n",
                                                 add_special_tokens=False)
            else:
                if result.stop_reason == "stop" and result.matched_stop is None:  # the stop token goes in raw mode
                    rebuilt[row].pop(), masks[row].pop(), logprobs[row].pop()
                obs = tokenizer.encode(obs_text, add_special_tokens=False)
            rebuilt[row] += obs
            masks[row] += [0] * len(obs)
            logprobs[row] += [0.0] * len(obs)
        live = list(range(n))
    for row in range(n):
        assert out.response_ids[row] == rebuilt[row]
        assert out.loss_masks[row] == masks[row]
        assert out.rollout_logprobs[row] == pytest.approx(logprobs[row])


@pytest.mark.parametrize("conversation", [False, True])
def test_multi_turn_sequences_are_exact(tiny_model, tiny_tokenizer, conversation):
    engine, gen = _generator(tiny_model, tiny_tokenizer, max_turns=3, conversation_mode=conversation)
    out = gen.generate(_input(["test_counting"] * 4), seed=0)
    assert len(engine.calls) == 3  # three turns, all four trajectories in every engine call
    _check_layout(engine, out, tiny_tokenizer, conversation)
    assert out.metrics["generate/avg_turns"] == 3.0
    assert out.metrics["environment/turns_taken"] == 3.0
    if conversation:  # the observation really is a chat turn in the training sequence
        assert "<|im_start|>user\nobs1<|im_end|>" in tiny_tokenizer.decode(out.response_ids[0])


# every printable character is a one-token stop string: nearly every response ends on one
ANY_CHARACTER = tuple(CHARACTERS)


@pytest.mark.parametrize("conversation, append_eos", [(True, True), (True, False), (False, True)])
def test_stop_strings_end_turns_and_close_them_as_skyrl_does(tiny_model, tiny_tokenizer, conversation, append_eos):
    engine, gen = _generator(tiny_model, tiny_tokenizer, max_turns=3, conversation_mode=conversation,
                             append_eos_after_stop_str=append_eos)
    out = gen.generate(_input(["test_counting"] * 4, stop=ANY_CHARACTER), seed=0)
    results = [r for _, outputs in engine.calls for r in outputs]
    assert sum(r.matched_stop is not None for r in results) >= 10  # of 12 responses
    _check_layout(engine, out, tiny_tokenizer, conversation, append_eos)
    first = engine.calls[0][1][0]
    assert first.matched_stop is not None and len(first.response_ids) == 1
    eos = tiny_tokenizer.eos_token_id
    if conversation and append_eos:  # the stop string's token, then the eos the model did not sample
        assert out.response_ids[0][:2] == [first.response_ids[0], eos]
        assert out.loss_masks[0][:2] == [1, 0] and out.rollout_logprobs[0][1] == 0.0
    else:  # conversation without the eos: the next turn follows; raw mode: the observation text
        assert out.response_ids[0][1] != eos and out.loss_masks[0][:2] == [1, 0]
    # the turn's reward sits on the model's last token (the stop string's), never on the appended eos
    for row, reward in enumerate(out.rewards):
        rewarded = [i for i, r in enumerate(reward) if r != 0.0]
        assert len(rewarded) == 3 and all(out.loss_masks[row][i] == 1 for i in rewarded)
    # so the outcome (turn 3: 0.3) is read there: every episode passes, also when a 0 follows it
    assert all(passes(reward, mask) for reward, mask in zip(out.rewards, out.loss_masks))
    if conversation and append_eos:
        assert all(reward[-1] == 0.0 for reward in out.rewards)  # the appended eos: not the outcome


@pytest.mark.parametrize("conversation", [False, True])
def test_top_logprobs_are_carried_in_line_with_the_response(tiny_model, tiny_tokenizer, conversation):
    engine, gen = _generator(tiny_model, tiny_tokenizer, max_turns=3, conversation_mode=conversation)
    out = gen.generate(_input(["test_counting"] * 2, logprobs=2), seed=0)
    sampled = [top for _, outputs in engine.calls for r in outputs for top in r.top_logprobs]
    for row in range(2):
        tops, mask = out.rollout_top_logprobs[row], out.loss_masks[row]
        assert len(tops) == len(out.response_ids[row])
        assert all((len(top) == 2) == (m == 1) for top, m in zip(tops, mask))  # [] on observation tokens
        assert all(top in sampled for top in tops if top)
    assert gen.generate(_input(["test_counting"]), seed=0).rollout_top_logprobs == []  # not asked


def test_per_turn_rewards_sit_on_each_turns_last_sampled_token(tiny_model, tiny_tokenizer):
    engine, gen = _generator(tiny_model, tiny_tokenizer, max_turns=3, conversation_mode=True)
    out = gen.generate(_input(["test_counting"] * 2), seed=1)
    for row, reward in enumerate(out.rewards):
        assert isinstance(reward, list) and len(reward) == len(out.response_ids[row])
        mask = out.loss_masks[row]
        # the last sampled token of each turn: a model token followed by an observation token or the end
        turn_ends = [i for i in range(len(mask)) if mask[i] == 1 and (i + 1 == len(mask) or mask[i + 1] == 0)]
        assert len(turn_ends) == 3
        expected = [0.0] * len(reward)
        for turn, index in enumerate(turn_ends, start=1):
            expected[index] = 0.1 * turn
        assert reward == pytest.approx(expected)
    batch = build_training_batch(out.prompt_token_ids, out.response_ids, out.loss_masks, out.rewards,
                                 ["a", "a"], out.rollout_logprobs, tiny_tokenizer.pad_token_id)
    assert batch.rewards.sum(-1).tolist() == pytest.approx([0.6, 0.6])


def test_single_turn_reward_stays_a_number(tiny_model, tiny_tokenizer):
    _, gen = _generator(tiny_model, tiny_tokenizer, max_turns=1)
    out = gen.generate(_input(["test_counting"] * 2), seed=0)
    assert out.rewards == [pytest.approx(0.1)] * 2
    assert all(mask == [1] * len(mask) for mask in out.loss_masks)


def test_generator_max_turns_caps_the_loop(tiny_model, tiny_tokenizer):
    engine, gen = _generator(tiny_model, tiny_tokenizer, max_turns=2)
    out = gen.generate(_input(["test_counting"]), seed=0)
    assert len(engine.calls) == 2 and out.metrics["generate/avg_turns"] == 2.0
    # every turn samples with a seed of its own
    assert engine.seeds == [derive_seed(0, "turn", 0), derive_seed(0, "turn", 1)]
    # the env was built with the generator's max_turns, so it knew turn 2 was its last
    assert sum(out.rewards[0]) == pytest.approx(0.1 + 0.2)


def test_context_limit_ends_the_trajectory(tiny_model, tiny_tokenizer):
    probe = Generator(HFEngine(tiny_model, tiny_tokenizer), tiny_tokenizer)
    prompt_len = len(probe.encode_prompt([{"role": "user", "content": "What is 3 + 4?"}]))
    engine, gen = _generator(tiny_model, tiny_tokenizer, max_turns=3, max_input_length=prompt_len + 5)
    out = gen.generate(_input(["test_counting"] * 2, max_tokens=4), seed=0)
    assert len(engine.calls) == 1  # no room for "obs1" and another turn
    assert out.stop_reasons == ["length", "length"]
    assert out.metrics["generate/context_full"] == 2.0


def test_failing_environments_cost_only_their_trajectory(tiny_model, tiny_tokenizer, caplog):
    _, gen = _generator(tiny_model, tiny_tokenizer, max_turns=2)
    # returns although the hanging step never ends: it was abandoned after the 1 s limit
    out = gen.generate(_input(["test_hanging", "test_broken_init", "test_junk", "test_counting"]), seed=0)
    assert out.rewards[:3] == [0.0, 0.0, 0.0]
    assert sum(out.rewards[3]) == pytest.approx(0.3)
    assert out.metrics["generate/env_timeouts"] == 1.0
    assert out.metrics["generate/env_errors"] == 2.0  # init raised, step returned junk
    assert "cannot reach the task server" in caplog.text and "in the environment's code:" in caplog.text
    assert out.response_ids[1] == []  # a trajectory whose env never started samples nothing


def _wait_until(predicate, guard_s: float = 300.0) -> None:
    """Poll for a state the test's own events make certain; the guard only keeps a bug from hanging."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_env_runner_bounds_time_and_reports_failures():
    runner = EnvRunner(max_workers=2, timeout_s=0.3)

    def boom():
        raise ValueError("bad")

    release = threading.Event()
    results = runner.run([lambda: 1, boom, lambda: release.wait(600), lambda: 4])
    assert results[0] == 1 and results[3] == 4
    assert isinstance(results[1], EnvCallFailure) and results[1].kind == "error" and "bad" in results[1].message
    assert isinstance(results[2], EnvCallFailure) and results[2].kind == "timeout"
    assert runner.stragglers == 1
    release.set()
    _wait_until(lambda: runner.stragglers == 0)  # the straggler ends once released, and is counted out
    inline = EnvRunner(max_workers=0)
    assert inline.run([lambda: 2, boom])[0] == 2


def test_env_runner_keeps_one_pool_and_replaces_stuck_threads():
    """Calls run on a fixed pool of max_workers threads (no thread per call); a call past its limit
    gives up its thread's place, so stuck calls never lower the concurrency of later runs."""
    runner = EnvRunner(max_workers=2, timeout_s=2.0)  # room for both meeting calls to start on a busy machine
    before = threading.active_count()
    for _ in range(5):
        assert runner.run([lambda: 1] * 8) == [1] * 8
    assert threading.active_count() - before == 2
    release = threading.Event()
    stuck = runner.run([lambda: release.wait(600), lambda: release.wait(600)])
    assert [r.kind for r in stuck] == ["timeout", "timeout"] and runner.stragglers == 2
    meet = threading.Barrier(2)   # passes only if both calls run at the same time (else the limit ends them)
    assert runner.run([meet.wait, meet.wait]) in ([0, 1], [1, 0])
    release.set()
    _wait_until(lambda: runner.stragglers == 0)
    assert threading.active_count() - before == 2   # the released stragglers' threads ended


def test_a_run_survives_a_reward_function_that_raises_and_hangs(tmp_path):
    """End to end: a user's reward function that raises on some answers and hangs on others costs
    those trajectories their reward; the steps complete and the failures are counted."""
    from ridgeline.config import load_config
    from ridgeline.trainer.trainer import Trainer

    module = tmp_path / "flaky_reward.py"
    module.write_text(
        "import time\n"
        "def score(text, extras):\n"
        "    if '1' in text:\n"
        "        raise RuntimeError('grader crashed')\n"
        "    if '2' in text:\n"
        "        time.sleep(5)\n"
        "    return 1.0\n")
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=32",
                       f"environment.reward_fn={module}:score", "environment.step_timeout_s=0.5",
                       "environment.skyrl_gym.max_env_workers=8", "generator.sampling_params.max_generate_length=8",
                       "environment.max_env_error_fraction=1.0",
                       "generator.sampling_params.temperature=1.0", "trainer.eval_before_train=false"])
    trainer = Trainer.from_config(cfg)
    trainer.train()
    steps = [r for r in trainer.history if "policy/policy_loss" in r]
    assert len(steps) == 2
    assert sum(r["generate/env_errors"] for r in steps) > 0
    assert sum(r["generate/env_timeouts"] for r in steps) > 0


def test_env_steps_show_a_progress_bar_when_asked(monkeypatch, capsys):
    monkeypatch.setenv("RIDGELINE_PROGRESS", "1")
    EnvRunner(max_workers=2, timeout_s=1.0).run([lambda: 1] * 5)
    err = capsys.readouterr().err
    assert "env steps" in err and "/5" in err
    monkeypatch.setenv("RIDGELINE_PROGRESS", "0")
    EnvRunner(max_workers=2, timeout_s=1.0).run([lambda: 1] * 5)
    assert capsys.readouterr().err == ""
