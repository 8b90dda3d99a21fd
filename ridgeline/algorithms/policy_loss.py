"""Policy-gradient surrogate losses.

Every loss has the same signature,

    fn(log_probs, old_log_probs, advantages, loss_mask, config, rollout_log_probs=None)
        -> (scalar loss, metrics: dict[str, float])

All tensors are [B, T]. `config` is the `trainer.algorithm` section of the config (a
read-only OmegaConf map, `ridgeline.config.loss_view`, read by attribute). Each loss builds a per-token loss l_t and reduces it
with `reduce_loss(l, loss_mask, config.loss_reduction)`, which picks up the mini-batch
normalisers the worker sets with `loss_normalizers(...)`.

Notation: r_t = pi(y_t) / pi_old(y_t) is the importance ratio, A_t the advantage and sg[.] a
stop-gradient. With rollout log-probs given and `config.off_policy_correction` (or use_tis) on,
every loss multiplies l_t by the correction's weights and masks before reducing (off_policy.py).

Metrics shared by all losses (masked means over the loss_mask tokens unless noted):
    clip_frac       share of tokens clipped by the loss (no gradient through the ratio term),
                    = clip_frac_low + clip_frac_high
    clip_frac_low   clipped below: r_t < 1 - eps_low (with A_t < 0 for PPO-style losses)
    clip_frac_high  clipped above: r_t > 1 + eps_high (with A_t > 0 for PPO-style losses)
    ratio_mean      the ratio the loss used
    ratio_max       its max over the masked tokens (0 for an empty mask)
    ppo_kl          mean of log pi_old - log pi, the k1 estimate of KL(pi_old || pi)
Keys ending in `_max` aggregate across micro-batches as a max, all others as token-weighted means.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import functools
import logging

import torch
from torch import Tensor

if TYPE_CHECKING:  # a policy loss's `config` (ridgeline.config sits above this layer)
    from ridgeline.config.loss_view import LossConfig
from ridgeline.algorithms.off_policy import off_policy_correction
from ridgeline.algorithms.reductions import masked_mean, reduce_loss
from ridgeline.algorithms.registry import register_policy_loss

logger = logging.getLogger(__name__)

# exp(20) ~ 4.9e8: far outside any clip range, yet finite, so a token the policy moved wildly
# (or a garbage log-prob) cannot overflow exp() into inf and then into NaN in the loss.
_LOG_RATIO_CLAMP = 20.0

Metrics = dict[str, float]


# ----------------------------------------------------------------------------- shared pieces


def _on_real_tokens(values: Tensor, loss_mask: Tensor) -> Tensor:
    """`values` with the padding set to 0. Whatever garbage sits there (inf, NaN) would otherwise
    reach the reduction, where `inf * 0` or `NaN * 0` in the mask is NaN; `where` also sends the
    padding a zero gradient rather than a NaN one."""
    return torch.where(loss_mask > 0, values, torch.zeros_like(values))


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor) -> Tensor:
    """log pi - log pi_old in float32 (bf16 differences are too coarse for a 0.2 clip range), 0 on
    the padding and clamped to +-20 so exp() stays finite; the gradient flows through log_probs only."""
    diff = _on_real_tokens(log_probs.float() - old_log_probs.detach().float(), loss_mask)
    return diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _prepare(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
             loss_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log-ratio, ratio r, advantages): float32, 0 (r = 1) on the padding, only r with gradient."""
    log_ratio = _log_ratio(log_probs, old_log_probs, loss_mask)
    return log_ratio, log_ratio.exp(), _on_real_tokens(advantages.detach().float(), loss_mask)


