"""SkyRL's `generator.step_wise_trajectories`: every turn of a multi-turn trajectory trains as a
sample of its own (exactly the ids the engine was given and the ids it sampled), with the
trajectory's advantage on every step's own tokens, mini-batches cut by trajectories, padding
rows for data-parallel ranks, and the reward metrics counted over trajectories."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.config.validate import ConfigError
from ridgeline.envs import register
from ridgeline.envs.feedback import FeedbackEnv, Grade
from ridgeline.generation.env_steps import EnvRunner
from ridgeline.generation.generator import Generator
from ridgeline.generation.step_wise import step_rewards, training_samples
from ridgeline.generation.types import GeneratorInput, GeneratorOutput, TrajectoryID, total_reward
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import SamplingParams
from ridgeline.models.tiny import CHARACTERS, build_tiny_model
from ridgeline.trainer.advantages import compute_advantages
from ridgeline.training.batch import RankShare, TrainingBatch, build_training_batch, rank_shares

PAD = 0


class DigitEnv(FeedbackEnv):
    """Solved by any answer that holds a digit (reward 1.0); otherwise feedback and another turn.
    A random tiny model writes a digit now and then, so episodes take 1 to max_turns turns."""

    feedback_message = "Answer with a number."

    def grade(self, action: str) -> Grade:
        solved = any(c.isdigit() for c in action)
        return Grade(reward=1.0 if solved else 0.0, correct=solved)


register("test_step_wise_digits", DigitEnv, overwrite=True)


# ------------------------------------------------------------------------------ cutting rewards
def test_step_rewards_keep_each_turns_reward_on_its_own_tokens():
    # turn 1: ids 0-2 (reward 0.1 on its last), observation 3-4, turn 2: ids 5-6 (reward 0.2), then an
    # appended eos (7) that a truncation penalty (add_to_final) put -0.5 on
    reward = [0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.2, -0.5]
    steps = step_rewards(reward, [(0, 3), (5, 7)])
    assert steps == [[0.0, 0.0, 0.1], [0.0, pytest.approx(-0.3)]]
    assert sum(map(sum, steps)) == pytest.approx(sum(reward))
    assert step_rewards(0.75, [(0, 2), (4, 5), (7, 9)]) == [0.0, 0.0, 0.75]   # a number: the last step
    with pytest.raises(ValueError, match="before any token the model sampled"):
        step_rewards([0.3, 0.0, 0.0], [(1, 3)])


# ------------------------------------------------------------------------------ advantages
def _rollout() -> GeneratorOutput:
    """Two prompts x two trajectories of 1, 3, 2 and 2 turns. Responses: turn ids with observation
    ids (900+) between turns; per-token rewards on each turn's last id. Returns: 1.0, 0.5, 1.0, 0.0.
    The last step of trajectory 1 (1 token) is shorter than its earlier steps (3 and 2 tokens)."""
    obs = [900, 901]
    turns = {0: [[11, 12, 13]], 1: [[21, 22, 23], [24, 25], [26]], 2: [[31], [32, 33, 34]], 3: [[41, 42], [43, 44]]}
    turn_rewards = {0: [1.0], 1: [0.0, 0.25, 0.25], 2: [0.0, 1.0], 3: [0.0, 0.0]}
    out = GeneratorOutput([], [], [], [], [], [], [], [], turn_spans=[])
    for t in range(4):
        response, mask, reward, spans = [], [], [], []
        for k, ids in enumerate(turns[t]):
            if k:
                response += obs
                mask += [0, 0]
                reward += [0.0, 0.0]
            spans.append((len(response), len(response) + len(ids)))
            response += ids
            mask += [1] * len(ids)
            reward += [0.0] * (len(ids) - 1) + [turn_rewards[t][k]]
        out.prompt_token_ids.append([1, 2, 3 + t // 2])
        out.response_ids.append(response)
        out.loss_masks.append(mask)
        out.rewards.append(reward if len(spans) > 1 else reward[-1])
        out.rollout_logprobs.append([-0.5 if m else 0.0 for m in mask])
        out.stop_reasons.append("stop")
        out.responses.append("")
        out.trajectory_ids.append(TrajectoryID("A" if t < 2 else "B", t % 2))
        out.turn_spans.append(spans)
    return out


def _batch(out: GeneratorOutput, step_wise: bool) -> TrainingBatch:
    s = training_samples(out, step_wise)
    return build_training_batch(s.prompt_token_ids, s.response_ids, s.loss_masks, s.rewards, s.uids,
                                s.rollout_logprobs, PAD, trajectory_index=s.trajectory_index)


def _algorithm(*overrides: str):
    critic = ["trainer.critic.model.path=tiny://llama", "trainer.critic_mini_batch_size=16"] if "trainer.algorithm.advantage_estimator=gae" in overrides else []
    return load_config(["+experiment=tiny", *critic, *overrides]).trainer.algorithm


def test_training_samples_cut_every_turn_out_of_its_trajectory():
    out = _rollout()
    samples = training_samples(out, step_wise=True)
    assert len(samples) == 8 and samples.trajectory_index == [0, 1, 1, 1, 2, 2, 3, 3]
    # trajectory 1, turn 2: its prompt is everything before it, its response the turn's own ids
    assert samples.prompt_token_ids[2] == [1, 2, 3, 21, 22, 23, 900, 901]
    assert samples.response_ids[2] == [24, 25] and samples.loss_masks[2] == [1, 1]
    assert samples.rewards[1:4] == [[0.0, 0.0, 0.0], [0.0, 0.25], [0.25]]
    assert samples.rewards[0] == 1.0 and samples.uids == ["A"] * 4 + ["B"] * 4
    whole = training_samples(out, step_wise=False)
    assert whole.response_ids == out.response_ids and whole.trajectory_index == [0, 1, 2, 3]


@pytest.mark.parametrize("norm_by_std", [False, True])
def test_grpo_advantage_of_a_trajectory_covers_every_token_of_every_step(norm_by_std):
    batch = _batch(_rollout(), step_wise=True)
    metrics = compute_advantages(batch, _algorithm(f"trainer.algorithm.grpo_norm_by_std={norm_by_std}"), None)
    # by hand: group A returns (1.0, 0.5), group B (1.0, 0.0); mean-centred, divided by the unbiased
    # group std (+1e-6) when asked
    std_a, std_b = (0.125 ** 0.5, 0.5 ** 0.5) if norm_by_std else (1.0 - 1e-6, 1.0 - 1e-6)
    per_trajectory = [0.25 / (std_a + 1e-6), -0.25 / (std_a + 1e-6), 0.5 / (std_b + 1e-6), -0.5 / (std_b + 1e-6)]
    lengths = [3, 3, 2, 1, 1, 3, 2, 2]
    for row, (trajectory, length) in enumerate(zip(batch.trajectories().tolist(), lengths)):
        expected = [per_trajectory[trajectory]] * length + [0.0] * (batch.response_width - length)
        assert batch.advantages[row].tolist() == pytest.approx(expected, abs=1e-6)
        assert batch.returns[row].tolist() == pytest.approx(expected, abs=1e-6)
    # SkyRL's loss/* over trajectories: the mean return, the mean advantage over every trained token
    assert metrics["loss/avg_final_rewards"] == pytest.approx((1.0 + 0.5 + 1.0 + 0.0) / 4)
    tokens = [3, 6, 4, 4]
    assert metrics["loss/avg_raw_advantages"] == pytest.approx(
        sum(a * n for a, n in zip(per_trajectory, tokens)) / sum(tokens), abs=1e-6)
    assert metrics["advantages/singleton_groups"] == 0.0


def test_step_wise_advantages_equal_the_whole_trajectorys_on_its_sampled_tokens():
    """grpo: the same numbers as training the whole trajectory as one sample; gae with
    gamma = lambda = 1: the same returns (the critic's targets), whatever the values of the
    observation tokens that no step holds."""
    out = _rollout()
    for estimator in ("grpo", "gae"):
        alg = _algorithm(f"trainer.algorithm.advantage_estimator={estimator}", "trainer.algorithm.gamma=1.0",
                         "trainer.algorithm.lambd=1.0")
        batches = {mode: _batch(out, step_wise=mode) for mode in (False, True)}
        g = torch.Generator().manual_seed(0)
        batches[False].values = torch.randn(batches[False].response_mask.shape, generator=g) \
            * batches[False].response_mask
        # each step's row sees the same prefix as the whole trajectory: the same values on its tokens
        steps = batches[True]
        steps.values = torch.zeros(steps.response_mask.shape)
        for row, (trajectory, (start, end)) in enumerate(_step_spans(out)):
            steps.values[row, :end - start] = batches[False].values[trajectory, start:end]
        for batch in batches.values():
            compute_advantages(batch, alg, None)
        field = "advantages" if estimator == "grpo" else "returns"
        for row, (trajectory, (start, end)) in enumerate(_step_spans(out)):
            assert getattr(steps, field)[row, :end - start].tolist() == pytest.approx(
                getattr(batches[False], field)[trajectory, start:end].tolist(), abs=1e-6)


def _step_spans(out: GeneratorOutput):
    return [(t, span) for t, spans in enumerate(out.turn_spans) for span in spans]


def test_gae_runs_through_the_later_turns_of_the_trajectory():
    """Trajectory of two steps ([a0 a1], [b0]) with rewards 0.5 on a1 and 1.0 on b0, gamma 0.5,
    lambda 0.8: returns = A + V of the chain a0 a1 b0, by hand."""
    out = GeneratorOutput([[1, 2]], [[5, 6, 900, 7]], [[0.0, 0.5, 0.0, 1.0]], [[1, 1, 0, 1]], ["stop"],
                          [[-1.0, -1.0, 0.0, -1.0]], [""], [TrajectoryID("A", 0)], turn_spans=[[(0, 2), (3, 4)]])
    batch = _batch(out, step_wise=True)
    v = [0.2, 0.4, 0.3]
    batch.values = torch.tensor([[v[0], v[1]], [v[2], 0.0]])
    compute_advantages(batch, _algorithm("trainer.algorithm.advantage_estimator=gae", "trainer.algorithm.gamma=0.5",
                                         "trainer.algorithm.lambd=0.8"), None)
    gamma, lam = 0.5, 0.8
    a2 = 1.0 - v[2]
    a1 = 0.5 + gamma * v[2] - v[1] + gamma * lam * a2
    a0 = 0.0 + gamma * v[1] - v[0] + gamma * lam * a1
    assert batch.returns.flatten().tolist() == pytest.approx([a0 + v[0], a1 + v[1], a2 + v[2], 0.0])


# ------------------------------------------------------------------------------ mini-batches and ranks
def test_mini_batches_are_cut_by_trajectories_and_ranks_get_padded_shares():
    batch = _batch(_rollout(), step_wise=True)            # trajectories of 1, 3, 2 and 2 steps
    minis = batch.mini_batches(2)                         # two trajectories per optimizer step
    assert [m.batch_size for m in minis] == [4, 4]
    assert [m.trajectories().tolist() for m in minis] == [[0, 1, 1, 1], [2, 2, 3, 3]]
    # one trajectory per optimizer step, two ranks: mini-batches of 1, 3, 2, 2 rows; the odd ones get a
    # padding row (a copy of their last row) so each rank holds half of every mini-batch
    shares = rank_shares(batch.trajectories(), 1, 2)
    assert [s.rows.tolist() for s in shares] == [[0, 1, 2, 4, 6], [0, 3, 3, 5, 7]]
    assert [s.padding.tolist() for s in shares] == [[False] * 5, [True, False, True, False, False]]
    part = batch.share(shares[1])
    assert part.num_samples == 3
    assert part.loss_mask[[0, 2]].sum() == 0 and part.response_mask[[0, 2]].sum() == 0
    assert part.loss_mask[1].sum() == 1   # the real row 3 (a one-token step) keeps its mask
    # on the rank, its share of each global mini-batch is one mini-batch of its own
    assert [m.batch_size for m in part.mini_batches(1)] == [1, 2, 1, 1]


def _policy_worker(model, reduction: str):
    from omegaconf import OmegaConf

    from ridgeline.config.schema import base_config
    from ridgeline.training.optim import LRSchedule, build_scheduler
    from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker
    algorithm = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": reduction})
    cfg = PolicyTrainConfig(mini_batch_trajectories=2, micro_batch_size=2, micro_forward_batch_size=4,
                            loss_reduction=reduction, algorithm=algorithm, max_grad_norm=1e9,
                            use_entropy_loss=True, entropy_loss_coef=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return PolicyWorker(model, cfg, optimizer, build_scheduler(optimizer, LRSchedule("constant", 0, 0)))


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_padding_rows_change_nothing_and_optimizer_steps_follow_trajectories(tiny_tokenizer, reduction):
    """A batch whose mini-batches carry padding rows (as a rank's share does) trains exactly like
    the batch without them: same losses, same weights after the steps; and the optimizer takes one
    step per mini-batch of trajectories, however many steps (rows) they hold."""
    vocab = len(tiny_tokenizer)
    out = _rollout()
    for ids in out.response_ids:
        ids[:] = [i % vocab for i in ids]
    batch = _batch(out, step_wise=True)
    compute_advantages(batch, _algorithm(), None)
    # every mini-batch (2 trajectories: rows 0-3 and 4-7) gets a padding row, a copy of its last row
    padded = batch.share(RankShare(torch.tensor([0, 1, 2, 3, 3, 4, 5, 6, 7, 7]),
                                   torch.tensor([False] * 4 + [True] + [False] * 4 + [True])))
    results = []
    for b in (batch, padded):
        model = build_tiny_model("llama", tiny_tokenizer, seed=0)
        metrics = _policy_worker(model, reduction).train(b)
        results.append((metrics, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (plain, weights), (with_padding, padded_weights) = results
    assert plain["policy/policy_update_steps"] == with_padding["policy/policy_update_steps"] == 2.0
    assert with_padding["policy/policy_loss"] == pytest.approx(plain["policy/policy_loss"], abs=1e-6)
    assert with_padding["policy/policy_entropy"] == pytest.approx(plain["policy/policy_entropy"], abs=1e-6)
    assert torch.allclose(weights, padded_weights, atol=1e-6)


# ------------------------------------------------------------------------------ the generator
class RecordingEngine(HFEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[list[int]], list]] = []

    def generate(self, requests, seed=None):
        outputs = super().generate(requests, seed=seed)
        self.calls.append(([list(r.prompt_token_ids) for r in requests], outputs))
        return outputs


@pytest.mark.parametrize("stop", [None, tuple(CHARACTERS)], ids=["stop-token", "stop-strings"])
def test_each_step_is_what_the_engine_was_given_and_sampled(tiny_model, tiny_tokenizer, stop):
    """gsm8k_multi_turn (skyrl-gym's env) on the tiny model, conversation mode: step k of every
    trajectory has as prompt exactly the engine's input of turn k, which is the whole trajectory's
    sequence up to there, and as response exactly the ids the engine sampled, with its logprobs.
    With stop strings, the eos appended after each turn (loss mask 0) is in the next step's prompt."""
    engine = RecordingEngine(tiny_model, tiny_tokenizer)
    gen = Generator(engine, tiny_tokenizer, max_turns=3, conversation_mode=True, runner=EnvRunner(max_workers=4))
    n = 4
    extras = {"reward_spec": {"method": "rule", "ground_truth": "7"}}
    out = gen.generate(GeneratorInput(
        prompts=[[{"role": "user", "content": "What is 3 + 4?"}]] * n, env_classes=["gsm8k_multi_turn"] * n,
        env_extras=[extras] * n, trajectory_ids=[TrajectoryID("u", k) for k in range(n)],
        sampling_params=SamplingParams(max_generate_length=5, stop=stop)), seed=3)
    samples = training_samples(out, step_wise=True)
    assert len(samples) == sum(len(spans) for spans in out.turn_spans) > n
    step = 0
    for trajectory in range(n):
        spans = out.turn_spans[trajectory]
        for turn, (start, end) in enumerate(spans):
            inputs, outputs = engine.calls[turn]
            live = [t for t in range(n) if len(out.turn_spans[t]) > turn]  # the rows the engine got this turn
            sampled = outputs[live.index(trajectory)]
            assert samples.trajectory_index[step] == trajectory
            assert samples.prompt_token_ids[step] == inputs[live.index(trajectory)]
            assert samples.prompt_token_ids[step] == out.prompt_token_ids[trajectory] + out.response_ids[trajectory][:start]
            assert samples.response_ids[step] == sampled.response_ids
            assert samples.rollout_logprobs[step] == pytest.approx(sampled.logprobs)
            assert samples.loss_masks[step] == [1] * (end - start)
            step += 1
        # the steps' rewards add up to the trajectory's return; an eos appended after the last turn is in no step
        rows = [j for j, t in enumerate(samples.trajectory_index) if t == trajectory]
        assert sum(total_reward(samples.rewards[j]) for j in rows) == pytest.approx(total_reward(out.rewards[trajectory]))
        tail = out.response_ids[trajectory][spans[-1][1]:]
        assert tail == ([tiny_tokenizer.eos_token_id] if stop and sampled.matched_stop is not None else [])
        assert out.loss_masks[trajectory][spans[-1][1]:] == [0] * len(tail)
    # a turn's message is closed by an eos: sampled (in the step), or appended (in the next step's prompt)
    eos = tiny_tokenizer.eos_token_id
    for j in range(1, len(samples)):
        if samples.trajectory_index[j] == samples.trajectory_index[j - 1]:
            after = samples.prompt_token_ids[j][len(samples.prompt_token_ids[j - 1]) + len(samples.response_ids[j - 1])]
            assert samples.response_ids[j - 1][-1] == eos or after == eos


# ------------------------------------------------------------------------------ config
def test_step_wise_config_rules(caplog):
    with pytest.raises(ConfigError) as info:
        load_config(["+experiment=tiny", "generator.step_wise_trajectories=true"])
    (problem,) = info.value.problems
    assert problem.startswith("generator.step_wise_trajectories=true needs generator.use_conversation_multi_turn=true")
    assert "Fix: generator.use_conversation_multi_turn=true" in problem
    # SkyRL's Qwen3 step-wise script passes a key 0.3.1 never reads: one notice, and it is not in the config
    with caplog.at_level(logging.WARNING, logger="ridgeline.config.validate"):
        cfg = load_config(["+experiment=tiny", "generator.step_wise_trajectories=true",
                           "generator.use_conversation_multi_turn=true", "+generator.retokenize_chat_history=true"])
    assert cfg.generator.step_wise_trajectories is True and "retokenize_chat_history" not in vars(cfg.generator)
    notices = [r.getMessage() for r in caplog.records if "retokenize_chat_history" in r.getMessage()]
    assert len(notices) == 1 and "never reads it" in notices[0] and "token-in/token-out" in notices[0]


# ------------------------------------------------------------------------------ the real loop
def test_step_wise_training_runs_through_the_trainer(tmp_path):
    """Two steps of the tiny model on a multi-turn env (1 to 3 turns per episode) with step-wise
    samples, dynamic sampling on: every kept trajectory's turns are the step's samples, the
    optimizer takes one step per mini-batch of trajectories, the reward metrics are those of the
    trajectories, each trajectory's steps share its GRPO advantage, and eval runs."""
    from ridgeline.trainer.trainer import Trainer

    cfg = load_config([
        "+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=8", "data.prepare.num_val=4",
        "+data.prepare.env_class=test_step_wise_digits", "environment.env_class=test_step_wise_digits",
        "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=2", "generator.n_samples_per_prompt=4",
        "generator.max_turns=3", "generator.use_conversation_multi_turn=true",
        "generator.step_wise_trajectories=true", "generator.sampling_params.max_generate_length=3",
        "trainer.algorithm.dynamic_sampling.type=filter", "trainer.algorithm.dynamic_sampling.max_sample_batches=2",
        "trainer.dump_data_batch=true", "trainer.micro_train_batch_size_per_gpu=8", "generator.max_input_length=200"])
    trainer = Trainer.from_config(cfg)
    rollouts: list[GeneratorOutput] = []
    collect = trainer.collect_rollout

    def kept(rows):  # what dynamic sampling handed on, to compare the step's numbers with
        out, stats = collect(rows)
        rollouts.append(out)
        return out, stats

    trainer.collect_rollout = kept
    trainer.train()
    steps = [r for r in trainer.history if "policy/policy_loss" in r]
    assert len(steps) == 2 and len(rollouts) == 2
    for step, (metrics, out) in enumerate(zip(steps, rollouts), start=1):
        turns = [len(spans) for spans in out.turn_spans]
        assert metrics["generate/step_wise_samples"] == sum(turns) and len(set(turns)) > 1
        # one optimizer step per 2 prompts x 4 trajectories, however many turns they took
        assert metrics["policy/policy_update_steps"] == math.ceil(len(out) / 8)
        returns = [total_reward(r) for r in out.rewards]
        assert metrics["reward/avg_raw_reward"] == pytest.approx(sum(returns) / len(returns))
        assert metrics["loss/avg_final_rewards"] == pytest.approx(sum(returns) / len(returns))
        dump = tmp_path / "tiny" / "dumped_data" / f"global_step_{step}_training_input.jsonl"
        rows = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(rows) == sum(turns)
        by_trajectory: dict[int, set[float]] = {}
        for row in rows:
            by_trajectory.setdefault(row["trajectory"], set()).add(round(row["advantages"]["mean"], 5))
        assert sorted(by_trajectory) == list(range(len(out)))
        assert all(len(means) == 1 for means in by_trajectory.values())  # one advantage per trajectory
    assert any("eval/all/avg_score" in row for row in trainer.history)


@pytest.mark.integration
def test_step_wise_on_two_ranks_reproduces_one_process(tmp_path):
    """PPO (gae, a critic) with step-wise samples, as 2 policy + 2 critic + 2 reference FSDP2 ranks on
    Ray: mini-batches of 2 prompts' trajectories hold odd numbers of steps, so the ranks' shares are
    padded; the losses, grad norms and values equal the one-process run's."""
    from ridgeline.entrypoints.run import run_training
    from ridgeline.tracking.trackers import read_metrics

    common = [
        "+experiment=tiny", "trainer.logger=jsonl", "data.prepare.num_train=8", "data.prepare.num_val=4",
        "+data.prepare.env_class=test_step_wise_digits", "environment.env_class=test_step_wise_digits",
        "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=2", "generator.n_samples_per_prompt=4",
        "generator.max_turns=3", "generator.use_conversation_multi_turn=true", "generator.step_wise_trajectories=true",
        "generator.sampling_params.max_generate_length=3", "generator.max_input_length=200",
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.algorithm.advantage_estimator=gae",
        "trainer.critic.model.path=tiny://llama", "trainer.critic_mini_batch_size=1", "trainer.eval_before_train=false",
        "trainer.dump_data_batch=true"]
    ranks = ["trainer.strategy=fsdp2", "trainer.placement.colocate_all=false",
             "trainer.placement.policy_num_gpus_per_node=2", "trainer.placement.ref_num_gpus_per_node=2",
             "trainer.placement.critic_num_gpus_per_node=2"]
    run_training(load_config(common + [f"trainer.export_path={tmp_path / 'single'}"]))
    run_training(load_config(common + ranks + [f"trainer.export_path={tmp_path / 'ray'}"]))
    single, multi = ([r for r in read_metrics(tmp_path / mode / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r]
                     for mode in ("single", "ray"))
    assert len(single) == len(multi) == 2
    # some critic mini-batch (1 prompt: 4 trajectories) held an odd number of steps: a rank got a padding row
    odd = 0
    for step in (1, 2):
        dump = tmp_path / "single" / "tiny" / "dumped_data" / f"global_step_{step}_training_input.jsonl"
        trajectories = [json.loads(line)["trajectory"] for line in dump.read_text().splitlines()]
        odd += sum(sum(t // 4 == k for t in trajectories) % 2 for k in range(4))
    assert odd > 0
    for x, y in zip(single, multi):
        assert y["generate/step_wise_samples"] == x["generate/step_wise_samples"]
        for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/raw_grad_norm", "policy/policy_entropy",
                    "policy/policy_kl", "critic/value_loss", "critic/values_mean", "critic/raw_grad_norm",
                    "loss/avg_raw_advantages", "policy/policy_update_steps"):
            assert y[key] == pytest.approx(x[key], abs=1e-5), key
