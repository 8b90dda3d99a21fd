"""Debugging dumps under `trainer.export_path` (the run's own folder with `trainer.exports_per_run`,
as the presets set), at SkyRL-Train's paths and file names.

`trainer.dump_data_batch`: what a step trained on, one readable JSON line per row, in
`<export_path>/dumped_data/global_step_<N>_training_input.jsonl` (SkyRL pickles its own batch
class under that stem as `.pkl`). Each line (`dump_training_batch`):

    {"step": 3, "row": 0, "uid": "3-train-0",
     "trajectory": 0,                                 # the trajectory the row is a sample (step-wise: a turn) of
     "prompt": "<|im_start|>user\\n...",            # decoded prompt tokens (special tokens kept)
     "response": "...<|im_end|>",                     # decoded response tokens, as trained on
     "reward": 1.0,                                   # the row's return: sum of token rewards
     "response_tokens": 17,
     "loss_mask": {"sum": 17.0, "length": 17},        # tokens that count in the loss
     "rewards": {"sum": 1.0, "mean": 0.058824, "length": 17},   # per-token rewards (after shaping)
     "advantages": {"sum": 8.5, "mean": 0.5, "length": 17},
     ...                                              # returns, values, logprobs when the step has them
     "trained_response": "..."}                       # only when some response tokens are masked

Summaries are over the row's response tokens. The text is decoded from `batch.sequences`, i.e.
the token ids the policy was trained on, so a tokenisation surprise shows up here. When the loss
mask leaves tokens out (multi-turn observations, overlong filtering), `trained_response` repeats
the response with each masked run replaced by `[N tokens not trained]`.

`trainer.dump_eval_results`: every eval sample, in `eval_dump_folder(export_path, step)` =
`<export_path>/dumped_evals/global_step_<N>_evals/` (`eval_only/` outside training): one
`<data_source>.jsonl` per data source ("/" written as "_") with one line per sample, and
`aggregated_results.jsonl`, one line holding the eval metrics (`write_eval_dump`,
`read_eval_dump`). A training run also writes `ridgeline_run.json` there (`DumpOwner`: its run id
and folder): every run with the same `export_path` shares SkyRL's `dumped_evals/`, and the run
report shows only the dumps its own run wrote.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ridgeline.tracking.jsonl import read_jsonl

if TYPE_CHECKING:  # only for annotations: the dump works on the tensors it is handed
    import torch

    from ridgeline.training.batch import TrainingBatch

log = logging.getLogger(__name__)

# per-token tensors summarised for each row, when the batch carries them
_SUMMARISED = ("rewards", "advantages", "returns", "values", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def _summary(values: torch.Tensor) -> dict[str, float | int]:
    total = float(values.sum())
    length = int(values.numel())
    return {"sum": round(total, 6), "mean": round(total / length, 6) if length else 0.0, "length": length}


def _masked_text(tokenizer, ids: list[int], mask: list[float]) -> str:
    """The response with runs of loss-masked tokens replaced by a short marker."""
    pieces: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (mask[end] > 0) != (mask[start] > 0):
            if mask[start] > 0:
                pieces.append(tokenizer.decode(ids[start:end], skip_special_tokens=False))
            else:
                pieces.append(f"[{end - start} tokens not trained]")
            start = end
    return "".join(pieces)


def training_batch_rows(batch: TrainingBatch, tokenizer, step: int) -> list[dict[str, Any]]:
    """The dump's rows (see the module docstring), without writing them."""
    width_p = batch.sequences.shape[1] - batch.response_width
    trajectories = batch.trajectories()
    rows = []
    for i in range(batch.batch_size):
        prompt_ids = batch.sequences[i, :width_p][batch.attention_mask[i, :width_p].bool()].tolist()
        length = int(batch.response_mask[i].sum())
        response_ids = batch.sequences[i, width_p:width_p + length].tolist()
        loss_mask = batch.loss_mask[i, :length]
        row: dict[str, Any] = {
            "step": step, "row": i, "uid": batch.uids[i], "trajectory": int(trajectories[i]),
            "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
            "response": tokenizer.decode(response_ids, skip_special_tokens=False),
            "reward": round(float(batch.rewards[i, :length].sum()), 6),
            "response_tokens": length,
            "loss_mask": {"sum": float(loss_mask.sum()), "length": length},
        }
        for name in _SUMMARISED:
            tensor = getattr(batch, name)
            if tensor is not None:
                row[name] = _summary(tensor[i, :length].float())
        if float(loss_mask.sum()) < length:
            row["trained_response"] = _masked_text(tokenizer, response_ids, loss_mask.tolist())
        rows.append(row)
    return rows