def _ppo_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and the masks of the tokens where the
    clipped branch is strictly larger (so no gradient), split by which bound did it."""
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    # Strict inequalities: at a tie both branches have the same value and gradient.
    clipped_low = (adv < 0) & (ratio < 1.0 - eps_low)
    clipped_high = (adv > 0) & (ratio > 1.0 + eps_high)
    return per_token, clipped_low, clipped_high


def _common_metrics(ratio: Tensor, log_ratio: Tensor, loss_mask: Tensor, clipped_low: Tensor | None = None,
                    clipped_high: Tensor | None = None, **extra: Tensor) -> Metrics:
    """The shared metric keys (and any `extra` per-token indicators, averaged over the mask),
    turned into floats with a single device sync."""
    with torch.no_grad():
        mask = loss_mask > 0
        none = torch.zeros_like(mask)
        low = none if clipped_low is None else clipped_low
        high = none if clipped_high is None else clipped_high
        ratio = ratio.detach()
        # ratios are positive, so 0 on the padding leaves the max of the real tokens (or 0)
        ratio_max = torch.where(mask, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(())
        values = {
            "clip_frac": masked_mean((low | high).float(), loss_mask),
            "clip_frac_low": masked_mean(low.float(), loss_mask),
            "clip_frac_high": masked_mean(high.float(), loss_mask),
            "ratio_mean": masked_mean(ratio, loss_mask),
            "ratio_max": ratio_max,
            "ppo_kl": masked_mean(-log_ratio.detach(), loss_mask),
            **{key: masked_mean(v.detach().float(), loss_mask) for key, v in extra.items()},
        }
        floats = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
    return dict(zip(values, floats))


def _reduce(per_token: Tensor, loss_mask: Tensor, config: LossConfig, old_log_probs: Tensor,
            rollout_log_probs: Tensor | None, metrics: Metrics) -> tuple[Tensor, Metrics]:
    """Apply the off-policy correction, then the configured reduction: the one exit of every loss.

    With rollout logprobs and `off_policy_correction` (or SkyRL 0.3.1's use_tis) on, l_t <- f_t l_t,
    f_t the truncated importance weight times the masks of `off_policy.off_policy_correction` (no
    gradient). The factor multiplies the whole per-token loss, so it composes with every surrogate,
    clipped or not; the reduction keeps the original mask, so dropped tokens still count in its
    denominator (SkyRL 0.4's normalisation).
    """
    if rollout_log_probs is not None:
        factor, extra = off_policy_correction(old_log_probs, rollout_log_probs, loss_mask, config)
        if factor is not None:
            per_token = per_token * factor
            metrics.update(extra)
    return reduce_loss(per_token, loss_mask, config.loss_reduction), metrics


@functools.lru_cache(maxsize=None)
def _warn_reduction_once(loss: str, reduction: str, expected: str = "sequence_mean") -> None:
    """Warn (once per loss and reduction: the cache remembers the call) when a loss runs with a
    reduction other than its paper's; not an error, a user may want to compare."""
    if reduction != expected:
        logger.warning("policy loss %r is defined with loss_reduction=%r; running with %r instead",
                       loss, expected, reduction)


def _needs_rollout(loss: str, rollout_log_probs: Tensor | None) -> Tensor:
    if rollout_log_probs is None:
        raise ValueError(f"policy loss {loss} weighs tokens against the engine's logprobs, and this batch has none "
                         "(generator.sampling_params.logprobs, or an engine that returns them)")
    return rollout_log_probs


def _ratio_range(name: str, ratio: Tensor, clipped: Tensor, loss_mask: Tensor) -> Metrics:
    """SkyRL 0.4's loss_metrics/<name>_{mean,clamped_mean,max,min} over the loss tokens (max/min 0
    for an empty mask)."""
    with torch.no_grad():
        real = loss_mask > 0
        picked = ratio[real]
        empty = ratio.new_zeros(())
        values = [masked_mean(ratio, loss_mask), masked_mean(clipped, loss_mask),
                  picked.max() if picked.numel() else empty, picked.min() if picked.numel() else empty]
        floats = torch.stack([v.float().reshape(()) for v in values]).tolist()
    return {f"loss_metrics/{name}_{k}": v for k, v in zip(("mean", "clamped_mean", "max", "min"), floats)}


def _covariance(log_probs: Tensor, adv: Tensor, loss_mask: Tensor) -> Tensor:
    """cov_t = (A_t - mean A) (log pi_t - mean log pi), means over the masked tokens, no gradient:
    the per-token contribution to Cov(log pi, A), which drives the change of policy entropy."""
    with torch.no_grad():
        lp = _on_real_tokens(log_probs.detach().float(), loss_mask)
        return (adv - masked_mean(adv, loss_mask)) * (lp - masked_mean(lp, loss_mask))


# ----------------------------------------------------------------------------- losses


@register_policy_loss("regular")
def ppo_clip_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
                  rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), with the asymmetric range
    of DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476) when eps_clip_high > eps_clip_low:

        l_t = max( -A_t r_t,  -A_t clip(r_t, 1 - eps_clip_low, 1 + eps_clip_high) )
    """
    log_ratio, ratio, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)
    per_token, low, high = _ppo_surrogate(ratio, adv, config.eps_clip_low, config.eps_clip_high)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, low, high)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("dual_clip")
def dual_clip_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
                   rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    arXiv 1912.09729): the regular l_t, further bounded for negative advantages,

        l'_t = min( l_t, -A_t c )  if A_t < 0,  else l_t,      c = clip_ratio_c > 1

    For A_t < 0 the regular loss grows without bound in r_t, so one token the policy drifted far
    towards could dominate the update; the bound caps it at r_t = c (no gradient there).
    Extra metric: dual_clip_frac (share of tokens where the bound is active; not in clip_frac).
    """
    c = float(config.clip_ratio_c)
    if c <= 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {c}")
    log_ratio, ratio, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)
    per_token, low, high = _ppo_surrogate(ratio, adv, config.eps_clip_low, config.eps_clip_high)
    bound = -adv * c
    bounded = (adv < 0) & (bound < per_token.detach())
    per_token = torch.where(bounded, bound, per_token)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, low, high, dual_clip_frac=bounded)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("gspo")
