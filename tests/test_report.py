"""The run report: from a realistic run folder, an empty one, a crashed one; samples; the CLI;
two real tiny runs sharing one runs folder, each report about its own run only."""

from __future__ import annotations

import argparse
import html
import json
import re
from pathlib import Path

import pytest

from ridgeline.tracking.dumps import DumpOwner, write_eval_dump
from ridgeline.tracking.report import load_run, smooth, write_report
from ridgeline.tracking.run_info import AlgorithmSummary, Hardware, RunInfo, write_run_info
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
        "policy/ppo_clip_ratio": 0.0, "policy/clip_frac_low": 0.0, "policy/clip_frac_high": 0.0,  # never clipped
        "policy/ppo_kl": 0.001, "policy/policy_kl": 0.002 * step, "policy/raw_grad_norm": 0.5, "policy/policy_lr": 1e-6,
        "critic/value_loss": 0.3, "critic/values_clipfrac": 0.0, "critic/raw_grad_norm": 0.2,
        "rollout/logprob_abs_diff_mean": 1e-5, "rollout/logprob_abs_diff_max": 1e-3,
        "loss/avg_raw_advantages": 0.0, "dynamic_sampling/signal_groups": 4.0,
        "timing/generate": 2.0, "timing/fwd_logprobs_values_reward": 0.5,
        "timing/compute_advantages_and_returns": 0.01, "timing/critic_train": 0.4, "timing/policy_train": 1.0,
        "timing/train_critic_and_policy": 1.4, "timing/sync_weights": 0.1, "timing/step": 4.01,
        "throughput/tokens_per_second": 1000.0 + step, "throughput/generate_tokens_per_second": 500.0,
        "memory/rss_gib": 1.0 + step / 100, "memory/peak_rss_gib": 1.2, "timing/elapsed": 30.0 * step,
    }


def eval_row(step: int, value: float) -> dict:
    return {"step": step, "eval/openai_gsm8k/pass_at_1": value, "eval/openai_gsm8k/avg_score": value,
            "eval/arith/pass_at_1": value / 2, "eval/arith/avg_score": value / 2,
            "eval/all/pass_at_1": value * 0.75, "eval/all/avg_score": value * 0.75, "timing/eval": 3.0}


RUN_ID = "20261127-101500-abcdef01"


def run_info(run_dir: Path) -> RunInfo:
    return RunInfo(run_id=RUN_ID, run_dir=str(run_dir.resolve()), started=1795773600.0,
                   sessions=[1795773600.0, 1795774000.0], placement="one process on cpu",
                   hardware=Hardware(cpu="Test CPU 9000", cpus=2, memory_gib=7.5, gpus=["NVIDIA H100 80GB HBM3"]),
                   algorithm=AlgorithmSummary(advantage_estimator="grpo", policy_loss="regular",
                                              kl="KL loss (k3, coef 0.001)", loss_reduction="token_mean", critic=None),
                   versions={"ridgeline": "0.1.0", "torch": "2.9.0"})