def dump_training_batch(batch: TrainingBatch, tokenizer, path: str | Path, step: int) -> Path:
    """Write `batch` as JSON lines to `path` (replaced if it exists); returns the path. The
    trainer's place: `export_path/dumped_data/global_step_<N>_training_input.jsonl`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in training_batch_rows(batch, tokenizer, step):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


# ------------------------------------------------------------------------------------ eval dumps
EVAL_DUMPS = "dumped_evals"
AGGREGATED_FILE = "aggregated_results.jsonl"
OWNER_FILE = "ridgeline_run.json"   # not a .jsonl: readers of the dump's samples never see it
_STEP_FOLDER = re.compile(r"^global_step_(\d+)_evals$")


def eval_dump_folder(export_path: str | Path, step: int | None) -> Path:
    """SkyRL's folder for the eval at `step`; `eval_only` for an eval outside training (None)."""
    return Path(export_path) / EVAL_DUMPS / ("eval_only" if step is None else f"global_step_{step}_evals")


def eval_dump_step(folder: Path) -> int | None:
    """The step of an `eval_dump_folder`, None for any other folder."""
    match = _STEP_FOLDER.match(Path(folder).name)
    return int(match.group(1)) if match else None


def source_file(data_source: str) -> str:
    """The file of one data source in an eval dump: "/" would make a subfolder, so it becomes "_"."""
    return data_source.replace("/", "_") + ".jsonl"


@dataclass(frozen=True)
class DumpOwner:
    """The training run that wrote an eval dump (`RUN_DIR/run.json`'s run id and folder)."""

    run_id: str
    run_dir: str


def eval_dump_owner(folder: str | Path) -> DumpOwner | None:
    """Who wrote the dump in `folder`; None for a dump without a readable owner file (SkyRL's,
    `ridgeline eval`'s, or one from before owner files)."""
    try:
        return DumpOwner(**json.loads((Path(folder) / OWNER_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def write_eval_dump(folder: str | Path, records: Sequence[dict[str, Any]], metrics: dict[str, float],
                    owner: DumpOwner | None = None) -> Path:
    """`folder/<data_source>.jsonl` for each `records[i]["data_source"]` (records in their order)
    and `folder/aggregated_results.jsonl` (`metrics` on one line), then `folder/ridgeline_run.json`
    naming `owner` when given; returns the folder. An earlier dump in the folder (it holds
    `aggregated_results.jsonl`) is replaced as a whole, owner file included, so a data source it
    had and this one has not leaves no file behind; replacing another run's dump is logged (runs
    that share `trainer.export_path` share SkyRL's dump folders)."""
    folder = Path(folder)
    if (folder / AGGREGATED_FILE).is_file():
        earlier = eval_dump_owner(folder)
        if owner is not None and earlier is not None and earlier.run_id != owner.run_id:
            log.warning("%s held the eval dump of another run (%s); this run's replaces it. Runs with the same "
                        "trainer.export_path share SkyRL's dumped_evals/: trainer.exports_per_run=true "
                        "(or a trainer.export_path per run) keeps both", folder, earlier.run_dir)
        for old in folder.glob("*.jsonl"):
            old.unlink()
        (folder / OWNER_FILE).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_file.setdefault(source_file(record["data_source"]), []).append(record)
    for name, rows in by_file.items():
        with (folder / name).open("w", encoding="utf-8") as f:
            for row in rows:
                # default=str: ground truths and extras from parquet may be numpy scalars and the like
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    (folder / AGGREGATED_FILE).write_text(json.dumps(metrics, ensure_ascii=False) + "\n", encoding="utf-8")
    if owner is not None:  # last: a dump cut short by a crash names no owner
        (folder / OWNER_FILE).write_text(json.dumps(asdict(owner)) + "\n", encoding="utf-8")
    return folder


def read_eval_dump(folder: str | Path) -> list[dict[str, Any]]:
    """Every sample record of an eval dump, file by file in name order (a truncated last line,
    left by a killed run, is skipped)."""
    folder = Path(folder)
    return [row for path in sorted(folder.glob("*.jsonl")) if path.name != AGGREGATED_FILE
            for row in read_jsonl(path).rows]
