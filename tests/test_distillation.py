"""On-policy distillation (SkyRL's examples/on_policy_distillation): the `no_op` estimator and the
`importance_sampling` loss by hand, the teacher-KL reward, the SkyRL math of the worker's
seq_mean_token_sum_norm, the config rules, and the tiny student distilling from a tiny teacher
through the real Trainer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from ridgeline.algorithms import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, compute_no_op_advantages,
                                  importance_sampling_loss, loss_normalizers, reduce_loss)
from ridgeline.algorithms.kl_control import kl_penalized_rewards
from ridgeline.config import ConfigError, base_config, load_config
from ridgeline.training.batch import build_training_batch
from ridgeline.training.build import loss_config, skyrl_max_seq_len
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker
from skyrl_commands import SKYRL_COMMANDS

COMMANDS = SKYRL_COMMANDS
DISTILL_SCRIPTS = ["on_policy_distillation/run_on_policy_distill_math_qwen3_1.7b.sh",
                   "on_policy_distillation/run_on_policy_distill_math_qwen3_4b.sh"]
PRESET = "+experiment=on_policy_distillation"


def algorithm(**overrides) -> DictConfig:
    return OmegaConf.merge(base_config().trainer.algorithm, OmegaConf.create(overrides))


# ------------------------------------------------------------------------------ the two built-ins
def test_no_op_passes_the_token_rewards_through() -> None:
    rewards = torch.tensor([[0.0, -0.5, 1.25, 9.0], [2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv, returns = ADVANTAGE_ESTIMATORS.get("no_op")(token_level_rewards=rewards, response_mask=mask,
                                                     index=["a", "a"], values=None, gamma=0.9, lambd=0.5)
    # A = R * mask: the 9.0 on padding is dropped, nothing else changes (no baseline, no whitening)
    assert adv.tolist() == [[0.0, -0.5, 1.25, 0.0], [2.0, 0.0, 0.0, 0.0]]
    assert returns.tolist() == adv.tolist() and returns is not adv
    assert adv.dtype == torch.float32 and not adv.requires_grad
    assert ADVANTAGE_ESTIMATORS.get("no_op") is compute_no_op_advantages


def _is_example():
    """log r = log pi - log pi_old, A and the mask of two rows; row 1's last token is padding."""
    log_ratio = torch.tensor([[math.log(2.0), 0.0, math.log(0.5)], [0.0, math.log(3.0), 5.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.1, -4.0]])
    adv = torch.tensor([[1.0, -2.0, 4.0], [0.5, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return (old + log_ratio).requires_grad_(), old, adv, mask


def test_importance_sampling_loss_by_hand() -> None:
    log_probs, old, adv, mask = _is_example()
    # l_t = -r_t A_t: row 0 [-2*1, -1*-2, -0.5*4] = [-2, 2, -2] (sum -2); row 1 [-1*0.5, -3*1] (sum -3.5)
    # seq_mean_token_sum_norm, T = max_seq_len = 10, 2 rows: (-2/10 - 3.5/10) / 2 = -0.275
    with loss_normalizers(None, 2, max_seq_len=10):
        loss, metrics = POLICY_LOSSES.get("importance_sampling")(
            log_probs, old, adv, mask, algorithm(loss_reduction="seq_mean_token_sum_norm"))
    assert loss.item() == pytest.approx(-0.275, abs=1e-6)
    loss.backward()
    # d l_t / d log pi_t = -r_t A_t, / (2 rows * 10): row 0 [-2, 2, -2] / 20; padding gets nothing
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.1, 0.1, -0.1], [-0.025, -0.15, 0.0]]))
    # no clipping; ratios 2, 1, 0.5, 1, 3 -> mean 1.5, max 3; ppo_kl = mean(-log r) = -(ln 3) / 5
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.5, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(3.0, abs=1e-6)
    assert metrics["ppo_kl"] == pytest.approx(-math.log(3.0) / 5, abs=1e-6)
    # token_mean (warned about once): (-2 + 2 - 2 - 0.5 - 3) / 5 = -1.1
    loss, _ = importance_sampling_loss(*_is_example(), algorithm(loss_reduction="token_mean"))
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)


def test_seq_mean_token_sum_norm_divides_by_skyrls_constant() -> None:
    values = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # SkyRL's call reduce_loss(loss, mask, mode, max_seq_len): (4/8 + 2/8) / 2 = 0.375
    assert reduce_loss(values, mask, "seq_mean_token_sum_norm", 8).item() == pytest.approx(0.375)
    with loss_normalizers(None, None, max_seq_len=8):  # the worker's block
        assert reduce_loss(values, mask, "seq_mean_token_sum_norm").item() == pytest.approx(0.375)
    # no constant anywhere: the padded width (2): (4/2 + 2/2) / 2 = 1.5
    assert reduce_loss(values, mask, "seq_mean_token_sum_norm").item() == pytest.approx(1.5)
    # the other reductions do not read it
    assert reduce_loss(values, mask, "token_mean", 8).item() == pytest.approx(2.0)


