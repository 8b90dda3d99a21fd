"""Hand-computed checks of ridgeline.algorithms; the arithmetic sits next to each expected value."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from ridgeline.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_REDUCTIONS,
    POLICY_LOSSES,
    Registry,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
    count_singleton_groups,
    kl_penalty,
    masked_mean,
    register_advantage_estimator,
    resolve_kl_estimator,
    whiten_advantages,
)

SQRT3 = math.sqrt(3.0)


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0.0, atol=atol)


# ----------------------------------------------------------------------------- registry


def test_builtins_are_registered() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == ["gae", "grpo", "maxrl", "no_op", "reinforce++", "rloo"]
    assert POLICY_LOSSES.names() == ["cispo", "clip_cov", "dpo", "dppo", "dro", "dual_clip", "gspo",
                                     "importance_sampling", "kl_cov", "regular", "rollout_is", "sapo", "sft"]
    assert KL_ESTIMATORS.names() == ["abs", "k1", "k2", "k3"]
    assert LOSS_REDUCTIONS.names() == ["prompt_mean", "seq_mean_token_sum_norm", "sequence_mean", "token_mean",
                                       "token_mean_legacy", "token_sum"]
    assert "grpo" in ADVANTAGE_ESTIMATORS and "ppo" not in ADVANTAGE_ESTIMATORS
    assert ADVANTAGE_ESTIMATORS.get("grpo") is compute_grpo_advantages
    assert ADVANTAGE_ESTIMATORS.get("rloo") is compute_rloo_advantages
    assert ADVANTAGE_ESTIMATORS.get("reinforce++") is compute_reinforce_plus_plus_advantages


def test_registry_unknown_name_lists_available() -> None:
    reg: Registry = Registry("widget")
    reg.register("beta")(lambda: 2)
    reg.register("alpha")(lambda: 1)
    for exc_type in (KeyError, ValueError):
        with pytest.raises(exc_type) as info:
            reg.get("gamma")
        assert str(info.value) == "unknown widget 'gamma'; available: alpha, beta"
    with pytest.raises(KeyError, match="available: cispo, clip_cov, dpo, dppo, dro, dual_clip, gspo, importance_sampling, "
                                       "kl_cov, regular, rollout_is, sapo, sft"):
        POLICY_LOSSES.get("ppo")


def test_registry_rejects_duplicate_names() -> None:
    reg: Registry = Registry("widget")

    @reg.register("a")
    def first() -> int:
        return 1

    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")
    assert reg.get("a") is first  # the decorator returns the function unchanged


# ----------------------------------------------------------------------------- GRPO


def _grpo_batch() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    # Groups interleaved: a = [1, 0, 1, 0], b = [1, 1, 1, 0]. Responses have 1..3 tokens
    # out of T = 3; rewards sit on the last real token except row 2, whose 1 is split
    # 0.5 + 0.5 over two tokens to check the row sum.
    rewards = torch.tensor(
        [
            [0.0, 0.0, 1.0],  # a  score 1
            [0.0, 1.0, 0.0],  # b  score 1
            [0.5, 0.5, 0.0],  # b  score 1
            [0.0, 0.0, 0.0],  # a  score 0
            [1.0, 0.0, 0.0],  # a  score 1
            [0.0, 0.0, 0.0],  # b  score 0
            [0.0, 0.0, 0.0],  # a  score 0
            [1.0, 0.0, 0.0],  # b  score 1
        ]
    )
    lengths = [3, 2, 2, 3, 1, 3, 2, 1]
    mask = (torch.arange(3).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    uids = ["a", "b", "b", "a", "a", "b", "a", "b"]
    return rewards, mask, uids


def _broadcast(per_row: list[float], mask: torch.Tensor) -> torch.Tensor:
    return torch.tensor(per_row).unsqueeze(-1) * mask


def test_grpo_normalised_by_std() -> None:
    rewards, mask, uids = _grpo_batch()
    adv, ret = compute_grpo_advantages(token_level_rewards=rewards, response_mask=mask, index=uids, epsilon=0.0)
    # a: mean 0.5, unbiased var = 4 * 0.5^2 / 3 = 1/3, std = 1/sqrt(3) -> A = +-0.5 * sqrt(3) = +-0.8660254
    # b: mean 0.75, var = (3 * 0.25^2 + 0.75^2) / 3 = 0.75 / 3 = 0.25, std = 0.5 -> A = 0.5 or -1.5
    h = 0.5 * SQRT3
    expected = _broadcast([h, 0.5, 0.5, -h, h, -1.5, -h, 0.5], mask)
    close(adv, expected.tolist())
    assert adv.dtype == torch.float32
    assert torch.equal(ret, adv) and ret.data_ptr() != adv.data_ptr()
    assert torch.all(adv[mask == 0] == 0)  # padding carries no advantage


def test_grpo_default_epsilon() -> None:
    rewards, mask, uids = _grpo_batch()
    adv, _ = compute_grpo_advantages(token_level_rewards=rewards, response_mask=mask, index=uids)
    # a: 0.5 / (0.57735027 + 1e-6) = 0.86602390;  b: 0.25 / 0.500001 = 0.49999900, -0.75 / 0.500001 = -1.49999700
    close(adv[:, 0], [0.8660239, 0.499999, 0.499999, -0.8660239, 0.8660239, -1.499997, -0.8660239, 0.499999])


def test_dr_grpo_no_std_normalisation() -> None:
    rewards, mask, uids = _grpo_batch()
    adv, _ = compute_grpo_advantages(
        token_level_rewards=rewards, response_mask=mask, index=uids, grpo_norm_by_std=False
    )
    # a: score - 0.5 = +-0.5;  b: score - 0.75 = 0.25 or -0.75
    close(adv, _broadcast([0.5, 0.25, 0.25, -0.5, 0.5, -0.75, -0.5, 0.25], mask).tolist())


def test_grpo_singleton_and_constant_groups() -> None:
    rewards = torch.tensor([[0.7, 0.0], [1.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    uids = ["solo", "same", "same"]
    # solo: a group of one has nothing to compare against -> 0 (it used to keep its raw score 0.7)
    # same: std 0 -> 0 / (0 + 1e-6) = 0
    for norm in (True, False):
        adv, ret = compute_grpo_advantages(
            token_level_rewards=rewards, response_mask=mask, index=uids, grpo_norm_by_std=norm
        )
        close(adv, [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
        close(ret, [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert count_singleton_groups(uids) == 1


def test_grpo_index_length_checked() -> None:
    rewards, mask, uids = _grpo_batch()
    with pytest.raises(ValueError, match="index"):
        compute_grpo_advantages(token_level_rewards=rewards, response_mask=mask, index=uids[:-1])


def test_grpo_has_no_grad_and_upcasts() -> None:
    rewards = torch.tensor([[1.0], [0.0]], dtype=torch.bfloat16, requires_grad=True)
    adv, _ = compute_grpo_advantages(
        token_level_rewards=rewards, response_mask=torch.ones(2, 1), index=["u", "u"], epsilon=0.0
    )
    # mean 0.5, std = sqrt(2 * 0.25 / 1) = 0.70710678 -> +-0.5 / 0.70710678 = +-0.70710678
    close(adv, [[0.70710678], [-0.70710678]])
    assert adv.dtype == torch.float32 and not adv.requires_grad


def test_count_singleton_groups() -> None:
    assert count_singleton_groups(["a", "b", "a", "c"]) == 2  # b and c occur once
    assert count_singleton_groups(["a", "a"]) == 0
    assert count_singleton_groups([]) == 0
    assert count_singleton_groups(torch.tensor([7, 7, 3])) == 1  # tensor ids compare by value


# ----------------------------------------------------------------------------- RLOO


def _rloo_batch() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    # a = [1, 0, 1, 0] (n = 4) and b = [1, 1, 0] (n = 3) interleaved, plus a singleton s.
    # Rewards on the last real token of T = 3; lengths vary so padding is checked too.
    rewards = torch.tensor(
        [
            [0.0, 0.0, 1.0],  # a  score 1
            [0.0, 1.0, 0.0],  # b  score 1
            [0.0, 0.0, 0.0],  # a  score 0
            [1.0, 0.0, 0.0],  # b  score 1
            [0.0, 0.7, 0.0],  # s  score 0.7
            [0.0, 1.0, 0.0],  # a  score 1
            [0.0, 0.0, 0.0],  # b  score 0
            [0.0, 0.0, 0.0],  # a  score 0
        ]
    )
    lengths = [3, 2, 1, 1, 2, 2, 3, 2]
    mask = (torch.arange(3).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    return rewards, mask, ["a", "b", "a", "b", "s", "a", "b", "a"]


def test_rloo() -> None:
    rewards, mask, index = _rloo_batch()
    adv, ret = compute_rloo_advantages(token_level_rewards=rewards, response_mask=mask, index=index)
    # a, r = 1: others [0, 1, 0] mean 1/3 -> 1 - 1/3 = 2/3;  r = 0: others [1, 1, 0] mean 2/3 -> -2/3
    #   (same as (r - 0.5) * 4 / 3 = +-0.5 * 4/3 = +-2/3)
    # b, r = 1: others [1, 0] mean 1/2 -> 1/2;  r = 0: others [1, 1] mean 1 -> -1
    #   (same as (r - 2/3) * 3 / 2 = 1/2 or -1)
    # s: a group of one -> 0
    t = 2.0 / 3.0
    expected = _broadcast([t, 0.5, -t, 0.5, 0.0, t, -1.0, -t], mask)
    close(adv, expected.tolist())
    assert torch.all(adv[mask == 0] == 0)  # padding carries no advantage
    assert torch.equal(ret, adv) and ret.data_ptr() != adv.data_ptr()
    assert adv.dtype == torch.float32 and count_singleton_groups(index) == 1


def test_rloo_no_grad_and_upcasts() -> None:
    rewards = torch.tensor([[2.0], [0.0]], dtype=torch.bfloat16, requires_grad=True)
    adv, _ = compute_rloo_advantages(token_level_rewards=rewards, response_mask=torch.ones(2, 1), index=[0, 0])
    close(adv, [[2.0], [-2.0]])  # n = 2: 2 - 0 = 2, 0 - 2 = -2
    assert adv.dtype == torch.float32 and not adv.requires_grad


# ----------------------------------------------------------------------------- REINFORCE++


def _rpp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # row 0: 3 tokens, reward 1 on t = 2;  row 1: 2 tokens, reward 2 on t = 1.
    # The 5.0 on row 1's padding must count as 0 and must not flow back into its response.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    return rewards, mask


def test_reinforce_pp_gamma_one() -> None:
    rewards, mask = _rpp_batch()
    adv, ret = compute_reinforce_plus_plus_advantages(
        token_level_rewards=rewards, response_mask=mask, index=["x", "y"], gamma=1.0, epsilon=0.0
    )
    # G row 0 = [1, 1, 1, 0], row 1 = [2, 2, 0, 0]
    close(ret, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    # masked G = 1, 1, 1, 2, 2: n = 5, mean = 7 / 5 = 1.4
    # deviations -0.4 (x3), 0.6 (x2): sum sq = 3 * 0.16 + 2 * 0.36 = 1.2, unbiased var = 1.2 / 4 = 0.3
    # std = sqrt(0.3) = 0.5477226 -> A = -0.4 / 0.5477226 = -0.7302967, 0.6 / 0.5477226 = 1.0954451
    lo, hi = -0.4 / math.sqrt(0.3), 0.6 / math.sqrt(0.3)
    close(adv, [[lo, lo, lo, 0.0], [hi, hi, 0.0, 0.0]])
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32


def test_reinforce_pp_gamma_half() -> None:
    rewards, mask = _rpp_batch()
    adv, ret = compute_reinforce_plus_plus_advantages(
        token_level_rewards=rewards, response_mask=mask, index=["x", "y"], gamma=0.5, epsilon=0.0
    )
    # row 0: G_2 = 1, G_1 = 0.5 * 1 = 0.5, G_0 = 0.5 * 0.5 = 0.25;  row 1: G_1 = 2, G_0 = 0.5 * 2 = 1
    close(ret, [[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    # masked G = 0.25, 0.5, 1, 1, 2: sum 4.75, mean 0.95
    # deviations -0.7, -0.45, 0.05, 0.05, 1.05: sum sq = 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8
    # unbiased var = 1.8 / 4 = 0.45, std = sqrt(0.45) = 0.6708204
    # A = -0.7 / 0.6708204 = -1.0434984, -0.45 / s = -0.6708204, 0.05 / s = 0.0745356, 1.05 / s = 1.5652476
    s = math.sqrt(0.45)
    close(adv, [[-0.7 / s, -0.45 / s, 0.05 / s, 0.0], [0.05 / s, 1.05 / s, 0.0, 0.0]])


def test_reinforce_pp_default_epsilon_and_masked_gap() -> None:
    rewards, mask = _rpp_batch()
    adv, _ = compute_reinforce_plus_plus_advantages(token_level_rewards=rewards, response_mask=mask)
    # gamma defaults to 1 and epsilon to 1e-6: -0.4 / (0.5477226 + 1e-6) = -0.7302954
    close(adv[0, 0], -0.4 / (math.sqrt(0.3) + 1e-6))
    # A masked-out token inside the row resets the return: the reward after the gap does not reach t = 0, 1.
    _, ret = compute_reinforce_plus_plus_advantages(
        token_level_rewards=torch.tensor([[0.0, 0.0, 0.0, 1.0]]), response_mask=torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    )
    close(ret, [[0.0, 0.0, 0.0, 1.0]])


# ----------------------------------------------------------------------------- shared estimator contract


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++"])
def test_estimators_ignore_foreign_kwargs(name: str) -> None:
    rewards, mask, uids = _grpo_batch()
    fn = ADVANTAGE_ESTIMATORS.get(name)
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=uids)
    plain = fn(**kwargs)
    noisy = fn(**kwargs, values=torch.zeros_like(rewards), lambd=0.95, grpo_norm_by_std=True, some_future_option="x")
    close(noisy[0], plain[0].tolist())
    close(noisy[1], plain[1].tolist())
    assert torch.all(plain[0][mask == 0] == 0) and torch.all(plain[1][mask == 0] == 0)
    with pytest.raises(TypeError):
        fn(rewards, mask, uids)  # keyword-only: the old positional call fails loudly


def test_grpo_generic_call_ignores_foreign_kwargs() -> None:
    rewards, mask, uids = _grpo_batch()
    fn = ADVANTAGE_ESTIMATORS.get("grpo")
    adv, _ = fn(
        token_level_rewards=rewards, response_mask=mask, index=uids, gamma=1.0, lambd=0.95, values=None, epsilon=0.0
    )
    close(adv[0], [0.5 * SQRT3] * 3)


def test_whiten_advantages() -> None:
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = whiten_advantages(adv, mask, epsilon=0.0)
    # masked values 1, 2, 3, 4 (padding 100, -50 ignored): mean 2.5
    # deviations -1.5, -0.5, 0.5, 1.5: sum sq = 2.25 + 0.25 + 0.25 + 2.25 = 5, unbiased var = 5 / 3
    # std = sqrt(5/3) = 1.2909944 -> -1.1618950, -0.3872983, 0.3872983, 1.1618950; padding -> 0
    s = math.sqrt(5.0 / 3.0)
    close(out, [[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]])
    # default epsilon 1e-6: 1.5 / (1.2909944 + 1e-6) = 1.1618941
    close(whiten_advantages(adv, mask)[1, 0], 1.5 / (s + 1e-6))
    # one masked token: std 0 -> (x - x) / (0 + 1e-6) = 0, no NaN
    close(whiten_advantages(torch.tensor([[3.0, 9.0]]), torch.tensor([[1.0, 0.0]])), [[0.0, 0.0]])
    assert out.dtype == torch.float32


# ----------------------------------------------------------------------------- KL


def test_kl_estimators() -> None:
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-2.0, -1.0, -0.5]])
    # log_ratio = [1, -1, 0]
    close(kl_penalty(log_probs, ref, "k1"), [[1.0, -1.0, 0.0]])
    close(kl_penalty(log_probs, ref, "abs"), [[1.0, 1.0, 0.0]])
    close(kl_penalty(log_probs, ref, "k2"), [[0.5, 0.5, 0.0]])  # 0.5 * 1^2
    # k3 = exp(-x) - 1 + x: x=1 -> e^-1 = 0.36787944;  x=-1 -> e - 2 = 0.71828183;  x=0 -> 0
    close(kl_penalty(log_probs, ref), [[math.exp(-1.0), math.e - 2.0, 0.0]])


def test_k3_clamps() -> None:
    log_probs = torch.tensor([[30.0, -30.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0, -2.5]])
    # x=30 -> clamp 20 -> e^-20 - 1 + 20 = 19.0000 -> clamp 10
    # x=-30 -> clamp -20 -> e^20 - 21 = 4.85e8 -> clamp 10
    # x=2.5 -> e^-2.5 + 1.5 = 0.08208500 + 1.5 = 1.582085 (no clamp)
    close(kl_penalty(log_probs, ref, "k3"), [[10.0, 10.0, 1.582085]])


def test_kl_upcasts_bf16() -> None:
    out = kl_penalty(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.bfloat16), "k3")
    assert out.dtype == torch.float32


def test_resolve_kl_estimator() -> None:
    assert resolve_kl_estimator("k2", use_kl_estimator_k3=True, use_abs_kl=True) == "k2"
    assert resolve_kl_estimator(None, use_kl_estimator_k3=True, use_abs_kl=True) == "abs"
    assert resolve_kl_estimator(None, use_kl_estimator_k3=True, use_abs_kl=False) == "k3"
    assert resolve_kl_estimator(None, use_kl_estimator_k3=False, use_abs_kl=False) == "k1"
    with pytest.raises(ValueError, match="available: abs, k1, k2, k3"):
        resolve_kl_estimator("k4", use_kl_estimator_k3=False, use_abs_kl=False)


# ----------------------------------------------------------------------------- reductions

VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])


def test_token_mean() -> None:
    fn = LOSS_REDUCTIONS.get("token_mean")
    assert fn(VALUES, MASK).item() == pytest.approx(4.2)  # (1 + 2 + 5 + 6 + 7) / 5 = 21 / 5
    assert fn(VALUES, MASK, num_tokens=10).item() == pytest.approx(2.1)  # 21 / 10
    assert fn(VALUES, MASK.bool()).item() == pytest.approx(4.2)
    assert fn(VALUES, torch.zeros_like(MASK)).item() == 0.0  # 0 / clamp(0, min=1)


def test_sequence_mean() -> None:
    fn = LOSS_REDUCTIONS.get("sequence_mean")
    assert fn(VALUES, MASK).item() == pytest.approx(3.75)  # ((1+2)/2 + (5+6+7)/3) / 2 = (1.5 + 6) / 2
    assert fn(VALUES, MASK, num_sequences=5).item() == pytest.approx(1.5)  # 7.5 / 5
    empty_row = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert fn(VALUES, empty_row).item() == pytest.approx(0.75)  # (1.5 + 0) / 2


def test_seq_mean_token_sum_norm() -> None:
    fn = LOSS_REDUCTIONS.get("seq_mean_token_sum_norm")
    assert fn(VALUES, MASK).item() == pytest.approx(2.625)  # (3/4 + 18/4) / 2 = (0.75 + 4.5) / 2
    assert fn(VALUES, MASK, num_sequences=7).item() == pytest.approx(0.75)  # 5.25 / 7


def test_masked_mean() -> None:
    assert masked_mean(VALUES, MASK).item() == pytest.approx(4.2)  # 21 / 5
    close(masked_mean(VALUES, MASK, dim=-1), [1.5, 6.0])  # 3/2, 18/3
    close(masked_mean(VALUES, MASK, dim=0), [3.0, 4.0, 7.0, 0.0])  # 6/2, 8/2, 7/1, empty column -> 0


@pytest.mark.parametrize("name", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_sum_to_full_batch(name: str) -> None:
    values = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [-1.0, 0.5, 2.0, 9.0], [4.0, 4.0, 4.0, 4.0]]
    )
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    fn = LOSS_REDUCTIONS.get(name)
    full = fn(values, mask)
    # global normalisers: 1 + 4 + 1 + 3 = 9 tokens, 4 sequences
    reduce = partial(fn, num_tokens=mask.sum().item(), num_sequences=values.shape[0])
    split = reduce(values[:2], mask[:2]) + reduce(values[2:], mask[2:])
    assert split.item() == pytest.approx(full.item(), abs=1e-6)
    if name == "token_mean":
        # masked row sums: 1, 26, -1, 12 -> full = 38 / 9 = 4.2222222
        assert full.item() == pytest.approx(38 / 9)
        # local normalisers averaged over the 2 micro-batches weight tokens unequally:
        # (27 / 5 + 11 / 4) / 2 = (5.4 + 2.75) / 2 = 4.075 != 4.2222
        naive = (fn(values[:2], mask[:2]) + fn(values[2:], mask[2:])) / 2
        assert naive.item() == pytest.approx(4.075)
