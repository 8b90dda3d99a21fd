"""``sft.*`` and ``dpo.*``: the data columns and objective of `ridgeline sft` / `ridgeline dpo`.

Everything else those commands share with RL runs (batch sizes, optimizer, device, checkpoints,
trackers, `data.train_data` / `data.val_data`) keeps its `trainer.*` / `data.*` key (docs/sft_dpo.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgeline.config.fields import Report, Section, setting, show


@dataclass
class SFTConfig(Section):
    # the column holding a chat ([{role, content}, ...]); loss on its assistant turns only
    messages_key: str = setting("messages")
    # used when a row has no messages column: the prompt (text, or a chat) and the assistant's answer
    prompt_key: str = setting("prompt")
    # the column of the assistant's answer (with prompt_key)
    response_key: str = setting("response")
    # rows whose templated chat is longer (tokens) are dropped, with a count in the log
    max_length: int = setting(2048)
    # also score data.val_data through the generator and each row's env (the RL eval: pass@1, ...);
    # its rows must then be RL rows (prompt, env_class, reward_spec) carrying the response column too
    eval_with_env: bool = setting(False)

    def check(self, at: str, report: Report) -> None:
        if self.max_length < 2:
            report.add(f"{at}.max_length={show(self.max_length)} must be at least 2 tokens. Fix: e.g. {at}.max_length=2048.")


@dataclass
class DPOConfig(Section):
    # the strength of the implicit KL to the reference: rewards are beta * (log pi - log pi_ref)
    beta: float = setting(0.1)
    # where pairs come from: `file` (rows of data.train_data with prompt / chosen / rejected) or
    # `env` (on-policy: data.train_data holds RL prompt rows; each step samples
    # generator.n_samples_per_prompt answers per prompt, the env scores them, best vs worst)
    pairs: str = setting("file", choices=("file", "env"))
    # sigmoid: -log sigmoid(beta * margin) (DPO); ipo: (margin_avg - 1 / (2 beta))^2 on mean token logratios
    loss_type: str = setting("sigmoid", choices=("sigmoid", "ipo"))
    # the column of a pair's prompt (text, or a chat)
    prompt_key: str = setting("prompt")
    # the column of the preferred answer
    chosen_key: str = setting("chosen")
    # the column of the dispreferred answer
    rejected_key: str = setting("rejected")
    # pairs whose longer templated side is longer (tokens) are dropped, with a count in the log
    max_length: int = setting(2048)

    def check(self, at: str, report: Report) -> None:
        if not self.beta > 0:
            report.add(f"{at}.beta={show(self.beta)} must be positive. Fix: e.g. {at}.beta=0.1.")
        if self.max_length < 2:
            report.add(f"{at}.max_length={show(self.max_length)} must be at least 2 tokens. Fix: e.g. {at}.max_length=2048.")
