"""``trainer.algorithm.*``: advantage estimator, policy loss, KL, dynamic sampling, DAPO's overlong
punishment (SkyRL-Train 0.3.1's keys)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, ClassVar, List, Optional

from ridgeline.config.fields import Report, Section, one_of, setting, show


@dataclass
class KLControlConfig(Section):
    # how beta of the KL-in-reward penalty (use_kl_in_reward) moves: fixed at kl_loss_coef, or adaptive toward
    # kl_target
    type: str = setting("fixed", choices=("fixed", "adaptive"))
    # the adaptive controller's target KL per token
    kl_target: float = setting(0.1)
    # the adaptive controller's horizon in samples: how fast beta follows the KL
    horizon: int = setting(10000)


@dataclass
class DynamicSamplingConfig(Section):
    # DAPO's dynamic sampling: filter = sample more batches until train_batch_size prompt groups have reward
    # variance; replace = copy groups with signal over those without; null = off
    type: Optional[str] = setting(None, choices=(None, "filter", "replace"))
    # filter: batches sampled at most in one step; short of train_batch_size groups then, the step trains on
    # those it has (with a warning)
    max_sample_batches: int = setting(30)
    # replace: the share of groups with signal a batch needs for the replacement to happen
    min_replace_ratio: float = setting(0.3)

    def check(self, at: str, report: Report) -> None:
        if self.type == "filter" and self.max_sample_batches < 1:
            report.add(f"{at}.max_sample_batches={show(self.max_sample_batches)} must be at least 1: it is how many "
                       f"batches filter may generate in one step. Fix: e.g. {at}.max_sample_batches=30.")
        if self.type == "replace" and not 0 <= self.min_replace_ratio <= 1:
            report.add(f"{at}.min_replace_ratio={show(self.min_replace_ratio)} must be in [0, 1]: the share of groups "
                       f"with signal needed before the others are replaced. Fix: e.g. {at}.min_replace_ratio=0.3.")


# Settings of single policy losses (SkyRL key names); each is read only by its loss.
@dataclass
class CISPOConfig(Section):
    # CISPO clips its importance weight below at 1 - this
    cispo_eps_clip_low: float = setting(0.0)
    # CISPO clips its importance weight above at 1 + this
    cispo_eps_clip_high: float = setting(5.0)
    # SkyRL 0.4: the policy the clipped weight is taken against: "old" (pi / pi_old, the paper's) or
    # "rollout" (pi / pi_rollout: the weight is then itself the off-policy correction, for async runs)
    cispo_anchor: str = setting("old", choices=("old", "rollout"))


@dataclass
class DPPOConfig(Section):
    """SkyRL 0.4's `dppo` loss (Divergence PPO, arXiv 2602.04879): tokens whose probability moved
    too far from the sampler's lose their gradient."""
    # which divergence decides: "binary_tv" (|p - p_rollout|) or "binary_kl" (Bernoulli KL of the two)
    dppo_type: str = setting("binary_tv", choices=("binary_tv", "binary_kl"))
    delta_low: float = setting(0.2)    # threshold for negative advantages (0.2 for TV, 0.05 for KL)
    delta_high: float = setting(0.2)   # threshold for positive advantages (0.2 for TV, 0.05 for KL)


