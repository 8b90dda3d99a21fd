"""The objectives of `ridgeline sft` and `ridgeline dpo`, as registered policy losses, so the
policy worker's optimizer steps (micro-batches, exact accumulation, grad clipping, skipped
steps) train them exactly as they train RL losses.

    sft: L = -(1 / N_tok) sum_{i,t} m_{i,t} log pi(y_{i,t})              (reduced by loss_reduction)
    dpo: rows (2i, 2i+1) are the chosen and rejected answers of pair i; `old_log_probs` carry the
         frozen reference's logprobs, so per row rho = sum_t m_t (log pi - log pi_ref) (IPO: the
         mean over the row's tokens) and L = (1 / N_pairs) sum_i PREFERENCE_LOSSES[loss_type](rho_c, rho_r, beta)

`PREFERENCE_LOSSES` maps `dpo.loss_type` to a pure function of per-pair logratios.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # a policy loss's `config` (ridgeline.config sits above this layer)
    from ridgeline.config.loss_view import LossConfig
from ridgeline.algorithms.reductions import reduce_loss
from ridgeline.algorithms.registry import Registry, register_policy_loss

PREFERENCE_LOSSES: Registry = Registry("preference loss")


@PREFERENCE_LOSSES.register("sigmoid")
def dpo_sigmoid_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """[P], [P] -> [P]: DPO (Rafailov et al. 2023), -log sigmoid(beta * (rho_c - rho_r)), where
    rho = log pi(y|x) - log pi_ref(y|x) summed over the answer's tokens."""
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    """[P], [P] -> [P]: IPO (Azar et al. 2023), (rho_c - rho_r - 1 / (2 beta))^2, with rho the
    per-token mean logratio (TRL's `loss_type="ipo"`): a squared loss that stops pushing once the
    margin reaches 1 / (2 beta), where DPO's sigmoid keeps pushing."""
    return (chosen_logratios - rejected_logratios - 1.0 / (2.0 * beta)) ** 2


def sequence_logratios(log_probs: Tensor, ref_log_probs: Tensor, loss_mask: Tensor, average: bool) -> Tensor:
    """[B, T] x 3 -> [B]: sum (or, `average`, mean) over each row's loss tokens of log pi - log pi_ref."""
    diff = torch.where(loss_mask > 0, log_probs - ref_log_probs, torch.zeros_like(log_probs)) * loss_mask
    total = diff.sum(-1)
    return total / loss_mask.sum(-1).clamp(min=1.0) if average else total


PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def preference_sums(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> dict[str, float]:
    """[P], [P] -> TRL's DPO metrics as sums over the pairs (`<name>_sum`) and the pair count
    (`pairs_sum`), which add up across micro-batches: the implicit rewards beta * rho of the chosen
    and rejected answers, whether the chosen one is ahead, and the margin."""
    chosen, rejected = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    values = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                          (chosen - rejected).sum(), chosen.new_tensor(float(chosen.numel()))]).tolist()
    return dict(zip([f"{name}_sum" for name in PREFERENCE_METRICS] + ["pairs_sum"], values))


def preference_metrics(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """`preference_sums` (summed over any number of batches; keys may carry `prefix`) -> the means
    over the pairs, under TRL's names."""
    pairs = max(1.0, sums[f"{prefix}pairs_sum"])
    return {name: sums[f"{prefix}{name}_sum"] / pairs for name in PREFERENCE_METRICS}


@register_policy_loss("sft")
def sft_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
             rollout_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """[B, T] -> scalar: the negative log-likelihood of the loss tokens (the assistant turns),
    reduced by `config.loss_reduction` over the optimizer step's mini-batch (token_mean: mean NLL
    per token). `old_log_probs`, `advantages` and the rollout logprobs are not used."""
    return reduce_loss(-log_probs, loss_mask, config.loss_reduction), {}


@register_policy_loss("dpo")
def dpo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
             rollout_log_probs: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """[2P, T] -> scalar: the mean over the step's pairs of `PREFERENCE_LOSSES[config.dpo.loss_type]`.
    Rows 2i / 2i+1 are pair i's chosen / rejected answers; `old_log_probs` are the reference's
    logprobs. Metrics: `preference_sums` of this micro-batch's pairs (the worker adds them up)."""
    if config.get("dpo") is None:
        raise ValueError("policy loss 'dpo' trains preference pairs: run it with `ridgeline dpo`, which gives it "
                         "the pairs, the reference's logprobs and the dpo.* settings")
    beta, loss_type = float(config.dpo.beta), str(config.dpo.loss_type)
    if log_probs.shape[0] % 2:
        raise ValueError(f"dpo: {log_probs.shape[0]} rows cannot be (chosen, rejected) pairs")
    ratios = sequence_logratios(log_probs, old_log_probs, loss_mask, average=loss_type == "ipo")
    chosen, rejected = ratios[0::2], ratios[1::2]
    per_pair = PREFERENCE_LOSSES.get(loss_type)(chosen, rejected, beta)
    # each pair's loss on both of its rows, as a [2P, 1] per-row value: sequence_mean divides their
    # sum by the mini-batch's rows (2 x pairs), so accumulation over micro-batches stays exact
    per_row = per_pair.repeat_interleave(2).unsqueeze(-1)
    rows = (loss_mask.sum(-1, keepdim=True) > 0).to(per_row.dtype)
    return reduce_loss(per_row, rows, "sequence_mean"), preference_sums(chosen, rejected, beta)
