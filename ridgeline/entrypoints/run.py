"""Run a training job from a validated config: the one function both entry points call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import os
import sys

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig


log = logging.getLogger("ridgeline")


def setup_logging() -> None:
    """The commands' log format on stderr, and the known noise of the libraries silenced once
    (`ridgeline.library_noise`)."""
    from ridgeline.library_noise import silence_library_noise

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    silence_library_noise()


def run_training(cfg: RidgelineConfig) -> dict:
    from ridgeline.entrypoints.preflight import preflight
    from ridgeline.trainer.run_lock import RunLock, run_folders

    preflight(cfg)   # an engine or strategy this machine cannot run: doctor's one message, before any loading
    # the run's folders first, before torch and the rest load: a second command on them stops at once
    run_lock = RunLock.acquire(run_folders(cfg.trainer))
    try:
        return _train(cfg)
    except Exception as exc:
        if "ray" in sys.modules:   # a Ray worker killed for memory: one message, not Ray's OOM report
            from ridgeline.distributed.ray_errors import RayMemoryError, memory_kill, memory_kill_message
            kill = memory_kill(exc)
            if kill is not None:
                raise RayMemoryError(memory_kill_message(kill, _need(cfg))) from exc
        raise
    finally:
        run_lock.release()


def _need(cfg: RidgelineConfig) -> str | None:
    """The run's memory estimate as a sentence, for the message of a worker killed for memory."""
    from ridgeline.errors import UserError
    from ridgeline.training.memory_estimate import need_sentence

    try:
        return need_sentence(cfg)
    except (UserError, OSError, ValueError) as exc:   # the model's config cannot be read: the message goes without it
        log.debug("no memory estimate: %s", exc)
        return None


def _train(cfg: RidgelineConfig) -> dict:
    from ridgeline.config import unbuilt_defaults
    from ridgeline.tracking.infra_log import infra_log
    from ridgeline.trainer.async_trainer import build_trainer

    setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with infra_log(cfg.trainer.log_path) as infra:   # SkyRL 0.4's trainer.log_path
        log.debug("infrastructure log: %s", infra)
        trainer = build_trainer(cfg)
        # once the run is built: an error in what the user named (models, data, envs) stands alone
        for note in unbuilt_defaults(cfg):
            log.warning("not acted on: %s", note)
        summary = trainer.train()
    for line in summary_lines(summary):
        print(line)
    return summary


def held_out_line(before: dict | None, after: dict | None) -> str | None:
    """`held-out (greedy): pass@1 0.250 -> 0.500, solved 0.125 -> 0.375`, or None without an eval.
    pass@1 counts any positive reward as a pass (SkyRL's rule, so a format reward alone counts):
    the solved share (reward >= 1) stands beside it so that nobody misreads it."""
    if not after:
        return None
    shown = [(name, key) for name, key in (("pass@1", "eval/all/pass_at_1"), ("solved", "eval/all/accuracy"))
             if key in after]
    if not shown:
        return None
    changes = [f"{name} {before[key]:.3f} -> {after[key]:.3f}" if before and key in before else
               f"{name} {after[key]:.3f}" for name, key in shown]
    return f"held-out (greedy): {', '.join(changes)}"


def summary_lines(summary: dict) -> list[str]:
    """What a finished run prints last: held-out pass@1 before -> after, then where its files are,
    the report (the page to open) on the very last line."""
    lines = []
    before, after = summary["eval_before"], summary["eval_after"]
    held_out = held_out_line(before, after)
    if held_out:
        lines.append(held_out)
    lines.append(f"{summary['steps']} steps in {summary['wall_seconds']:.0f} s; final model: {summary['final_model']}; "
                 f"reward plot: {summary['plot']}")
    lines.append(f"report: {summary['report']}" if summary["report"] else
                 "report: not written (see the warning above); `ridgeline report RUN_DIR` writes it")
    return lines
