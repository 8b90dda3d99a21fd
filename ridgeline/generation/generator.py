"""The generator: the agent loop of every trajectory, token-in / token-out.

Per trajectory: the environment may rewrite the prompt (`init`), the chat template turns it into
token ids once, and then, turn after turn, the engine samples a response, the decoded text goes to
`env.step`, and the observations it returns are appended as tokens, until the environment says
done, `generator.max_turns` turns were taken, or the next input would exceed
`generator.max_input_length`. All live trajectories generate together, one engine call per turn.

Token-in / token-out: earlier turns are never decoded and re-encoded. The next turn's input is
exactly the prompt ids + every sampled id + every observation id so far, and that is the sequence
the trainer trains on: `loss_mask` 1 on sampled ids, 0 on observation ids; rollout logprobs line
up with the sampled ids. `turn_spans` records where each turn's sampled ids sit, which is all
step-wise training (`generation.step_wise`) needs to cut a trajectory into its turns.

Observations become tokens in one of two ways (`generator.use_conversation_multi_turn`):
* true: as chat turns. The response is closed with the end-of-turn token if the model did not
  sample one (loss mask 0), then the chat template's own text between messages and the new
  messages, rendered with the assistant turn opened, follow.
* false: as raw text after the response, in the same assistant message: a trailing stop token
  is removed first (not the last token of a stop string: that is text), then the observation text
  is tokenized and appended.

Stop strings (`sampling_params.stop`): a response that ended on one keeps it (the environment
parses it, e.g. `</sql>`). In conversation mode, with `generator.
append_eos_token_after_stop_str_in_multi_turn` (SkyRL's rule), the eos token is appended after it
on every turn, the last one included: loss mask 0 and logprob 0.0, since the model did not sample
it. Without it the next chat turn follows the stop string directly, as in SkyRL.

Rewards: a single-turn trajectory gets its step's reward as one number. A multi-turn one gets a
per-token reward list with each step's reward on the last token the model sampled in that turn
(SkyRL puts it on an appended eos; Ridgeline keeps it on a token the loss sees).
Environment calls (`init`, `step`, `get_metrics`, `aggregate_metrics`, `close`) run concurrently,
each under a time limit (`EnvRunner`), and what they return is checked in the worker thread
(`generation.env_outputs`): an `init` or `step` that raises, hangs or returns something that breaks
the contract (a non-finite or non-number reward, malformed observations or metadata) costs its
trajectory the reward (0), is counted, and is logged once per env class, call and reason; the run
goes on while such trajectories stay within `environment.max_env_error_fraction` of the call's,
and stops past it with the first failure and its row (`EnvErrorShareError`): a broken reward must
not train a run on zeros. Observations over `generator.max_observation_chars` are cut before they are tokenized
(`generate/observations_truncated`). A truncated trajectory (stop reason "length") keeps its
environment's reward here: what truncation costs is decided by `generation.truncation`.

Seeds: turn t samples with `derive_seed(seed, "turn", t)`, so no two turns share one.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

from transformers import PreTrainedTokenizerBase

from ridgeline import envs
from ridgeline.data import chat_template_ids, encode_chat_prompt
from ridgeline.errors import UserError
from ridgeline.generation.env_outputs import (CAP_KEY, CheckedStep, Cut, check_init, check_metrics,
                                               check_step)
from ridgeline.generation.env_steps import EnvCallFailure, EnvRunner
from ridgeline.generation.types import GeneratorInput, GeneratorOutput, Reward
from ridgeline.inference.types import EngineOutput, EngineRequest, InferenceEngine, TopLogprobs
from ridgeline.seeding import derive_seed

log = logging.getLogger(__name__)

DEFAULT_MAX_OBSERVATION_CHARS = 100_000   # generator.max_observation_chars' default


class EnvErrorShareError(UserError, RuntimeError):
    """More of a generation call's trajectories failed in their environment than
    `environment.max_env_error_fraction` allows."""


@dataclass
class Trajectory:
    """One rollout in progress."""

    env: envs.Env | None
    env_class: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # [] where none were asked / sampled
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (token index, reward)
    # [start, end) of each turn's sampled ids in response_ids: what step-wise training cuts out
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    stop_reason: str = "stop"
    text: str = ""  # the decoded model text of all turns, for logs and eval dumps
    last_metadata: dict[str, Any] = field(default_factory=dict)  # of the last env step
    failure: tuple[str, EnvCallFailure] | None = None  # (call, why) when the env cost it its reward

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_sampled(self, out: EngineOutput) -> None:
        self.turn_spans.append((len(self.response_ids), len(self.response_ids) + len(out.response_ids)))
        self.response_ids += out.response_ids
        self.loss_mask += [1] * len(out.response_ids)
        self.logprobs += list(out.logprobs)
        self.top_logprobs += out.top_logprobs if out.top_logprobs is not None else [[] for _ in out.response_ids]
        self.stop_reason = out.stop_reason

    def add_observation(self, ids: list[int]) -> None:
        """Tokens the model did not sample (observations, an appended eos): loss mask 0, logprob 0."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.top_logprobs += [[] for _ in ids]

    def drop_last(self) -> None:
        """Remove the last id (raw mode: a turn's stop token), from its turn's span too."""
        del self.response_ids[-1], self.loss_mask[-1], self.logprobs[-1], self.top_logprobs[-1]
        start, end = self.turn_spans[-1]
        self.turn_spans[-1] = (start, min(end, len(self.response_ids)))

    def reward(self) -> Reward:
        if self.failed:
            return 0.0
        if self.turns <= 1:
            return sum(r for _, r in self.turn_rewards)
        per_token = [0.0] * len(self.response_ids)
        for index, value in self.turn_rewards:
            per_token[index] += value
        return per_token


