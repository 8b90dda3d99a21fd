"""`ridgeline export CHECKPOINT OUT`: Hugging Face model folders from a training checkpoint.

CHECKPOINT is a checkpoint folder (`<trainer.ckpt_path>/global_step_N`) or a `trainer.ckpt_path`
(its latest complete checkpoint is taken). OUT receives the same layout as the periodic exports
(`trainer.hf_save_interval`): `OUT/policy` (weights, config, generation config, tokenizer; loads
with `transformers.AutoModelForCausalLM.from_pretrained`) and, when the run had a critic,
`OUT/critic`. Nothing is loaded into memory: the checkpoint's folders are copied; except for a LoRA
run's checkpoint, whose adapters (the policy's, the critic's) are merged into the base model its
run named (docs/lora.md).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export", help="write Hugging Face model folders from a checkpoint",
        description="ridgeline export runs/tiny/ckpts exported/  (OUT/policy, and OUT/critic with a critic)")
    parser.add_argument("checkpoint", help="a checkpoint folder (<ckpt_path>/global_step_N), or a ckpt_path "
                                           "whose latest checkpoint is taken")
    parser.add_argument("out", help="folder to write (must not exist, or be empty)")
    return parser


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ridgeline.trainer.checkpoint import export_checkpoint

    folder = export_checkpoint(args.checkpoint, args.out)  # CheckpointError: reported by the command
    out = Path(args.out)
    written = ", ".join(str(p) for p in sorted(out.iterdir()))
    print(f"exported {folder} -> {written}")
    return 0
