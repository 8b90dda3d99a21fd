"""SkyRL-Train 0.3.1's example command lines (data/skyrl_0_3_1_commands.json, its "source" says how
they were extracted): script path under skyrl-train/examples -> the Hydra overrides it passes."""

from __future__ import annotations

import json
from pathlib import Path

_DATA = json.loads((Path(__file__).parent / "data" / "skyrl_0_3_1_commands.json").read_text())
SKYRL_COMMANDS: dict[str, list[str]] = {script: entry["overrides"] for script, entry in _DATA["commands"].items()}
SKYRL_ENTRYPOINTS: dict[str, str] = {script: entry["entrypoint"] for script, entry in _DATA["commands"].items()}