class Generator:
    """`generate(GeneratorInput) -> GeneratorOutput` over any `InferenceEngine`.

    env_settings: `environment.skyrl_gym` (per env class). max_turns / max_input_length /
    conversation_mode: `generator.max_turns`, `generator.max_input_length`,
    `generator.use_conversation_multi_turn`. append_eos_after_stop_str:
    `generator.append_eos_token_after_stop_str_in_multi_turn`. runner: how environment calls are
    run (`environment.skyrl_gym.max_env_workers`, `environment.step_timeout_s`).
    max_observation_chars: `generator.max_observation_chars` (None: no cap).
    max_env_error_fraction: `environment.max_env_error_fraction` (1.0: never stop).
    """

    def __init__(self, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase, *,
                 env_settings: dict[str, dict[str, Any]] | None = None, max_turns: int = 1,
                 max_input_length: int | None = None, conversation_mode: bool = False,
                 append_eos_after_stop_str: bool = True, runner: EnvRunner | None = None,
                 max_observation_chars: int | None = DEFAULT_MAX_OBSERVATION_CHARS,
                 max_env_error_fraction: float = 1.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_settings = env_settings or {}
        self.max_turns = max_turns
        self.max_input_length = max_input_length
        self.conversation_mode = conversation_mode
        self.append_eos_after_stop_str = append_eos_after_stop_str
        self.runner = runner or EnvRunner(max_workers=0)
        self.max_observation_chars = max_observation_chars
        self.max_env_error_fraction = max_env_error_fraction
        self._logged: set[tuple[str, ...]] = set()
        self._base_ids: list[int] | None = None

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat_prompt(self.tokenizer, messages)

    # ------------------------------------------------------------------------------ the loop
    def generate(self, inp: GeneratorInput, seed: int | None = None) -> GeneratorOutput:
        if len(inp.trajectory_ids) != len(inp.prompts):
            raise ValueError(f"GeneratorInput: {len(inp.trajectory_ids)} trajectory_ids for {len(inp.prompts)} prompts")
        t0 = time.perf_counter()
        counts: dict[str, float] = defaultdict(float)
        trajectories = self._start(inp, counts)
        engine_seconds = 0.0
        for turn in range(self.max_turns):
            live = [t for t in trajectories if not t.done]
            if not live:
                break
            t_engine = time.perf_counter()
            results = self.engine.generate(
                [EngineRequest(t.prompt_ids + t.response_ids, inp.sampling_params) for t in live],
                seed=None if seed is None else derive_seed(seed, "turn", turn))
            engine_seconds += time.perf_counter() - t_engine
            texts = self.tokenizer.batch_decode([r.response_ids for r in results], skip_special_tokens=True)
            for traj, result, text in zip(live, results, texts):
                traj.add_sampled(result)
                traj.turns += 1
                traj.text += text
            steps = self.runner.run([functools.partial(_step, t.env, text, self.max_observation_chars)
                                     for t, text in zip(live, texts)])
            last_turn = turn + 1 >= self.max_turns
            for traj, result, step in zip(live, results, steps):
                self._apply_step(traj, step, result, last_turn, counts)
        out = self._finish(inp, trajectories, counts, engine_seconds, time.perf_counter() - t0)
        self._check_error_share(inp, trajectories)
        return out

    def _check_error_share(self, inp: GeneratorInput, trajectories: list[Trajectory]) -> None:
        """Stop the run when more trajectories than `max_env_error_fraction` lost their reward to
        their environment: the first one's error, its row, and the fix."""
        failed = [(i, t) for i, t in enumerate(trajectories) if t.failed]
        if not failed or len(failed) <= self.max_env_error_fraction * len(trajectories):
            return
        index, traj = failed[0]
        assert traj.failure is not None
        call, failure = traj.failure
        what, _ = _FAILURE_TEXT[failure.kind]
        raise EnvErrorShareError(
            f"environment {traj.env_class}: {call} {what} on {len(failed)} of {len(trajectories)} trajectories of "
            f"this {inp.mode} batch (step {inp.global_step}), more than environment.max_env_error_fraction="
            f"{self.max_env_error_fraction:g} allows. The first: {failure.message.rstrip('.')} (row: "
            f"{_row_text(inp.env_extras[index], inp.prompts[index])}). Fix: the environment or reward function "
            f"(its traceback is in the log above; ridgeline --debug shows it here too); to go on training with "
            f"these trajectories scored 0, raise environment.max_env_error_fraction (1.0 never stops).")

    def _start(self, inp: GeneratorInput, counts: dict[str, float]) -> list[Trajectory]:
        """Build each trajectory's environment and `init` it (on the runner, under the time limit)
        and encode the prompts; an env that fails to build, or whose `init` fails, hangs or returns
        a bad prompt, leaves its trajectory done with reward 0."""
        slots = [_Slot() for _ in inp.prompts]
        started = self.runner.run(
            [functools.partial(self._start_env, slot, env_class, extras, prompt)
             for slot, env_class, extras, prompt in zip(slots, inp.env_classes, inp.env_extras, inp.prompts)],
            desc="env init")
        trajectories = []
        encoded: dict[str, list[int]] = {}   # a GRPO group's samples share one prompt: template it once
        for slot, env_class, prompt, init_out in zip(slots, inp.env_classes, inp.prompts, started):
            failure = init_out if isinstance(init_out, EnvCallFailure) else None
            messages = prompt if isinstance(init_out, EnvCallFailure) else init_out
            if failure is not None:
                self._failure(env_class, "init", failure, counts)
            key = json.dumps(messages, sort_keys=True, default=str)
            if key not in encoded:
                encoded[key] = self.encode_prompt(messages)
            # an env built before its init failed or timed out is still closed at the end
            traj = Trajectory(slot.env, env_class, list(encoded[key]))
            if failure is not None:
                traj.done, traj.failure = True, ("init", failure)
            trajectories.append(traj)
        return trajectories

    def _start_env(self, slot: _Slot, env_class: str, extras: dict[str, Any],
                   prompt: list[dict[str, str]]) -> list[dict[str, str]]:
        slot.env = build_env(env_class, extras, self.env_settings, self.max_turns)
        return check_init(slot.env.init(prompt), prompt, self.max_observation_chars)

    def _apply_step(self, traj: Trajectory, step: CheckedStep | EnvCallFailure, result: EngineOutput,
                    last_turn: bool, counts: dict[str, float]) -> None:
        if isinstance(step, EnvCallFailure):
            self._failure(traj.env_class, "step", step, counts)
            traj.done, traj.failure = True, ("step", step)
            return
        reward = step.reward
        traj.last_metadata = step.metadata
        if step.done or last_turn:
            traj.turn_rewards.append((len(traj.response_ids) - 1, reward))
            traj.done = True
            traj.add_observation(self._eos_after_stop_string(result))
            return
        if step.cut is not None:
            counts["observations_truncated"] += 1
            self._note_cut(traj.env_class, step.cut)
        drop_stop, observation = self._observation_ids(traj, step.observations, result)
        kept = len(traj.response_ids) - int(drop_stop)
        if self.max_input_length is not None and len(traj.prompt_ids) + kept + len(observation) > self.max_input_length:
            # no room for another turn: the episode ends here, with this turn's reward
            traj.turn_rewards.append((len(traj.response_ids) - 1, reward))
            traj.done, traj.stop_reason = True, "length"
            counts["context_full"] += 1
            traj.add_observation(self._eos_after_stop_string(result))
            return
        if drop_stop:
            traj.drop_last()
        traj.turn_rewards.append((max(0, len(traj.response_ids) - 1), reward))
        traj.add_observation(observation)

    def _finish(self, inp: GeneratorInput, trajectories: list[Trajectory], counts: dict[str, float],
                engine_seconds: float, total_seconds: float) -> GeneratorOutput:
        """Each env's `get_metrics`, each env class's `aggregate_metrics`, then every env's `close`,
        all on the runner (a hung `close` costs one time limit, never the run)."""
        started = [(t, t.env) for t in trajectories if t.env is not None]
        episodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
        aggregators: dict[str, envs.Env] = {}   # per env class, one of its envs: it knows how they combine
        reported = self.runner.run([functools.partial(_get_metrics, env) for _, env in started], desc="env metrics")
        for (traj, env), metrics in zip(started, reported):
            if isinstance(metrics, EnvCallFailure):
                self._failure(traj.env_class, "get_metrics", metrics, counts, score=False)
                continue
            episodes[traj.env_class].append(metrics)
            aggregators.setdefault(traj.env_class, env)
        per_class = self._class_metrics(episodes, aggregators, counts)
        closed = self.runner.run([functools.partial(_close, env) for _, env in started], desc="env close")
        for (traj, _), outcome in zip(started, closed):
            if isinstance(outcome, EnvCallFailure):
                self._failure(traj.env_class, "close", outcome, counts, score=False)
        metrics = {
            "generate/env_errors": counts["error"] + counts["bad_output"],
            "generate/env_bad_outputs": counts["bad_output"],
            "generate/env_timeouts": counts["timeout"],
            "generate/observations_truncated": counts["observations_truncated"],
            "generate/context_full": counts["context_full"],
            "generate/avg_turns": sum(t.turns for t in trajectories) / max(1, len(trajectories)),
            "generate/engine_seconds": engine_seconds,
            "generate/env_seconds": total_seconds - engine_seconds,
        }
        if self.runner.stragglers:
            metrics["generate/env_stragglers"] = float(self.runner.stragglers)
        metrics.update(environment_metrics(per_class))
        return GeneratorOutput(
            prompt_token_ids=[t.prompt_ids for t in trajectories],
            response_ids=[t.response_ids for t in trajectories],
            rewards=[t.reward() for t in trajectories],
            loss_masks=[t.loss_mask for t in trajectories],
            stop_reasons=[t.stop_reason for t in trajectories],  # type: ignore[misc]
            rollout_logprobs=[t.logprobs for t in trajectories],
            rollout_top_logprobs=[t.top_logprobs for t in trajectories] if inp.sampling_params.num_top_logprobs else [],
            responses=[t.text for t in trajectories],
            trajectory_ids=list(inp.trajectory_ids),
            metrics=metrics,
            step_metadata=[t.last_metadata for t in trajectories],
            turn_spans=[list(t.turn_spans) for t in trajectories],
        )

    def _class_metrics(self, episodes: dict[str, list[dict[str, Any]]], aggregators: dict[str, envs.Env],
                       counts: dict[str, float]) -> dict[str, ClassMetrics]:
        """Per env class, its `aggregate_metrics` of its episodes, with how many reported each key."""
        classes = list(episodes)
        combined = self.runner.run([functools.partial(_aggregate, aggregators[c], episodes[c]) for c in classes],
                                   desc="env aggregate")
        out: dict[str, ClassMetrics] = {}
        for env_class, result in zip(classes, combined):
            if isinstance(result, EnvCallFailure):
                self._failure(env_class, "aggregate_metrics", result, counts, score=False)
            else:
                out[env_class] = result
        return out

    # ------------------------------------------------------------------------------ observations
    def _observation_ids(self, traj: Trajectory, observations: list[dict[str, str]],
                         result: EngineOutput) -> tuple[bool, list[int]]:
        """(drop the response's trailing stop token?, the ids to append) for these observations."""
        if self.conversation_mode:
            if result.stop_reason != "stop":
                # the model ran out of tokens mid-turn: close its message as the template would
                closing = [self.tokenizer.eos_token_id]
            else:
                closing = self._eos_after_stop_string(result)
            return False, closing + self._between_turns() + self._render_messages(observations)
        # raw mode continues the same assistant message, so its stop token must go (a stop string's
        # last token is text and stays)
        drop_stop = (result.stop_reason == "stop" and result.matched_stop is None and bool(traj.loss_mask)
                     and traj.loss_mask[-1] == 1)
        text = "".join(m["content"] for m in observations)
        return drop_stop, list(self.tokenizer.encode(text, add_special_tokens=False))

    def _eos_after_stop_string(self, result: EngineOutput) -> list[int]:
        """[eos] when SkyRL's append_eos_token_after_stop_str_in_multi_turn applies to this turn's
        response (conversation mode, ended on a stop string, not already on eos), else []."""
        eos = self.tokenizer.eos_token_id
        if (self.conversation_mode and self.append_eos_after_stop_str and result.matched_stop is not None
                and result.response_ids and result.response_ids[-1] != eos):
            return [eos]
        return []

    def _render_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """The template's tokens for `messages` appended to a conversation, with the assistant turn
        opened: the template of [base + messages] minus that of [base]."""
        prefix = self._base_conversation_ids()
        full = chat_template_ids(self.tokenizer, _BASE_CONVERSATION + list(messages), add_generation_prompt=True)
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template does not render a conversation as a prefix of its "
                             "continuation; use generator.use_conversation_multi_turn=false")
        return full[len(prefix):]

    def _between_turns(self) -> list[int]:
        """Template tokens after an assistant message's end-of-turn token (e.g. ChatML's newline)."""
        ids = self._base_conversation_ids()
        eos = self.tokenizer.eos_token_id
        last = max((i for i, t in enumerate(ids) if t == eos), default=len(ids) - 1)
        return ids[last + 1:]

    def _base_conversation_ids(self) -> list[int]:
        # rendered once: every observation of every turn is measured against it
        if self._base_ids is None:
            self._base_ids = chat_template_ids(self.tokenizer, _BASE_CONVERSATION, add_generation_prompt=False)
        return self._base_ids

    # ------------------------------------------------------------------------------ failures
    def _failure(self, env_class: str, call: str, failure: EnvCallFailure, counts: dict[str, float],
                 score: bool = True) -> None:
        """Count a failed environment call; log it once per env class, call, kind and field."""
        counts[failure.kind] += 1
        key = (env_class, call, failure.kind, failure.field)
        if key in self._logged:
            return
        self._logged.add(key)
        what, metric = _FAILURE_TEXT[failure.kind]
        consequence = "The trajectory gets reward 0" if score else "The reward stands"
        log.error("environment %s: %s %s: %s. %s (logged once per env class, call and reason; counted in "
                  "generate/%s).%s", env_class, call, what, failure.message.rstrip("."), consequence, metric,
                  "\n" + failure.details if failure.details else "")

    def _note_cut(self, env_class: str, cut: Cut) -> None:
        key = (env_class, "observation cut")
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning("environment %s: an observation of %d characters was cut to %s=%d (%d characters of its last "
                    "kept message cut, %d later messages dropped). Logged once per env class; counted in "
                    "generate/observations_truncated.", env_class, cut.size, CAP_KEY, self.max_observation_chars,
                    cut.chars, cut.dropped)