def make_run(run_dir: Path, steps: int = 6, info: bool = True) -> Path:
    """A run folder as the trainer leaves it, with `run.json` unless `info` is false; its
    export_path (`run_dir/../exports`) holds one eval dump of its own and one of another run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [eval_row(0, 0.2)]
    for step in range(1, steps + 1):
        row = step_row(step)
        if step % 3 == 0:
            row.update(eval_row(step, 0.2 + 0.05 * step))
        rows.append(row)
    rows[2]["policy/policy_entropy"] = None  # a NaN, written as null by the jsonl tracker
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    exports = run_dir.parent / "exports"
    (run_dir / "config.yaml").write_text(
        f"trainer:\n  project_name: proj\n  run_name: my-run\n  export_path: {exports}\n  train_batch_size: 16\n"
        "  policy:\n    model:\n      path: tiny://llama\n    optimizer_config:\n      lr: 1.0e-06\n"
        "  algorithm:\n    advantage_estimator: grpo\n    policy_loss_type: null\n    ppo_loss_type: regular\n"
        "generator:\n  n_samples_per_prompt: 4\n")
    if info:
        write_run_info(run_dir, run_info(run_dir))
    # SkyRL's shared folder: this run's dump at step 3, another run's at step 4 (same export_path)
    record = {"input_prompt": "own eval prompt", "output_response": "42", "score": 1.0, "data_source": "arith"}
    write_eval_dump(exports / "dumped_evals" / "global_step_3_evals", [record], {},
                    owner=DumpOwner(RUN_ID, str(run_dir.resolve())))
    write_eval_dump(exports / "dumped_evals" / "global_step_4_evals", [{**record, "input_prompt": "FOREIGN prompt"}],
                    {}, owner=DumpOwner("another-run", str(run_dir.parent / "other")))
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
    # the clip fractions are 0 at every step: named, not drawn
    assert images(page) == ["Reward and accuracy", "Reward and accuracy over time", "Held-out pass@1 by data source",
                            "KL", "Entropy", "Response length", "Losses", "Gradient norm", "Seconds per phase",
                            "Throughput", "Memory", "Engine vs trainer logprobs"]
    assert "Not drawn, every value 0: Clip fraction." in page
    for section in ("First and last values", "Key settings", "Held-out evaluation", "Eval dumps",
                    "Examples from the eval at step 6", "Rollouts by step", "All metrics"):
        assert section in page, section
    # the header: start, wall time, hardware, model, the algorithm as resolved, a link to the config
    assert "<tr><td>started</td><td>2026-11-27 10:00:00 UTC (resumed 1 time(s))</td></tr>" in page
    assert "<tr><td>wall time</td><td>3 min 00 s (from the start to the last logged row)</td></tr>" in page
    assert ("CPU: Test CPU 9000 (2 CPUs, 7.5 GiB memory); GPU: NVIDIA H100 80GB HBM3; one process on cpu"
            in page)
    assert "<tr><td>model</td><td>tiny://llama</td></tr>" in page
    assert "grpo advantages, regular policy loss (token_mean), KL: KL loss (k3, coef 0.001)" in page
    assert "None policy loss" not in page
    assert '<a href="config.yaml">config.yaml</a>' in page and "<summary>config.yaml</summary>" in page
    assert "<td><code>trainer.policy.optimizer_config.lr</code></td><td>1.000e-06</td>" in page
    assert "<td><code>generator.n_samples_per_prompt</code></td><td>4</td>" in page
    # every piece of run text is escaped: the page has no script and no injected tag
    assert "<script" not in page and "<b>bold" not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in page
    assert "user: first &lt;script&gt;" in page  # chat prompts as role: content lines
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<link" not in page
    assert "openai_gsm8k" in page and "arith" in page
    assert "unreadable line" not in page
    # its own eval dumps (in the shared export folder and the run folder), not the other run's
    assert "exports/dumped_evals/global_step_3_evals</code></td></tr>" in page and "FOREIGN prompt" not in page
    assert "Left out: 1 eval dump folder(s)" in page and "global_step_4_evals" in page
    # the step browser: every sampled step, the first and last open
    assert '<details id="step-1" open>' in page and '<details id="step-6" open>' in page
    assert "<summary>Step 1: 3 rollout(s), mean reward 0.3333</summary>" in page


def test_report_without_run_json_names_the_raw_loss_keys(tmp_path):
    page = write_report(make_run(tmp_path / "run", info=False)).read_text()
    assert "policy_loss_type=None, ppo_loss_type=regular (no run.json, which names the loss as resolved)" in page
    assert "None policy loss" not in page
    assert "<tr><td>started</td><td>– (no run.json" in page
    # without a run id, the export folder's dumps cannot be told to be this run's: both left out
    assert "global_step_3_evals</code></td></tr>" not in page and "Left out: 2 eval dump folder(s)" in page


def test_a_report_beside_the_run_folder_links_the_config_relatively(tmp_path):
    run_dir = make_run(tmp_path / "run")
    page = write_report(run_dir, tmp_path / "out.html").read_text()
    assert '<a href="run/config.yaml">run/config.yaml</a>' in page


def test_report_series_and_samples(tmp_path):
    data = load_run(make_run(tmp_path / "run"))
    assert data.series("eval/all/pass_at_1") == [(0, 0.15000000000000002), (3, 0.2625), (6, 0.375)]
    assert [s for s, _ in data.series("policy/policy_entropy")] == [1, 3, 4, 5, 6]  # the null is skipped
    assert data.time_series("reward/avg_raw_reward")[:2] == [(30.0, 0.1), (60.0, 0.2)]
    by_step = data.samples_by_step()
    assert list(by_step) == [1, 6]
    first = by_step[1]
    assert len(first) == 3 and [s["reward"] for s in first] == [0.0, 0.0, 1.0]  # lists summed
    assert first[0]["prompt"] == f"system: be brief\nuser: first {NASTY}"  # the earlier run's is gone
    assert [(d.step, d.folder.name, len(d.records)) for d in data.eval_dumps] == [
        (3, "global_step_3_evals", 1), (6, "global_step_6_evals", 6)]  # the metrics line is not a sample
    assert [f.name for f in data.foreign_dumps] == ["global_step_4_evals"]
    # pass rate 3 of 6: the last two scores are per token, and [0.0, 1.0] sums to a pass
    assert "<td>6</td><td>6</td><td>0.5</td>" in write_report(tmp_path / "run").read_text()


def test_a_resume_cuts_the_rollouts_of_the_steps_it_redoes(tmp_path):
    """A resumed run redoes the steps after its checkpoint: their rollouts are cut from
    samples.jsonl when it starts (with metrics.jsonl's rows), then written again."""
    from ridgeline.trainer.checkpoint import prepare_metrics

    path = tmp_path / "samples.jsonl"
    for step, text in [(1, "a"), (2, "b"), (3, "killed")]:
        write_samples(path, step, [text] * 2, [text] * 2, [1.0, 0.0])
    with path.open("a") as f:
        f.write('{"step": 3, "prom')  # the killed process's last line
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    ckpt = tmp_path / "ckpts" / "global_step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"run_dir": str(tmp_path), "global_step": 2,
                                                         "metrics_rows": 2}))
    prepare_metrics(tmp_path, ckpt)
    write_samples(path, 3, ["redone"] * 2, ["redone"] * 2, [1.0, 0.0])
    data = load_run(tmp_path)
    assert {step: [r["prompt"] for r in rows] for step, rows in data.samples_by_step().items()} == {
        1: ["a", "a"], 2: ["b", "b"], 3: ["redone", "redone"]}
    assert [r["step"] for r in data.rows] == [1, 2]


