"""Ridgeline's SkyRL 0.4 algorithms against the `skyrl` 0.4.0 wheel's own functions on random inputs.

Outside the default suite (marker skyrl04, `make test-skyrl04`): it needs the unpacked wheel (the
folder holding `skyrl/`, from $SKYRL04_SRC, default /work/wt/pkgs/skyrl) and the extra
`skyrl04-parity` (jaxtyping, loguru, cloudpathlib; ray and numpy come with the `ray` extra).
Python 3.11's typing.TypedDict is replaced by typing_extensions' before the import, as the wheel
(written for 3.12) needs.

SkyRL 0.4 reduces a loss by summing `loss * mask` over advantages scaled in advance per mini-batch
(`apply_loss_reduction_to_advantages_minibatch`), Ridgeline by dividing inside `reduce_loss`: each
comparison scales SkyRL's advantages with that function and compares the sums, values and gradients.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ridgeline.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, loss_normalizers
from ridgeline.config import base_config

pytestmark = pytest.mark.skyrl04

SOURCE = Path(os.environ.get("SKYRL04_SRC", "/work/wt/pkgs/skyrl"))


@pytest.fixture(scope="module")
def skyrl():
    if not (SOURCE / "skyrl" / "backends" / "skyrl_train" / "utils" / "ppo_utils.py").is_file():
        pytest.skip(f"the skyrl 0.4 wheel is not unpacked at {SOURCE} (set SKYRL04_SRC)")
    for module in ("jaxtyping", "loguru", "cloudpathlib", "ray"):
        pytest.importorskip(module, reason=f"{module} (pip install -e '.[skyrl04-parity,ray]')")
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]   # the wheel's 3.12 TypedDict
    sys.path.insert(0, str(SOURCE))
    from skyrl.backends.skyrl_train.utils import off_policy_correction_utils, ppo_utils
    from skyrl.train.config import AlgorithmConfig

    return ppo_utils, off_policy_correction_utils, AlgorithmConfig


def _inputs(seed: int, rows: int = 8, width: int = 12):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=gen) * 3 - 0.05
    log_probs = (old + torch.randn(rows, width, generator=gen) * 0.15).clamp(max=-1e-3)
    rollout = (old + torch.randn(rows, width, generator=gen) * 0.15).clamp(max=-1e-3)
    adv = torch.randn(rows, 1, generator=gen).expand(rows, width) * mask
    return log_probs, old, rollout, adv.contiguous(), mask


def _configs(AlgorithmConfig, loss: str, reduction: str, correction: dict, extra: dict):
    sky = AlgorithmConfig(policy_loss_type=loss, loss_reduction=reduction, max_seq_len=20)
    for key, value in correction.items():
        setattr(sky.off_policy_correction, key, value)
    for section, values in extra.items():
        for key, value in values.items():
            setattr(getattr(sky, section), key, value)
    ours = OmegaConf.merge(base_config().trainer.algorithm,
                           {"policy_loss_type": loss, "loss_reduction": reduction,
                            "off_policy_correction": correction, **extra})
    return sky, ours


CORRECTIONS = {
    "none": {},
    "token_tis": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.1},
    "sequence_tis": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 1.5},
    "geometric": {"sequence_mask_metric": "geometric", "geo_mask_low": 0.98, "geo_mask_high": 1.02},
    "product": {"sequence_mask_metric": "product", "product_mask_low": 0.7, "product_mask_high": 1.3},
    "icepop": {"token_mask_is_threshold_low": 0.85, "token_mask_is_threshold_high": 1.15},
    "everything": {"outlier_token_is_threshold_low": 0.7, "outlier_token_is_threshold_high": 1.4,
                   "token_mask_is_threshold_low": 0.85, "token_mask_is_threshold_high": 1.15,
                   "tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.05, "sequence_mask_metric": "geometric",
                   "geo_mask_low": 0.97, "geo_mask_high": 1.03},
}
LOSSES = {
    "regular": {}, "dual_clip": {}, "gspo": {}, "sapo": {},
    "cispo": {"cispo": {"cispo_eps_clip_low": 0.1, "cispo_eps_clip_high": 0.1}},
    "cispo_rollout": {"cispo": {"cispo_anchor": "rollout", "cispo_eps_clip_low": 0.1, "cispo_eps_clip_high": 0.1}},
    "rollout_is": {}, "dppo": {"dppo": {"delta_low": 0.02, "delta_high": 0.02}},
    "dppo_kl": {"dppo": {"dppo_type": "binary_kl", "delta_low": 0.002, "delta_high": 0.002}},
}


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("case", sorted(LOSSES))
def test_losses_and_corrections_match_skyrl04(skyrl, case: str, correction: str, reduction: str) -> None:
    ppo_utils, _, AlgorithmConfig = skyrl
    loss = case.split("_")[0] if case.startswith(("dppo", "cispo")) else case
    if case == "cispo_rollout" and CORRECTIONS[correction].get("tis_ratio_type"):
        pytest.skip("refused by both: the rollout anchor is the correction")
    sky_cfg, our_cfg = _configs(AlgorithmConfig, loss, reduction, CORRECTIONS[correction], LOSSES[case])
    for seed in range(3):
        log_probs, old, rollout, adv, mask = _inputs(seed)
        scaled = ppo_utils.apply_loss_reduction_to_advantages_minibatch(adv, mask, reduction, mask.shape[0], 20)
        lp_sky = log_probs.clone().requires_grad_(True)
        sky_loss, sky_metrics = ppo_utils.PolicyLossRegistry.get(loss)(
            lp_sky, old, scaled, config=sky_cfg, loss_mask=mask, rollout_logprobs=rollout)
        (sky_grad,) = torch.autograd.grad(sky_loss, lp_sky)
        lp = log_probs.clone().requires_grad_(True)
        with loss_normalizers(mask.sum().item(), mask.shape[0], max_seq_len=20):
            our_loss, our_metrics = POLICY_LOSSES.get(loss)(lp, old, adv, mask, our_cfg, rollout)
        (our_grad,) = torch.autograd.grad(our_loss, lp)
        torch.testing.assert_close(our_loss, sky_loss.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(our_grad, sky_grad, rtol=1e-4, atol=1e-6)
        assert our_metrics["clip_frac"] == pytest.approx(sky_metrics["clip_ratio"], abs=1e-6)
        for key, value in sky_metrics.items():
            # SkyRL's is_ratio_std / _min count the padding as zeros; ours are over the loss tokens
            if key in ("clip_ratio", "is_ratio_std", "is_ratio_min"):
                continue
            assert our_metrics[f"loss_metrics/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_masked_ratio_statistics_match_skyrl04_without_padding(skyrl) -> None:
    _, opc_utils, AlgorithmConfig = skyrl
    sky_cfg, our_cfg = _configs(AlgorithmConfig, "regular", "token_mean", CORRECTIONS["everything"], {})
    log_probs, old, rollout, adv, _ = _inputs(7)
    full = torch.ones_like(old)
    _, sky_metrics, _ = opc_utils.compute_off_policy_correction(old, rollout, full, sky_cfg.off_policy_correction)
    _, ours = POLICY_LOSSES.get("regular")(log_probs, old, adv, full, our_cfg, rollout)
    for key in ("is_ratio_std", "is_ratio_min"):
        assert ours[f"loss_metrics/{key}"] == pytest.approx(sky_metrics[key], rel=1e-5)


@pytest.mark.parametrize("reduction", ["token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm",
                                       "prompt_mean"])
def test_reductions_over_micro_batches_match_skyrl04(skyrl, reduction: str) -> None:
    """The gradient of a mini-batch of 8 rows (4 prompts of 2) in micro-batches of 3, 3 and 2."""
    ppo_utils, _, AlgorithmConfig = skyrl
    sky_cfg, our_cfg = _configs(AlgorithmConfig, "regular", reduction, {}, {})
    log_probs, old, rollout, adv, mask = _inputs(3)
    boundaries = [(0, 2), (2, 4), (4, 6), (6, 8)]
    # SkyRL's token_mean_legacy splits into micro_batch_size slices; 8 rows in micro-batches of 2
    micro = 2 if reduction == "token_mean_legacy" else 3
    scaled = ppo_utils.apply_loss_reduction_to_advantages_minibatch(adv, mask, reduction, micro, 20,
                                                                    prompt_boundaries=boundaries)
    lp_sky = log_probs.clone().requires_grad_(True)
    sky_loss, _ = ppo_utils.PolicyLossRegistry.get("regular")(lp_sky, old, scaled, config=sky_cfg, loss_mask=mask)
    (sky_grad,) = torch.autograd.grad(sky_loss, lp_sky)
    lp = log_probs.clone().requires_grad_(True)
    starts = list(range(0, 8, micro))
    divisors = torch.tensor([4 * mask[2 * (i // 2):2 * (i // 2) + 2].sum().item() for i in range(8)])
    total = 0
    with loss_normalizers(mask.sum().item(), 8, max_seq_len=20, micro_batches=len(starts)) as norms:
        for start in starts:
            rows = slice(start, start + micro)
            norms.prompt_divisors = divisors[rows]
            total = total + POLICY_LOSSES.get("regular")(lp[rows], old[rows], adv[rows], mask[rows], our_cfg)[0]
    (our_grad,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, sky_loss.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_grad, sky_grad, rtol=1e-4, atol=1e-7)


def test_maxrl_matches_skyrl04(skyrl) -> None:
    ppo_utils, _, AlgorithmConfig = skyrl
    gen = torch.Generator().manual_seed(0)
    rewards = torch.zeros(12, 5)
    rewards[:, -1] = (torch.rand(12, generator=gen) < 0.4).float() + torch.rand(12, generator=gen) * 0.1
    mask = torch.ones(12, 5)
    index = [str(i // 4) for i in range(12)]
    sky, _ = ppo_utils.AdvantageEstimatorRegistry.get("maxrl")(token_level_rewards=rewards.clone(),
                                                                response_mask=mask, index=index)
    ours, _ = ADVANTAGE_ESTIMATORS.get("maxrl")(token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(ours, sky.float(), rtol=1e-5, atol=1e-5)
