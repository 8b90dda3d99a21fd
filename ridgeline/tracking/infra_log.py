"""SkyRL 0.4's `trainer.log_path`: the run's infrastructure log, `{log_path}/infra-YYMMDD_HHMMSS.log`.

Engine start-up, model loading and worker set-up (the loggers below, at INFO and above) are copied
there while a run trains; the console keeps its own output. Ray actors log in their own processes
(Ray's session folder), as SkyRL's do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ridgeline.errors import UserError

__all__ = ["INFRA_LOGGERS", "infra_log"]

# what SkyRL writes to its infra log: engines, model loading, workers (and the libraries behind them)
INFRA_LOGGERS: tuple[str, ...] = ("ridgeline.inference", "ridgeline.models", "ridgeline.distributed",
                                  "ridgeline.training", "vllm", "sglang", "ray")


@contextmanager
def infra_log(folder: str | Path) -> Iterator[Path]:
    """The infra log file in `folder` (created), attached to INFRA_LOGGERS until the block ends."""
    path = Path(folder).expanduser() / f"infra-{time.strftime('%y%m%d_%H%M%S')}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"trainer.log_path={folder}: the infrastructure log {path} cannot be written "
                        f"({exc.strerror or exc}). Fix: trainer.log_path=<a folder you can write>.") from None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in INFRA_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield path
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()
