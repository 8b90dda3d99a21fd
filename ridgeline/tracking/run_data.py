"""What a run left in its folder, read for the run report (`report.py`), and only this run's.

`metrics.jsonl` (may be empty or end in a truncated line), `config.yaml`, `run.json`
(`run_info.py`), `samples.jsonl` (`samples.py`) and the eval dumps
(`dumped_evals/global_step_<N>_evals/`, SkyRL's layout, `dumps.py`). Eval dumps are looked for
under `trainer.export_path` (where the trainer writes them, SkyRL's place, shared by every run
with that export path) and in the run folder (where `trainer.exports_per_run` writes them, as the
presets set, or a run folder copied elsewhere with its dumps); a
dump counts as this run's when its owner file names this run's id, or, for a dump without one
(SkyRL's, or from before owner files), when it sits in the run folder itself. The others are
listed in `RunData.foreign_dumps`, so the report can say what it left out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from ridgeline.tracking.dumps import EVAL_DUMPS, eval_dump_owner, eval_dump_step, read_eval_dump
from ridgeline.tracking.jsonl import read_jsonl
from ridgeline.tracking.run_info import RunInfo, read_run_info
from ridgeline.tracking.samples import SAMPLES_FILE

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
ELAPSED = "timing/elapsed"     # seconds since the run's first start, in every row the trainer logs
Points = list[tuple[float, float]]


def is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class EvalDump:
    step: int
    folder: Path
    records: list[dict]


@dataclass
class RunData:
    run_dir: Path
    rows: list[dict] = field(default_factory=list)
    skipped_lines: int = 0
    metrics_found: bool = False
    config: dict = field(default_factory=dict)
    config_text: str = ""               # config.yaml as written (shown folded in the report)
    info: RunInfo | None = None         # run.json; None for a folder without one
    samples: list[dict] = field(default_factory=list)
    eval_dumps: list[EvalDump] = field(default_factory=list)
    foreign_dumps: list[Path] = field(default_factory=list)   # dump folders found that are not this run's

    def keys(self) -> list[str]:
        return sorted({k for row in self.rows for k in row if k != "step"})

    def series(self, key: str) -> Points:
        """(step, value) for every finite number logged under `key`, by step; when a step was
        logged twice (a resumed run repeats steps) the later value wins."""
        by_step: dict[float, float] = {}
        for row in self.rows:
            value, step = row.get(key), row.get("step")
            if is_number(value) and is_number(step) and math.isfinite(value):
                by_step[step] = float(value)
        return sorted(by_step.items())

    def time_series(self, key: str) -> Points:
        """(seconds since the run started, value) for `key`, from the rows that carry both (the
        trainer logs `timing/elapsed` in every row)."""
        points = [(row[ELAPSED], float(row[key])) for row in self.rows
                  if is_number(row.get(key)) and math.isfinite(row[key]) and is_number(row.get(ELAPSED))]
        return sorted(points)

    def setting(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def samples_by_step(self) -> dict[int, list[dict]]:
        """The sampled rollouts of each step, by step. A resume cuts the steps it redoes from
        samples.jsonl (checkpoint.prepare_metrics); should a step still come again after another
        one (a file from before that), its latest writing is kept."""
        out: dict[int, list[dict]] = {}
        previous = None
        for row in self.samples:
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):  # steps are written as integers
                continue
            if step != previous:
                out[step] = []   # a step's rows are written together: a new run of them starts afresh
                previous = step
            out[step].append(row)
        return dict(sorted(out.items()))


def _read_config(run_dir: Path) -> tuple[dict, str]:
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return {}, ""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # a hand-edited or partial file must not stop the report: said, shown as text
        log.warning("%s does not parse as YAML (%s): the report shows it as text, without its settings table",
                    path, str(exc).splitlines()[0])
        return {}, text
    return (loaded if isinstance(loaded, dict) else {}), text


def _dump_places(run_dir: Path, config: dict) -> list[Path]:
    """Where eval dumps may be: `trainer.export_path/dumped_evals`, then `run_dir/dumped_evals`."""
    places = []
    export = (config.get("trainer") or {}).get("export_path")
    if isinstance(export, str) and export:
        places.append(Path(export) / EVAL_DUMPS)
    places.append(run_dir / EVAL_DUMPS)
    seen, out = set(), []
    for place in places:
        key = place.resolve()
        if key not in seen and place.is_dir():
            seen.add(key)
            out.append(place)
    return out


def _is_own(folder: Path, run_dir: Path, info: RunInfo | None) -> bool:
    owner = eval_dump_owner(folder)
    if owner is None:  # SkyRL's dump, or one from before owner files: only in the run's own folder
        return folder.parent.resolve() == (run_dir / EVAL_DUMPS).resolve()
    return info is not None and owner.run_id == info.run_id


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    config, text = _read_config(run_dir)
    data = RunData(run_dir=run_dir, config=config, config_text=text, info=read_run_info(run_dir))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        read = read_jsonl(metrics)
        data.rows, data.skipped_lines, data.metrics_found = read.rows, read.skipped, True
    if (run_dir / SAMPLES_FILE).exists():
        data.samples = read_jsonl(run_dir / SAMPLES_FILE).rows
    for place in _dump_places(run_dir, data.config):
        for folder in sorted(place.iterdir()):
            step = eval_dump_step(folder)
            if step is None or not folder.is_dir():
                continue
            if not _is_own(folder, run_dir, data.info):
                data.foreign_dumps.append(folder)
                continue
            records = read_eval_dump(folder)
            if records:
                data.eval_dumps.append(EvalDump(step, folder, records))
    data.eval_dumps.sort(key=lambda dump: dump.step)
    return data
