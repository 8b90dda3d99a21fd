"""Run a training job from a validated config: the one function both entry points call."""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig

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


def run_training(cfg: DictConfig) -> dict:
    from ridgeline.trainer.run_lock import RunLock, run_folders

    # the run's folders first, before torch and the rest load: a second command on them stops at once
    run_lock = RunLock.acquire(run_folders(cfg.trainer))
    try:
        return _train(cfg)
    finally:
        run_lock.release()


def _train(cfg: DictConfig) -> dict:
    from ridgeline.config import unbuilt_defaults
    from ridgeline.tracking.infra_log import infra_log
    from ridgeline.trainer.trainer import Trainer

    setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with infra_log(cfg.trainer.log_path) as infra:   # SkyRL 0.4's trainer.log_path
        log.debug("infrastructure log: %s", infra)
        trainer = Trainer.from_config(cfg)
        # once the run is built: an error in what the user named (models, data, envs) stands alone
        for note in unbuilt_defaults(cfg):
            log.warning("not acted on: %s", note)
        summary = trainer.train()
    for line in summary_lines(summary):
        print(line)
    return summary


def summary_lines(summary: dict) -> list[str]:
    """What a finished run prints last: held-out pass@1 before -> after, then where its files are,
    the report (the page to open) on the very last line."""
    lines = []
    before, after = summary["eval_before"], summary["eval_after"]
    if before and after:
        lines.append(f"held-out pass@1 (greedy): {before['eval/all/pass_at_1']:.3f} -> {after['eval/all/pass_at_1']:.3f}")
    elif after:
        lines.append(f"held-out pass@1 (greedy): {after['eval/all/pass_at_1']:.3f}")
    lines.append(f"{summary['steps']} steps in {summary['wall_seconds']:.0f} s; final model: {summary['final_model']}; "
                 f"reward plot: {summary['plot']}")
    lines.append(f"report: {summary['report']}" if summary["report"] else
                 "report: not written (see the warning above); `ridgeline report RUN_DIR` writes it")
    return lines