def test_skyrls_max_seq_len_is_max_input_plus_max_generate_length() -> None:
    cfg = load_config(["+experiment=tiny", "trainer.max_prompt_length=100", "generator.max_input_length=300",
                       "generator.sampling_params.max_generate_length=24"])
    assert skyrl_max_seq_len(cfg) == 324
    section = loss_config(cfg)
    assert section.max_seq_len == 324 and section.loss_reduction == cfg.trainer.algorithm.loss_reduction


def test_the_workers_accumulated_gradient_is_skyrls(tiny_model, tiny_tokenizer) -> None:
    """importance_sampling + seq_mean_token_sum_norm through the worker, in 1, 2 or 4 micro-batches:
    the gradient of SkyRL's loss mean_i sum_t -r_it A_it m_it / max_seq_len over the mini-batch."""
    torch.manual_seed(0)
    rows, prompt, width = 8, 5, 4
    sequences = torch.randint(3, len(tiny_tokenizer), (rows, prompt + width))
    lengths = [4, 2, 4, 3, 1, 4, 4, 2]
    batch = build_training_batch(
        prompt_ids=[s[:prompt].tolist() for s in sequences],
        response_ids=[s[prompt:prompt + n].tolist() for s, n in zip(sequences, lengths)],
        loss_masks=[[1] * n for n in lengths], rewards=[0.0] * rows, uids=[str(i) for i in range(rows)],
        rollout_logprobs=None, pad_id=tiny_tokenizer.pad_token_id)
    batch.advantages = torch.randn(rows, width) * batch.response_mask
    batch.old_logprobs = (torch.randn(rows, width) * 0.2 - 3.0) * batch.response_mask
    section = algorithm(loss_reduction="seq_mean_token_sum_norm")

    # SkyRL's loss, by hand on the whole mini-batch
    model = copy.deepcopy(tiny_model)
    lp, _ = response_logprobs(model, batch.sequences, batch.attention_mask, width, 1.0)
    ratio = torch.exp(lp - batch.old_logprobs)
    expected_loss = (-(ratio * batch.advantages) * batch.loss_mask).sum(-1).div(50).mean()
    expected_loss.backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()])

    for micro in (rows, 4, 2):
        model = copy.deepcopy(tiny_model)
        cfg = PolicyTrainConfig(mini_batch_trajectories=rows, micro_batch_size=micro, micro_forward_batch_size=micro,
                                policy_loss="importance_sampling", loss_reduction="seq_mean_token_sum_norm",
                                algorithm=section, max_seq_len=50, max_grad_norm=1e9)
        opt = build_optimizer(model, lr=0.0, betas=(0.9, 0.999), weight_decay=0.0)
        metrics = PolicyWorker(model, cfg, opt, build_scheduler(opt, LRSchedule("constant", 0, 0))).train(batch)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
        assert metrics["policy/policy_loss"] == pytest.approx(expected_loss.item(), rel=1e-5, abs=1e-8)


# ------------------------------------------------------------------------------ the teacher-KL reward
def test_distillation_reward_is_minus_the_teacher_kl() -> None:
    task = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])   # the environment's reward: dropped
    loss_mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])   # row 1: an observation token, padding
    student = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, 7.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-0.8, -1.0, 0.0]])
    penalty = kl_penalized_rewards(task, student, teacher, loss_mask, beta=1.0, kind="k1", keep_task_reward=False)
    # r_t = -(log pi - log teacher) on the loss tokens: row 0 -[0.5, -1, 0]; row 1 -[-0.2] then 0, 0
    torch.testing.assert_close(penalty.rewards, torch.tensor([[-0.5, 1.0, 0.0], [0.2, 0.0, 0.0]]))
    # SkyRL's loss/avg_kl: mean of row means ((0.5 - 1 + 0) / 3, -0.2 / 1) = (-1/6 - 0.2) / 2
    assert penalty.kl_mean == pytest.approx((-1 / 6 - 0.2) / 2, abs=1e-6)
    assert penalty.kl_max_mean == pytest.approx((1.0 + 0.2) / 2, abs=1e-6)
    # distill/teacher_kl: every loss token alike, (0.5 - 1 + 0 - 0.2) / 4
    assert penalty.kl_token_mean == pytest.approx(-0.7 / 4, abs=1e-6)
    # the same path with the task reward kept and beta 0.5 is the ordinary KL penalty
    kept = kl_penalized_rewards(task, student, teacher, loss_mask, beta=0.5, kind="k1")
    torch.testing.assert_close(kept.rewards, torch.tensor([[-0.25, 0.5, 1.0], [0.1, 0.5, 0.0]]))


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize("script", DISTILL_SCRIPTS)
def test_skyrls_distillation_scripts_pass_unchanged_after_the_preset(script) -> None:
    cfg = load_config([PRESET, *COMMANDS[script]])
    alg = cfg.trainer.algorithm
    assert (alg.on_policy_distillation, alg.use_kl_in_reward, alg.use_kl_loss) == (True, True, False)
    assert (alg.advantage_estimator, alg.policy_loss_type, alg.loss_reduction, alg.kl_estimator_type) == (
        "no_op", "importance_sampling", "seq_mean_token_sum_norm", "k1")
    assert alg.kl_loss_coef == 1.0 and cfg.trainer.ref.model.path.endswith("global_step_90/")
    assert skyrl_max_seq_len(cfg) == 2048 + 8192