_FAILURE_TEXT = {   # kind -> (what happened, the metric that counts it)
    "error": ("raised", "env_errors"),
    "bad_output": ("returned a bad output", "env_bad_outputs and generate/env_errors"),
    "timeout": ("timed out", "env_timeouts"),
}


def _row_text(extras: dict[str, Any], prompt: list[dict[str, str]]) -> str:
    """Enough of a dataset row to find it: data_source, extra_info's index if any, the prompt's start."""
    info = extras.get("extra_info")
    index = info.get("index") if isinstance(info, dict) else None
    last = prompt[-1]["content"] if prompt else ""
    start = " ".join(last.split())
    start = start if len(start) <= 60 else start[:57] + "..."
    parts = [f"data_source={extras.get('data_source')}"]
    if index is not None:
        parts.append(f"extra_info.index={index}")
    return ", ".join(parts + [f"prompt {start!r}"])


# a conversation the observations are rendered after (its text does not matter)
_BASE_CONVERSATION = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

# keep the old name importable for code written against the single-turn generator
SingleTurnGenerator = Generator


@dataclass(frozen=True)
class ClassMetrics:
    """One env class's `aggregate_metrics` of a step's episodes, and per key how many episodes
    reported it (a key the aggregator made up counts 1)."""

    values: dict[str, float]
    counts: dict[str, int]


