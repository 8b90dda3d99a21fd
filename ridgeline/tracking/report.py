"""`ridgeline report RUN_DIR`: one self-contained `report.html` about a run.

Reads what the run left in its folder: `metrics.jsonl` (required for the charts, may be empty or
end in a truncated line), `config.yaml`, `samples.jsonl` (see `samples.py`) and the eval dumps
(`dumped_evals/global_step_<N>_evals/`, SkyRL's layout, `dumps.py`; under `trainer.export_path`,
or in the run folder). Charts are inline PNGs; the page loads nothing from anywhere, so it can
be mailed or attached to an issue. A metric the run did not log is simply not drawn.
"""

from __future__ import annotations

import datetime
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ridgeline.errors import UserError
from ridgeline.tracking import charts
from ridgeline.tracking.dumps import EVAL_DUMPS, eval_dump_step, read_eval_dump
from ridgeline.tracking.jsonl import read_jsonl
from ridgeline.tracking.samples import SAMPLES_FILE, write_samples

__all__ = ["RunData", "RunFolderError", "build_charts", "load_run", "render_report", "write_report",
           "write_samples"]

REPORT_FILE = "report.html"
MAX_TEXT = 3000           # characters of a prompt / response shown in a table cell
EVAL_EXAMPLES = 3         # passing and failing examples shown from the last eval dump
_PASS_AT_1 = re.compile(r"^eval/(.+)/pass_at_1$")

Points = list[tuple[float, float]]
# the phases of a training step in the order they run (trainer.py), stacked bottom to top; they
# add up to about timing/step. Not stacked: timing/train_critic_and_policy (critic_train +
# policy_train) and the work after the step's row (checkpoints, exports, reference refresh).
PHASES = ["timing/generate", "timing/postprocess_generator_output", "timing/convert_to_training_input",
          "timing/engine_sleep", "timing/fwd_logprobs_values_reward", "timing/apply_reward_kl_penalty",
          "timing/compute_advantages_and_returns", "timing/critic_train", "timing/policy_train",
          "timing/sync_weights"]


