"""One TRL `GRPOTrainer` run for `bench/vs_trl.py`; runs inside TRL's own environment (`.venv-trl`).

    OMP_NUM_THREADS=1 .venv-trl/bin/python bench/trl_runner.py SPEC.json OUT.json

Not meant to be called by hand: `bench/vs_trl.py` writes SPEC (the model folder, the prompt files,
the number of steps and the `GRPOConfig` keyword arguments, which live in one table there) and
reads OUT. The reward is Ridgeline's own `arithmetic` env (`ridgeline.envs` imports only the
standard library, so it is imported from the checkout without installing Ridgeline here).

OUT holds wall-clock stamps (time.time(), so the driver's spawn time is comparable):
`t_spawn` (from the driver), `t_imported`, `t_trainer_built` (model and tokenizer loaded),
`t_train_begin`, `step_begin`/`step_end` (one per optimizer step), `t_train_end`; the held-out
greedy evals (`evals`: step, accuracy, seconds) when SPEC asks for them; the effective GRPOConfig;
per-step reward and completion length; and what the training and generation forwards computed in
(the LM head's output dtype), to check bf16 autocast.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T_START = time.time()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")           # everything is a local folder; never the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, GenerationConfig, TrainerCallback  # noqa: E402

import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, str(REPO))  # ridgeline.envs only (standard library): the reward both sides use
from ridgeline import envs  # noqa: E402
from ridgeline.allocator import active_allocator  # noqa: E402  (standard library only, like envs)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


REWARD_CALLS: list[list[str]] = []  # the ground truths of each training reward call (the step's prompts)


def score(texts: list[str], ground_truths: list[str]) -> list[float]:
    """Ridgeline's `arithmetic` env, one instance per completion, exactly as Ridgeline's generator
    builds and steps it (on the decoded text, special tokens skipped)."""
    return [envs.make("arithmetic", extras={"reward_spec": {"ground_truth": gt}}).step(text).reward
            for text, gt in zip(texts, ground_truths)]


def arithmetic_reward(prompts, completions, ground_truth, **_):
    REWARD_CALLS.append(sorted(set(ground_truth)))
    return score([c[-1]["content"] if isinstance(c, list) else c for c in completions], ground_truth)


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def prompt_ids(tokenizer, messages) -> list[int]:
    """The chat-templated prompt as GRPOTrainer tokenizes it (`_tokenize_prompts`)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = out["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, chunk: int) -> float:
    """Held-out greedy accuracy with the model TRL trains and generates with (its `generate`, the
    same chat-template prompts, left padding as TRL's generation), scored by the same reward."""
    was_training = model.training
    model.eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    correct = 0
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        ids = [prompt_ids(tokenizer, r["prompt"]) for r in part]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        texts = []
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id) + 1]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
        rewards = score(texts, [r["ground_truth"] for r in part])
        correct += sum(r >= 1.0 for r in rewards)
    if was_training:
        model.train()
    return correct / len(rows)


class BenchCallback(TrainerCallback):
    """Wall-clock stamps of every optimizer step, and the held-out evals (timed apart)."""

    def __init__(self, record: dict, spec: dict, tokenizer, eval_rows: list[dict] | None):
        self.record, self.spec, self.tokenizer, self.eval_rows = record, spec, tokenizer, eval_rows
        self.trainer = None

    def _eval(self, model, step: int) -> None:
        t0 = time.time()
        acc = greedy_accuracy(model, self.tokenizer, self.eval_rows, self.spec["eval_max_new_tokens"],
                              self.spec["eval_chunk"])
        seconds = time.time() - t0
        self.record["evals"].append({"step": step, "accuracy": acc, "seconds": seconds, "t_end": time.time()})
        print(f"[trl] eval @ step {step}: {acc:.3f} ({seconds:.1f} s)", flush=True)

    def _wants_eval(self, step: int) -> bool:
        interval = self.spec.get("eval_interval", -1)
        return bool(self.eval_rows) and (step == self.spec["steps"] or (interval > 0 and step % interval == 0))

    def on_train_begin(self, args, state, control, model=None, **_):
        self.record["t_train_begin"] = time.time()
        self.record["activation_checkpointing"] = bool(getattr(model, "is_activation_checkpointing", False))
        if self.eval_rows and self.spec.get("eval_before_train", True):
            self._eval(model, 0)

    def on_step_begin(self, args, state, control, **_):
        self.record["step_begin"].append(time.time())

    def on_step_end(self, args, state, control, model=None, **_):
        self.record["step_end"].append(time.time())
        metrics = getattr(self.trainer, "_metrics", {}).get("train", {})
        for key, name in (("reward", "reward"), ("completions/mean_length", "completion_length")):
            values = metrics.get(key) or [None]
            self.record["per_step"].setdefault(name, []).append(values[-1])
        step = state.global_step
        print(f"[trl] step {step}: {self.record['step_end'][-1] - self.record['step_begin'][-1]:.2f} s, "
              f"reward {self.record['per_step']['reward'][-1]}", flush=True)
        if self._wants_eval(step):
            self._eval(model, step)

    def on_train_end(self, args, state, control, **_):
        self.record["t_train_end"] = time.time()


def probe_dtypes(model, record: dict) -> None:
    """Record the LM head's output dtype in the first generation forward (no grad) and the first
    training forward (grad): bf16 there means the forward ran under bf16 autocast."""
    head = model.get_output_embeddings()
    seen: dict[str, str] = record.setdefault("lm_head_output_dtype", {})

    def hook(_module, _inputs, output):
        phase = "train" if torch.is_grad_enabled() else "generate"
        seen.setdefault(phase, str(output.dtype).replace("torch.", ""))
        if len(seen) == 2:
            handle.remove()

    handle = head.register_forward_hook(hook)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    record: dict = {"framework": "trl", "versions": {"trl": trl.__version__, "torch": torch.__version__},
                    "t_spawn": float(os.environ.get("BENCH_T_SPAWN", T_START)), "t_process_start": T_START,
                    "t_imported": time.time(), "step_begin": [], "step_end": [], "evals": [], "per_step": {}}
    import accelerate
    import transformers
    record["versions"].update(transformers=transformers.__version__, accelerate=accelerate.__version__)
    record["allocator"] = active_allocator()

    # The tokenizer as GRPOTrainer loads it itself (left padding and truncation), from the same folder.
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left", truncation_side="left")
    train_rows = read_jsonl(spec["train_file"])
    eval_rows = read_jsonl(spec["eval_file"]) if spec.get("eval_file") else None
    record["first_prompt_ids"] = prompt_ids(tokenizer, train_rows[0]["prompt"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in train_rows])

    config = GRPOConfig(output_dir=str(out_path.parent / "trl_output"), max_steps=spec["steps"], **spec["grpo_config"])
    callback = BenchCallback(record, spec, tokenizer, eval_rows)
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[callback])
    callback.trainer = trainer
    probe_dtypes(trainer.model, record)
    record["t_trainer_built"] = time.time()
    record["optimizer"] = None
    record["grpo_config"] = {k: (v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v))
                             for k, v in config.to_dict().items()}
    record["parameters"] = sum(p.numel() for p in trainer.model.parameters())
    trainer.train()
    record["optimizer"] = f"{type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, 'optimizer') else trainer.optimizer).__name__}" \
        f" {({k: v for k, v in trainer.optimizer.param_groups[0].items() if k in ('fused', 'foreach', 'eps', 'betas')})}"
    record["reward_ground_truths"] = REWARD_CALLS
    record["t_done"] = time.time()
    out_path.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