def gspo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
              rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071).
    The importance ratio is the sequence's length-normalised likelihood ratio,

        s_i   = exp( (1/|y_i|) sum_t (log pi(y_it) - log pi_old(y_it)) )
        s_it  = sg[s_i] * pi(y_it) / sg[pi(y_it)]            (value s_i, gradient per token)
        l_it  = max( -A_it s_it,  -A_it clip(s_it, 1 - eps_clip_low, 1 + eps_clip_high) )

    so a whole response is clipped or kept together. With A_it = A_i this is GSPO exactly; the
    paper averages per sequence, so loss_reduction=sequence_mean is expected (a warning otherwise).
    ratio_mean / ratio_max are of s_i; ppo_kl stays the per-token k1 estimate.
    """
    _warn_reduction_once("gspo", config.loss_reduction)
    log_ratio, _, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)
    # a mean of log-ratios clamped to +-20 stays within +-20, so exp() stays finite
    seq_log_ratio = masked_mean(log_ratio.detach(), loss_mask, dim=-1).unsqueeze(-1)
    lp = _on_real_tokens(log_probs.float(), loss_mask)
    # lp - sg[lp] is 0 in value and 1 in gradient: the value is s_i, the gradient per token
    ratio = torch.exp(seq_log_ratio + (lp - lp.detach()))
    per_token, low, high = _ppo_surrogate(ratio, adv, config.eps_clip_low, config.eps_clip_high)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, low, high)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("cispo")
def cispo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
               rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585): clip the importance weight, not the
    update, so every token keeps its gradient,

        l_t = -sg[ clip(r_t, 1 - cispo_eps_clip_low, 1 + cispo_eps_clip_high) ] A_t log pi(y_t)

    (the REINFORCE gradient weighted by a bounded ratio). clip_frac_low / clip_frac_high count the
    tokens whose weight hit the lower / upper bound, whatever the sign of A_t.

    SkyRL 0.4's `cispo.cispo_anchor`: "old" takes r_t against pi_old (the paper's; r_t = 1 on a
    batch's first optimizer step), "rollout" against the engine's pi_rollout, so that the bounded
    weight is itself the off-policy correction (asynchronous runs; TIS on top is refused). Extra
    metrics, SkyRL 0.4's: loss_metrics/cispo/ratio_{mean,clamped_mean,max,min} of r_t and of its
    clipped value over the loss tokens.
    """
    cispo = config.cispo
    lower, upper = 1.0 - cispo.cispo_eps_clip_low, 1.0 + cispo.cispo_eps_clip_high
    behaviour = old_log_probs
    if cispo.cispo_anchor == "rollout":
        behaviour = _needs_rollout("cispo with cispo.cispo_anchor=rollout", rollout_log_probs)
    log_ratio, ratio, adv = _prepare(log_probs, behaviour, advantages, loss_mask)
    weight = ratio.detach().clamp(lower, upper)
    per_token = -weight * adv * _on_real_tokens(log_probs.float(), loss_mask)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, ratio < lower, ratio > upper)
    metrics.update(_ratio_range("cispo/ratio", ratio.detach(), weight, loss_mask))
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


DRO_BETA = 0.05   # the Tinker docs' example value: no source states another default


