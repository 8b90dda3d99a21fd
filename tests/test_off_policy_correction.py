"""SkyRL 0.4's off-policy correction and its new losses, estimator and reductions, by hand.

rho_t = exp(log pi_old - log pi_rollout) is set directly through the log-ratios; the arithmetic
sits next to every expected number. `tests/test_skyrl04_parity.py` (marker skyrl04, `make
test-skyrl04`) compares the same functions with the `skyrl` 0.4 wheel's own on random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from ridgeline.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_REDUCTIONS,
    POLICY_LOSSES,
    loss_normalizers,
    reduce_loss,
)
from ridgeline.algorithms.off_policy import corrects_off_policy, off_policy_correction
from ridgeline.config import ConfigError, base_config, load_config

LN2 = math.log(2.0)


def cfg(**overrides) -> DictConfig:
    """The real trainer.algorithm section with `overrides` merged in."""
    return OmegaConf.merge(base_config().trainer.algorithm, OmegaConf.create(overrides))


def opc(**keys) -> DictConfig:
    return cfg(off_policy_correction=keys)


def correct(log_rho: list[list[float]], config: DictConfig, mask: torch.Tensor | None = None):
    """(factor, metrics) for old = log_rho, rollout = 0."""
    old = torch.tensor(log_rho)
    mask = torch.ones_like(old) if mask is None else mask
    return off_policy_correction(old, torch.zeros_like(old), mask, config)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0.0, atol=atol)


# ----------------------------------------------------------------------------- the correction


def test_nothing_on_is_no_factor_and_no_metrics() -> None:
    assert correct([[0.3, -0.2]], cfg()) == (None, {})


def test_token_tis_and_the_ratio_statistics() -> None:
    # rho = [exp 0, exp -1, exp 2] = [1, 0.3678794, 7.3890561]; cap 2
    factor, metrics = correct([[0.0, -1.0, 2.0, 55.0]], opc(tis_ratio_type="token", token_tis_ratio_clip_high=2.0),
                              torch.tensor([[1.0, 1.0, 1.0, 0.0]]))  # the 4th is padding (garbage rho)
    close(factor, [[1.0, math.exp(-1), 2.0, 0.0]])
    assert metrics["loss_metrics/tis_token_clip_high_ratio"] == pytest.approx(1 / 3)   # one token of 3 capped
    assert metrics["loss_metrics/is_ratio_mean"] == pytest.approx(2.9189785)   # (1 + 0.3678794 + 7.3890561) / 3
    assert metrics["loss_metrics/is_ratio_std"] == pytest.approx(3.8840815)    # unbiased std of the three
    assert metrics["loss_metrics/is_ratio_max"] == pytest.approx(math.exp(2))
    assert metrics["loss_metrics/is_ratio_min"] == pytest.approx(math.exp(-1))


def test_use_tis_is_token_tis_with_its_cap() -> None:
    log_rho = [[0.0, -1.0, 2.0]]
    old_keys = correct(log_rho, cfg(use_tis=True, tis_imp_ratio_cap=2.0))
    new_keys = correct(log_rho, opc(tis_ratio_type="token", token_tis_ratio_clip_high=2.0))
    assert torch.equal(old_keys[0], new_keys[0]) and old_keys[1] == new_keys[1]
    with pytest.raises(ValueError, match="tis_imp_ratio_cap must be > 0"):
        correct(log_rho, cfg(use_tis=True, tis_imp_ratio_cap=-1.0))


def test_sequence_tis() -> None:
    # row 0: exp(0.1 + 0.2) = 1.3498588 (< cap 5); row 1: exp(1 + 1) = 7.389 -> 5
    factor, metrics = correct([[0.1, 0.2], [1.0, 1.0]], opc(tis_ratio_type="sequence"))
    close(factor, [[1.3498588, 1.3498588], [5.0, 5.0]])
    assert metrics["loss_metrics/tis_seq_clip_high_ratio"] == 0.5


def test_geometric_sequence_mask() -> None:
    # geometric means exp(mean log rho): exp(0.005) = 1.00501 kept; exp(0.01) = 1.01005 > 1.01 dropped;
    # exp(-0.02) = 0.98020 < 0.99 dropped
    factor, metrics = correct([[0.004, 0.006], [0.02, 0.0], [-0.03, -0.01]], opc(sequence_mask_metric="geometric"))
    close(factor, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    assert metrics["loss_metrics/geo_sequence_mask_masked_ratio"] == pytest.approx(2 / 3)
    assert metrics["loss_metrics/geo_sequence_mask_over_high_ratio"] == pytest.approx(1 / 3)
    assert metrics["loss_metrics/geo_sequence_mask_under_low_ratio"] == pytest.approx(1 / 3)


def test_product_sequence_mask() -> None:
    # products: exp(1.0) = 2.718 > 2 dropped; exp(0.1) = 1.105 kept; exp(-0.8) = 0.449 < 0.5 dropped
    factor, metrics = correct([[0.5, 0.5], [0.2, -0.1], [-0.5, -0.3]], opc(sequence_mask_metric="product"))
    close(factor, [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    assert metrics["loss_metrics/product_sequence_mask_masked_ratio"] == pytest.approx(2 / 3)
    assert metrics["loss_metrics/product_sequence_mask_over_high_ratio"] == pytest.approx(1 / 3)
    assert metrics["loss_metrics/product_sequence_mask_under_low_ratio"] == pytest.approx(1 / 3)


def test_icepop_token_mask() -> None:
    # rho = [1, 0.368 (< 0.5), 1.649, 2.718 (> 2)]: the two outside [0.5, 2] are dropped, alone
    factor, metrics = correct([[0.0, -1.0, 0.5, 1.0]],
                              opc(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0))
    close(factor, [[1.0, 0.0, 1.0, 0.0]])
    assert metrics["loss_metrics/token_mask_ratio"] == 0.5


def test_outlier_sequences() -> None:
    # row 0 holds exp(5) = 148 > 100, row 1 exp(-10) = 4.5e-5 < 1e-4: both rows go; row 2 stays
    factor, metrics = correct([[0.0, 5.0], [0.0, -10.0], [0.1, 0.0]],
                              opc(outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0))
    close(factor, [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    assert metrics["loss_metrics/outlier_seq_masked_ratio"] == pytest.approx(2 / 3)
    assert metrics["loss_metrics/outlier_seq_over_high_ratio"] == pytest.approx(1 / 3)
    assert metrics["loss_metrics/outlier_seq_under_low_ratio"] == pytest.approx(1 / 3)


def test_masks_apply_in_skyrl_order() -> None:
    # the token mask drops rho = exp(1) > 2 first, so the sequence weight is exp(0.1) = 1.1051709 of the token
    # left, and the geometric mean is over it alone (exp(0.1) > 1.01: without the geo mask it would stay)
    config = opc(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0, tis_ratio_type="sequence")
    factor, _ = correct([[1.0, 0.1]], config)
    close(factor, [[0.0, 1.1051709]])
    factor, metrics = correct([[1.0, 0.1]], opc(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0,
                                                sequence_mask_metric="geometric", geo_mask_high=1.2))
    close(factor, [[0.0, 1.0]])   # exp(0.1) = 1.105 < 1.2 (it would be exp(0.55) = 1.73 with the dropped token)
    # the token TIS share is of the tokens the masks left: one of the two is above cap 1.5
    factor, metrics = correct([[0.0, 1.0, -1.0]], opc(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=3.0,
                                                      tis_ratio_type="token", token_tis_ratio_clip_high=1.5))
    close(factor, [[1.0, 1.5, 0.0]])
    assert metrics["loss_metrics/tis_token_clip_high_ratio"] == 0.5
    assert metrics["loss_metrics/token_mask_ratio"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("reduction, expected", [
    ("token_mean", -3 / 4),                        # 3 tokens of -1 left, the original 4 tokens divide
    ("sequence_mean", -(2 / 2 + 1 / 2) / 2),       # each row by its own 2 tokens, 2 rows
])
def test_dropped_tokens_keep_their_place_in_the_denominator(reduction: str, expected: float) -> None:
    log_probs = torch.zeros(2, 2, requires_grad=True)  # on-policy: r = 1, l = -A = -1 per token
    rollout = torch.tensor([[0.0, 0.0], [0.0, 1.0]])   # rho = exp(-1) = 0.37 on the last token: IcePop drops it
    config = cfg(loss_reduction=reduction,
                 off_policy_correction={"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0})
    loss, metrics = POLICY_LOSSES.get("regular")(log_probs, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2),
                                                 config, rollout)
    assert loss.item() == pytest.approx(expected)
    assert metrics["loss_metrics/token_mask_ratio"] == 0.25


@pytest.mark.parametrize("name", ["regular", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "rollout_is", "dppo",
                                  "importance_sampling"])
def test_every_loss_takes_the_sequence_mask(name: str) -> None:
    # row 1's geometric mean exp(0.5) is far outside [0.99, 1.01]: its loss and gradient vanish, row 0's stay
    log_probs = torch.tensor([[-1.0, -0.5], [-0.7, -0.2]])
    old = log_probs + torch.tensor([[0.0, 0.0], [0.5, 0.5]])
    rollout = log_probs.clone()   # rho = exp(old - rollout): 1 on row 0, exp(0.5) on row 1
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    config = cfg(off_policy_correction={"sequence_mask_metric": "geometric"})
    lp = log_probs.clone().requires_grad_(True)
    torch.manual_seed(0)
    loss, metrics = POLICY_LOSSES.get(name)(lp, old, adv, torch.ones(2, 2), config, rollout)
    (grad,) = torch.autograd.grad(loss, lp)
    assert (grad[1] == 0).all() and (grad[0] != 0).any()
    assert metrics["loss_metrics/geo_sequence_mask_masked_ratio"] == 0.5


@pytest.mark.parametrize("overrides, corrects", [
    ({}, False), ({"use_tis": True, "tis_imp_ratio_cap": 2.0}, True),
    ({"off_policy_correction": {"sequence_mask_metric": "geometric"}}, True),
    ({"off_policy_correction": {"token_mask_is_threshold_low": 0.5}}, False),   # IcePop needs both bounds
    ({"off_policy_correction": {"outlier_token_is_threshold_high": 100.0}}, True),
    ({"policy_loss_type": "rollout_is"}, True), ({"policy_loss_type": "dppo"}, True),
    ({"policy_loss_type": "cispo"}, False), ({"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "rollout"}}, True),
])
def test_what_counts_as_a_correction(overrides: dict, corrects: bool) -> None:
    # the asynchronous trainer warns about a run without one
    assert corrects_off_policy(cfg(**overrides)) is corrects


# ----------------------------------------------------------------------------- the new losses


def run(name: str, log_probs, old, adv, mask, config, rollout=None):
    log_probs = log_probs.clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.get(name)(log_probs, old, adv, mask, config, rollout)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, metrics, grad


def log(values) -> torch.Tensor:
    return torch.tensor([values]).log()


def test_rollout_is() -> None:
    # q = pi / pi_rollout = [0.5/0.5, 0.5/0.25, 0.5/0.45] = [1, 2, 1.1111111]; (0.8, 1.2) keeps 1 and 1.111
    log_probs, rollout = log([0.5, 0.5, 0.5]), log([0.5, 0.25, 0.45])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, metrics, grad = run("rollout_is", log_probs, log([0.9, 0.9, 0.9]), adv, torch.ones(1, 3), cfg(), rollout)
    # l = -sg(w) A log pi = [-(1)(1)(-ln 2), 0, -(1.1111)(-1)(-ln 2)] = [0.6931472, 0, -0.7701635]; / 3
    assert loss.item() == pytest.approx(-0.0256721, abs=1e-6)
    close(grad, [[-1 / 3, 0.0, 1.1111111 / 3]])   # -w A / 3: pi_old (0.9) plays no part
    assert metrics["clip_frac"] == pytest.approx(1 / 3) and metrics["clip_frac_high"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout_is weighs tokens against the engine's logprobs"):
        run("rollout_is", log_probs, log_probs, adv, torch.ones(1, 3), cfg())


def test_dppo_binary_tv() -> None:
    # p = [0.6, 0.3, 0.5, 0.2], p_mu = [0.3, 0.6, 0.5, 0.1], A = [1, -1, 1, -1], delta 0.2:
    # token 0: A > 0 and p - p_mu = 0.3 > 0.2 -> dropped; token 1: A < 0 and p_mu - p = 0.3 > 0.2 -> dropped;
    # token 3: A < 0 but p rose -> kept. q = p / p_mu = [2, 0.5, 1, 2]
    log_probs, mu = log([0.6, 0.3, 0.5, 0.2]), log([0.3, 0.6, 0.5, 0.1])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, metrics, grad = run("dppo", log_probs, log([0.9] * 4), adv, torch.ones(1, 4), cfg(), mu)
    assert loss.item() == pytest.approx((0 + 0 - 1 + 2) / 4)   # l = -q A on the kept tokens
    close(grad, [[0.0, 0.0, -1 / 4, 2 / 4]])                    # d(-q A)/d log pi = -q A
    assert (metrics["clip_frac"], metrics["clip_frac_low"], metrics["clip_frac_high"]) == (0.5, 0.25, 0.25)
    # without rollout logprobs pi_old is the behaviour policy
    loss_old, _, _ = run("dppo", log_probs, mu, adv, torch.ones(1, 4), cfg())
    assert loss_old.item() == pytest.approx(0.25)


def test_dppo_binary_kl() -> None:
    # p = 0.3 vs p_mu = 0.1, A > 0: TV 0.2 is not > 0.2 (kept), but the Bernoulli KL
    # 0.1 ln(0.1/0.3) + 0.9 ln(0.9/0.7) = -0.1098612 + 0.2261830 = 0.1163218 > 0.05 drops it;
    # p = 0.5 vs 0.5: KL 0, kept (q = 1)
    log_probs, mu = log([0.3, 0.5]), log([0.1, 0.5])
    adv = torch.ones(1, 2)
    tv, _, _ = run("dppo", log_probs, mu, adv, torch.ones(1, 2), cfg(), mu)
    kl, metrics, grad = run("dppo", log_probs, mu, adv, torch.ones(1, 2),
                            cfg(dppo={"dppo_type": "binary_kl", "delta_low": 0.05, "delta_high": 0.05}), mu)
    assert tv.item() == pytest.approx(-(3.0 + 1.0) / 2)   # TV keeps both: -(q A) = -3, -1
    assert kl.item() == pytest.approx(-1.0 / 2)
    close(grad, [[0.0, -0.5]])
    assert metrics["clip_frac_high"] == 0.5


def test_cispo_rollout_anchor() -> None:
    # pi = pi_old = 0.5 (r_old = 1); pi_rollout = [0.25, 0.5] -> q = [2, 1]; bounds [1 - 1, 1 + 0.5] = [0, 1.5]
    log_probs, rollout = log([0.5, 0.5]), log([0.25, 0.5])
    cispo = {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 0.5}
    old_anchor, _, _ = run("cispo", log_probs, log_probs, torch.ones(1, 2), torch.ones(1, 2), cfg(cispo=cispo), rollout)
    assert old_anchor.item() == pytest.approx(LN2)   # l = -1 * 1 * ln 0.5 per token
    loss, metrics, grad = run("cispo", log_probs, log_probs, torch.ones(1, 2), torch.ones(1, 2),
                              cfg(cispo={**cispo, "cispo_anchor": "rollout"}), rollout)
    assert loss.item() == pytest.approx((1.5 + 1.0) * LN2 / 2)   # w = [min(2, 1.5), 1]
    close(grad, [[-1.5 / 2, -1.0 / 2]])
    assert metrics["loss_metrics/cispo/ratio_mean"] == pytest.approx(1.5)           # (2 + 1) / 2
    assert metrics["loss_metrics/cispo/ratio_clamped_mean"] == pytest.approx(1.25)  # (1.5 + 1) / 2
    assert (metrics["loss_metrics/cispo/ratio_max"], metrics["loss_metrics/cispo/ratio_min"]) == pytest.approx((2, 1))


# ----------------------------------------------------------------------------- estimator, reductions


def test_maxrl() -> None:
    rewards = torch.zeros(7, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    mask = torch.ones(7, 2)
    adv, returns = ADVANTAGE_ESTIMATORS.get("maxrl")(token_level_rewards=rewards, response_mask=mask,
                                                      index=["a"] * 4 + ["b"] * 2 + ["c"])
    # group a: mean 0.25 -> (1 - 0.25) / (0.25 + 1e-6) = 2.999988, (0 - 0.25) / 0.250001 = -0.999996
    # group b: all 1 -> 0; group c alone -> 0
    close(adv[:, 0], [2.999988, -0.999996, -0.999996, -0.999996, 0.0, 0.0, 0.0])
    assert torch.equal(adv, returns) and torch.equal(adv[:, 0], adv[:, 1])


VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])


def test_token_mean_legacy_is_the_mean_of_micro_batch_means() -> None:
    fn = LOSS_REDUCTIONS.get("token_mean_legacy")
    assert fn(VALUES, MASK).item() == pytest.approx(4.2)   # one micro-batch: 21 / 5, token_mean's value
    with loss_normalizers(5, 2, micro_batches=2):
        # row 0 alone: (1 + 2) / 2 = 1.5, row 1 alone: 18 / 3 = 6; each / 2 micro-batches -> 3.75 (not 4.2)
        split = reduce_loss(VALUES[:1], MASK[:1], "token_mean_legacy") + reduce_loss(VALUES[1:], MASK[1:],
                                                                                      "token_mean_legacy")
        exact = reduce_loss(VALUES[:1], MASK[:1], "token_mean") + reduce_loss(VALUES[1:], MASK[1:], "token_mean")
    assert split.item() == pytest.approx(3.75) and exact.item() == pytest.approx(4.2)


def test_prompt_mean() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # prompts a = rows 0, 1 (3 tokens, sum 1 + 2 + 4 = 7), b = rows 2, 3 (5 tokens, sum 3 + 4 = 7); P = 2
    # -> (7 / 3 + 7 / 5) / 2 = (2.3333333 + 1.4) / 2 = 1.8666667 (token_mean: 14 / 8 = 1.75)
    divisors = torch.tensor([2 * 3.0, 2 * 3.0, 2 * 5.0, 2 * 5.0])
    with loss_normalizers(8, 4, prompt_divisors=divisors) as norms:
        assert reduce_loss(values, mask, "prompt_mean").item() == pytest.approx(1.8666667)
        # one micro-batch per prompt sums to the same
        norms.prompt_divisors = divisors[:2]
        first = reduce_loss(values[:2], mask[:2], "prompt_mean")
        norms.prompt_divisors = divisors[2:]
        assert (first + reduce_loss(values[2:], mask[2:], "prompt_mean")).item() == pytest.approx(1.8666667)
    with pytest.raises(ValueError, match="prompt_mean needs the prompt group of every row"):
        reduce_loss(values, mask, "prompt_mean")


# ----------------------------------------------------------------------------- the config


def test_the_config_keys_load() -> None:
    cfg_ = load_config(["+experiment=tiny", "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric",
                        "trainer.algorithm.off_policy_correction.token_mask_is_threshold_low=0.5",
                        "trainer.algorithm.off_policy_correction.token_mask_is_threshold_high=2.0",
                        "trainer.algorithm.policy_loss_type=dppo", "trainer.algorithm.dppo.dppo_type=binary_kl",
                        "trainer.algorithm.loss_reduction=prompt_mean", "trainer.algorithm.advantage_estimator=maxrl"])
    assert cfg_.trainer.algorithm.off_policy_correction.geo_mask_low == 0.99
    assert cfg_.trainer.algorithm.dppo.dppo_type == "binary_kl"


@pytest.mark.parametrize("overrides, says", [
    (["use_tis=true", "tis_imp_ratio_cap=2.0", "off_policy_correction.tis_ratio_type=token"], "both ask for TIS"),
    (["policy_loss_type=cispo", "cispo.cispo_anchor=rollout", "off_policy_correction.tis_ratio_type=sequence"],
     "would count it twice"),
    (["off_policy_correction.token_mask_is_threshold_low=0.5"], "on only when both are set"),
    (["off_policy_correction.sequence_mask_metric=product", "off_policy_correction.product_mask_low=3.0"],
     "must be below"),
    (["off_policy_correction.tis_ratio_type=sequence", "off_policy_correction.sequence_tis_ratio_clip_high=0"],
     "must be greater than 0"),
    (["off_policy_correction.sequence_mask_metric=harmonic"], "sequence_mask_metric"),
    (["cispo.cispo_anchor=new"], "cispo_anchor"),
])
def test_bad_corrections_are_refused(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(["+experiment=tiny"] + [f"trainer.algorithm.{o}" for o in overrides])


def test_prompt_mean_on_several_ranks_is_refused_before_anything_loads():
    from ridgeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss_reduction=prompt_mean is built for one training process"):
        load_config(["+experiment=tiny", "trainer.strategy=fsdp2", "trainer.placement.policy_num_gpus_per_node=2",
                     "trainer.algorithm.loss_reduction=prompt_mean"])
    load_config(["+experiment=tiny", "trainer.algorithm.loss_reduction=prompt_mean"])   # one process: fine