@dataclass
class OffPolicyCorrectionConfig(Section):
    """SkyRL 0.4's `trainer.algorithm.off_policy_correction`: weights and masks from the per-token
    ratio rho_t = pi_old(y_t) / pi_rollout(y_t) between the trainer and the engine that sampled,
    applied to every policy loss (ridgeline.algorithms.off_policy; docs/algorithms.md)."""
    # null | "token" | "sequence": multiply each token's loss by min(rho_t, token cap), or each
    # sequence's by min(prod_t rho_t, sequence cap) (truncated importance sampling)
    tis_ratio_type: Optional[str] = setting(None, choices=(None, "token", "sequence"))
    token_tis_ratio_clip_high: float = setting(2.0)      # the token cap (1.5-5 is usual)
    sequence_tis_ratio_clip_high: float = setting(5.0)   # the sequence cap (2-10 is usual)
    # null | "geometric" | "product": drop a sequence whose (prod_t rho_t)^(1/T) or prod_t rho_t
    # lies outside [low, high] below
    sequence_mask_metric: Optional[str] = setting(None, choices=(None, "geometric", "product"))
    # geometric sequence mask: upper bound on (prod_t rho_t)^(1/T)
    geo_mask_high: float = setting(1.01)
    # geometric sequence mask: lower bound on (prod_t rho_t)^(1/T)
    geo_mask_low: float = setting(0.99)
    # product sequence mask: upper bound on prod_t rho_t
    product_mask_high: float = setting(2.0)
    # product sequence mask: lower bound on prod_t rho_t
    product_mask_low: float = setting(0.5)
    # drop a whole sequence when any of its tokens has rho_t below low / above high (either may be set)
    outlier_token_is_threshold_low: Optional[float] = setting(None, example="1e-4")
    # drop a sequence holding a token with rho_t above this (null: no upper bound)
    outlier_token_is_threshold_high: Optional[float] = setting(None, example="100")
    # IcePop: drop single tokens whose rho_t lies outside [low, high] (on only when both are set)
    token_mask_is_threshold_low: Optional[float] = setting(None, example="0.5")
    # IcePop's upper bound on rho_t
    token_mask_is_threshold_high: Optional[float] = setting(None, example="2.0")

    def check(self, at: str, report: Report) -> None:
        positive = [("token_tis_ratio_clip_high", "token")] if self.tis_ratio_type == "token" else []
        if self.tis_ratio_type == "sequence":
            positive = [("sequence_tis_ratio_clip_high", "sequence")]
        for name, kind in positive:
            if getattr(self, name) <= 0:
                report.add(f"{at}.{name}={show(getattr(self, name))} must be greater than 0: it caps the {kind} "
                           f"importance weight. Fix: e.g. {at}.{name}={show(getattr(OffPolicyCorrectionConfig(), name))}.")
        bounds = {"geometric": ("geo_mask_low", "geo_mask_high"), "product": ("product_mask_low", "product_mask_high")}
        pairs = [bounds[self.sequence_mask_metric]] if self.sequence_mask_metric in bounds else []
        pairs += [("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
                  ("token_mask_is_threshold_low", "token_mask_is_threshold_high")]
        for low, high in pairs:
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and lo < 0 or hi is not None and hi <= 0:
                report.add(f"{at}.{low}={show(lo)} / {at}.{high}={show(hi)}: ratio bounds must be positive. "
                           f"Fix: e.g. {at}.{low}={show(getattr(OffPolicyCorrectionConfig(), low) or 0.5)}.")
            elif lo is not None and hi is not None and lo >= hi:
                report.add(f"{at}.{low}={show(lo)} must be below {at}.{high}={show(hi)}: the ratios between them "
                           f"are kept. Fix: e.g. {at}.{low}=0.5 {at}.{high}=2.0.")
        if (self.token_mask_is_threshold_low is None) != (self.token_mask_is_threshold_high is None):
            report.add(f"{at}.token_mask_is_threshold_low={show(self.token_mask_is_threshold_low)} and "
                       f"{at}.token_mask_is_threshold_high={show(self.token_mask_is_threshold_high)}: the token mask "
                       f"(IcePop) is on only when both are set (SkyRL ignores one alone). Fix: set both, e.g. "
                       f"{at}.token_mask_is_threshold_low=0.5 {at}.token_mask_is_threshold_high=2.0, or neither.")


@dataclass
class ClipCovConfig(Section):
    # clip_cov: the share of tokens whose gradient is dropped
    clip_ratio: float = setting(0.0002)
    # clip_cov: lower bound of the covariance a dropped token may have
    clip_cov_lb: float = setting(1.0)
    # clip_cov: upper bound of the covariance a dropped token may have
    clip_cov_ub: float = setting(5.0)


@dataclass
class KLCovConfig(Section):
    # kl_cov: the share of tokens (highest covariance first) that get the KL penalty
    kl_cov_frac: float = setting(0.2)
    # kl_cov: the coefficient of the |log pi - log pi_old| penalty
    ppo_kl_coef: float = setting(1.0)


@dataclass
class SAPOConfig(Section):
    # SAPO's gate temperature for positive advantages
    tau_pos: float = setting(1.0)
    # SAPO's gate temperature for negative advantages
    tau_neg: float = setting(1.05)


# the settings each built-in loss reads: (key below trainer.algorithm, holds, in words)
LOSS_SETTINGS: dict[str, list[tuple[str, Callable[[float], bool], str]]] = {
    "dual_clip": [("clip_ratio_c", lambda v: v > 1, "greater than 1")],
    "cispo": [("cispo.cispo_eps_clip_low", lambda v: 0 <= v <= 1, "in [0, 1]"),
              ("cispo.cispo_eps_clip_high", lambda v: v >= 0, "0 or more")],
    "clip_cov": [("clip_cov.clip_ratio", lambda v: 0 < v <= 1, "in (0, 1]")],
    "kl_cov": [("kl_cov.kl_cov_frac", lambda v: 0 < v <= 1, "in (0, 1]"),
               ("kl_cov.ppo_kl_coef", lambda v: v >= 0, "0 or more")],
    "sapo": [("sapo.tau_pos", lambda v: v > 0, "greater than 0"),
             ("sapo.tau_neg", lambda v: v > 0, "greater than 0")],
    "dppo": [("dppo.delta_low", lambda v: v > 0, "greater than 0"),
             ("dppo.delta_high", lambda v: v > 0, "greater than 0")],
    "rollout_is": [("eps_clip_low", lambda v: 0 <= v < 1, "in [0, 1)")],
}


@dataclass
class AlgorithmConfig(Section):
    # built-in estimators that ignore critic values (a user's estimator may read them)
    CRITIC_FREE_ESTIMATORS: ClassVar[tuple[str, ...]] = ("grpo", "rloo", "reinforce++", "no_op", "maxrl")

    advantage_estimator: str = setting("grpo")   # a registered name, or "my_pkg.module:function"
    # Ridgeline extension: modules (dotted names or .py files) imported before the names above are
    # looked up, so the estimators and losses they register (@register_advantage_estimator /
    # @register_policy_loss, SkyRL's custom main file) can be named; every policy rank imports them too.
    algorithm_modules: List[str] = setting([])
    # GRPO divides each prompt group's centred rewards by their standard deviation (false: Dr. GRPO's centring
    # only)
    grpo_norm_by_std: bool = setting(True)
    # SkyRL 0.3.1's switch: the k3 KL estimator (kl_estimator_type, when set, wins)
    use_kl_estimator_k3: bool = setting(True)
    # SkyRL 0.3.1's switch: the |log ratio| KL estimator (wins over use_kl_estimator_k3; kl_estimator_type wins
    # over both)
    use_abs_kl: bool = setting(False)
    # the KL estimator of the KL terms (k1, k2, k3 or abs); null: use_abs_kl / use_kl_estimator_k3 decide
    kl_estimator_type: Optional[str] = setting(None, choices=(None, "k1", "k2", "k3", "abs"))
    # subtract beta x KL(pi_old || ref) from each token's reward (beta from kl_ctrl) instead of a KL loss term
    use_kl_in_reward: bool = setting(False)
    # Ridgeline extension (SkyRL's on_policy_distillation example trainer): with use_kl_in_reward the
    # reward is the KL term alone, r_t = -kl_loss_coef * (log pi_old(y_t) - log pi_ref(y_t)), the
    # environment's reward is dropped, and trainer.ref.model.path is the teacher.
    on_policy_distillation: bool = setting(False)
    # add kl_loss_coef x KL(pi || ref) to the policy loss
    use_kl_loss: bool = setting(True)
    # the KL loss term's coefficient (and the fixed controller's beta)
    kl_loss_coef: float = setting(0.001)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # subtract entropy_loss_coef x the policy's entropy from its loss
    use_entropy_loss: bool = setting(False)
    # the entropy bonus's coefficient
    entropy_loss_coef: float = setting(0.01)
    # whiten the advantages over every response token of the batch (mean 0, std 1) after the estimator
    advantage_batch_normalize: bool = setting(False)
    # the critic's value head's name in its state dict and saved files
    value_head_prefix: str = setting("value_head")
    # the policy loss, a registered name (SkyRL 0.3.1's key; policy_loss_type, when set, wins)
    ppo_loss_type: str = setting("regular")
    policy_loss_type: Optional[str] = setting(None)   # null: ppo_loss_type names the loss
    # token_mean: the mini-batch's token mean (SkyRL 0.4's); token_mean_legacy: SkyRL 0.3.1's mean of the
    # micro-batches' token means; prompt_mean (0.4): the token mean of each prompt group, averaged over prompts
    loss_reduction: str = setting("token_mean", choices=("token_mean", "token_mean_legacy", "sequence_mean",
                                                         "seq_mean_token_sum_norm", "prompt_mean"))
    # GAE's lambda
    lambd: float = setting(1.0)
    # the discount of GAE and the returns
    gamma: float = setting(1.0)
    # the PPO ratio is clipped below at 1 - eps_clip_low
    eps_clip_low: float = setting(0.2)
    # the PPO ratio is clipped above at 1 + eps_clip_high
    eps_clip_high: float = setting(0.2)
    clip_ratio_c: float = setting(3.0)   # read only by the dual_clip policy loss
    # read only by the dro policy loss: beta of its penalty beta/2 (log p - log q)^2, which holds the
    # policy near the sampler q (Ridgeline's key; policy_loss.DRO_BETA, the Tinker API's `beta`)
    dro_beta: float = setting(0.05)
    # the critic's clipped value loss keeps new values within this of the old ones; 0 or less: unclipped
    value_clip: float = setting(0.2)
    # with a critic, divide rewards by their running standard deviation
    normalize_reward: bool = setting(True)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    # SkyRL 0.3.1: rows of a prompt group whose rewards are all equal get no loss (mask 0)
    zero_variance_filter: bool = setting(False)
    # SkyRL 0.4: two returns within this absolute tolerance count as equal for zero_variance_filter
    # (float rewards such as an LLM judge's)
    zero_variance_filter_tol: float = setting(1e-6)
    # SkyRL 0.4: the temperature the policy loss scales logits by; null: generator.sampling_params.temperature
    temperature: Optional[float] = setting(None)
    # SkyRL 0.4: the constant seq_mean_token_sum_norm divides each row's loss sum by; null: SkyRL
    # 0.3.1's derived generator.max_input_length + generator.sampling_params.max_generate_length
    max_seq_len: Optional[int] = setting(None)
    # SkyRL 0.3.1's TIS switch, kept: use_tis=true is off_policy_correction.tis_ratio_type=token with
    # token_tis_ratio_clip_high=tis_imp_ratio_cap (SkyRL 0.4's mapping, made in one place:
    # ridgeline.algorithms.off_policy.tis_setting)
    use_tis: bool = setting(False)
    # use_tis's cap of the token importance weight (must be positive with use_tis)
    tis_imp_ratio_cap: float = setting(-1.0)
    off_policy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KLCovConfig = field(default_factory=KLCovConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)
    # DAPO soft overlong punishment (the keys of SkyRL's DAPO recipe). null = off. A response
    # longer than max_generate_length - overlong_buffer_len loses reward linearly, down to
    # -overlong_buffer_penalty_factor at max_generate_length.
    overlong_buffer_len: Optional[int] = setting(None)
    # DAPO's largest overlong penalty, reached at max_generate_length
    overlong_buffer_penalty_factor: float = setting(1.0)

    @property
    def uses_reference(self) -> bool:
        """A KL term (loss or reward) needs the reference model."""
        return self.use_kl_loss or self.use_kl_in_reward

    @property
    def loss_name(self) -> str:
        return self.policy_loss_type if self.policy_loss_type is not None else self.ppo_loss_type

    def check(self, at: str, report: Report) -> None:
        self._registered(at, report)
        if self.kl_loss_coef < 0:
            report.add(f"{at}.kl_loss_coef={show(self.kl_loss_coef)} must not be negative. "
                       f"Fix: e.g. {at}.kl_loss_coef=0.001.")
        if not 0 <= self.eps_clip_low < 1:
            report.add(f"{at}.eps_clip_low={show(self.eps_clip_low)} must be in [0, 1): the ratio is clipped below "
                       f"at 1 - eps_clip_low, which must stay positive. Fix: e.g. {at}.eps_clip_low=0.2.")
        if self.dro_beta < 0:
            report.add(f"{at}.dro_beta={show(self.dro_beta)} must not be negative: the dro loss would push the "
                       f"policy away from the sampler. Fix: e.g. {at}.dro_beta=0.05.")
        if self.eps_clip_high < 0:
            report.add(f"{at}.eps_clip_high={show(self.eps_clip_high)} must be 0 or more: the ratio is clipped above "
                       f"at 1 + eps_clip_high. Fix: e.g. {at}.eps_clip_high=0.2 (0.28 for clip-higher).")
        if self.use_kl_loss and self.use_kl_in_reward:
            report.add(f"{at}.use_kl_loss=true and {at}.use_kl_in_reward=true cannot both be on: the KL penalty to "
                       "the reference model is applied either as a loss term or subtracted from the reward, not "
                       f"both. Fix: keep the KL loss ({at}.use_kl_in_reward=false), or move it into the reward "
                       f"({at}.use_kl_loss=false).")
        if self.use_tis and self.tis_imp_ratio_cap <= 0:
            report.add(f"{at}.use_tis=true needs a positive {at}.tis_imp_ratio_cap (got {self.tis_imp_ratio_cap}): "
                       "it caps the importance weight exp(old - rollout logprob) of each token. Fix: "
                       f"{at}.tis_imp_ratio_cap=2.0 (a common choice), or use_tis=false.")
        self.off_policy_correction.check(f"{at}.off_policy_correction", report)
        if self.use_tis and self.off_policy_correction.tis_ratio_type is not None:
            report.add(f"{at}.use_tis=true and {at}.off_policy_correction.tis_ratio_type="
                       f"{show(self.off_policy_correction.tis_ratio_type)} both ask for TIS (use_tis is SkyRL 0.3.1's "
                       f"spelling of tis_ratio_type=token). Fix: keep one, e.g. {at}.use_tis=false.")
        if self.loss_name == "cispo" and self.cispo.cispo_anchor == "rollout" and (
                self.use_tis or self.off_policy_correction.tis_ratio_type is not None):
            report.add(f"{at}.cispo.cispo_anchor=rollout already weighs each token by pi / pi_rollout, which is the "
                       f"off-policy correction; TIS ({at}.use_tis / {at}.off_policy_correction.tis_ratio_type) would "
                       f"count it twice. Fix: {at}.off_policy_correction.tis_ratio_type=null {at}.use_tis=false, or "
                       f"{at}.cispo.cispo_anchor=old.")
        if self.use_kl_in_reward and self.kl_ctrl.type == "adaptive":
            for name in ("kl_target", "horizon"):
                value = getattr(self.kl_ctrl, name)
                if value <= 0:
                    report.add(f"{at}.kl_ctrl.{name}={show(value)} must be greater than 0 for the adaptive KL "
                               f"controller. Fix: e.g. {at}.kl_ctrl.{name}={show(getattr(KLControlConfig(), name))}.")
        self.dynamic_sampling.check(f"{at}.dynamic_sampling", report)
        if self.on_policy_distillation:
            self._distillation(at, report)
        if self.overlong_buffer_penalty_factor < 0:
            report.add(f"{at}.overlong_buffer_penalty_factor={show(self.overlong_buffer_penalty_factor)} must not be "
                       f"negative (it is the reward lost at full length). Fix: {at}.overlong_buffer_penalty_factor=1.0.")
        self._loss_settings(at, report)

    def _distillation(self, at: str, report: Report) -> None:
        """on_policy_distillation: the teacher's KL enters as the reward, k1, with a fixed coefficient
        (trainer.ref.model.path, the teacher, is checked by the trainer section)."""
        from ridgeline.algorithms import resolve_kl_estimator

        key, preset = f"{at}.on_policy_distillation=true", "+experiment=on_policy_distillation"
        if not self.use_kl_in_reward:
            report.add(f"{key} makes the KL to the teacher the reward, but {at}.use_kl_in_reward=false leaves the KL "
                       f"out of the reward. Fix: {at}.use_kl_in_reward=true {at}.use_kl_loss=false (or {preset}).")
        try:
            estimator = resolve_kl_estimator(self.kl_estimator_type, self.use_kl_estimator_k3, self.use_abs_kl)
        except Exception:  # an unknown name is reported by its own key's choices
            estimator = "k1"
        if estimator != "k1":
            report.add(f"{key} rewards each token with -(log pi_old - log pi_teacher), the k1 estimate, whose policy "
                       f"gradient is the reverse KL's; the KL estimator here is {estimator} "
                       f"({at}.kl_estimator_type={show(self.kl_estimator_type)}, use_kl_estimator_k3="
                       f"{show(self.use_kl_estimator_k3)}, use_abs_kl={show(self.use_abs_kl)}). "
                       f"Fix: {at}.kl_estimator_type=k1.")
        if self.kl_ctrl.type == "adaptive":
            report.add(f"{key} with {at}.kl_ctrl.type=adaptive: the KL is the whole reward, so steering its "
                       f"coefficient towards a target KL only rescales the reward. Fix: {at}.kl_ctrl.type=fixed "
                       f"(the coefficient is {at}.kl_loss_coef, 1.0 in SkyRL's example).")
        if self.kl_loss_coef <= 0:
            report.add(f"{key} with {at}.kl_loss_coef={show(self.kl_loss_coef)}: the reward is -kl_loss_coef * KL, so "
                       f"it would be 0. Fix: {at}.kl_loss_coef=1.0 (SkyRL's example).")

    def _loss_settings(self, at: str, report: Report) -> None:
        loss, defaults = self.loss_name, AlgorithmConfig()
        for name, holds, words in LOSS_SETTINGS.get(loss, []):
            value, default = _dotted(self, name), _dotted(defaults, name)
            if not holds(value):
                report.add(f"{at}.{name}={show(value)} must be {words} for the {loss} policy loss. "
                           f"Fix: e.g. {at}.{name}={show(default)}.")
        if loss == "clip_cov" and self.clip_cov.clip_cov_lb >= self.clip_cov.clip_cov_ub:
            report.add(f"{at}.clip_cov.clip_cov_lb={show(self.clip_cov.clip_cov_lb)} must be below clip_cov_ub="
                       f"{show(self.clip_cov.clip_cov_ub)}: tokens whose covariance lies between them are candidates "
                       f"for clipping. Fix: e.g. {at}.clip_cov.clip_cov_lb=1.0 {at}.clip_cov.clip_cov_ub=5.0.")

    def _registered(self, at: str, report: Report) -> None:
        from ridgeline.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PolicyLoss, load_algorithm_modules

        for module in self.algorithm_modules:
            try:
                load_algorithm_modules([module])
            except Exception as exc:  # the user's module: any failure is a config problem
                report.add(f"{at}.algorithm_modules lists {module!r}, which could not be imported "
                           f"({type(exc).__name__}: {exc}). Fix: a dotted module on the Python path or a path to a "
                           ".py file.")
                return  # the names it would have registered are not there: no second problem for them
        names = [("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS, "@register_advantage_estimator"),
                 ("ppo_loss_type", self.ppo_loss_type, POLICY_LOSSES, "@register_policy_loss")]
        if self.policy_loss_type is not None:
            names.append(("policy_loss_type", self.policy_loss_type, POLICY_LOSSES, "@register_policy_loss"))
        for name, value, registry, decorator in names:
            key = f"{at}.{name}"
            if value not in registry and ":" in value:
                try:
                    registry.import_path(value)
                except Exception as exc:  # the user's module: any failure is a config problem
                    report.add(f"{key}={value} could not be imported ({type(exc).__name__}: {exc}). Fix: name a "
                               "function as 'my_pkg.my_module:my_function' on the Python path (PYTHONPATH or an "
                               "installed package).")
                    continue
            elif value not in registry:
                built = registry.names()
                close = difflib.get_close_matches(value, built, n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]}?" if close else ""
                where = (f"none of {at}.algorithm_modules={show(self.algorithm_modules)} registers it" if
                         self.algorithm_modules else f"{at}.algorithm_modules names no module of yours")
                report.add(f"{key}={value} is not a registered {registry.kind}.{hint} Registered: {one_of(built)}; "
                           f"{where}. Fix: register it in your own module with {decorator}(\"{value}\") from "
                           f"ridgeline.algorithms (SkyRL's custom main file) and add that module, e.g. "
                           f"{at}.algorithm_modules=[my_algorithms.py]; or name the function itself, "
                           f"{key}=my_pkg.my_module:my_function.")
                continue
            if registry is POLICY_LOSSES and value == "dpo":
                # rows of (chosen, rejected) pairs with the reference's logprobs: only `ridgeline dpo` builds them
                report.add(f"{key}=dpo trains preference pairs, which RL rollouts are not. Fix: `ridgeline dpo` "
                           "(docs/sft_dpo.md), or another loss here.")
                continue
            if registry is POLICY_LOSSES and value == self.loss_name:
                try:
                    PolicyLoss.bind(value)
                except TypeError as exc:
                    report.add(f"{key}={value}: {exc}. Fix: give the loss Ridgeline's or SkyRL's signature "
                               "(docs/algorithms.md).")


def _dotted(section: object, name: str) -> float:
    for part in name.split("."):
        section = getattr(section, part)
    return section  # type: ignore[return-value]
