"""Weights & Biases, working with or without a network.

`WANDB_MODE` is honoured when set (online, offline, disabled). When it is not set, the run goes
online only if an API key is configured (`WANDB_API_KEY` or a netrc entry for the W&B host) and
the host answers; otherwise it is written offline under `run_dir/wandb/` and can be uploaded
later with `wandb sync RUN_DIR/wandb/offline-run-*`. A machine with no network never hangs in
`wandb.init`.
"""

from __future__ import annotations

import logging
import netrc
import os
import socket
from pathlib import Path
from typing import Any, Literal, Mapping
from urllib.parse import urlparse

from ridgeline.errors import UserError
from ridgeline.tracking.scalars import scalars

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.wandb.ai"
WandbMode = Literal["online", "offline", "disabled", "shared"]
# WANDB_MODE values `wandb.init`'s settings take besides those: its older names
_MODES: dict[str, WandbMode] = {"online": "online", "offline": "offline", "disabled": "disabled", "shared": "shared",
                                "dryrun": "offline", "run": "online"}


def _api_key_configured(environ: Mapping[str, str], host: str) -> bool:
    if environ.get("WANDB_API_KEY"):
        return True
    path = environ.get("NETRC") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _reachable(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_wandb_mode(environ: Mapping[str, str] | None = None, timeout: float = 3.0) -> WandbMode:
    """The `mode` for `wandb.init`: `WANDB_MODE` if set, else online when a key is configured
    and the W&B host answers within `timeout` seconds, else offline."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE"):
        mode = _MODES.get(environ["WANDB_MODE"].strip().lower())
        if mode is None:
            raise UserError(f"WANDB_MODE={environ['WANDB_MODE']!r} is not a W&B mode. Fix: one of "
                             f"{', '.join(_MODES)}, or unset it")
        return mode
    if environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    url = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL)
    host = url.hostname or "api.wandb.ai"
    if not _api_key_configured(environ, host):
        return "offline"
    port = url.port or (80 if url.scheme == "http" else 443)
    return "online" if _reachable(host, port, timeout) else "offline"


class WandbTracker:
    """One W&B run: `project=project_name`, `name=run_name`, `id=run_id` (`resume="allow"`, so
    a resumed job with the same id continues the same run), files under `run_dir/wandb/`."""

    def __init__(self, run_dir: str | Path, project_name: str, run_name: str,
                 config: dict | None = None, run_id: str | None = None):
        import wandb  # slow to import (~0.5 s): only when this tracker is asked for

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = resolve_wandb_mode()
        if self.mode == "offline" and not os.environ.get("WANDB_MODE"):
            log.info("wandb: no API key or no connection, writing the run offline under %s/wandb "
                     "(upload it later with `wandb sync`)", run_dir)
        self.run = wandb.init(project=project_name, name=run_name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config, mode=self.mode)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        # W&B stores NaN and inf, and accepts any key; only the numbers go through.
        values = scalars(metrics)
        if values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
