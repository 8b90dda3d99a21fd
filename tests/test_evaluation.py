"""Held-out evaluation: pass@k maths, grouping by prompt and data source, dumps (SkyRL's files),
and `ridgeline eval` end to end on the tiny model (a preset, a saved Hugging Face folder, a bare
safetensors checkpoint)."""

import argparse
import json
import math
from pathlib import Path

import pytest

from ridgeline.entrypoints import eval as eval_cli
from ridgeline.generation.types import GeneratorInput, GeneratorOutput, TrajectoryID
from ridgeline.inference.types import SamplingParams
from ridgeline.tracking.dumps import AGGREGATED_FILE, read_eval_dump
from ridgeline.trainer.evaluation import EvalAccumulator, pass_at_k, reported_ks


def output(rewards, metadata=None, stop="stop", uids=None):
    """A GeneratorOutput with these rewards (one trajectory each), prompt ids [1, i] and 3-token
    responses; without uids every trajectory is a prompt of its own."""
    size = len(rewards)
    uids = list(uids) if uids is not None else [f"p{i}" for i in range(size)]
    return GeneratorOutput(
        prompt_token_ids=[[1, i] for i in range(size)], response_ids=[[5, 6, 7]] * size, rewards=list(rewards),
        loss_masks=[[1, 1, 1]] * size, stop_reasons=[stop] * size, rollout_logprobs=[[0.0] * 3] * size,
        responses=[f"answer {i}" for i in range(size)],
        trajectory_ids=[TrajectoryID(uid, uids[:i].count(uid)) for i, uid in enumerate(uids)],
        step_metadata=list(metadata) if metadata is not None else [{} for _ in range(size)])


def prompt(text):
    return [{"role": "user", "content": text}]


def inputs(prompts, ground_truths, env_class="arith"):
    """The GeneratorInput of a batch: one entry per trajectory, the ground truth in the row's reward_spec."""
    return GeneratorInput(prompts=list(prompts), env_classes=[env_class] * len(prompts),
                          env_extras=[{"reward_spec": {"method": "rule", "ground_truth": t}} for t in ground_truths],
                          trajectory_ids=[], sampling_params=SamplingParams(), mode="eval")


def decode(ids):
    return " ".join(f"t{i}" for i in ids)


def add(acc, sources, prompts, out, ground_truths):
    acc.add(sources, inputs(prompts, ground_truths), out, decode)


# ------------------------------------------------------------------------------------ pass@k
def test_pass_at_k_matches_hand_computed_values():
    # n=4 samples, c=1 correct
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)          # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 1, 4) == pytest.approx(1.0)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)         # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 3, 4) == pytest.approx(1 - math.comb(5, 4) / math.comb(8, 4))
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    for bad in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_reported_ks_are_one_powers_of_two_and_n():
    assert reported_ks(1) == [1]
    assert reported_ks(2) == [1, 2]
    assert reported_ks(5) == [1, 2, 4, 5]
    assert reported_ks(8) == [1, 2, 4, 8]
    assert reported_ks(16) == [1, 2, 4, 8, 16]


