"""The run report: from a realistic run folder, an empty one, a crashed one; samples; the CLI."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from ridgeline.tracking.report import load_run, write_report
from ridgeline.tracking.samples import spread, write_samples

NASTY = '<script>alert("x")</script> & <b>bold</b>'


def step_row(step: int) -> dict:
    """What the trainer logs for one training step (the keys of trainer.py / worker.py)."""
    r = step / 10
    return {
        "step": step,
        "reward/avg_raw_reward": r, "reward/accuracy": r / 2, "reward/avg_pass_at_4": min(1.0, 2 * r),
        "reward/solve_none_frac": 1 - r, "loss/avg_kl": 0.01 * step,
        "generate/avg_num_tokens": 40 + step, "generate/max_num_tokens": 64.0, "generate/min_num_tokens": 10.0,
        "generate/truncated_frac": 0.1, "generate/engine_seconds": 1.0,
        "environment/parsed": 0.9,
        "policy/policy_loss": -0.01 * step, "policy/final_loss": -0.01 * step, "policy/policy_entropy": 1.5 - r,
        "policy/ppo_clip_ratio": 0.02, "policy/clip_frac_low": 0.01, "policy/clip_frac_high": 0.01,
        "policy/ppo_kl": 0.001, "policy/policy_kl": 0.002 * step, "policy/raw_grad_norm": 0.5, "policy/policy_lr": 1e-6,
        "critic/value_loss": 0.3, "critic/values_clipfrac": 0.05, "critic/raw_grad_norm": 0.2,
        "rollout/logprob_abs_diff_mean": 1e-5, "rollout/logprob_abs_diff_max": 1e-3,
        "loss/avg_raw_advantages": 0.0, "dynamic_sampling/signal_groups": 4.0,
        "timing/generate": 2.0, "timing/fwd_logprobs_values_reward": 0.5,
        "timing/compute_advantages_and_returns": 0.01, "timing/critic_train": 0.4, "timing/policy_train": 1.0,
        "timing/train_critic_and_policy": 1.4, "timing/sync_weights": 0.1, "timing/step": 4.01,
        "throughput/tokens_per_second": 1000.0 + step, "throughput/generate_tokens_per_second": 500.0,
    }


def eval_row(step: int, value: float) -> dict:
    return {"step": step, "eval/openai_gsm8k/pass_at_1": value, "eval/openai_gsm8k/avg_score": value,
            "eval/arith/pass_at_1": value / 2, "eval/arith/avg_score": value / 2,
            "eval/all/pass_at_1": value * 0.75, "eval/all/avg_score": value * 0.75, "timing/eval": 3.0}


def make_run(run_dir: Path, steps: int = 6) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [eval_row(0, 0.2)]
    for step in range(1, steps + 1):
        row = step_row(step)
        if step % 3 == 0:
            row.update(eval_row(step, 0.2 + 0.05 * step))
        rows.append(row)
    rows[2]["policy/policy_entropy"] = None  # a NaN, written as null by the jsonl tracker
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text(
        "trainer:\n  project_name: proj\n  run_name: my-run\n  export_path: /nonexistent/exports\n"
        "  policy:\n    model:\n      path: tiny://llama\n"
        "  algorithm:\n    advantage_estimator: grpo\n    policy_loss_type: regular\n")
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"first {NASTY}"}]
    write_samples(run_dir / "samples.jsonl", 1, ["an earlier run"], ["old"], [0.0])
    write_samples(run_dir / "samples.jsonl", 1, [chat] * 8, [f"answer {i} {NASTY}" for i in range(8)],
                  [0.0, [0.0, 1.0]] * 4, limit=3, overwrite=True)
    write_samples(run_dir / "samples.jsonl", steps, ["plain last prompt"] * 2, ["last answer", "other"],
                  [1.0, 0.0])
    # an eval dump as SkyRL-Train writes it (no `passed`: the score decides), copied into the run folder
    dump = run_dir / "dumped_evals" / f"global_step_{steps}_evals"
    dump.mkdir(parents=True)
    records = [{"input_prompt": f"<|user|>q{i} {NASTY}", "output_response": f"r{i}",
                "score": float(i % 2) if i < 4 else [0.0, float(i % 2)], "stop_reason": "stop", "env_class": "gsm8k",
                "env_extras": {}, "data_source": "openai/gsm8k", "ground_truth": str(i)} for i in range(6)]
    (dump / "openai_gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (dump / "aggregated_results.jsonl").write_text(json.dumps({"eval/all/avg_score": 0.5}) + "\n")
    return run_dir


def images(page: str) -> list[str]:
    return re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,', page)


def test_report_of_a_full_run(tmp_path):
    run_dir = make_run(tmp_path / "run")
    path = write_report(run_dir)
    assert path == run_dir / "report.html"
    page = path.read_text()
    assert "<h1>proj / my-run</h1>" in page
    assert images(page) == ["Reward and accuracy", "Held-out pass@1 by data source", "KL", "Entropy",
                            "Response length", "Clip fraction", "Losses", "Gradient norm",
                            "Seconds per phase", "Throughput", "Engine vs trainer logprobs"]
    for section in ("First and last values", "Held-out evaluation", "Eval dumps", "Examples from the eval at step 6",
                    "Sample rollouts", "Step 1 (first sampled step)", "Step 6 (last sampled step)", "All metrics"):
        assert section in page, section
    # every piece of run text is escaped: the page has no script and no injected tag
    assert "<script" not in page and "<b>bold" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in page
    assert "user: first &lt;script&gt;" in page  # chat prompts as role: content lines
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<link" not in page
    assert "tiny://llama" in page and "grpo advantages" in page
    assert "openai_gsm8k" in page and "arith" in page
    assert "unreadable line" not in page


def test_report_series_and_samples(tmp_path):
    data = load_run(make_run(tmp_path / "run"))
    assert data.series("eval/all/pass_at_1") == [(0, 0.15000000000000002), (3, 0.2625), (6, 0.375)]
    assert [s for s, _ in data.series("policy/policy_entropy")] == [1, 3, 4, 5, 6]  # the null is skipped
    first = [s for s in data.samples if s["step"] == 1]
    assert len(first) == 3 and [s["reward"] for s in first] == [0.0, 0.0, 1.0]  # lists summed
    assert first[0]["prompt"] == f"system: be brief\nuser: first {NASTY}"  # the earlier run's is gone
    [(step, folder, records)] = data.eval_dumps
    assert step == 6 and folder.name == "global_step_6_evals" and len(records) == 6  # the metrics line is not a sample
    # pass rate 3 of 6: the last two scores are per token, and [0.0, 1.0] sums to a pass
    assert "<td>6</td><td>6</td><td>0.5</td>" in write_report(tmp_path / "run").read_text()


def test_report_of_an_empty_and_a_crashed_run(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    page = write_report(empty).read_text()
    assert "holds no complete row yet" in page and images(page) == []

    bare = tmp_path / "bare"
    bare.mkdir()
    assert "No metrics.jsonl" in write_report(bare).read_text()

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    lines = [json.dumps(step_row(s)) for s in (1, 2, 3)]
    (crashed / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:40])  # killed mid-write
    page = write_report(crashed, tmp_path / "out.html").read_text()
    assert "1 unreadable line(s)" in page
    assert "Reward and accuracy" in images(page) and "Held-out pass@1 by data source" not in images(page)
    assert "Sample rollouts" not in page and not (crashed / "report.html").exists()

    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "missing")


def test_spread_picks_across_the_batch():
    assert spread(3, 4) == [0, 1, 2]
    assert spread(16, 4) == [0, 5, 10, 15]
    assert spread(10, 1) == [0]


def test_cli_report(tmp_path, capsys):
    from ridgeline.entrypoints.report import add_parser, run

    parser = argparse.ArgumentParser(prog="ridgeline")
    add_parser(parser.add_subparsers(dest="command", required=True))
    run_dir = make_run(tmp_path / "run", steps=3)
    assert run(parser.parse_args(["report", str(run_dir)])) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")
    from ridgeline import cli
    assert cli.main(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "x.html")]) == 2  # one message
    assert "no run folder" in capsys.readouterr().err


def test_plot_rewards_still_works(tmp_path):
    from ridgeline.tracking.plot import plot_rewards

    run_dir = make_run(tmp_path / "run")
    out = plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
