"""Hand-computed checks of the policy losses in ridgeline.algorithms.policy_loss.

Every example sets the ratios r = exp(log_probs - old_log_probs) directly (old = 0 unless noted),
and the arithmetic sits next to each expected value. Gradients are taken w.r.t. log_probs.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from ridgeline.algorithms import (
    POLICY_LOSSES,
    cispo_loss,
    clip_cov_loss,
    dual_clip_loss,
    gspo_loss,
    kl_cov_loss,
    loss_normalizers,
    ppo_clip_loss,
    sapo_loss,
)
from ridgeline.algorithms import policy_loss
from ridgeline.config import base_config

ALL_LOSSES = ["regular", "dual_clip", "gspo", "cispo", "clip_cov", "kl_cov", "sapo"]
COMMON_KEYS = {"clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "ppo_kl"}


def cfg(**overrides) -> DictConfig:
    """The real trainer.algorithm section with `overrides` merged in (nested dicts merge per key)."""
    return OmegaConf.merge(base_config().trainer.algorithm, OmegaConf.create(overrides))


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0.0, atol=atol)


def run(name: str, log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
        config: DictConfig, rollout: torch.Tensor | None = None):
    """(loss, metrics, d loss / d log_probs)."""
    log_probs = log_probs.clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(name)(log_probs, old, adv, mask, config, rollout)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, metrics, grad


def log(values) -> torch.Tensor:
    return torch.tensor(values).log()


@pytest.fixture(autouse=True)
def _fresh_warnings():
    policy_loss._warn_reduction_once.cache_clear()
    yield


# ----------------------------------------------------------------------------- registry


def test_registry_holds_every_loss() -> None:
    assert set(ALL_LOSSES) <= set(POLICY_LOSSES.names())
    functions = [ppo_clip_loss, dual_clip_loss, gspo_loss, cispo_loss, clip_cov_loss, kl_cov_loss, sapo_loss]
    for name, fn in zip(ALL_LOSSES, functions):
        assert POLICY_LOSSES.get(name) is fn


# ----------------------------------------------------------------------------- regular PPO

# 2 x 3, the last token of row 1 is padding (its r = 3 and A = 0.5 must count nowhere)
PPO_RATIOS = [[1.2, 1.5, 0.5], [0.7, 1.5, 3.0]]
PPO_ADV = torch.tensor([[2.0, 1.0, 1.0], [-1.0, -1.0, 0.5]])
PPO_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _ppo_example(name: str = "regular", **overrides):
    config = cfg(eps_clip_low=0.2, eps_clip_high=0.28, **overrides)  # range [0.8, 1.28]
    return run(name, log(PPO_RATIOS), torch.zeros(2, 3), PPO_ADV, PPO_MASK, config)


def test_regular_values_gradients_and_metrics() -> None:
    loss, metrics, grad = _ppo_example()
    # (0,0) A=2,  r=1.2 inside:            -2 * 1.2 = -2.4;              grad -A r = -2.4
    # (0,1) A=1,  r=1.5 > 1.28:            max(-1.5, -1.28) = -1.28;     clipped high, grad 0
    # (0,2) A=1,  r=0.5:                   max(-0.5, -0.8) = -0.5;       not clipped, grad -0.5
    # (1,0) A=-1, r=0.7 < 0.8:             max(0.7, 0.8) = 0.8;          clipped low, grad 0
    # (1,1) A=-1, r=1.5:                   max(1.5, 1.28) = 1.5;         grad -A r = 1.5
    # token_mean: (-2.4 - 1.28 - 0.5 + 0.8 + 1.5) / 5 = -1.88 / 5 = -0.376
    assert loss.item() == pytest.approx(-0.376)
    close(grad, [[-2.4 / 5, 0.0, -0.5 / 5], [0.0, 1.5 / 5, 0.0]])
    assert metrics["clip_frac"] == pytest.approx(0.4)  # 2 of 5
    assert metrics["clip_frac_low"] == pytest.approx(0.2)  # (1,0)
    assert metrics["clip_frac_high"] == pytest.approx(0.2)  # (0,1)
    assert metrics["ratio_mean"] == pytest.approx(1.08)  # (1.2 + 1.5 + 0.5 + 0.7 + 1.5) / 5 = 5.4 / 5
    assert metrics["ratio_max"] == pytest.approx(1.5)  # not the padding's 3.0
    # ppo_kl = -mean(ln r) = -ln(1.2 * 1.5 * 0.5 * 0.7 * 1.5) / 5 = -ln(0.945) / 5 = 0.0113141
    assert metrics["ppo_kl"] == pytest.approx(-math.log(0.945) / 5, abs=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())
    assert COMMON_KEYS == set(metrics)


def test_regular_symmetric_range_and_ties() -> None:
    ratios = [[1.2, 0.8, 1.1]]
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, metrics, grad = run("regular", log(ratios), torch.zeros(1, 3), adv, torch.ones(1, 3),
                              cfg(loss_reduction="token_mean"))
    # eps 0.2 both sides. r = 1.2 with A > 0 and r = 0.8 with A < 0 sit exactly on the bound: a tie,
    # both branches equal in value and gradient, so not clipped.  -1.2 + 0.8 + 1.1 = 0.7 -> / 3
    assert loss.item() == pytest.approx(0.7 / 3)
    close(grad, [[-1.2 / 3, 0.8 / 3, 1.1 / 3]])
    assert metrics["clip_frac"] == 0.0


def test_reduction_mode_is_honoured() -> None:
    # per token as in test_regular_values_gradients_and_metrics: [[-2.4, -1.28, -0.5], [0.8, 1.5, pad]]
    token, _, _ = _ppo_example(loss_reduction="token_mean")
    assert token.item() == pytest.approx(-0.376)  # -1.88 / 5
    # row means: -4.18 / 3 = -1.3933333 and 2.3 / 2 = 1.15 -> (-1.3933333 + 1.15) / 2 = -0.1216667
    seq, _, _ = _ppo_example(loss_reduction="sequence_mean")
    assert seq.item() == pytest.approx((-4.18 / 3 + 1.15) / 2)
    # row sums over the padded width 3: (-4.18 / 3 + 2.3 / 3) / 2 = -0.3133333
    norm, _, _ = _ppo_example(loss_reduction="seq_mean_token_sum_norm")
    assert norm.item() == pytest.approx((-4.18 + 2.3) / 3 / 2)


def test_loss_normalizers_context_is_used() -> None:
    # The worker's mini-batch counts replace this micro-batch's own 5 tokens / 2 sequences.
    with loss_normalizers(num_tokens=10, num_sequences=4):
        token, _, grad = _ppo_example(loss_reduction="token_mean")
        seq, _, _ = _ppo_example(loss_reduction="sequence_mean")
    assert token.item() == pytest.approx(-0.188)  # -1.88 / 10
    close(grad, [[-2.4 / 10, 0.0, -0.5 / 10], [0.0, 1.5 / 10, 0.0]])
    assert seq.item() == pytest.approx((-4.18 / 3 + 1.15) / 4)  # row means summed / 4 = -0.0608333
    # outside the block the local counts are back
    assert _ppo_example(loss_reduction="token_mean")[0].item() == pytest.approx(-0.376)


@pytest.mark.parametrize("name", ["regular", "dual_clip", "gspo", "cispo", "sapo"])
def test_micro_batches_under_loss_normalizers_sum_to_the_batch(name: str) -> None:
    # clip_cov / kl_cov are left out: their token selection depends on the micro-batch's statistics.
    torch.manual_seed(0)
    log_probs = -torch.rand(4, 5) * 2
    old = log_probs + (torch.rand(4, 5) - 0.5) * 0.6
    adv = torch.randn(4, 5)
    mask = torch.tensor([[1.0] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    for reduction in ("token_mean", "sequence_mean"):
        config = cfg(loss_reduction=reduction)
        full, _ = POLICY_LOSSES.get(name)(log_probs, old, adv, mask, config)
        with loss_normalizers(num_tokens=float(mask.sum()), num_sequences=4):
            parts = [POLICY_LOSSES.get(name)(log_probs[s], old[s], adv[s], mask[s], config)[0]
                     for s in (slice(0, 2), slice(2, 4))]
        assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


# ----------------------------------------------------------------------------- dual clip


def test_dual_clip() -> None:
    ratios = [[5.0, 2.0, 5.0, 0.5]]
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    loss, metrics, grad = run("dual_clip", log(ratios), torch.zeros(1, 4), adv, torch.ones(1, 4),
                              cfg(clip_ratio_c=3.0))
    # A=-1, r=5: regular max(5, 1.2) = 5, bounded by -A c = 3 -> 3 (no gradient)
    # A=-1, r=2: regular 2 < 3 -> 2, grad -A r = 2
    # A=+1, r=5: no bound for A > 0: max(-5, -1.2) = -1.2 (clipped high)
    # A=-2, r=0.5: regular max(1.0, 1.6) = 1.6 (clipped low) < 6 -> 1.6
    # token_mean: (3 + 2 - 1.2 + 1.6) / 4 = 5.4 / 4 = 1.35
    assert loss.item() == pytest.approx(1.35)
    close(grad, [[0.0, 2.0 / 4, 0.0, 0.0]])
    assert metrics["dual_clip_frac"] == pytest.approx(0.25)  # token 0
    assert metrics["clip_frac"] == pytest.approx(0.5)  # tokens 2 and 3, the regular clip
    assert (metrics["clip_frac_low"], metrics["clip_frac_high"]) == pytest.approx((0.25, 0.25))
    assert metrics["ratio_max"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run("dual_clip", log([[1.0]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), cfg(clip_ratio_c=1.0))


# ----------------------------------------------------------------------------- GSPO


def test_gspo_values_gradients_and_metrics() -> None:
    # row 0 log-ratios 0.1, 0.2, 0.0 -> mean 0.1 -> s_0 = exp(0.1) = 1.1051709
    # row 1 log-ratios 0.6, 0.0, (padding 1e4) -> mean over the 2 real tokens 0.3 -> s_1 = exp(0.3) = 1.3498588
    log_probs = torch.tensor([[0.1, 0.2, 0.0], [0.6, 0.0, 1e4]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    loss, metrics, grad = run("gspo", log_probs, torch.zeros(2, 3), adv, PPO_MASK, cfg(loss_reduction="sequence_mean"))
    # row 0: s inside [0.8, 1.2]: l = -1.1051709 on every token
    # row 1: s = 1.3498588 > 1.2 with A > 0: the whole sequence is clipped, l = -1.2, no gradient
    # sequence_mean: (-1.1051709 + -1.2) / 2 = -1.1525855
    assert loss.item() == pytest.approx((-math.exp(0.1) - 1.2) / 2)
    # token gradient of -A s_it is -A s_0 = -1.1051709, times the sequence_mean weight 1 / (2 rows * 3 tokens)
    close(grad, [[-math.exp(0.1) / 6] * 3, [0.0, 0.0, 0.0]])
    assert metrics["clip_frac"] == pytest.approx(0.4)  # the 2 tokens of row 1, of 5
    assert metrics["clip_frac_high"] == pytest.approx(0.4)
    # ratio_mean over tokens of the sequence ratio: (3 * 1.1051709 + 2 * 1.3498588) / 5 = 1.2030461
    assert metrics["ratio_mean"] == pytest.approx((3 * math.exp(0.1) + 2 * math.exp(0.3)) / 5)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.3))
    assert metrics["ppo_kl"] == pytest.approx(-0.18)  # -(0.1 + 0.2 + 0 + 0.6 + 0) / 5, per token


def test_gspo_on_policy_gradient_is_the_sequence_policy_gradient() -> None:
    # On-policy s_i = 1, so the loss is -(1/B) sum_i A_i (1/|y_i|) sum_t log pi(y_it) in gradient:
    # d/d log pi(y_it) = -A_i / (B |y_i|).  Row 0: A=2, |y|=3 -> -2/6;  row 1: A=-1, |y|=2 -> 1/4.
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -9.0]])
    adv = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    loss, metrics, grad = run("gspo", log_probs, log_probs, adv, PPO_MASK, cfg(loss_reduction="sequence_mean"))
    close(grad, [[-2 / 6] * 3, [0.25, 0.25, 0.0]])
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)  # -A_i s_i per row, averaged: (-2 + 1) / 2
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)


def test_gspo_and_sapo_warn_once_off_sequence_mean(caplog: pytest.LogCaptureFixture) -> None:
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with caplog.at_level(logging.WARNING, logger=policy_loss.__name__):
        gspo_loss(*args, cfg(loss_reduction="sequence_mean"))
        assert not caplog.records
        for _ in range(3):
            gspo_loss(*args, cfg(loss_reduction="token_mean"))
            sapo_loss(*args, cfg(loss_reduction="token_mean"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # once per loss
    assert "'gspo'" in messages[0] and "sequence_mean" in messages[0] and "token_mean" in messages[0]
    assert "'sapo'" in messages[1]


# ----------------------------------------------------------------------------- CISPO


def test_cispo_keeps_gradient_on_clipped_tokens() -> None:
    # weight range [1 - 0.2, 1 + 0.5] = [0.8, 1.5]
    log_probs = torch.tensor([[-1.0, -0.5, -2.0, -1.0]])
    ratios = torch.tensor([[2.0, 1.2, 0.5, 1.0]])
    old = log_probs - ratios.log()
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    config = cfg(eps_clip_low=0.2, eps_clip_high=0.5, cispo={"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.5})
    loss, metrics, grad = run("cispo", log_probs, old, adv, mask, config)
    # l = -w A log pi;  d l / d log pi = -w A
    # t0: r=2   -> w=1.5 (upper bound), A=1:  -1.5 * 1 * -1    = 1.5;   grad -1.5
    # t1: r=1.2 -> w=1.2,               A=-1: -1.2 * -1 * -0.5 = -0.6;  grad 1.2
    # t2: r=0.5 -> w=0.8 (lower bound), A=-1: -0.8 * -1 * -2   = -1.6;  grad 0.8
    # t3: r=1   -> w=1,                 A=2:  -1 * 2 * -1      = 2;     grad -2
    # token_mean: (1.5 - 0.6 - 1.6 + 2) / 4 = 1.3 / 4 = 0.325
    assert loss.item() == pytest.approx(0.325)
    close(grad, [[-1.5 / 4, 1.2 / 4, 0.8 / 4, -2.0 / 4]])
    clip = (metrics["clip_frac"], metrics["clip_frac_low"], metrics["clip_frac_high"])
    assert clip == pytest.approx((0.5, 0.25, 0.25))
    assert metrics["ratio_mean"] == pytest.approx(1.175)  # (2 + 1.2 + 0.5 + 1) / 4
    assert metrics["ratio_max"] == pytest.approx(2.0)
    assert metrics["ppo_kl"] == pytest.approx(-math.log(1.2) / 4)  # -(ln 2 + ln 1.2 + ln 0.5 + 0) / 4
    # PPO with the same range clips t0 (A>0, r > 1.5) and t2 (A<0, r < 0.8): no gradient there
    _, _, ppo_grad = run("regular", log_probs, old, adv, mask, config)
    close(ppo_grad, [[0.0, 1.2 / 4, 0.0, -2.0 / 4]])


def test_cispo_defaults_bound_the_weight_to_1_6() -> None:
    # defaults: low 0, high 5 -> w in [1, 6].  r = 0.5 -> w = 1;  r = 8 -> w = 6.  A=1, log pi = -1, -2.
    log_probs = torch.tensor([[-1.0, -2.0]])
    old = log_probs - log([[0.5, 8.0]])
    loss, metrics, grad = run("cispo", log_probs, old, torch.ones(1, 2), torch.ones(1, 2), cfg())
    # (-1 * 1 * -1 + -6 * 1 * -2) / 2 = (1 + 12) / 2 = 6.5
    assert loss.item() == pytest.approx(6.5)
    close(grad, [[-0.5, -3.0]])
    assert metrics["clip_frac"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- Clip-Cov / KL-Cov

# 5 real tokens + 1 padding. log pi = -3 + d with d = [2, -1, 1, -2, 0] (mean -3 over the real
# tokens); A = [3, -2, 2, 0, -3] (mean 0). cov = A d = [6, 2, 2, 0, 0]. The padding (log pi -inf,
# A 50) must stay out of both means (a -inf there would make every cov NaN).
COV_LOG_PROBS = torch.tensor([[-1.0, -4.0, -2.0], [-5.0, -3.0, -math.inf]])
COV_ADV = torch.tensor([[3.0, -2.0, 2.0], [0.0, -3.0, 50.0]])


def test_clip_cov_zeroes_the_chosen_token() -> None:
    # token (0,1) gets r = 0.5 with A = -2: PPO-clipped (low), so not a candidate despite cov 2
    old = COV_LOG_PROBS.clone()
    old[0, 1] -= math.log(0.5)
    config = cfg(clip_cov={"clip_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0})
    torch.manual_seed(0)
    loss, metrics, grad = run("clip_cov", COV_LOG_PROBS, old, COV_ADV, PPO_MASK, config)
    # candidates: cov in (1, 5) and not PPO-clipped -> only token (0,2) (cov 6 is above ub, 0 below lb)
    # k = min(max(int(0.0002 * 5), 1), 1) = 1 -> (0,2) is zeroed
    # per token: -3, max(1.0, 1.6) = 1.6, 0 (zeroed, was -2), 0 (A=0), 3 -> (-3 + 1.6 + 3) / 5 = 0.32
    assert loss.item() == pytest.approx(0.32)
    # grads -A r / 5: (0,0) -3/5;  (0,1) clipped;  (0,2) zeroed (regular PPO would give -2/5);  (1,1) 3/5
    close(grad, [[-0.6, 0.0, 0.0], [0.0, 0.6, 0.0]])
    assert metrics["clip_cov_frac"] == pytest.approx(0.2)  # 1 of 5
    assert metrics["clip_frac"] == pytest.approx(0.2) and metrics["clip_frac_low"] == pytest.approx(0.2)
    _, _, ppo_grad = run("regular", COV_LOG_PROBS, old, COV_ADV, PPO_MASK, config)
    close(ppo_grad, [[-0.6, 0.0, -0.4], [0.0, 0.6, 0.0]])


def test_clip_cov_chooses_k_candidates_at_random() -> None:
    # d = [1, -1, 1, -1, 0, 0], A = [2, -2, 2, -2, 1, -1]: cov = [2, 2, 2, 2, 0, 0] -> 4 candidates;
    # clip_ratio 0.34 -> k = int(0.34 * 6) = 2 of them lose their gradient.
    log_probs = torch.tensor([[-1.0, -3.0, -1.0, -3.0, -2.0, -2.0]])
    adv = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, -1.0]])
    config = cfg(clip_cov={"clip_ratio": 0.34, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0})
    chosen_sets = set()
    for seed in range(12):
        torch.manual_seed(seed)
        _, metrics, grad = run("clip_cov", log_probs, log_probs, adv, torch.ones(1, 6), config)
        zeroed = tuple((grad[0] == 0).nonzero().flatten().tolist())
        assert len(zeroed) == 2 and set(zeroed) <= {0, 1, 2, 3}
        assert metrics["clip_cov_frac"] == pytest.approx(2 / 6)
        chosen_sets.add(zeroed)
    assert len(chosen_sets) > 1  # random, not always the same pair
    torch.manual_seed(3)
    first = run("clip_cov", log_probs, log_probs, adv, torch.ones(1, 6), config)[2]
    torch.manual_seed(3)
    close(run("clip_cov", log_probs, log_probs, adv, torch.ones(1, 6), config)[2], first.tolist())  # seeded


def test_kl_cov_penalises_the_top_covariance_token() -> None:
    # log-ratios: (0,0) 0.1, (0,1) -0.2, others 0; cov as above -> top-1 is (0,0) (cov 6)
    old = COV_LOG_PROBS.clone()
    old[0, 0] -= 0.1
    old[0, 1] += 0.2
    config = cfg(kl_cov={"kl_cov_frac": 0.2, "ppo_kl_coef": 0.5})  # k = max(1, int(0.2 * 5)) = 1
    loss, metrics, grad = run("kl_cov", COV_LOG_PROBS, old, COV_ADV, PPO_MASK, config)
    # (0,0): -3 e^0.1 + 0.5 |0.1| = -3.3155128 + 0.05 = -3.2655128;  grad -3 e^0.1 + 0.5 sign(0.1) = -2.8155128
    # (0,1): A=-2, r = e^-0.2 = 0.8187308 -> 1.6374615 (no clip at all);  grad 1.6374615
    # (0,2): -2;  (1,0): 0 (A=0);  (1,1): 3
    # token_mean: (-3.2655128 + 1.6374615 - 2 + 0 + 3) / 5 = -0.1256102
    assert loss.item() == pytest.approx((-3 * math.exp(0.1) + 0.05 + 2 * math.exp(-0.2) + 1) / 5)
    close(grad, [[(-3 * math.exp(0.1) + 0.5) / 5, 2 * math.exp(-0.2) / 5, -0.4], [0.0, 0.6, 0.0]])
    assert metrics["kl_cov_frac"] == pytest.approx(0.2)
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.1))
    assert metrics["ppo_kl"] == pytest.approx(0.02)  # -(0.1 - 0.2) / 5


def test_kl_cov_penalty_pulls_back_both_ways() -> None:
    # one token, log-ratio -0.3, A = 0: cov 0 but it is the only token so k = 1 picks it.
    # l = 0.5 |-0.3| = 0.15, grad 0.5 * sign(-0.3) = -0.5 (raising log pi moves back towards pi_old)
    loss, metrics, grad = run("kl_cov", torch.tensor([[-1.3]]), torch.tensor([[-1.0]]), torch.zeros(1, 1),
                              torch.ones(1, 1), cfg(kl_cov={"kl_cov_frac": 0.2, "ppo_kl_coef": 0.5}))
    assert loss.item() == pytest.approx(0.15)
    close(grad, [[-0.5]])
    assert metrics["kl_cov_frac"] == 1.0


# ----------------------------------------------------------------------------- SAPO


def test_sapo_on_policy_gradient_is_the_policy_gradient() -> None:
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, 7.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, -1.0, 9.0]])
    loss, metrics, grad = run("sapo", log_probs, log_probs, adv, PPO_MASK, cfg(loss_reduction="sequence_mean"))
    # r = 1: f(1) = sigmoid(0) * 4 / tau = 2 / tau;  tau = 1 for A > 0, 1.05 for A < 0 (defaults)
    # row 0: -2*1, -(2/1.05)(-2) = 3.8095238, -2*0.5 = -1 -> mean (-3 + 3.8095238) / 3 = 0.2698413
    # row 1: -2*3 = -6, 2/1.05 = 1.9047619 -> mean -2.0476190;  loss (0.2698413 - 2.0476190) / 2 = -0.8888889
    assert loss.item() == pytest.approx(((-3 + 4 / 1.05) / 3 + (-6 + 2 / 1.05) / 2) / 2)
    # f'(1) = 1 whatever tau, so d l / d log pi = -A, times the weight 1 / (B |y_i|)
    close(grad, [[-1 / 6, 2 / 6, -0.5 / 6], [-3 / 4, 1 / 4, 0.0]])
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_max"] == pytest.approx(1.0)


def test_sapo_gate_off_policy() -> None:
    # r = 1.5 for both tokens; d l / d log pi = -A f'(r) r with f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1))
    # A = 1,  tau 1:    s = sigmoid(0.5)   = 0.6224593 -> l = -4 s = -2.4898373;  grad -4 s(1-s) 1.5 = -1.4100223
    # A = -1, tau 1.05: s = sigmoid(0.525) = 0.6283162 -> l = 4 s / 1.05 = 2.3935855; grad 4 s(1-s) 1.5 = 1.4012097
    loss, metrics, grad = run("sapo", log([[1.5, 1.5]]), torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]),
                              torch.ones(1, 2), cfg(loss_reduction="sequence_mean"))
    assert loss.item() == pytest.approx((-2.4898373 + 2.3935855) / 2, abs=1e-6)
    close(grad, [[-1.4100223 / 2, 1.4012097 / 2]])
    assert metrics["ratio_mean"] == pytest.approx(1.5)


# ----------------------------------------------------------------------------- shared behaviour


def test_tis_weights_the_per_token_loss() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    rollout = torch.tensor([[-1.0, -1.0, -2.5, 100.0]])  # padding holds garbage
    adv = torch.ones(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    config = cfg(use_tis=True, tis_imp_ratio_cap=2.0)
    # on-policy r = 1, so l = -A = -1 per token, times
    # w = min(exp(old - rollout), 2) = [exp(0) = 1, exp(-1) = 0.3678794, exp(2) = 7.389 -> 2]
    loss, metrics, grad = run("regular", old, old, adv, mask, config, rollout)
    assert loss.item() == pytest.approx(-(1 + math.exp(-1) + 2) / 3)  # -1.1226265
    close(grad, [[-1 / 3, -math.exp(-1) / 3, -2 / 3, 0.0]])
    # SkyRL 0.4's metrics: the mean of rho = exp(old - rollout) before the cap, the share of capped tokens
    assert metrics["loss_metrics/is_ratio_mean"] == pytest.approx((1 + math.exp(-1) + math.exp(2)) / 3)
    assert metrics["loss_metrics/tis_token_clip_high_ratio"] == pytest.approx(1 / 3)
    # off without the flag or without rollout log-probs: plain -1, no metric
    for c, r in ((cfg(use_tis=False, tis_imp_ratio_cap=2.0), rollout), (config, None)):
        loss, metrics, _ = run("regular", old, old, adv, mask, c, r)
        assert loss.item() == pytest.approx(-1.0) and not any(k.startswith("loss_metrics/") for k in metrics)
    with pytest.raises(ValueError, match="tis_imp_ratio_cap"):
        run("regular", old, old, adv, mask, cfg(use_tis=True, tis_imp_ratio_cap=-1.0), rollout)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_applies_tis(name: str) -> None:
    # rollout = old - ln 1.5 gives the same weight w = 1.5 (< cap 2) on every token, and every loss
    # is linear in its per-token values, so the loss and its gradient scale by exactly 1.5.
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -1.0]])
    old = torch.tensor([[-1.1, -1.8, -0.5], [-0.2, -1.4, -1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    config = cfg(use_tis=True, tis_imp_ratio_cap=2.0)
    torch.manual_seed(0)
    plain, _, plain_grad = run(name, log_probs, old, adv, PPO_MASK, config)
    torch.manual_seed(0)
    weighted, metrics, weighted_grad = run(name, log_probs, old, adv, PPO_MASK, config, old - math.log(1.5))
    assert weighted.item() == pytest.approx(1.5 * plain.item(), abs=1e-6)
    close(weighted_grad, (1.5 * plain_grad).tolist())
    assert metrics["loss_metrics/is_ratio_mean"] == pytest.approx(1.5)


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("garbage", [1e4, -1e4, -math.inf, math.nan])
def test_garbage_on_padding_stays_out(name: str, garbage: float) -> None:
    # garbage in every input at the padding position, TIS on
    log_probs = torch.tensor([[-1.0, -0.5, garbage]])
    old = torch.tensor([[-1.2, -0.5, -garbage]])
    adv = torch.tensor([[1.0, -1.0, garbage]])
    rollout = torch.tensor([[-1.3, -0.4, garbage]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    config = cfg(use_tis=True, tis_imp_ratio_cap=2.0)
    torch.manual_seed(0)
    loss, metrics, grad = run(name, log_probs, old, adv, mask, config, rollout)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    assert grad[0, 2] == 0.0
    # the same two real tokens without the padding column give the same loss and metrics
    torch.manual_seed(0)
    ref_loss, ref_metrics, _ = run(name, log_probs[:, :2], old[:, :2], adv[:, :2], mask[:, :2], config,
                                   rollout[:, :2])
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    assert metrics == pytest.approx(ref_metrics, abs=1e-6)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_reports_the_common_metrics_and_survives_an_empty_mask(name: str) -> None:
    log_probs = torch.tensor([[-1.0, -0.5]])
    loss, metrics, grad = run(name, log_probs, log_probs + 0.3, torch.ones(1, 2), torch.zeros(1, 2), cfg())
    assert COMMON_KEYS <= set(metrics)
    assert loss.item() == 0.0 and metrics["ratio_max"] == 0.0 and metrics["clip_frac"] == 0.0
    assert (grad == 0).all()
    # the loss-specific keys
    extra = {"dual_clip": {"dual_clip_frac"}, "clip_cov": {"clip_cov_frac"}, "kl_cov": {"kl_cov_frac"},
             "cispo": {f"loss_metrics/cispo/ratio_{k}" for k in ("mean", "clamped_mean", "max", "min")}}
    assert set(metrics) - COMMON_KEYS == extra.get(name, set())


def test_minimal_config_is_enough() -> None:
    # only the keys a loss reads: without rollout log-probs the correction keys are not read
    config = OmegaConf.create({"eps_clip_low": 0.2, "eps_clip_high": 0.2, "loss_reduction": "token_mean"})
    loss, _ = ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), config)
    assert loss.item() == pytest.approx(-1.0)


def test_bf16_inputs_compute_in_float32() -> None:
    # 1.1 is not representable in bf16 differences; the loss upcasts before taking the ratio
    log_probs = torch.tensor([[0.0, -1.0]], dtype=torch.bfloat16)
    for name in ALL_LOSSES:
        torch.manual_seed(0)
        loss, metrics = POLICY_LOSSES.get(name)(log_probs, log_probs, torch.ones(1, 2), torch.ones(1, 2), cfg())
        assert loss.dtype == torch.float32 and metrics["ratio_mean"] == 1.0
