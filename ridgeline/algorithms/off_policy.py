"""Off-policy correction between the engine that sampled and the policy that trains.

The engine samples with its own numerics (bf16 weights, a different kernel, a KV cache), and in
the asynchronous modes from older weights, so the "old" policy the trainer recomputes is not
exactly the policy that produced the tokens. `off_policy_correction` is SkyRL 0.4's
`trainer.algorithm.off_policy_correction` (truncated importance sampling per token or sequence,
sequence masks, IcePop's token mask, outlier sequences); every policy loss applies it to its
per-token loss before reducing (policy_loss._reduce).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

# exp(20) ~ 4.9e8: finite, and far above any sensible cap
_LOG_RATIO_CLAMP = 20.0


class CorrectionSettings(Protocol):
    """`trainer.algorithm.off_policy_correction` (ridgeline/config/schema/algorithm.py says what each does)."""

    tis_ratio_type: str | None
    token_tis_ratio_clip_high: float
    sequence_tis_ratio_clip_high: float
    sequence_mask_metric: str | None
    geo_mask_high: float
    geo_mask_low: float
    product_mask_high: float
    product_mask_low: float
    outlier_token_is_threshold_low: float | None
    outlier_token_is_threshold_high: float | None
    token_mask_is_threshold_low: float | None
    token_mask_is_threshold_high: float | None


class AlgorithmSettings(Protocol):
    """The keys of `trainer.algorithm` the correction reads."""

    use_tis: bool
    tis_imp_ratio_cap: float

    @property   # read-only: the config's own section type satisfies it
    def off_policy_correction(self) -> CorrectionSettings: ...


def tis_setting(algorithm: AlgorithmSettings) -> tuple[str | None, float]:
    """(tis_ratio_type, its cap): SkyRL 0.3.1's `use_tis` is 0.4's tis_ratio_type=token with
    token_tis_ratio_clip_high=tis_imp_ratio_cap, the mapping SkyRL 0.4 makes when it validates."""
    kind: str | None
    if algorithm.use_tis:
        kind, key, cap = "token", "tis_imp_ratio_cap", float(algorithm.tis_imp_ratio_cap)
    else:
        c = algorithm.off_policy_correction
        kind = c.tis_ratio_type
        sequence = kind == "sequence"
        cap = float(c.sequence_tis_ratio_clip_high if sequence else c.token_tis_ratio_clip_high)
        key = f"off_policy_correction.{'sequence' if sequence else 'token'}_tis_ratio_clip_high"
    if kind is not None and cap <= 0:
        raise ValueError(f"trainer.algorithm.{key} must be > 0 when TIS is on, got {cap}")
    return kind, cap


class AnchorSettings(Protocol):
    cispo_anchor: str


class LossSettings(AlgorithmSettings, Protocol):
    """With the keys naming the loss (`trainer.algorithm`)."""

    policy_loss_type: str | None
    ppo_loss_type: str
    @property
    def cispo(self) -> AnchorSettings: ...


def corrects_off_policy(algorithm: LossSettings) -> bool:
    """Whether the loss corrects for rollouts the trainer's pi_old did not sample: a correction of
    `off_policy_correction` (or use_tis) is on, or the loss weighs tokens against pi_rollout itself
    (`rollout_is`, `dppo`, `cispo` with cispo_anchor=rollout)."""
    c = algorithm.off_policy_correction
    loss = algorithm.policy_loss_type if algorithm.policy_loss_type is not None else algorithm.ppo_loss_type
    return (tis_setting(algorithm)[0] is not None or c.sequence_mask_metric is not None
            or c.outlier_token_is_threshold_low is not None or c.outlier_token_is_threshold_high is not None
            or (c.token_mask_is_threshold_low is not None and c.token_mask_is_threshold_high is not None)
            or loss in ("rollout_is", "dppo") or (loss == "cispo" and algorithm.cispo.cispo_anchor == "rollout"))


def _ratio(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()


def _share(flags: Tensor, count: Tensor) -> Tensor:
    return flags.float().sum() / count.clamp(min=1)


def off_policy_correction(old_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor,
                          algorithm: AlgorithmSettings) -> tuple[Tensor | None, dict[str, float]]:
    """SkyRL 0.4's off-policy correction (`trainer.algorithm.off_policy_correction`), from the
    per-token ratio between the trainer's pi_old and the engine that sampled,

        rho_t = exp(log pi_old(y_t) - log pi_rollout(y_t))        (log-ratio clamped to +-20)

    Applied in SkyRL's order, each step on the loss mask m the previous one left:
      1. outlier sequences: m_i <- 0 if any token has rho_t < outlier low or > outlier high;
      2. IcePop token mask: m_t <- 0 unless token low <= rho_t <= token high;
      3. TIS: w_t = min(rho_t, C_tok) (token), or w_i = min(exp(sum_t m_t log rho_t), C_seq) (sequence);
      4. sequence mask: m_i <- 0 unless low <= rho_i <= high, with rho_i = exp(mean_t log rho_t)
         (geometric) or exp(sum_t log rho_t) (product), over the tokens m keeps.
    Returns the per-token factor w * m / m_0 [B, T] to multiply the per-token loss by (no gradient;
    None when nothing is on) and SkyRL's metrics, named as SkyRL 0.4 logs them under
    `policy/loss_metrics/`: is_ratio_{mean,std,max,min} (of rho over the loss tokens),
    outlier_seq_{masked,over_high,under_low}_ratio, token_mask_ratio, tis_token_clip_high_ratio /
    tis_seq_clip_high_ratio, {geo,product}_sequence_mask_{masked,over_high,under_low}_ratio (shares of
    the tokens, or of the sequences, of this call). The caller reduces with the original mask, so a
    dropped token or sequence still counts in the denominator, as in SkyRL 0.4 (whose reduction is
    fixed in advance by scaling the advantages). SkyRL's is_ratio_std / _min take the padding as 0;
    these are over the loss tokens (the same without padding)."""
    c = algorithm.off_policy_correction
    tis_type, tis_cap = tis_setting(algorithm)
    outlier_low, outlier_high = c.outlier_token_is_threshold_low, c.outlier_token_is_threshold_high
    token_low, token_high = c.token_mask_is_threshold_low, c.token_mask_is_threshold_high
    outliers = outlier_low is not None or outlier_high is not None
    token_mask = token_low is not None and token_high is not None
    if tis_type is None and c.sequence_mask_metric is None and not outliers and not token_mask:
        return None, {}
    values: dict[str, Tensor] = {}
    with torch.no_grad():
        real = loss_mask > 0
        log_rho = torch.where(real, old_log_probs.float() - rollout_log_probs.float(), 0.0)
        rho = _ratio(log_rho)
        tokens = real.sum()
        picked = rho[real]
        values["is_ratio_mean"] = _share(torch.where(real, rho, 0.0), tokens)
        values["is_ratio_std"] = picked.std() if picked.numel() > 1 else rho.new_zeros(())
        values["is_ratio_max"] = picked.max() if picked.numel() else rho.new_zeros(())
        values["is_ratio_min"] = picked.min() if picked.numel() else rho.new_zeros(())
        rows = torch.tensor(float(rho.shape[0]), device=rho.device)
        keep = real
        if outliers:
            high = real & (rho > outlier_high) if outlier_high is not None else torch.zeros_like(real)
            low = real & (rho < outlier_low) if outlier_low is not None else torch.zeros_like(real)
            bad = (high | low).any(-1, keepdim=True)
            values["outlier_seq_masked_ratio"] = _share(bad, rows)
            values["outlier_seq_over_high_ratio"] = _share(high.any(-1), rows)
            values["outlier_seq_under_low_ratio"] = _share(low.any(-1), rows)
            keep = keep & ~bad
        if token_low is not None and token_high is not None:   # token_mask
            out = keep & ((rho < token_low) | (rho > token_high))
            values["token_mask_ratio"] = _share(out, keep.sum())
            keep = keep & ~out
        weight = keep.float()
        if tis_type == "token":
            values["tis_token_clip_high_ratio"] = _share(keep & (rho > tis_cap), keep.sum())
            weight = weight * rho.clamp(max=tis_cap)
        elif tis_type == "sequence":
            seq_rho = _ratio(torch.where(keep, log_rho, 0.0).sum(-1, keepdim=True))
            values["tis_seq_clip_high_ratio"] = _share(seq_rho > tis_cap, rows)
            weight = weight * seq_rho.clamp(max=tis_cap)
        elif tis_type is not None:
            raise ValueError(f"off_policy_correction.tis_ratio_type must be null, token or sequence, got {tis_type!r}")
        metric = c.sequence_mask_metric
        if metric is not None:
            seq_log = torch.where(keep, log_rho, 0.0).sum(-1, keepdim=True)
            if metric == "geometric":
                seq_rho = _ratio(seq_log / keep.sum(-1, keepdim=True).clamp(min=1))
                band_low, band_high, name = c.geo_mask_low, c.geo_mask_high, "geo"
            elif metric == "product":
                seq_rho, band_low, band_high, name = _ratio(seq_log), c.product_mask_low, c.product_mask_high, "product"
            else:
                raise ValueError(f"off_policy_correction.sequence_mask_metric must be null, geometric or product, "
                                 f"got {metric!r}")
            over, under = seq_rho > band_high, seq_rho < band_low
            values[f"{name}_sequence_mask_masked_ratio"] = _share(over | under, rows)
            values[f"{name}_sequence_mask_over_high_ratio"] = _share(over, rows)
            values[f"{name}_sequence_mask_under_low_ratio"] = _share(under, rows)
            weight = weight * ~(over | under)
        floats = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
    return weight, {f"loss_metrics/{k}": v for k, v in zip(values, floats)}


def logprob_mismatch(trainer_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """(sum, max, count) of |trainer - rollout| logprob over masked tokens: summable across
    micro-batches, so the caller can report an exact mean and max per step."""
    with torch.no_grad():
        diff = (trainer_log_probs.float() - rollout_log_probs.float()).abs() * mask
        return float(diff.sum()), float(diff.max()) if diff.numel() else 0.0, float(mask.sum())


def rollout_kl_sum(trainer_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> float:
    """Sum over the masked tokens of Schulman's k3 estimate of KL(pi_rollout || pi_old) from the
    engine's own samples: with rho_t = pi_old(y_t) / pi_rollout(y_t),

        k3_t = rho_t - 1 - log rho_t     (>= 0; its mean is the KL, unbiased, for y_t ~ pi_rollout)

    float64, log-ratio clamped to +-20; summable over micro-batches and ranks (the caller divides
    by the token count)."""
    with torch.no_grad():
        log_rho = torch.where(mask > 0, trainer_log_probs.double() - rollout_log_probs.double(), 0.0)
        log_rho = log_rho.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return float((log_rho.exp() - 1.0 - log_rho).sum())


def prob_ratio_moments(trainer_log_probs: Tensor, rollout_log_probs: Tensor,
                       mask: Tensor) -> tuple[float, float, float]:
    """Summable moments of SkyRL's engine/trainer probability ratio over the masked tokens,

        q_t = exp(log pi_rollout(y_t) - log pi_old(y_t)),

    as (sum of d_t, sum of d_t^2, count) with d_t = q_t - 1: shifted by 1 (q_t sits near 1) so the
    variance `ratio_mean_std` recovers from the sums keeps its digits. float64, no clamp: a
    token the two disagree on wildly shows as a large ratio, as in SkyRL."""
    with torch.no_grad():
        picked = mask > 0
        # `where`, not indexing: no data-dependent shape on the device (and padding's garbage stays out)
        dev = torch.where(picked, (rollout_log_probs.double() - trainer_log_probs.double()).exp() - 1.0, 0.0)
        total, squares, count = torch.stack([dev.sum(), dev.square().sum(), picked.sum().double()]).tolist()
    return total, squares, count


def ratio_mean_std(dev_sum: float, dev_squares: float, count: float) -> tuple[float, float]:
    """(mean, unbiased std) of q_t from `prob_ratio_moments` sums (added over micro-batches and
    ranks): SkyRL's `policy/rollout_train_prob_diff_mean` / `_std` (torch's std: n - 1; NaN for
    one token)."""
    if count <= 0:
        raise ValueError("ratio_mean_std: no tokens")
    mean_dev = dev_sum / count
    if count < 2:
        return 1.0 + mean_dev, float("nan")
    variance = max(0.0, (dev_squares - dev_sum * mean_dev) / (count - 1))
    return 1.0 + mean_dev, math.sqrt(variance)