@register_policy_loss("rollout_is")
def rollout_is_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor,
                    config: LossConfig, rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """SkyRL 0.4's `rollout_is` (GLM-5 tech report, arXiv 2602.15763, section 4.1.2): the
    importance weight is taken against the engine's logprobs and zeroed outside the trust range
    (IcePop-style), with a stop-gradient,

        q_t = pi(y_t) / pi_rollout(y_t),   w_t = q_t if 1 - eps_clip_low < q_t < 1 + eps_clip_high else 0
        l_t = -sg[w_t] A_t log pi(y_t)

    It needs no pi_old: the one importance ratio is to the sampler (asynchronous runs, where the
    trainer's pi_old is not what sampled). clip_frac counts the zeroed tokens (low: q_t <= 1 -
    eps_clip_low, high: q_t >= 1 + eps_clip_high); ratio_* and ppo_kl are of q_t.
    """
    rollout = _needs_rollout("rollout_is", rollout_log_probs)
    log_ratio, ratio, adv = _prepare(log_probs, rollout, advantages, loss_mask)
    low, high = ratio <= 1.0 - config.eps_clip_low, ratio >= 1.0 + config.eps_clip_high
    weight = torch.where(low | high, torch.zeros_like(ratio), ratio).detach()
    per_token = -weight * adv * _on_real_tokens(log_probs.float(), loss_mask)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, low, high)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("dppo")
def dppo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
              rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """DPPO, binary variants (Divergence Proximal Policy Optimization, "Rethinking the Trust Region
    in LLM RL", arXiv 2602.04879; SkyRL 0.4's `dppo`). The trust region is a divergence between
    probabilities, not a ratio: with mu the engine's policy (pi_old when there are no rollout
    logprobs), p = pi(y_t), p_mu = mu(y_t), q_t = p / p_mu,

        binary_tv:  drop if A_t > 0 and p - p_mu > delta_high,  or A_t < 0 and p_mu - p > delta_low
        binary_kl:  D = p_mu log(p_mu / p) + (1 - p_mu) log((1 - p_mu + 1e-8) / (1 - p + 1e-8));
                    drop if A_t > 0, p > p_mu and D > delta_high,  or A_t < 0, p < p_mu and D > delta_low
        l_t = -q_t A_t (1 - drop_t)

    (the mask has no gradient). clip_frac counts the dropped tokens (low: A_t < 0, high: A_t > 0).
    """
    d = config.dppo
    mu = rollout_log_probs if rollout_log_probs is not None else old_log_probs
    log_ratio, ratio, adv = _prepare(log_probs, mu, advantages, loss_mask)
    with torch.no_grad():
        lp = _on_real_tokens(log_probs.detach().float(), loss_mask)
        p = lp.exp()
        mu_lp = _on_real_tokens(mu.float(), loss_mask)
        p_mu = mu_lp.exp()
        moved = p - p_mu
        if d.dppo_type == "binary_tv":
            high = (adv > 0) & (moved > d.delta_high)
            low = (adv < 0) & (-moved > d.delta_low)
        elif d.dppo_type == "binary_kl":
            kl = p_mu * (mu_lp - lp) + (1 - p_mu) * torch.log((1 - p_mu + 1e-8) / (1 - p + 1e-8))
            high = (adv > 0) & (moved > 0) & (kl > d.delta_high)
            low = (adv < 0) & (moved < 0) & (kl > d.delta_low)
        else:
            raise ValueError(f"dppo.dppo_type must be binary_tv or binary_kl, got {d.dppo_type!r}")
    per_token = torch.where(low | high, torch.zeros_like(ratio), -ratio * adv)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, low, high)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("clip_cov")