REFUSALS = {
    "use_kl_in_reward": (["trainer.algorithm.use_kl_in_reward=false"],
                         "trainer.algorithm.on_policy_distillation=true makes the KL to the teacher the reward"),
    "k3": (["trainer.algorithm.kl_estimator_type=k3"], "trainer.algorithm.on_policy_distillation=true rewards "
                                                       "each token with -(log pi_old - log pi_teacher)"),
    "adaptive": (["trainer.algorithm.kl_ctrl.type=adaptive"],
                 "trainer.algorithm.on_policy_distillation=true with trainer.algorithm.kl_ctrl.type=adaptive"),
    "coef": (["trainer.algorithm.kl_loss_coef=0"],
             "trainer.algorithm.on_policy_distillation=true with trainer.algorithm.kl_loss_coef=0"),
    "no teacher": (["trainer.ref.model.path=tiny://llama"],
                   "trainer.algorithm.on_policy_distillation=true rewards the policy for agreeing with the teacher"),
    "ref refresh": (["trainer.update_ref_every_epoch=true"],
                    "trainer.algorithm.on_policy_distillation=true with trainer.update_ref_every_epoch=true"),
    "critic": (["trainer.critic.model.path=tiny://llama", "trainer.critic_mini_batch_size=16"],
               "trainer.critic.model.path=tiny://llama builds and trains a critic, but "
               "trainer.algorithm.advantage_estimator=no_op never reads its values"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_senseless_distillation_settings_are_refused_in_one_sentence(case) -> None:
    extra, start = REFUSALS[case]
    with pytest.raises(ConfigError) as info:
        load_config(["+experiment=[tiny,on_policy_distillation]", "trainer.ref.model.path=tiny://llama-small",
                     *extra])
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith(start) and "Fix:" in info.value.problems[0], info.value.problems[0]


# ------------------------------------------------------------------------------ the real loop
@torch.no_grad()
def _reverse_kl(student, teacher, prompts: list[list[int]]) -> float:
    """Exact KL(student || teacher) of the first response token's distribution, over the whole
    vocabulary, averaged over `prompts`."""
    total = 0.0
    for ids in prompts:
        s = student(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        t = teacher(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        total += float((s.exp() * (s - t)).sum())
    return total / len(prompts)


def test_tiny_student_distills_from_a_tiny_teacher(tmp_path) -> None:
    from ridgeline.data import encode_chat_prompt
    from ridgeline.trainer.trainer import Trainer

    cfg = load_config(["+experiment=[tiny,on_policy_distillation]", "trainer.ref.model.path=tiny://llama-small",
                       f"trainer.export_path={tmp_path}", "trainer.eval_before_train=false", "trainer.logger=jsonl",
                       "data.prepare.num_train=96", "trainer.policy.optimizer_config.lr=1e-3"])
    trainer = Trainer.from_config(cfg)
    student, teacher = trainer.workers.policy.model, trainer.workers.ref.model
    assert type(teacher).__name__ == "LlamaForCausalLM" and teacher.config.num_hidden_layers == 4  # llama-small
    prompts = [encode_chat_prompt(trainer.tokenizer, row.prompt) for row in trainer.val_data]
    before = _reverse_kl(student, teacher, prompts)
    trainer.train()
    after = _reverse_kl(student, teacher, prompts)
    steps = [r for r in trainer.history if "distill/teacher_kl" in r]
    assert len(steps) == 6
    # the student moved towards the teacher: measured exactly on held-out prompts (0.035 -> 0.005 here)
    assert before > 0.01 and after < 0.5 * before, (before, after)
    kl = [r["distill/teacher_kl"] for r in steps]
    assert sum(kl[-2:]) < sum(kl[:2]), kl
    for r in steps:
        # SkyRL's KL-penalty metrics, beta fixed at kl_loss_coef = 1
        assert r["loss/kl_loss_coef"] == 1.0 and math.isfinite(r["loss/avg_kl"]) and r["loss/avg_kl_max"] >= 0
        # no_op: the advantages are the rewards, -KL per token; the environment's reward is gone
        assert r["loss/avg_raw_advantages"] == pytest.approx(-r["distill/teacher_kl"], abs=1e-6)
        assert r["policy/ppo_clip_ratio"] == 0.0
