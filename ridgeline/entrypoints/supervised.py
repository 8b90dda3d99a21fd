"""`ridgeline sft` and `ridgeline dpo`: a validated config -> ridgeline.trainer.supervised."""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import os

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig


COMMANDS = {
    "sft": ("supervised fine-tuning on chats: loss on the assistant turns only",
            "ridgeline sft +experiment=sft data.train_data=[train.jsonl] data.val_data=[val.jsonl] ...",
            "rows: {\"messages\": [{role, content}, ...]} or {\"prompt\": ..., \"response\": ...}; keys: sft.*, "
            "trainer.* (batch sizes, optimizer, checkpoints), data.*. See docs/sft_dpo.md."),
    "dpo": ("DPO (or IPO) on preference pairs against a frozen reference",
            "ridgeline dpo +experiment=dpo data.train_data=[pairs.jsonl] dpo.beta=0.1 ...",
            "rows: {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}; keys: dpo.* (beta, loss_type=sigmoid|ipo), "
            "trainer.* (batch sizes count pairs), data.*. See docs/sft_dpo.md."),
}


def add_parsers(sub, add_arguments) -> None:
    """The `sft` and `dpo` subcommands, with `ridgeline train`'s arguments (`add_arguments`)."""
    for name, (help_text, usage, epilog) in COMMANDS.items():
        parser = sub.add_parser(name, help=f"{help_text}; arguments are Hydra overrides", description=usage,
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser, overrides_nargs=argparse.REMAINDER)


def run(command: str, cfg: RidgelineConfig) -> dict:
    from ridgeline.entrypoints.preflight import preflight
    from ridgeline.entrypoints.run import held_out_line, setup_logging
    from ridgeline.trainer.supervised import DPO, SFT, run_supervised

    # an engine only samples DPO's env pairs or scores SFT's env eval
    preflight(cfg, uses_engine=(command == "dpo" and cfg.dpo.pairs == "env") or (command == "sft" and cfg.sft.eval_with_env))
    setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    summary = run_supervised(cfg, SFT if command == "sft" else DPO)
    before, after = summary["eval_before"], summary["eval_after"]
    if after and "eval/loss" in after:
        print(f"held-out loss: {before['eval/loss']:.4f} -> {after['eval/loss']:.4f}" if before else
              f"held-out loss: {after['eval/loss']:.4f}")
    held_out = held_out_line(before, after)   # with dpo.pairs=env / sft.eval_with_env: through the generator
    if held_out:
        print(held_out)
    print(f"{summary['steps']} steps in {summary['wall_seconds']:.0f} s; final model: {summary['final_model']}")
    return summary