def environment_metrics(per_class: dict[str, ClassMetrics]) -> dict[str, float]:
    """SkyRL's `environment/<key>` from each env class's aggregate. SkyRL lets a later class
    overwrite an earlier one's key; here a key several classes report is their aggregates' mean
    weighted by the episodes that reported it (for classes that average, as skyrl-gym's default
    does, the mean over all those episodes), and each class's own value is logged beside it as
    `environment/<env_class>/<key>` (for a key of one class that would repeat the same number)."""
    metrics: dict[str, float] = {}
    keys = sorted({k for m in per_class.values() for k in m.values})
    for key in keys:
        reporting = {env_class: m for env_class, m in per_class.items() if key in m.values}
        weight = sum(m.counts[key] for m in reporting.values())
        metrics[f"environment/{key}"] = sum(m.values[key] * m.counts[key] for m in reporting.values()) / weight
        if len(reporting) > 1:
            for env_class, m in reporting.items():
                metrics[f"environment/{env_class}/{key}"] = m.values[key]
    return metrics


def build_env(env_class: str, extras: dict[str, Any], env_settings: Mapping[str, dict[str, Any]],
              max_turns: int) -> envs.Env:
    """The env of one row, as the generator builds it: settings from `environment.skyrl_gym.<name>`
    (`<id>` for `skyrl_gym:<id>`), `max_turns` defaulting to `generator.max_turns`."""
    settings = dict(env_settings.get(env_class.removeprefix(envs.SKYRL_GYM_PREFIX), {}))
    settings.setdefault("max_turns", max_turns)
    return envs.make(env_class, env_config=settings, extras=extras)


@dataclass
class _Slot:
    """Where a starting trajectory's env is put as soon as it is built, so that an env whose
    `init` fails or times out can still be closed."""

    env: envs.Env | None = None


# The calls the runner makes, each in a worker thread under the time limit; everything they read
# from the env (attributes, returned values) is read there too.
def _step(env: envs.Env | None, text: str, max_chars: int | None) -> CheckedStep:
    assert env is not None, "a trajectory without an env is done before its first turn"
    return check_step(env.step(text), max_chars)


def _get_metrics(env: envs.Env) -> dict[str, Any]:
    return check_metrics(env.get_metrics())


def _aggregate(env: envs.Env, episodes: list[dict[str, Any]]) -> ClassMetrics:
    values = {str(k): float(v) for k, v in check_metrics(env.aggregate_metrics(episodes)).items() if _finite(v)}
    return ClassMetrics(values, {k: max(1, sum(k in row for row in episodes)) for k in values})


def _close(env: envs.Env) -> None:
    env.close()


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


__all__ = ["ClassMetrics", "Generator", "build_env", "SingleTurnGenerator", "Trajectory", "environment_metrics"]