# ------------------------------------------------------------------------------------ reading
@dataclass
class RunData:
    run_dir: Path
    rows: list[dict] = field(default_factory=list)
    skipped_lines: int = 0
    metrics_found: bool = False
    config: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    eval_dumps: list[tuple[int, Path, list[dict]]] = field(default_factory=list)

    def keys(self) -> list[str]:
        return sorted({k for row in self.rows for k in row if k != "step"})

    def series(self, key: str) -> Points:
        """(step, value) for every finite number logged under `key`, by step; when a step was
        logged twice (a resumed run repeats steps) the later value wins."""
        by_step: dict[float, float] = {}
        for row in self.rows:
            value, step = row.get(key), row.get("step")
            if _is_number(value) and _is_number(step) and math.isfinite(value):
                by_step[step] = float(value)
        return sorted(by_step.items())

    def setting(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _score(record: dict) -> float | None:
    """An eval dump record's total reward: its `score`, summed when it is per token."""
    score = record.get("score")
    if isinstance(score, list) and all(_is_number(x) for x in score):
        return float(sum(score))
    return float(score) if _is_number(score) else None


def _passed(record: dict) -> bool:
    """An eval dump record's verdict: its `passed` field (Ridgeline's), else SkyRL's rule on its
    score (> 0; a dump SkyRL-Train wrote)."""
    if isinstance(record.get("passed"), bool):
        return record["passed"]
    score = _score(record)
    return score is not None and score > 0.0


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        import yaml
        loaded = yaml.safe_load(path.read_text())
    except Exception:  # a hand-edited or partial file must not stop the report
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _eval_dump_dirs(run_dir: Path, config: dict) -> list[Path]:
    """Where eval dumps may be: `trainer.export_path` (where the trainer writes them, SkyRL's
    place), then the run folder (a run folder copied elsewhere with its dumps)."""
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


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    data = RunData(run_dir=run_dir, config=_read_config(run_dir))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        read = read_jsonl(metrics)
        data.rows, data.skipped_lines, data.metrics_found = read.rows, read.skipped, True
    if (run_dir / SAMPLES_FILE).exists():
        data.samples = read_jsonl(run_dir / SAMPLES_FILE).rows
    for place in _eval_dump_dirs(run_dir, data.config):
        for folder in place.iterdir():
            step = eval_dump_step(folder)
            records = read_eval_dump(folder) if step is not None and folder.is_dir() else []
            if records:
                data.eval_dumps.append((step, folder, records))
    data.eval_dumps.sort(key=lambda item: item[0])
    return data


# ------------------------------------------------------------------------------------ charts
def _prefixed(data: RunData, pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return [k for k in data.keys() if regex.search(k)]


def build_charts(data: RunData) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every chart the run has data for, in reading order."""
    s = data.series
    reward = {"train reward (mean)": s("reward/avg_raw_reward"), "train accuracy": s("reward/accuracy")}
    reward.update({k.split("/", 1)[1]: s(k) for k in _prefixed(data, r"^reward/avg_pass_at_\d+$")})
    reward["held-out pass@1"] = s("eval/all/pass_at_1")
    eval_keys = sorted(_prefixed(data, _PASS_AT_1.pattern), key=lambda k: (k != "eval/all/pass_at_1", k))
    timing = [k for k in PHASES if data.series(k)]
    specs: list[tuple[str, str | None]] = [
        ("Reward and accuracy", charts.line_chart("Reward and accuracy", reward, "reward / accuracy",
                                                  dashed=["held-out pass@1"])),
        ("Held-out pass@1 by data source",
         charts.line_chart("Held-out pass@1", {_PASS_AT_1.match(k).group(1): s(k) for k in eval_keys},
                           "pass@1", ylim=(-0.02, 1.02))),
        ("KL", charts.line_chart("KL", {k: s(k) for k in ("policy/policy_kl", "policy/ppo_kl",
                                                          "loss/avg_kl")}, "KL estimate")),
        ("Entropy", charts.line_chart("Policy entropy", {"policy/policy_entropy": s("policy/policy_entropy")},
                                      "nats / token")),
        ("Response length", charts.line_chart(
            "Response length", {"mean": s("generate/avg_num_tokens"), "max": s("generate/max_num_tokens"),
                                "min": s("generate/min_num_tokens")}, "tokens", dashed=["max", "min"])),
        ("Clip fraction", charts.line_chart(
            "Clip fraction", {k: s(k) for k in ("policy/ppo_clip_ratio", "policy/clip_frac_low",
                                                "policy/clip_frac_high", "critic/values_clipfrac")},
            "share of tokens")),
        ("Losses", charts.line_chart("Losses", {k: s(k) for k in ("policy/policy_loss", "policy/final_loss",
                                                                  "critic/value_loss", "critic/critic_loss")},
                                     "loss")),
        ("Gradient norm", charts.line_chart("Gradient norm (before clipping)",
                                            {k: s(k) for k in ("policy/raw_grad_norm", "critic/raw_grad_norm")})),
        ("Seconds per phase", charts.stacked_chart(
            "Seconds per phase", {k.split("/", 1)[1]: s(k) for k in timing},
            total=("step (total)", s("timing/step")), extra={"eval": s("timing/eval")}, ylabel="seconds")),
        ("Throughput", charts.line_chart("Throughput", {k.split("/", 1)[1]: s(k) for k in
                                                        _prefixed(data, r"^throughput/")}, "tokens / s")),
        ("Engine vs trainer logprobs", charts.line_chart(
            "|logprob engine - trainer|", {k.split("/", 1)[1]: s(k) for k in
                                           _prefixed(data, r"^rollout/logprob_abs_diff_")})),
    ]
    return [(title, png) for title, png in specs if png is not None]


# ------------------------------------------------------------------------------------ html
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    if not _is_number(value):
        return "–" if value is None else _e(value)
    if value != 0 and not 1e-3 <= abs(value) < 1e5:
        return f"{value:.3e}"
    return f"{value:.4g}"


def _text(value: Any) -> str:
    text = str(value)
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f"\n… ({len(text) - MAX_TEXT} more characters)"
    return f'<pre class="text">{_e(text)}</pre>'


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    """A table from cells that are already HTML (callers escape their text)."""
    headers = list(headers)
    head = ("<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr></thead>"
            if any(headers) else "")
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}>{head}<tbody>{body}</tbody></table>"


HEADLINE = [("reward/avg_raw_reward", "train reward"), ("reward/accuracy", "train accuracy"),
            ("eval/all/pass_at_1", "held-out pass@1"), ("generate/avg_num_tokens", "response length"),
            ("policy/policy_entropy", "entropy"), ("policy/policy_kl", "KL loss"),
            ("timing/step", "seconds / step")]


def _overview(data: RunData) -> str:
    steps = [row["step"] for row in data.rows if _is_number(row.get("step"))]
    seconds = sum(v for _, v in data.series("timing/step")) + sum(v for _, v in data.series("timing/eval"))
    facts = [
        ("run folder", _e(data.run_dir.resolve())),
        ("model", _e(data.setting("trainer.policy.model.path", "?"))),
        ("algorithm", _e(f"{data.setting('trainer.algorithm.advantage_estimator', '?')} advantages, "
                         f"{data.setting('trainer.algorithm.policy_loss_type', '?')} policy loss")),
        ("last step", _e(max(steps)) if steps else "–"),
        ("logged rows", _e(len(data.rows))),
        ("time in steps and evals", _e(f"{seconds:.0f} s") if seconds else "–"),
    ]
    out = _table(["", ""], facts, "facts")
    headline = []
    for key, label in HEADLINE:
        points = data.series(key)
        if points:
            headline.append([_e(label), _e(key), _num(points[0][1]) + f" <small>(step {_e(points[0][0])})</small>",
                             _num(points[-1][1]) + f" <small>(step {_e(points[-1][0])})</small>"])
    if headline:
        out += "<h3>First and last values</h3>" + _table(["", "metric", "first", "last"], headline)
    return out


def _notes(data: RunData) -> str:
    notes = []
    if not data.metrics_found:
        notes.append("No metrics.jsonl in this folder: the run logged nothing yet (or this is not a run folder).")
    elif not data.rows:
        notes.append("metrics.jsonl holds no complete row yet.")
    if data.skipped_lines:
        notes.append(f"{data.skipped_lines} unreadable line(s) of metrics.jsonl were skipped "
                     "(a run stopped in the middle of writing leaves a truncated last line).")
    return "".join(f'<p class="note">{_e(n)}</p>' for n in notes)


def _eval_section(data: RunData) -> str:
    keys = _prefixed(data, _PASS_AT_1.pattern)
    if not keys and not data.eval_dumps:
        return ""
    out = "<h2>Held-out evaluation</h2>"
    if keys:
        rows = []
        for key in sorted(keys, key=lambda k: (k != "eval/all/pass_at_1", k)):
            source = _PASS_AT_1.match(key).group(1)
            points = data.series(key)
            score = data.series(f"eval/{source}/avg_score")
            rows.append([_e(source), _num(points[0][1]) if points else "–", _num(points[-1][1]) if points else "–",
                         _num(max(v for _, v in points)) if points else "–",
                         _num(score[-1][1]) if score else "–"])
        out += _table(["data source", "first pass@1", "last pass@1", "best pass@1", "last avg score"], rows)
    if data.eval_dumps:
        rows = []
        for step, folder, records in data.eval_dumps:
            passed = sum(_passed(r) for r in records)
            rows.append([_e(step), _e(len(records)), _num(passed / len(records)) if records else "–",
                         f"<code>{_e(folder)}</code>"])
        out += "<h3>Eval dumps</h3>" + _table(["step", "samples", "pass rate", "folder"], rows)
        step, _, records = data.eval_dumps[-1]
        picked = ([r for r in records if _passed(r)][:EVAL_EXAMPLES]
                  + [r for r in records if not _passed(r)][:EVAL_EXAMPLES])
        if picked:
            from ridgeline.tracking.samples import prompt_text
            out += f"<h3>Examples from the eval at step {_e(step)}</h3>" + _table(
                ["source", "prompt", "response", "ground truth", "reward"],
                [[_e(r.get("data_source", "")), _text(prompt_text(r.get("input_prompt", ""))),
                  _text(r.get("output_response", "")), _text(r.get("ground_truth", "")), _num(_score(r))]
                 for r in picked], "samples")
    return out


def _samples_section(data: RunData) -> str:
    steps = sorted({r["step"] for r in data.samples if _is_number(r.get("step"))})
    if not steps:
        return ""
    out = "<h2>Sample rollouts</h2>"
    for step, label in [(steps[0], "first"), (steps[-1], "last")][: 1 if len(steps) == 1 else 2]:
        rows = [[_text(r.get("prompt", "")), _text(r.get("response", "")), _num(r.get("reward"))]
                for r in data.samples if r.get("step") == step]
        out += f"<h3>Step {_e(step)} ({label} sampled step)</h3>" + _table(["prompt", "response", "reward"], rows,
                                                                             "samples")
    return out


def _all_metrics(data: RunData) -> str:
    rows = []
    for key in data.keys():
        points = data.series(key)
        if points:
            values = [v for _, v in points]
            rows.append([f"<code>{_e(key)}</code>", _e(len(points)), _num(values[0]), _num(values[-1]),
                         _num(min(values)), _num(max(values))])
    if not rows:
        return ""
    return ("<h2>All metrics</h2><details><summary>" + _e(f"{len(rows)} metrics") + "</summary>"
            + _table(["metric", "points", "first", "last", "min", "max"], rows, "metrics") + "</details>")


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1300px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}h3{font-size:1em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}td,th{border:1px solid #ddd;padding:.3em .6em;
vertical-align:top;text-align:left}th{background:#f5f5f5}table.facts td:first-child{font-weight:600}
.charts{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0}figure img{max-width:100%;border:1px solid #eee}
pre.text{white-space:pre-wrap;word-break:break-word;max-width:55em;max-height:25em;overflow:auto;margin:0;
font-size:.85em}.note{background:#fff4e0;border-left:4px solid #e0a030;padding:.5em 1em}small{color:#777}
"""


def render_report(data: RunData) -> str:
    """The report page as a string."""
    run_name = data.setting("trainer.run_name") or data.run_dir.resolve().name
    project = data.setting("trainer.project_name")
    title = f"{project} / {run_name}" if project else str(run_name)
    figures = "".join(f'<figure><img alt="{_e(t)}" src="data:image/png;base64,{png}"></figure>'
                      for t, png in build_charts(data))
    created = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)} – Ridgeline run report</title><style>{CSS}</style></head><body>"
            f"<h1>{_e(title)}</h1><p><small>Ridgeline run report, written {_e(created)}</small></p>"
            + _notes(data) + _overview(data)
            + (f'<h2>Charts</h2><div class="charts">{figures}</div>' if figures else "")
            + _eval_section(data) + _samples_section(data) + _all_metrics(data)
            + "</body></html>\n")


class RunFolderError(UserError, FileNotFoundError):
    """The folder given as a run folder is not one."""


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write the report of the run in `run_dir` (to `run_dir/report.html` unless `out_path`);
    returns its path. Raises RunFolderError (a FileNotFoundError) when `run_dir` is not a folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"no run folder at {run_dir}")
    out = Path(out_path) if out_path is not None else run_dir / REPORT_FILE
    out.write_text(render_report(load_run(run_dir)), encoding="utf-8")
    return out