def clip_cov_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
                  rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).
    Entropy collapses through tokens with a large covariance between log-prob and advantage,

        cov_t = (A_t - mean A) (log pi_t - mean log pi)          (means over masked tokens)

    so the regular PPO loss is kept except on a few of them: among the masked tokens not already
    clipped by PPO with clip_cov_lb < cov_t < clip_cov_ub, choose uniformly at random
    k = min(max(int(clip_ratio * n_masked), 1), n_candidates) and set their l_t to 0 (no gradient).
    Uses the global torch RNG. Extra metric: clip_cov_frac (share of tokens zeroed).
    """
    cc = config.clip_cov
    log_ratio, ratio, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)
    per_token, low, high = _ppo_surrogate(ratio, adv, config.eps_clip_low, config.eps_clip_high)

    mask = loss_mask > 0
    cov = _covariance(log_probs, adv, loss_mask)
    candidates = mask & ~(low | high) & (cov > cc.clip_cov_lb) & (cov < cc.clip_cov_ub)
    n_masked = int(mask.sum())
    candidate_idx = candidates.flatten().nonzero().squeeze(-1)
    k = min(max(int(cc.clip_ratio * n_masked), 1), candidate_idx.numel())
    chosen_idx = candidate_idx[torch.randperm(candidate_idx.numel(), device=candidate_idx.device)[:k]]
    chosen = torch.zeros_like(candidates).flatten()
    chosen[chosen_idx] = True
    chosen = chosen.view_as(candidates)

    per_token = torch.where(chosen, torch.zeros_like(per_token), per_token)
    metrics = _common_metrics(ratio, log_ratio, loss_mask, low, high, clip_cov_frac=chosen)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("kl_cov")
def kl_cov_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
                rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).
    No clipping; instead the k masked tokens with the largest cov_t (as in clip_cov_loss),
    k = max(1, int(kl_cov_frac * n_masked)), get a KL penalty that holds them near pi_old:

        l_t = -A_t r_t + ppo_kl_coef |log pi(y_t) - log pi_old(y_t)|   for the top-k tokens
        l_t = -A_t r_t                                                  otherwise

    Extra metric: kl_cov_frac (share of tokens penalised). clip_frac is 0.
    """
    kc = config.kl_cov
    log_ratio, ratio, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)

    mask = loss_mask > 0
    n_masked = int(mask.sum())
    cov = _covariance(log_probs, adv, loss_mask)
    k = min(max(1, int(kc.kl_cov_frac * n_masked)), n_masked)
    # -inf on padding so top-k only ever picks real tokens (k <= n_masked)
    ranked = torch.where(mask, cov, torch.full_like(cov, -torch.inf)).flatten()
    penalised = torch.zeros_like(mask).flatten()
    penalised[torch.topk(ranked, k).indices] = True
    penalised = penalised.view_as(mask)

    per_token = -adv * ratio + torch.where(penalised, kc.ppo_kl_coef * log_ratio.abs(), torch.zeros_like(ratio))
    metrics = _common_metrics(ratio, log_ratio, loss_mask, kl_cov_frac=penalised)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("sapo")
def sapo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
              rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """SAPO (Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a smooth
    temperature-controlled gate in place of the hard clip,

        f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau,     tau = tau_pos if A_t > 0 else tau_neg
        l_t       = -f(r_t; tau) A_t

    f'(1) = 1, so on-policy the gradient is the plain policy gradient; away from r = 1 the
    gradient f'(r) r decays smoothly instead of dropping to 0. tau_neg > tau_pos damps
    negative-advantage tokens faster. The paper averages per sequence, so
    loss_reduction=sequence_mean is expected (a warning otherwise). clip_frac is 0.
    """
    _warn_reduction_once("sapo", config.loss_reduction)
    log_ratio, ratio, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)
    tau = torch.where(adv > 0, torch.full_like(adv, float(config.sapo.tau_pos)),
                      torch.full_like(adv, float(config.sapo.tau_neg)))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    per_token = -gate * adv
    metrics = _common_metrics(ratio, log_ratio, loss_mask)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("importance_sampling")
def importance_sampling_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor,
                             config: LossConfig, rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """Importance-sampled policy gradient, no clipping (Tinker's `importance_sampling` loss, the
    one of SkyRL's on-policy distillation example):

        l_t = -r_t A_t,      r_t = pi(y_t) / pi_old(y_t)

    Its gradient is -A_t r_t grad log pi(y_t): the REINFORCE gradient, reweighted to the sampling
    policy when the batch takes several optimizer steps (r_t = 1 on the first). SkyRL's example
    reduces it with seq_mean_token_sum_norm whatever loss_reduction says; here the configured
    reduction is used (the on_policy_distillation preset sets seq_mean_token_sum_norm) and any other
    is warned about once. clip_frac is 0.
    """
    _warn_reduction_once("importance_sampling", config.loss_reduction, expected="seq_mean_token_sum_norm")
    log_ratio, ratio, adv = _prepare(log_probs, old_log_probs, advantages, loss_mask)
    per_token = -ratio * adv
    metrics = _common_metrics(ratio, log_ratio, loss_mask)
    return _reduce(per_token, loss_mask, config, old_log_probs, rollout_log_probs, metrics)


@register_policy_loss("dro")
def dro_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, config: LossConfig,
             rollout_log_probs: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """DRO (Richemond et al. 2024, arXiv 2405.19107; the Tinker API's `dro`): an offline policy
    gradient held near the sampler q by a quadratic penalty,

        l_t = -(A_t log p_t - beta/2 (log p_t - log q_t)^2),   beta = config.dro_beta (0.05 when absent)
    """
    beta = float(config.get("dro_beta", DRO_BETA))
    log_ratio = log_probs.float() - old_log_probs.detach().float()
    per_token = -(advantages.detach().float() * log_probs.float() - 0.5 * beta * log_ratio.square())
    return reduce_loss(per_token, loss_mask, config.loss_reduction), {}
