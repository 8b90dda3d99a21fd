"""The real loop, end to end, on a tiny random model: config -> data -> engine -> env -> GRPO."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ridgeline.config import load_config
from ridgeline.entrypoints.run import run_training
from ridgeline.tracking.trackers import read_metrics


def tiny_overrides(run_dir, *extra):
    return ["+experiment=tiny", f"trainer.export_path={run_dir}", *extra]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Three real GRPO steps of the tiny preset (shared by the tests below), a Hugging Face export
    every two steps."""
    out = tmp_path_factory.mktemp("tiny")
    cfg = load_config(tiny_overrides(out, "data.prepare.num_train=48", "trainer.hf_save_interval=2"))
    summary = run_training(cfg)
    return cfg, summary, read_metrics(out / "tiny" / "metrics.jsonl")


def test_reward_rises_over_three_steps(tiny_run):
    _, summary, rows = tiny_run
    rewards = [r["reward/avg_raw_reward"] for r in rows if "reward/avg_raw_reward" in r]
    assert summary["steps"] == 3 and len(rewards) == 3
    assert rewards[-1] > rewards[0] + 0.03, rewards


def test_every_step_logs_the_promised_metrics(tiny_run):
    _, _, rows = tiny_run
    step = next(r for r in rows if r["step"] == 1)
    for key in ["reward/avg_raw_reward", "reward/accuracy", "generate/avg_num_tokens", "policy/policy_loss",
                "policy/policy_kl", "policy/policy_entropy", "policy/ppo_clip_ratio", "policy/raw_grad_norm",
                "policy/policy_lr", "timing/generate", "timing/fwd_logprobs_values_reward", "timing/policy_train",
                "timing/sync_weights", "timing/step", "throughput/tokens_per_second", "memory/peak_rss_gib"]:
        assert key in step and step[key] is not None, key
    assert step["policy/policy_lr"] == pytest.approx(1e-2)
    assert 0.1 < step["memory/peak_rss_gib"] < 64  # GiB: torch alone is a few hundred MB
    evals = [r for r in rows if "eval/all/pass_at_1" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before training and at the end
    assert "eval/arithmetic/pass_at_1" in evals[0]


def test_final_model_loads_with_transformers_and_exports_and_evals_are_where_skyrl_puts_them(tiny_run):
    cfg, summary, _ = tiny_run
    model = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    assert model.config.vocab_size > 0
    export = Path(cfg.trainer.run_dir)   # SkyRL's layout in the run's own folder (the preset's exports_per_run)
    assert cfg.trainer.exports_dir == cfg.trainer.run_dir
    # hf_save_interval=2 over 3 steps: step 2, and one after the last step (as SkyRL does)
    assert sorted(p.name for p in export.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (export / "global_step_3" / "policy" / "model.safetensors").is_file()
    dumped = sorted((export / "dumped_evals").iterdir())
    assert [d.name for d in dumped] == ["global_step_0_evals", "global_step_3_evals"]
    # SkyRL's two files, and the run that wrote them (the run report shows its own run's dumps only)
    assert sorted(p.name for p in dumped[0].iterdir()) == ["aggregated_results.jsonl", "arithmetic.jsonl",
                                                           "ridgeline_run.json"]
    owner, info = (json.loads(p.read_text()) for p in (dumped[0] / "ridgeline_run.json", export / "run.json"))
    assert owner == {"run_id": info["run_id"], "run_dir": info["run_dir"]}
    first = json.loads((dumped[0] / "arithmetic.jsonl").read_text().splitlines()[0])
    assert {"input_prompt", "output_response", "score", "stop_reason", "env_class", "env_extras",
            "data_source"} <= set(first)  # SkyRL's fields
    assert first["env_class"] == "arithmetic" and first["input_prompt"].endswith("assistant\n")
    aggregated = json.loads((dumped[1] / "aggregated_results.jsonl").read_text())
    assert aggregated["eval/all/pass_at_1"] == [r for r in read_metrics(export / "metrics.jsonl")
                                                if r["step"] == 3][-1]["eval/all/pass_at_1"]


def test_weights_reach_the_engine_after_a_step(tiny_run, tmp_path):
    from ridgeline.trainer.trainer import Trainer
    # gradient checkpointing is the base config's default (the presets turn it off for speed)
    cfg = load_config(tiny_overrides(tmp_path, "data.prepare.num_train=16", "trainer.eval_before_train=false",
                                     "trainer.gradient_checkpointing=true", "trainer.policy_mini_batch_size=8"))
    trainer = Trainer.from_config(cfg)
    before = {k: v.clone() for k, v in trainer.engine.model.named_parameters()}
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    trainer.run.global_step = 1
    metrics = trainer.train_step(rows)
    # two mini-batches: two optimizer steps, so the old-policy logprobs come from their own pass
    assert metrics["policy/policy_update_steps"] == 2.0
    # ... and the second mini-batch sees a policy that moved: ratio != 1 (exactly 0 without that pass)
    assert metrics["policy/ppo_kl"] != 0.0
    policy = dict(trainer.workers.policy.model.named_parameters())
    changed = [k for k, v in trainer.engine.model.named_parameters() if not torch.equal(v, before[k])]
    assert changed, "no engine weight changed after an optimizer step"
    for name, p in trainer.engine.model.named_parameters():
        assert torch.equal(p, policy[name].detach().to(p.dtype)), name


def test_cli_refuses_bad_config_before_loading_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ridgeline.cli", "train", "+experiment=tiny",
                           f"trainer.export_path={tmp_path}", "trainer.policy_mini_batch_size=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "policy_mini_batch_size" in proc.stderr and "16" in proc.stderr
    assert not (tmp_path / "tiny").exists()


@pytest.mark.integration
def test_main_base_entrypoint_runs_the_same_app(tmp_path):
    # a SkyRL-style override on the way: the free-form per-env key without '+' (the loader's rule)
    proc = subprocess.run([sys.executable, "-m", "ridgeline.entrypoints.main_base", *tiny_overrides(tmp_path),
                           "data.prepare.num_train=16", "generator.eval_sampling_params.max_generate_length=2",
                           "trainer.resume_mode=null", "environment.skyrl_gym.arithmetic.format_score=0.5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out (greedy): pass@1" in proc.stdout
    assert (tmp_path / "tiny" / "final_model" / "config.json").exists()
    assert not (tmp_path / "outputs").exists()


def test_overlong_filtering_drops_truncated_responses_from_the_loss(tmp_path):
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(tiny_overrides(tmp_path, "data.prepare.num_train=16", "trainer.eval_before_train=false",
                                     "generator.apply_overlong_filtering=true"))
    trainer = Trainer.from_config(cfg)
    seen = {}
    train = trainer.workers.policy.train

    def keep_batch(batch):
        seen["batch"] = batch
        return train(batch)

    trainer.workers.policy.train = keep_batch
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    metrics = trainer.train_step(rows)
    batch = seen["batch"]
    lengths = batch.response_mask.sum(-1).long()
    last = batch.sequences[:, -batch.response_width:].gather(1, (lengths - 1)[:, None]).squeeze(1)
    stopped = last == trainer.tokenizer.eos_token_id
    assert 0 < metrics["generate/truncated_frac"] < 1
    assert torch.equal(batch.loss_mask.sum(-1) > 0, stopped)


def test_zero_variance_filter_takes_signal_less_groups_out_of_the_loss(tmp_path):
    """SkyRL's trainer.algorithm.zero_variance_filter: in the trained batch, a row has loss tokens
    exactly when its prompt group's rewards differ."""
    from ridgeline.trainer.dynamic_sampling import signal_groups
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(tiny_overrides(tmp_path, "data.prepare.num_train=16", "trainer.eval_before_train=false",
                                     "trainer.algorithm.zero_variance_filter=true"))
    trainer = Trainer.from_config(cfg)
    seen = {}
    collect = trainer.collect_rollout

    def keep_rollout(rows):
        seen["out"], metrics = collect(rows)
        return seen["out"], metrics

    trainer.collect_rollout = keep_rollout
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    metrics = trainer.train_step(rows)
    out = seen["out"]
    signal = set(signal_groups(out.uids, out.rewards))
    assert [any(mask) for mask in out.loss_masks] == [uid in signal for uid in out.uids]
    assert metrics["generate/zero_variance_masked"] == sum(uid not in signal for uid in out.uids)


def test_rollouts_are_a_function_of_the_seed_and_the_step(tmp_path):
    """Generation seeds and dynamic sampling's further prompts derive from (trainer.seed, step,
    round): a second trainer of the same config collects the same rollout, another step does not."""
    from ridgeline.trainer.trainer import Trainer

    def collect(name, step):
        cfg = load_config(tiny_overrides(tmp_path / name, "data.prepare.num_train=16", "trainer.eval_before_train=false",
                                         "trainer.algorithm.dynamic_sampling.type=filter",
                                         "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
                                         "generator.n_samples_per_prompt=2", "trainer.micro_train_batch_size_per_gpu=32",
                                         "trainer.micro_forward_batch_size_per_gpu=32"))
        trainer = Trainer.from_config(cfg)
        rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
        trainer.run.global_step = step
        out, metrics = trainer.collect_rollout(rows)
        return (out.trajectory_ids, out.response_ids, out.rewards), metrics

    first, metrics = collect("a", 1)
    again, _ = collect("b", 1)
    later, _ = collect("c", 2)
    assert first == again and first[1] != later[1]
    assert metrics["dynamic_sampling/sample_batches"] > 1  # the further rounds and their prompts were drawn too


@pytest.mark.parametrize("overrides", [
    ["trainer.algorithm.advantage_estimator=rloo"],
    ["trainer.algorithm.advantage_estimator=reinforce++", "trainer.algorithm.gamma=0.9"],
    ["trainer.algorithm.advantage_batch_normalize=true"],
])
def test_other_estimators_run_a_real_step(tmp_path, overrides):
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(tiny_overrides(tmp_path, "data.prepare.num_train=16", "trainer.eval_before_train=false",
                                     *overrides))
    trainer = Trainer.from_config(cfg)
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    trainer.run.global_step = 1
    metrics = trainer.train_step(rows)
    assert metrics["policy/raw_grad_norm"] > 0 and metrics["advantages/singleton_groups"] == 0.0


def test_single_sample_groups_are_counted(tmp_path):
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(tiny_overrides(tmp_path, "data.prepare.num_train=16", "trainer.eval_before_train=false",
                                     "generator.n_samples_per_prompt=1", "trainer.micro_train_batch_size_per_gpu=16",
                                     "trainer.micro_forward_batch_size_per_gpu=16"))
    trainer = Trainer.from_config(cfg)
    rows = next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0))
    trainer.run.global_step = 1
    assert trainer.train_step(rows)["advantages/singleton_groups"] == 16.0


def test_a_run_writes_its_trackers_dumps_samples_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(tiny_overrides(tmp_path, "data.prepare.num_train=32", "trainer.dump_data_batch=true",
                                     "trainer.logger=[console,tensorboard,mlflow,wandb]"))
    summary = run_training(cfg)
    run_dir = tmp_path / "tiny"
    assert summary["disabled_trackers"] == {}
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "mlruns").is_dir() and (run_dir / "mlflow_run_id").exists()
    assert list((run_dir / "wandb").glob("offline-run-*"))
    dumps = sorted((run_dir / "dumped_data").iterdir())  # SkyRL's folder and file stem, in the run's folder
    assert [d.name for d in dumps] == ["global_step_1_training_input.jsonl", "global_step_2_training_input.jsonl"]
    first = json.loads(dumps[0].read_text().splitlines()[0])
    assert {"uid", "prompt", "response", "reward"} <= set(first)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2}
    report = (run_dir / "report.html").read_text()
    assert summary["report"] == str(run_dir / "report.html") and "<img" in report