# ------------------------------------------------------------------------------------ accumulator
def test_sources_are_reported_separately_and_together():
    acc = EvalAccumulator()
    # batch 1: two prompts of "arith" with 4 samples each; batch 2: one "openai/gsm8k" prompt.
    # Batch 2 reuses the uid "0-eval-0" as the trainer does: uids group within a call only.
    add(acc, ["arith"] * 8, [prompt("p1")] * 4 + [prompt("p2")] * 4,
        output([1, 0, 0, 0, 0, 0, 0, 0], uids=["0-eval-0"] * 4 + ["0-eval-1"] * 4), ["5"] * 8)
    add(acc, ["openai/gsm8k"] * 4, [prompt("p3")] * 4, output([1.0, 1.0, 0.5, 1.0], uids=["0-eval-0"] * 4), ["7"] * 4)
    m = acc.metrics()
    # arith: c = 1 of 4 and c = 0 of 4
    assert m["eval/arith/pass_at_1"] == pytest.approx((0.25 + 0) / 2)
    assert m["eval/arith/pass_at_2"] == pytest.approx((0.5 + 0) / 2)
    assert m["eval/arith/pass_at_4"] == pytest.approx((1 + 0) / 2)
    assert m["eval/arith/avg_score"] == pytest.approx(1 / 8)
    assert m["eval/arith/num_prompts"] == 2
    # gsm8k ("/" becomes "_"): the 0.5 is positive, a pass as in SkyRL (c = 4 of 4), but partial
    # credit is not solved (accuracy 3 of 4)
    assert m["eval/openai_gsm8k/pass_at_1"] == pytest.approx(1.0)
    assert m["eval/openai_gsm8k/pass_at_2"] == pytest.approx(1.0)
    assert m["eval/openai_gsm8k/avg_score"] == pytest.approx(3.5 / 4)
    assert m["eval/openai_gsm8k/accuracy"] == pytest.approx(0.75)
    # all: the three prompts together
    assert m["eval/all/pass_at_1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["eval/all/pass_at_2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["eval/all/pass_at_4"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["eval/all/avg_score"] == pytest.approx(4.5 / 12)
    assert m["eval/all/mean_positive_reward"] == pytest.approx(4.5 / 12)
    assert m["eval/all/accuracy"] == pytest.approx(4 / 12)
    assert m["eval/all/num_prompts"] == 3
    assert [(r["prompt_index"], r["sample_index"]) for r in acc.records] == \
        [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]


def test_samples_with_uids_of_their_own_are_prompts_of_their_own():
    """One sample per prompt: no pass@k beyond 1."""
    acc = EvalAccumulator()
    add(acc, ["arith"] * 4, [prompt("p")] * 4, output([1, 0, 0, 0]), ["5"] * 4)
    m = acc.metrics()
    each = {"pass_at_1": 0.25, "avg_score": 0.25, "mean_positive_reward": 0.25, "accuracy": 0.25, "num_prompts": 4}
    assert m == {f"eval/{source}/{name}": value for source in ("arith", "all") for name, value in each.items()}
    assert EvalAccumulator().metrics() == {}


def test_skyrl_pass_counts_positive_rewards_and_mean_positive_drops_negatives():
    """SkyRL's eval metrics (skyrl_train/generators/utils.py get_metrics_from_generator_output) on
    one prompt with 4 samples: a pass is a reward > 0; mean_positive_reward averages max(r, 0)."""
    acc = EvalAccumulator()
    add(acc, ["src"] * 4, [prompt("p")] * 4, output([-1.0, 0.5, 2.0, 0.0], uids=["u"] * 4), [None] * 4)
    m = acc.metrics()
    assert m["eval/src/avg_score"] == pytest.approx(1.5 / 4)
    assert m["eval/src/mean_positive_reward"] == pytest.approx(2.5 / 4)
    assert m["eval/src/pass_at_1"] == pytest.approx(2 / 4)                   # c = 2 (0.5 and 2.0)
    assert m["eval/src/pass_at_4"] == 1.0                                     # SkyRL's pass_at_<n>
    assert m["eval/src/accuracy"] == pytest.approx(1 / 4)                     # only 2.0 is solved
    assert [r["passed"] for r in acc.records] == [False, True, True, False]


def test_per_token_rewards_are_summed_and_pass_on_their_last_token():
    acc = EvalAccumulator()
    rewards = [[0.0, 0.0, 1.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.0]]
    add(acc, ["multi"] * 3, [prompt("p")] * 3, output(rewards, uids=["a", "a", "a"]), [None] * 3)
    m = acc.metrics()
    assert [r["score"] for r in acc.records] == rewards  # SkyRL's score: the reward as generated
    # SkyRL reads a per-token reward's outcome on its last token: the third sums to 0.5 but ends on 0
    assert [r["passed"] for r in acc.records] == [True, True, False]
    assert m["eval/multi/pass_at_1"] == pytest.approx(2 / 3)
    assert m["eval/multi/pass_at_2"] == pytest.approx(1.0)  # 1 - C(1,2)/C(3,2), C(1,2) = 0
    assert m["eval/multi/pass_at_3"] == pytest.approx(1.0)
    assert m["eval/multi/avg_score"] == pytest.approx(2.5 / 3)


def test_dump_writes_skyrls_files(tmp_path):
    """SkyRL's layout: one <data_source>.jsonl per source ("/" -> "_"), SkyRL's record fields plus
    Ridgeline's, and aggregated_results.jsonl with the metrics on one line."""
    acc = EvalAccumulator()
    metadata = [{"parsed": "5", "ground_truth": "5"}, {"parsed": "4", "ground_truth": "5"},
                {"parsed": None, "ground_truth": "9"}]
    # the third row has no ground truth in its reward_spec: the env's metadata supplies it
    add(acc, ["arith"] * 3, [prompt("2+3"), prompt("2+3"), prompt("4+5")],
        output([1.0, 0.5, 0.0], metadata, "length", uids=["0", "0", "1"]), ["5", "5", None])
    add(acc, ["openai/gsm8k"], [prompt("q")], output([1.0]), ["7"])
    folder = tmp_path / "dumped_evals" / "global_step_3_evals"
    assert acc.dump(folder, extra_metrics={"timing/eval": 1.5}) == folder
    assert sorted(p.name for p in folder.iterdir()) == [AGGREGATED_FILE, "arith.jsonl", "openai_gsm8k.jsonl"]
    rows = [json.loads(line) for line in (folder / "arith.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[1] == {"input_prompt": "t1 t1", "output_response": "t5 t6 t7", "score": 0.5, "stop_reason": "length",
                       "env_class": "arith", "env_extras": {"reward_spec": {"method": "rule", "ground_truth": "5"}},
                       "data_source": "arith", "prompt_index": 0, "sample_index": 1, "passed": True, "parsed": "4",
                       "ground_truth": "5", "num_tokens": 3}
    assert rows[2]["ground_truth"] == "9" and rows[2]["parsed"] is None and rows[2]["sample_index"] == 0
    assert [r["data_source"] for r in read_eval_dump(folder)] == ["arith"] * 3 + ["openai/gsm8k"]
    assert (folder / AGGREGATED_FILE).read_text().count("\n") == 1
    metrics = read_metrics(folder)
    assert metrics == {**acc.metrics(), "timing/eval": 1.5}
    assert metrics["eval/arith/pass_at_1"] == pytest.approx(0.5)  # (2/2 + 0/1) / 2: 0.5 is positive
    # a second dump into the folder replaces the first as a whole
    again = EvalAccumulator()
    add(again, ["arith"], [prompt("p")], output([0.0]), ["1"])
    again.dump(folder)
    assert sorted(p.name for p in folder.iterdir()) == [AGGREGATED_FILE, "arith.jsonl"]


def test_outputs_without_step_metadata_dump_parsed_as_none(tmp_path):
    acc = EvalAccumulator()
    out = output([1.0])
    out.step_metadata = []
    add(acc, ["arith"], [prompt("p")], out, ["1"])
    assert acc.records[0]["parsed"] is None and acc.records[0]["ground_truth"] == "1"
    with pytest.raises(ValueError, match="2 data sources for 2 inputs and 1 trajectories"):
        add(acc, ["arith"] * 2, [prompt("p")] * 2, out, ["1"] * 2)


# ------------------------------------------------------------------------------------ ridgeline eval
def tiny(export, *extra):
    return ["+experiment=tiny", f"trainer.export_path={export}", "data.prepare.num_train=16", *extra]


def read_results(folder: Path) -> list[dict]:
    return read_eval_dump(folder)


def read_metrics(folder: Path) -> dict:
    return json.loads((folder / AGGREGATED_FILE).read_text())


def test_cli_options_may_follow_the_overrides():
    parser = argparse.ArgumentParser(prog="ridgeline")
    eval_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--checkpoint", "ck", "+experiment=tiny", "--output", "out", "trainer.seed=1"])
    args = eval_cli._options_among_overrides(args)
    assert (args.checkpoint, args.output, args.overrides) == (Path("ck"), Path("out"),
                                                              ["+experiment=tiny", "trainer.seed=1"])
    assert args.func is eval_cli.run
    args = eval_cli.parse_args(["+experiment=tiny", "--output", "out", "trainer.seed=1"])
    assert (args.checkpoint, args.output, args.overrides) == (None, Path("out"), ["+experiment=tiny", "trainer.seed=1"])


def test_eval_on_the_tiny_preset_writes_metrics_and_dump(tmp_path, capsys):
    code = eval_cli.main(tiny(tmp_path, "generator.eval_n_samples_per_prompt=4",
                              "generator.eval_sampling_params.temperature=1.0"))
    assert code == 0
    folder = tmp_path / "tiny" / "dumped_evals" / "eval_only"  # SkyRL's layout, in the run's folder (exports_per_run)
    metrics = read_metrics(folder)
    for name in ["pass_at_1", "pass_at_2", "pass_at_4", "avg_score", "num_prompts"]:
        assert f"eval/arithmetic/{name}" in metrics and f"eval/all/{name}" in metrics
    assert metrics["eval/all/num_prompts"] == 16
    assert 0.0 <= metrics["eval/all/pass_at_1"] <= metrics["eval/all/pass_at_2"] <= metrics["eval/all/pass_at_4"] <= 1
    rows = read_results(folder)
    assert len(rows) == 16 * 4
    assert [r["sample_index"] for r in rows[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(r["ground_truth"] is not None and "parsed" in r and r["num_tokens"] <= 4 for r in rows)
    assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(metrics["eval/all/avg_score"])
    assert (folder / "config.yaml").exists()
    printed = capsys.readouterr().out
    assert "pass@4" in printed and "arithmetic" in printed


def test_eval_matches_the_trainers_eval(tmp_path):
    """Same config, same weights, same seed: `ridgeline eval` samples and scores exactly what
    `Trainer.evaluate` does at step 0."""
    from ridgeline.config import load_config
    from ridgeline.trainer.trainer import Trainer

    overrides = tiny(tmp_path, "generator.eval_n_samples_per_prompt=2", "generator.eval_sampling_params.temperature=1.0")
    report = eval_cli.evaluate_model(load_config(overrides), output=tmp_path / "out")
    trained = Trainer.from_config(load_config(overrides)).evaluate()
    for key in ["eval/all/pass_at_1", "eval/all/avg_score", "eval/arithmetic/pass_at_1"]:
        assert report.metrics[key] == pytest.approx(trained[key]), key
    dumped = read_results(tmp_path / "tiny" / "dumped_evals" / "global_step_0_evals")
    mine = read_results(tmp_path / "out")
    assert [(r["output_response"], r["score"]) for r in mine] == [(r["output_response"], r["score"]) for r in dumped]


def test_files_sharing_a_data_source_are_reported_apart(tmp_path):
    data = tmp_path / "tiny" / "data"
    code = eval_cli.main(tiny(tmp_path, f"data.val_data=[{data}/train.parquet,{data}/validation.parquet]",
                              "--output", str(tmp_path / "out")))
    assert code == 0
    metrics = read_metrics(tmp_path / "out")
    assert metrics["eval/arithmetic_train/num_prompts"] == 16
    assert metrics["eval/arithmetic_validation/num_prompts"] == 16
    assert metrics["eval/all/num_prompts"] == 32
    assert {r["data_source"] for r in read_results(tmp_path / "out")} == {"arithmetic/train", "arithmetic/validation"}


def save_tiny(folder: Path, seed: int) -> Path:
    """The tiny model of this seed, with its tokenizer, as a Hugging Face folder."""
    from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    build_tiny_model("llama", tokenizer, seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Sampled, not greedy: a random tiny model's greedy answer is the same for most weights.
SAMPLED = "generator.eval_sampling_params.temperature=1.0"


def test_eval_of_a_saved_folder_scores_the_same_model(tmp_path):
    """tiny://llama (seed 42, the preset's trainer.seed), its saved folder as the model path, and
    the folder as --checkpoint give the same samples; another seed's folder does not."""
    saved = save_tiny(tmp_path / "saved", seed=42)
    other = save_tiny(tmp_path / "other", seed=1)
    runs = {}
    for name, extra in [("tiny", []), ("path", [f"trainer.policy.model.path={saved}"]),
                        ("checkpoint", ["--checkpoint", str(saved)]), ("other", ["--checkpoint", str(other)])]:
        assert eval_cli.main(tiny(tmp_path, SAMPLED, "--output", str(tmp_path / name), *extra)) == 0
        runs[name] = read_results(tmp_path / name)
    assert runs["path"] == runs["tiny"] and runs["checkpoint"] == runs["tiny"]
    assert runs["other"] != runs["tiny"]  # so the equalities above can fail
    assert str(saved) in (tmp_path / "checkpoint" / "config.yaml").read_text()


def test_eval_zeroes_truncated_rewards_and_never_penalises_length(tmp_path):
    """The truncation policy's eval rule: zero_reward_on_non_stop applies, DAPO's length penalty
    (a training signal) does not."""
    base = tiny(tmp_path, SAMPLED, "generator.eval_n_samples_per_prompt=4")
    runs = {}
    for name, extra in [("plain", []), ("strict", ["generator.zero_reward_on_non_stop=true",
                                                   "trainer.algorithm.overlong_buffer_len=2"])]:
        assert eval_cli.main([*base, *extra, "--output", str(tmp_path / name)]) == 0
        runs[name] = read_results(tmp_path / name)
    plain, strict = runs["plain"], runs["strict"]
    assert [r["output_response"] for r in strict] == [r["output_response"] for r in plain]
    for a, b in zip(plain, strict):
        assert b["score"] == (a["score"] if a["stop_reason"] == "stop" else 0.0)
    # so the equalities above can fail: a truncated response with a reward, and a stopped one
    # longer than max_generate_length 4 - buffer 2 tokens, which a penalty would have cost
    assert any(r["stop_reason"] != "stop" and r["score"] > 0 for r in plain)
    assert any(r["stop_reason"] == "stop" and r["num_tokens"] > 2 for r in plain)


@pytest.mark.integration
def test_eval_of_bare_safetensors_weights(tmp_path):
    """A checkpoint with only *.safetensors: the weights go into the model trainer.policy.model.path
    names (tied lm_head included), and the tokenizer is the base model's."""
    full = save_tiny(tmp_path / "full", seed=1)
    bare = tmp_path / "bare"
    bare.mkdir()
    (full / "model.safetensors").rename(bare / "model.safetensors")
    assert eval_cli.main(tiny(tmp_path, SAMPLED, "--checkpoint", str(bare), "--output", str(tmp_path / "bare_out"))) == 0
    (bare / "model.safetensors").rename(full / "model.safetensors")
    assert eval_cli.main(tiny(tmp_path, SAMPLED, "--checkpoint", str(full), "--output", str(tmp_path / "full_out"))) == 0
    assert eval_cli.main(tiny(tmp_path, SAMPLED, "--output", str(tmp_path / "base_out"))) == 0
    assert read_results(tmp_path / "bare_out") == read_results(tmp_path / "full_out")
    assert read_results(tmp_path / "bare_out") != read_results(tmp_path / "base_out")  # the seed-1 weights


def test_bad_config_and_bad_checkpoint(tmp_path, capsys):
    assert eval_cli.main(tiny(tmp_path, "trainer.epochz=2")) == 2
    assert "invalid configuration" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert eval_cli.main(tiny(tmp_path, "--checkpoint", str(tmp_path / "empty"))) == 2
    assert "neither a Hugging Face model" in capsys.readouterr().err
    # safetensors of another architecture than the config's model
    from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
    build_tiny_model("llama-small", build_char_tokenizer()).save_pretrained(tmp_path / "small")
    (tmp_path / "small" / "config.json").unlink()
    assert eval_cli.main(tiny(tmp_path, "--checkpoint", str(tmp_path / "small"))) == 2
    assert "do not fit the model" in capsys.readouterr().err


@pytest.mark.integration
def test_eval_scores_a_training_checkpoint(tmp_path):
    """`--checkpoint` accepts a training checkpoint folder (or its ckpt_path): its policy is scored."""
    from ridgeline.config import load_config
    from ridgeline.entrypoints.eval import evaluate_model
    from ridgeline.trainer.trainer import Trainer

    overrides = ["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                 "trainer.ckpt_interval=1", "trainer.eval_before_train=false"]
    trainer = Trainer.from_config(load_config(overrides))
    trainer.train()
    ckpt_root = Path(trainer.cfg.trainer.ckpt_path)
    report = evaluate_model(load_config(overrides), checkpoint=ckpt_root, output=tmp_path / "eval")
    assert (tmp_path / "eval" / AGGREGATED_FILE).exists()
    assert "eval/all/pass_at_1" in report.metrics


def test_eval_checks_every_rows_environment_before_scoring(tmp_path):
    """An env class unknown to Ridgeline and to skyrl-gym stops `ridgeline eval` before any sample
    is generated, naming the file and the row (not a table of zero rewards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ridgeline.config import load_config
    from ridgeline.trainer.builders import EnvironmentCheckError

    data = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": [{"role": "user", "content": "1+1?"}],
                                          "env_class": "no_such_env",
                                          "reward_spec": {"method": "rule", "ground_truth": "2"}}]), data)
    with pytest.raises(EnvironmentCheckError, match=rf"{data} row 0, column 'env_class': unknown env 'no_such_env'"):
        eval_cli.evaluate_model(load_config(tiny(tmp_path, f"data.val_data=[{data}]")), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