def test_a_new_run_in_an_old_folder_sets_the_old_rollouts_aside(tmp_path):
    from ridgeline.trainer.checkpoint import prepare_metrics

    write_samples(tmp_path / "samples.jsonl", 1, ["old"], ["old"], [1.0])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    prepare_metrics(tmp_path, None)
    assert not (tmp_path / "samples.jsonl").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert len(list(tmp_path.glob("samples.jsonl.*.old"))) == 1 and len(list(tmp_path.glob("metrics.jsonl.*.old"))) == 1


def test_smoothing_is_a_debiased_moving_average():
    # 3 points: weight 1 - 1/2 = 0.5; debiased, the first value is kept
    assert smooth([(1, 0.0), (2, 1.0), (3, 1.0)]) == [(1, 0.0), (2, pytest.approx(2 / 3)), (3, pytest.approx(6 / 7))]
    flat = smooth([(i, 0.5) for i in range(40)])  # weight 0.75
    assert all(y == pytest.approx(0.5) for _, y in flat)


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
    assert "Reward and accuracy over time" in images(page)
    assert "Rollouts by step" not in page and not (crashed / "report.html").exists()

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


# ------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real tiny runs in one runs folder (the same trainer.export_path and exports_per_run=false,
    so SkyRL's shared dumped_evals/): `a` sums (evals at steps 0, 1, 2), then `b` multiplies (another seed; its
    final eval at step 2 replaces a's dump there). Then a's report is written again."""
    from ridgeline.config import load_config
    from ridgeline.entrypoints.run import run_training

    runs = tmp_path_factory.mktemp("runs")
    common = ["+experiment=tiny", f"trainer.export_path={runs}", "trainer.exports_per_run=false", "data.prepare.num_train=32"]
    run_training(load_config([*common, "trainer.run_name=a", "trainer.eval_interval=1"]))
    run_training(load_config([*common, "trainer.run_name=b", "data.prepare.ops=*", "trainer.seed=7",
                              "trainer.eval_before_train=false"]))
    return runs, write_report(runs / "a").read_text(), (runs / "b" / "report.html").read_text()


def sample_prompts(run_dir: Path) -> set[str]:
    return {json.loads(line)["prompt"] for line in (run_dir / "samples.jsonl").read_text().splitlines()}


@pytest.mark.integration
def test_each_report_shows_its_own_runs_samples_and_eval_dumps(two_runs):
    runs, page_a, page_b = two_runs
    escape = html.escape
    assert sample_prompts(runs / "a") and sample_prompts(runs / "b")
    assert all(escape(p, quote=False) in page_a for p in sample_prompts(runs / "a"))
    assert not any(escape(p, quote=False) in page_a for p in sample_prompts(runs / "b"))
    assert re.search(r"What is \d \+ \d", page_a) and not re.search(r"What is \d \* \d", page_a)
    assert re.search(r"What is \d \* \d", page_b) and not re.search(r"What is \d \+ \d", page_b)
    dumps = runs / "dumped_evals"
    own_a = re.findall(r"<tr><td>(\d+)</td><td>16</td><td>[^<]*</td><td><code>([^<]*)</code>", page_a)
    assert own_a == [("0", str(dumps / "global_step_0_evals")), ("1", str(dumps / "global_step_1_evals"))]
    assert "Left out: 1 eval dump folder(s)" in page_a and str(dumps / "global_step_2_evals") in page_a
    own_b = re.findall(r"<tr><td>(\d+)</td><td>16</td><td>[^<]*</td><td><code>([^<]*)</code>", page_b)
    assert own_b == [("2", str(dumps / "global_step_2_evals"))] and "Left out: 2 eval dump folder(s)" in page_b


def test_a_real_runs_report_has_its_header_charts_and_step_browser(two_runs):
    runs, page, _ = two_runs
    info = json.loads((runs / "a" / "run.json").read_text())
    assert info["algorithm"]["policy_loss"] == "regular" and info["run_dir"] == str((runs / "a").resolve())
    # the tiny preset leaves policy_loss_type null: the loss the workers use is named
    assert "grpo advantages, regular policy loss (token_mean), KL: KL loss (k3, coef 0.001)" in page
    assert "None policy loss" not in page
    for label in ("run id", "started", "wall time", "hardware", "model", "algorithm", "software", "config"):
        assert f"<tr><td>{label}</td><td>" in page, label
    assert re.search(r"<tr><td>started</td><td>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</td>", page)
    assert re.search(r"<tr><td>wall time</td><td>\d+ (s|min \d\d s) \(from the start", page)
    assert "; GPU: none; one process on cpu</td>" in page and "<tr><td>model</td><td>tiny://llama</td>" in page
    assert '<a href="config.yaml">config.yaml</a>' in page
    # one mini-batch, one pass: the ratio is exactly 1, nothing is clipped
    assert "Not drawn, every value 0: Clip fraction." in page and "Clip fraction" not in images(page)
    assert {"Reward and accuracy", "Reward and accuracy over time", "Memory"} <= set(images(page))
    assert '<details id="step-1" open>' in page and '<details id="step-2" open>' in page
    rows = [json.loads(line) for line in (runs / "a" / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["timing/elapsed"] for r in rows]
    assert len(elapsed) == len(rows) and elapsed == sorted(elapsed) and elapsed[0] > 0
    assert all(0 < r["memory/rss_gib"] <= r["memory/peak_rss_gib"] + 1e-6 for r in rows if "memory/rss_gib" in r)
