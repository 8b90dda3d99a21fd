"""SkyRL's example command lines, their "source" saying how they were extracted: SkyRL-Train 0.3.1's
(data/skyrl_0_3_1_commands.json, script path under skyrl-train/examples) and skyrl 0.4's
(data/skyrl_0_4_commands.json, script path under examples/train) -> the overrides each passes."""

from __future__ import annotations

import json
from pathlib import Path

_DATA = json.loads((Path(__file__).parent / "data" / "skyrl_0_3_1_commands.json").read_text())
SKYRL_COMMANDS: dict[str, list[str]] = {script: entry["overrides"] for script, entry in _DATA["commands"].items()}
SKYRL_ENTRYPOINTS: dict[str, str] = {script: entry["entrypoint"] for script, entry in _DATA["commands"].items()}

_DATA_0_4 = json.loads((Path(__file__).parent / "data" / "skyrl_0_4_commands.json").read_text())
SKYRL_0_4_COMMANDS: dict[str, list[str]] = {script: entry["overrides"] for script, entry in _DATA_0_4["commands"].items()}
SKYRL_0_4_ENTRYPOINTS: dict[str, str] = {script: entry["entrypoint"] for script, entry in _DATA_0_4["commands"].items()}
