"""SFT and DPO (issue 23): assistant-only masks against the chat template, the losses against
hand-computed numbers, and `ridgeline sft` / `ridgeline dpo` on the tiny model, resume included."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from ridgeline.algorithms import PREFERENCE_LOSSES, POLICY_LOSSES, loss_normalizers, preference_metrics
from ridgeline.cli import main
from ridgeline.data.schema import DatasetError
from ridgeline.data.supervised import PreferenceColumns, preference_pair, tokenize_chat

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4+4?"},
        {"role": "assistant", "content": "it is 8"}]


def masked_runs(tokenizer, sample) -> list[str]:
    """The decoded runs of consecutive loss-mask-1 tokens."""
    runs, current = [], []
    for token, m in zip(sample.response_ids, sample.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


# --------------------------------------------------------------------------------------- masks
def test_masks_are_exactly_the_assistant_turns_of_a_multi_turn_chat(tiny_tokenizer):
    sample = tokenize_chat(tiny_tokenizer, CHAT)
    eot = tiny_tokenizer.eos_token
    assert masked_runs(tiny_tokenizer, sample) == ["5" + eot, "it is 8" + eot]
    # the sample is the whole templated chat, split where the first assistant content starts
    whole = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tiny_tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False) == whole
    assert tiny_tokenizer.decode(sample.prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_dpo_masks_train_only_the_answer_not_assistant_turns_of_the_prompt(tiny_tokenizer):
    row = {"prompt": CHAT[:4], "chosen": "it is 8", "rejected": [{"role": "assistant", "content": "9"}]}
    pair = preference_pair(tiny_tokenizer, row, PreferenceColumns(), "row 0")
    eot = tiny_tokenizer.eos_token
    assert masked_runs(tiny_tokenizer, pair.chosen) == ["it is 8" + eot]
    assert masked_runs(tiny_tokenizer, pair.rejected) == ["9" + eot]
    assert pair.chosen.prompt_ids == pair.rejected.prompt_ids  # the same templated prompt


def test_a_template_that_rewrites_earlier_turns_is_refused_by_row(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    # renders only the last assistant message in full (as reasoning templates drop earlier thoughts)
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
                               "{% if m['role'] == 'assistant' and not loop.last %}{{ '...' }}{% else %}"
                               "{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(DatasetError, match="row 7: the chat template does not render turn 2"):
        tokenize_chat(tokenizer, CHAT, where="row 7")


def test_a_chat_without_an_assistant_turn_is_refused(tiny_tokenizer):
    with pytest.raises(DatasetError, match="no assistant turn"):
        tokenize_chat(tiny_tokenizer, CHAT[:2], where="row 0")


# -------------------------------------------------------------------------------------- losses
def test_preference_losses_against_hand_computed_numbers():
    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5])
    # sigmoid, beta 0.1: -log sigmoid(0.1) = log(1 + e^-0.1), -log sigmoid(-0.1) = log(1 + e^0.1)
    sigmoid = PREFERENCE_LOSSES.get("sigmoid")(chosen, rejected, 0.1)
    assert sigmoid.tolist() == pytest.approx([math.log(1 + math.exp(-0.1)), math.log(1 + math.exp(0.1))], abs=1e-7)
    # ipo, beta 0.5: (margin - 1)^2 with margins 1 and -1
    assert PREFERENCE_LOSSES.get("ipo")(chosen, rejected, 0.5).tolist() == [0.0, 4.0]


def _config(**dpo):
    return OmegaConf.create({"loss_reduction": "token_mean", "dpo": {"beta": 0.1, "loss_type": "sigmoid", **dpo}})


def test_dpo_policy_loss_on_token_logprobs():
    # two pairs; rows (chosen, rejected, chosen, rejected), three tokens, the last one padding on rows 1 and 3
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, 0.0], [-0.5, -0.5, -0.5], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.5], [-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    # logratios: chosen 1.0, 0.0; rejected -1.0, 1.0 -> margins 2.0, -1.0
    loss, sums = POLICY_LOSSES.get("dpo")(logp, ref, torch.zeros_like(logp), mask, _config())
    expected = (math.log(1 + math.exp(-0.2)) + math.log(1 + math.exp(0.1))) / 2
    assert float(loss) == pytest.approx(expected, abs=1e-7)
    assert preference_metrics(sums) == pytest.approx({"rewards/chosen": 0.05, "rewards/rejected": 0.0,
                                                      "rewards/accuracies": 0.5, "rewards/margins": 0.05})
    # IPO averages over the answer's tokens: chosen 1/3, 0; rejected -1/2, 1/2 -> margins 5/6, -1/2
    loss, _ = POLICY_LOSSES.get("dpo")(logp, ref, torch.zeros_like(logp), mask, _config(loss_type="ipo", beta=0.5))
    assert float(loss) == pytest.approx(((5 / 6 - 1) ** 2 + (-0.5 - 1) ** 2) / 2, abs=1e-6)
    # one pair per micro-batch inside the step's normalisers: the two halves add up to the whole
    with loss_normalizers(float(mask.sum()), 4.0):
        halves = [POLICY_LOSSES.get("dpo")(logp[i:i + 2], ref[i:i + 2], logp[i:i + 2], mask[i:i + 2], _config())[0]
                  for i in (0, 2)]
    assert float(sum(halves)) == pytest.approx(expected, abs=1e-7)


def test_sft_loss_is_the_mean_nll_of_the_loss_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    mask = torch.tensor([[1.0, 1, 0], [0, 1, 1]])
    loss, _ = POLICY_LOSSES.get("sft")(logp, logp, logp, mask, _config())
    assert float(loss) == pytest.approx((1 + 2 + 4 + 9) / 4)


# ---------------------------------------------------------------------------- the commands
def _write_data(folder):
    chats, pairs = folder / "chat.jsonl", folder / "pairs.jsonl"
    with open(chats, "w") as f:
        for i in range(24):
            a, b = i % 7, (3 * i) % 5
            if i % 2:
                row = {"messages": [{"role": "user", "content": f"{a}+{b}"},
                                    {"role": "assistant", "content": str(a + b)},
                                    {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "yes"}]}
            else:
                row = {"prompt": f"{a}+{b}", "response": str(a + b)}
            f.write(json.dumps(row) + "\n")
    with open(pairs, "w") as f:
        for i in range(16):
            a, b = i % 7, (3 * i) % 5
            f.write(json.dumps({"prompt": f"{a}+{b}", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n")
    return chats, pairs


def _args(command, data, run_dir, *extra):
    return [command, "+experiment=tiny", "data.prepare=null", f"data.train_data=[{data}]", f"data.val_data=[{data}]",
            f"trainer.run_dir={run_dir}", "trainer.train_batch_size=8", "trainer.policy_mini_batch_size=4",
            "trainer.micro_train_batch_size_per_gpu=2", "trainer.policy.optimizer_config.lr=1e-3",
            "trainer.ckpt_interval=2", f"{command}.max_length=64", *extra]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_and_a_resumed_run_repeats_the_same_losses(tmp_path):
    chats, _ = _write_data(tmp_path)
    assert main(_args("sft", chats, tmp_path / "whole", "trainer.max_steps=4", "trainer.hf_save_interval=4",
                      f"trainer.export_path={tmp_path / 'exports'}")) == 0
    whole = [r for r in _rows(tmp_path / "whole") if "train/loss" in r]
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    evals = [r["eval/loss"] for r in _rows(tmp_path / "whole") if "eval/loss" in r]
    assert evals[-1] < evals[0]
    assert (tmp_path / "whole" / "final_model" / "config.json").exists()
    # hf_save_interval, in the run's folder (the preset's exports_per_run), not the shared export_path
    assert (tmp_path / "whole" / "global_step_4" / "policy" / "config.json").exists()
    assert not (tmp_path / "exports").exists()
    # killed after the step-2 checkpoint, then resumed: steps 3 and 4 repeat bit for bit
    assert main(_args("sft", chats, tmp_path / "cut", "trainer.max_steps=2")) == 0
    assert main(_args("sft", chats, tmp_path / "cut", "trainer.max_steps=4", "trainer.resume_mode=latest")) == 0
    resumed = [r for r in _rows(tmp_path / "cut") if "train/loss" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in whole]
    assert [r["policy/raw_grad_norm"] for r in resumed] == [r["policy/raw_grad_norm"] for r in whole]


def test_dpo_starts_at_log_2_and_logs_trls_reward_metrics(tmp_path):
    _, pairs = _write_data(tmp_path)
    args = _args("dpo", pairs, tmp_path / "dpo", "trainer.max_steps=2", "trainer.policy_mini_batch_size=8")
    assert main(args) == 0
    rows = _rows(tmp_path / "dpo")
    first_eval, step1 = rows[0], next(r for r in rows if r.get("step") == 1 and "train/loss" in r)
    # before any update the policy is its reference: every logratio is 0
    assert first_eval["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first_eval["eval/rewards/margins"] == 0.0
    assert step1["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # one optimizer step per batch
    assert step1["rewards/accuracies"] == 0.0 and step1["rewards/chosen"] == pytest.approx(0.0, abs=1e-7)
    last = [r for r in rows if "eval/rewards/accuracies" in r][-1]
    assert last["eval/rewards/margins"] > 0 and last["eval/loss"] < math.log(2)


def test_dpo_ipo_runs_and_wrong_rows_are_one_message(tmp_path, capsys):
    chats, pairs = _write_data(tmp_path)
    assert main(_args("dpo", pairs, tmp_path / "ipo", "trainer.max_steps=1", "dpo.loss_type=ipo")) == 0
    assert main(_args("dpo", chats, tmp_path / "bad", "trainer.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert "row 0: missing column(s) ['chosen', 'rejected']" in err and "Fix:" in err and "Traceback" not in err


def test_pairs_with_identical_answers_are_named_not_trained_at_log_2(tmp_path, capsys, caplog):
    """Before: chosen == rejected in every pair trained at a constant loss of log 2 without a word."""
    _, pairs = _write_data(tmp_path)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps(dict(r, rejected=r["chosen"])) + "\n" for r in rows))
    assert main(_args("dpo", same, tmp_path / "same", "trainer.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert (f"data.train_data ({same}) holds no usable rows: every row left is unusable, their chosen and rejected "
            f"answers are the same tokens, so a preference loss learns nothing from them (first: {same}, row 0)") in err
    assert "Traceback" not in err
    some = tmp_path / "some.jsonl"  # two of 16 such rows: dropped, said once
    some.write_text("".join(json.dumps(dict(r, rejected=r["chosen"]) if i in (3, 5) else r) + "\n"
                            for i, r in enumerate(rows)))
    caplog.set_level("WARNING")
    assert main(_args("dpo", some, tmp_path / "some", "trainer.max_steps=1", "trainer.ckpt_interval=-1")) == 0
    assert "data.train_data: 2 row(s) dropped: their chosen and rejected answers are the same tokens" in caplog.text
    assert f"(first: {some}, row 3)" in caplog.text


def test_a_lone_surrogate_in_an_sft_file_is_one_message_naming_the_row(tmp_path, capsys):
    """Before: TypeError: TextEncodeInput must be Union[...] from the tokenizer, a traceback."""
    chats, _ = _write_data(tmp_path)
    lines = chats.read_text().splitlines()
    lines[5] = lines[5].replace('"sure?"', '"sure\\ud800?"')
    assert "\\ud800" in lines[5]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    assert main(_args("sft", broken, tmp_path / "run", "trainer.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert (f"{broken} row 5 (line 6), column messages[2]['content'] (character 4: '\\ud800'): a lone UTF-16 "
            "surrogate") in err
    assert "Traceback" not in err and "Fix:" in err


def test_sample_packing_trains_the_same_sft_steps(tmp_path):
    chats, _ = _write_data(tmp_path)
    losses = {}
    for packing in ("false", "true"):
        run_dir = tmp_path / f"packing_{packing}"
        assert main(_args("sft", chats, run_dir, "trainer.max_steps=2", "trainer.ckpt_interval=-1",
                          "trainer.eval_before_train=false", f"trainer.use_sample_packing={packing}")) == 0
        losses[packing] = [r["train/loss"] for r in _rows(run_dir) if "train/loss" in r]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)


# ------------------------------------------------------------------------ pairs from an env
def test_best_worst_pairs_take_each_prompts_extremes_and_skip_ties():
    from ridgeline.generation.types import GeneratorOutput, TrajectoryID
    from ridgeline.trainer.env_pairs import best_worst_pairs

    uids = ["a", "a", "a", "b", "b", "c", "c"]
    rewards = [0.5, 1.0, 0.0, 0.25, 0.25, [0.0, 1.0], 0.0]  # c's first answer: a per-token reward summing to 1
    out = GeneratorOutput(prompt_token_ids=[[u] for u in range(7)], response_ids=[[10 + i, 20 + i] for i in range(7)],
                          rewards=rewards, loss_masks=[[1, 1]] * 5 + [[1, 0], [1, 1]], stop_reasons=["stop"] * 7,
                          rollout_logprobs=[[0.0, 0.0]] * 7, responses=[""] * 7,
                          trajectory_ids=[TrajectoryID(uid, k) for k, uid in enumerate(uids)])
    pairs, tied = best_worst_pairs(out)
    assert tied == 1  # b: both answers scored 0.25
    assert [(p.chosen.response_ids, p.rejected.response_ids) for p in pairs] == [([11, 21], [12, 22]),
                                                                                 ([15, 25], [16, 26])]
    assert pairs[1].chosen.prompt_ids == [5] and pairs[1].chosen.loss_mask == [1, 0]  # the generator's mask, kept


def test_dpo_on_pairs_sampled_from_an_env(tmp_path):
    run_dir = tmp_path / "envdpo"
    assert main(["dpo", "+experiment=tiny", "dpo.pairs=env", f"trainer.run_dir={run_dir}", "trainer.max_steps=2",
                 "trainer.policy_mini_batch_size=16", "trainer.policy.optimizer_config.lr=1e-3"]) == 0
    rows = _rows(run_dir)
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # 16 prompts x 8 answers scored by the arithmetic env; a pair per prompt whose answers differ
    assert all(r["dpo/pairs"] + r["dpo/tied_prompts"] == 16 and r["dpo/pairs"] > 0 for r in steps)
    assert steps[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert "rewards/margins" in steps[1] and "reward/avg_raw_reward" in steps[1]
    assert "eval/all/pass_at_1" in rows[0] and "eval/all/pass_at_1" in rows[-1]  # through the generator


def test_env_pairs_need_two_answers_per_prompt(tmp_path, capsys):
    args = ["dpo", "+experiment=tiny", "dpo.pairs=env", f"trainer.run_dir={tmp_path}", "generator.n_samples_per_prompt=1"]
    assert main(args) == 2
    assert "Fix: generator.n_samples_per_prompt=4" in capsys.readouterr().err


@pytest.mark.integration
def test_dpo_on_env_pairs_resumes_exactly(tmp_path):
    base = ["dpo", "+experiment=tiny", "dpo.pairs=env", "trainer.policy_mini_batch_size=16",
            "trainer.policy.optimizer_config.lr=1e-3", "trainer.ckpt_interval=1", "trainer.eval_before_train=false",
            "trainer.eval_interval=-1", "data.val_data=[]"]
    assert main(base + [f"trainer.run_dir={tmp_path / 'whole'}", "trainer.max_steps=3"]) == 0
    assert main(base + [f"trainer.run_dir={tmp_path / 'cut'}", "trainer.max_steps=2"]) == 0
    assert main(base + [f"trainer.run_dir={tmp_path / 'cut'}", "trainer.max_steps=3", "trainer.resume_mode=latest"]) == 0
    keys = ("train/loss", "dpo/pairs", "reward/avg_raw_reward", "rewards/margins", "policy/raw_grad_norm")
    whole, cut = ([tuple(r[k] for k in keys) for r in _rows(tmp_path / d) if "train/loss" in r] for d in ("whole", "cut"))
    assert len(whole) == 3 and cut == whole


def test_arithmetic_worked_answers_serve_sft_and_keep_the_rl_columns(tmp_path, tiny_tokenizer):
    from ridgeline.data import PromptDataset
    from ridgeline.data.prepare_arithmetic import prepare_arithmetic
    from ridgeline.data.supervised import SFTColumns, load_sft_examples

    files = prepare_arithmetic(tmp_path, num_train=4, num_val=2, prompt_style="hash", env_class="gsm8k",
                               worked_answers=True)
    examples, _ = load_sft_examples([str(files["train"])], tiny_tokenizer, SFTColumns(), 256, "data.train_data")
    rows = list(PromptDataset([str(files["train"])], default_env_class="gsm8k"))
    for example, row in zip(examples, rows):
        expression, answer = row.extras["extra_info"]["expression"], row.extras["reward_spec"]["ground_truth"]
        assert masked_runs(tiny_tokenizer, example) == [f"{expression} = {answer}\n#### {answer}<|im_end|>"]


@pytest.mark.parametrize("preset", ["sft", "dpo", "sft_format", "grpo_after_sft"])
def test_the_presets_compose(preset):
    from ridgeline.config import load_config
    cfg = load_config([f"+experiment={preset}"])
    assert cfg.trainer.strategy == "single"


def test_sft_eval_with_env_scores_the_held_out_rows_through_the_generator(tmp_path, capsys):
    run_dir = tmp_path / "sft_env"
    assert main(["sft", "+experiment=tiny", "+data.prepare.worked_answers=true", "sft.eval_with_env=true",
                 f"trainer.run_dir={run_dir}", "trainer.max_steps=2", "trainer.train_batch_size=8",
                 "trainer.policy_mini_batch_size=8", "trainer.policy.optimizer_config.lr=1e-3"]) == 0
    rows = _rows(run_dir)
    for row in (rows[0], rows[-1]):  # before and after training: the loss and the env's verdicts
        assert {"eval/loss", "eval/all/pass_at_1", "eval/arithmetic/avg_score"} <= set(row)
    assert "held-out (greedy): pass@1 " in capsys.readouterr().out


def test_rl_runs_refuse_the_dpo_loss_and_may_train_sft_on_rollouts():
    from ridgeline.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="policy_loss_type=dpo trains preference pairs.*Fix: `ridgeline dpo`"):
        load_config(["+experiment=tiny", "trainer.algorithm.policy_loss_type=dpo"])
    assert load_config(["+experiment=tiny", "trainer.algorithm.policy_loss_type=sft"]).trainer.algorithm.policy_loss_type == "sft"
