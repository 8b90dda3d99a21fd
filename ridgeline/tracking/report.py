"""`ridgeline report RUN_DIR`: one self-contained `report.html` about one run.

What it reads, and how it keeps to this run's own files, is `run_data.py`. The page is
`templates/report.html.j2` (jinja2, every value HTML-escaped); charts are inline PNGs
(`charts.py`), so the page loads nothing from anywhere and can be mailed or attached to an issue.
A metric the run did not log is not drawn; a chart whose every value is 0 is named, not drawn.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ridgeline.errors import UserError
from ridgeline.tracking import charts
from ridgeline.tracking.run_data import CONFIG_FILE, ELAPSED, Points, RunData, is_number, load_run
from ridgeline.tracking.samples import prompt_text, write_samples

__all__ = ["RunData", "RunFolderError", "build_charts", "load_run", "render_report", "write_report",
           "write_samples"]

REPORT_FILE = "report.html"
TEMPLATE = "report.html.j2"
MAX_TEXT = 3000           # characters of a prompt / response shown in a table cell
EVAL_EXAMPLES = 3         # passing and failing examples shown from the last eval dump
_PASS_AT_1 = re.compile(r"^eval/(.+)/pass_at_1$")

# the phases of a training step in the order they run (trainer.py), stacked bottom to top; they
# add up to about timing/step. Not stacked: timing/train_critic_and_policy (critic_train +
# policy_train) and the work after the step's row (checkpoints, exports, reference refresh).
PHASES = ["timing/generate", "timing/postprocess_generator_output", "timing/convert_to_training_input",
          "timing/engine_sleep", "timing/fwd_logprobs_values_reward", "timing/apply_reward_kl_penalty",
          "timing/compute_advantages_and_returns", "timing/critic_train", "timing/policy_train",
          "timing/sync_weights"]
# (label, config key) of the settings shown in the header, when the run's config has them
HYPER_PARAMETERS = [
    ("learning rate", "trainer.policy.optimizer_config.lr"), ("train batch (prompts)", "trainer.train_batch_size"),
    ("mini-batch (prompts)", "trainer.policy_mini_batch_size"),
    ("micro-batch per device", "trainer.micro_train_batch_size_per_gpu"),
    ("samples per prompt", "generator.n_samples_per_prompt"), ("epochs", "trainer.epochs"),
    ("step cap", "trainer.max_steps"), ("updates per batch", "trainer.update_epochs_per_batch"),
    ("max prompt tokens", "trainer.max_prompt_length"),
    ("max response tokens", "generator.sampling_params.max_generate_length"),
    ("temperature", "generator.sampling_params.temperature"), ("clip low", "trainer.algorithm.eps_clip_low"),
    ("clip high", "trainer.algorithm.eps_clip_high"), ("seed", "trainer.seed"),
    ("strategy", "trainer.strategy"), ("engine", "generator.backend"),
]
HEADLINE = [("reward/avg_raw_reward", "train reward"), ("reward/accuracy", "train accuracy"),
            ("eval/all/pass_at_1", "held-out pass@1"), ("generate/avg_num_tokens", "response length"),
            ("policy/policy_entropy", "entropy"), ("policy/policy_kl", "KL loss"),
            ("timing/step", "seconds / step")]


# ------------------------------------------------------------------------------------ numbers
def smooth(points: Points) -> Points:
    """Debiased exponential moving average (TensorBoard's smoothing) whose span is about a tenth
    of the points, at least 2: weight 1 - 1 / max(2, n / 10)."""
    weight = 1.0 - 1.0 / max(2.0, len(points) / 10)
    out, average, norm = [], 0.0, 0.0
    for x, y in points:
        average = weight * average + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append((x, average / norm))
    return out


def _time_axis(seconds: float) -> tuple[str, float]:
    """An x-axis label and divisor for a wall-clock span of `seconds`."""
    if seconds < 120:
        return "wall-clock seconds since the start", 1.0
    if seconds < 2 * 3600:
        return "wall-clock minutes since the start", 60.0
    return "wall-clock hours since the start", 3600.0


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _num(value: Any) -> str:
    if not is_number(value):
        return "–" if value is None else str(value)
    if value != 0 and not 1e-3 <= abs(value) < 1e5:
        return f"{value:.3e}"
    return f"{value:.4g}"


def _clip(value: Any) -> str:
    text = str(value)
    return text[:MAX_TEXT] + f"\n… ({len(text) - MAX_TEXT} more characters)" if len(text) > MAX_TEXT else text


def _score(record: dict) -> float | None:
    """An eval dump record's total reward: its `score`, summed when it is per token."""
    score = record.get("score")
    if isinstance(score, list) and all(is_number(x) for x in score):
        return float(sum(score))
    return float(score) if is_number(score) else None


def _passed(record: dict) -> bool:
    """An eval dump record's verdict: its `passed` field (Ridgeline's), else SkyRL's rule on its
    score (> 0; a dump SkyRL-Train wrote)."""
    if isinstance(record.get("passed"), bool):
        return record["passed"]
    score = _score(record)
    return score is not None and score > 0.0


# ------------------------------------------------------------------------------------ charts
@dataclass
class ChartSpec:
    """One chart: its series (to tell empty and all-zero ones) and how to draw them."""

    title: str
    series: dict[str, Points]
    draw: Callable[[], str | None]


@dataclass
class Charts:
    figures: list[tuple[str, str]]     # (title, base64 PNG) in reading order
    all_zero: list[str]                # titles of the charts not drawn because every value is 0


def _matching(data: RunData, pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return [k for k in data.keys() if regex.search(k)]


def _eval_sources(data: RunData) -> list[tuple[str, str]]:
    """(key, data source) of every `eval/<source>/pass_at_1` series, eval/all first."""
    found = [(key, match.group(1)) for key in data.keys() if (match := _PASS_AT_1.match(key))]
    return sorted(found, key=lambda pair: (pair[0] != "eval/all/pass_at_1", pair[0]))


def _reward_series(data: RunData, series: Callable[[str], Points]) -> dict[str, Points]:
    out = {"train reward (mean)": series("reward/avg_raw_reward")}
    # beside the raw line once there is something to smooth
    out["train reward (smoothed)"] = smooth(out["train reward (mean)"]) if len(out["train reward (mean)"]) >= 3 else []
    out["train accuracy"] = series("reward/accuracy")
    out.update({k.split("/", 1)[1]: series(k) for k in _matching(data, r"^reward/avg_pass_at_\d+$")})
    out["held-out pass@1"] = series("eval/all/pass_at_1")
    return out


def _specs(data: RunData) -> list[ChartSpec]:
    s = data.series

    def line(title: str, series: dict[str, Points], ylabel: str = "", **kw: Any) -> ChartSpec:
        return ChartSpec(title, series, lambda: charts.line_chart(title, series, ylabel, **kw))

    reward = _reward_series(data, s)
    faint = ["train reward (mean)"] if reward["train reward (smoothed)"] else []
    timed = _reward_series(data, data.time_series)
    span = max((x for points in timed.values() for x, _ in points), default=0.0)
    xlabel, unit = _time_axis(span)
    timed = {name: [(x / unit, y) for x, y in points] for name, points in timed.items()}
    eval_sources = _eval_sources(data)
    timing = {k.split("/", 1)[1]: s(k) for k in PHASES if s(k)}
    total, evals = s("timing/step"), s("timing/eval")
    memory = {k.split("/", 1)[1]: s(k) for k in _matching(data, r"^memory/")}
    return [
        line("Reward and accuracy", reward, "reward / accuracy", dashed=["held-out pass@1"], faint=faint),
        line("Reward and accuracy over time", timed, "reward / accuracy", dashed=["held-out pass@1"],
             faint=faint, xlabel=xlabel),
        line("Held-out pass@1 by data source", {source: s(k) for k, source in eval_sources}, "pass@1",
             ylim=(-0.02, 1.02)),
        line("KL", {k: s(k) for k in ("policy/policy_kl", "policy/ppo_kl", "loss/avg_kl")}, "KL estimate"),
        line("Entropy", {"policy/policy_entropy": s("policy/policy_entropy")}, "nats / token"),
        line("Response length", {"mean": s("generate/avg_num_tokens"), "max": s("generate/max_num_tokens"),
                                 "min": s("generate/min_num_tokens")}, "tokens", dashed=["max", "min"]),
        line("Clip fraction", {k: s(k) for k in ("policy/ppo_clip_ratio", "policy/clip_frac_low",
                                                 "policy/clip_frac_high", "critic/values_clipfrac")},
             "share of tokens"),
        line("Losses", {k: s(k) for k in ("policy/policy_loss", "policy/final_loss", "critic/value_loss",
                                          "critic/critic_loss")}, "loss"),
        line("Gradient norm", {k: s(k) for k in ("policy/raw_grad_norm", "critic/raw_grad_norm")}),
        ChartSpec("Seconds per phase", {**timing, "step (total)": total, "eval": evals},
                  lambda: charts.stacked_chart("Seconds per phase", timing, total=("step (total)", total),
                                               extra={"eval": evals}, ylabel="seconds")),
        line("Throughput", {k.split("/", 1)[1]: s(k) for k in _matching(data, r"^throughput/")}, "tokens / s"),
        # from 0: a few MB of drift must not look like a leak
        line("Memory", memory, "GiB", ylim=(0.0, 1.05 * max((y for p in memory.values() for _, y in p), default=1.0))),
        line("Engine vs trainer logprobs", {k.split("/", 1)[1]: s(k)
                                            for k in _matching(data, r"^rollout/logprob_abs_diff_")}),
    ]


def build_charts(data: RunData) -> Charts:
    """Every chart the run has data for, in reading order; a chart whose every value is 0 (a
    feature the run did not use, e.g. clipping that never happened) is listed instead of drawn."""
    figures, all_zero = [], []
    for spec in _specs(data):
        values = [y for points in spec.series.values() for _, y in points]
        if not values:
            continue
        if all(y == 0 for y in values):
            all_zero.append(spec.title)
            continue
        png = spec.draw()
        if png is not None:
            figures.append((spec.title, png))
    return Charts(figures, all_zero)


# ------------------------------------------------------------------------------------ sections
def _started(data: RunData) -> str:
    if data.info is None:
        return "– (no run.json: the run predates it, or did not start)"
    when = datetime.datetime.fromtimestamp(data.info.started, datetime.timezone.utc)
    resumed = len(data.info.sessions) - 1
    return when.strftime("%Y-%m-%d %H:%M:%S UTC") + (f" (resumed {resumed} time(s))" if resumed > 0 else "")


def _wall_time(data: RunData) -> str:
    elapsed = data.series(ELAPSED)
    if elapsed:
        return f"{_duration(max(v for _, v in elapsed))} (from the start to the last logged row)"
    seconds = sum(v for _, v in data.series("timing/step")) + sum(v for _, v in data.series("timing/eval"))
    return f"{_duration(seconds)} in steps and evals (the rows carry no {ELAPSED})" if seconds else "–"


def _hardware(data: RunData) -> str:
    if data.info is None:
        return "– (no run.json)"
    hw = data.info.hardware
    memory = f", {hw.memory_gib:g} GiB memory" if hw.memory_gib is not None else ""
    gpus = ", ".join(hw.gpus) if hw.gpus else "none"
    return f"CPU: {hw.cpu} ({hw.cpus} CPUs{memory}); GPU: {gpus}; {data.info.placement}"


def _algorithm(data: RunData) -> str:
    if data.info is None:  # the raw keys, named as such: resolving them is the trainer's job
        key = "trainer.algorithm."
        return (f"{data.setting(key + 'advantage_estimator', '?')} advantages; policy_loss_type="
                f"{data.setting(key + 'policy_loss_type')}, ppo_loss_type={data.setting(key + 'ppo_loss_type', '?')} "
                "(no run.json, which names the loss as resolved)")
    alg = data.info.algorithm
    critic = f", critic {alg.critic}" if alg.critic else ""
    return (f"{alg.advantage_estimator} advantages, {alg.policy_loss} policy loss ({alg.loss_reduction}), "
            f"KL: {alg.kl}{critic}")


def _facts(data: RunData) -> list[tuple[str, str]]:
    steps = [row["step"] for row in data.rows if is_number(row.get("step"))]
    facts = [("run folder", str(data.run_dir.resolve())),
             ("run id", data.info.run_id if data.info else "–"),
             ("started", _started(data)), ("wall time", _wall_time(data)),
             ("last step", str(max(steps)) if steps else "–"), ("logged rows", str(len(data.rows))),
             ("hardware", _hardware(data)), ("model", str(data.setting("trainer.policy.model.path", "?"))),
             ("algorithm", _algorithm(data))]
    if data.info is not None:
        facts.append(("software", ", ".join(f"{k} {v}" for k, v in data.info.versions.items())))
    return facts


def _config_link(data: RunData, report_dir: Path) -> str | None:
    path = data.run_dir / CONFIG_FILE
    return Path(os.path.relpath(path.resolve(), report_dir.resolve())).as_posix() if path.exists() else None


def _hyper_parameters(data: RunData) -> list[tuple[str, str, str]]:
    missing = object()
    out = []
    for label, key in HYPER_PARAMETERS:
        value = data.setting(key, missing)
        if value is not missing:
            out.append((label, key, _num(value) if is_number(value) else str(value)))
    return out


def _headline(data: RunData) -> list[dict[str, Any]]:
    rows = []
    for key, label in HEADLINE:
        points = data.series(key)
        if points:
            rows.append({"label": label, "key": key, "first": points[0], "last": points[-1]})
    return rows


def _notes(data: RunData) -> list[str]:
    notes = []
    if not data.metrics_found:
        notes.append("No metrics.jsonl in this folder: the run logged nothing yet (or this is not a run folder).")
    elif not data.rows:
        notes.append("metrics.jsonl holds no complete row yet.")
    if data.skipped_lines:
        notes.append(f"{data.skipped_lines} unreadable line(s) of metrics.jsonl were skipped "
                     "(a run stopped in the middle of writing leaves a truncated last line).")
    return notes


def _eval_context(data: RunData) -> dict[str, Any] | None:
    sources_of = _eval_sources(data)
    if not sources_of and not data.eval_dumps and not data.foreign_dumps:
        return None
    sources = []
    for key, source in sources_of:
        points, score = data.series(key), data.series(f"eval/{source}/avg_score")
        sources.append({"source": source, "first": points[0][1] if points else None,
                        "last": points[-1][1] if points else None,
                        "best": max(v for _, v in points) if points else None,
                        "score": score[-1][1] if score else None})
    dumps = [{"step": d.step, "samples": len(d.records), "pass_rate": sum(map(_passed, d.records)) / len(d.records),
              "folder": str(d.folder)} for d in data.eval_dumps]
    examples, example_step = [], None
    if data.eval_dumps:
        last = data.eval_dumps[-1]
        example_step = last.step
        picked = ([r for r in last.records if _passed(r)][:EVAL_EXAMPLES]
                  + [r for r in last.records if not _passed(r)][:EVAL_EXAMPLES])
        examples = [{"source": r.get("data_source", ""), "prompt": prompt_text(r.get("input_prompt", "")),
                     "response": r.get("output_response", ""), "truth": r.get("ground_truth", ""),
                     "reward": _score(r)} for r in picked]
    return {"sources": sources, "dumps": dumps, "examples": examples, "example_step": example_step,
            "foreign": [str(f) for f in data.foreign_dumps]}


def _step_browser(data: RunData) -> list[dict[str, Any]]:
    by_step = data.samples_by_step()
    steps = list(by_step)
    out = []
    for step, rows in by_step.items():
        rewards = [r["reward"] for r in rows if is_number(r.get("reward"))]
        shown = [{"prompt": r.get("prompt", ""), "response": r.get("response", ""), "reward": r.get("reward")}
                 for r in rows]
        out.append({"step": step, "rows": shown, "mean": sum(rewards) / len(rewards) if rewards else None,
                    "open": step in (steps[0], steps[-1])})
    return out


def _all_metrics(data: RunData) -> list[dict[str, Any]]:
    rows = []
    for key in data.keys():
        values = [v for _, v in data.series(key)]
        if values:
            rows.append({"key": key, "points": len(values), "first": values[0], "last": values[-1],
                         "min": min(values), "max": max(values)})
    return rows


# ------------------------------------------------------------------------------------ page
def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("ridgeline.tracking", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = _num
    env.filters["clip"] = _clip
    return env


def render_report(data: RunData, report_dir: Path | None = None) -> str:
    """The report page as a string; `report_dir` (default: the run folder) is where the page will
    be, for the relative link to the run's config.yaml."""
    report_dir = data.run_dir if report_dir is None else report_dir
    run_name = data.setting("trainer.run_name") or data.run_dir.resolve().name
    project = data.setting("trainer.project_name")
    chart_set = build_charts(data)
    return _environment().get_template(TEMPLATE).render(
        title=f"{project} / {run_name}" if project else str(run_name),
        created=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        notes=_notes(data), facts=_facts(data), config_link=_config_link(data, report_dir),
        config_text=data.config_text, hyper_parameters=_hyper_parameters(data), headline=_headline(data),
        figures=chart_set.figures, all_zero=chart_set.all_zero, eval=_eval_context(data),
        steps=_step_browser(data), metrics=_all_metrics(data))


class RunFolderError(UserError, FileNotFoundError):
    """The folder given as a run folder is not one."""


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write the report of the run in `run_dir` (to `run_dir/report.html` unless `out_path`);
    returns its path. Raises RunFolderError (a FileNotFoundError) when `run_dir` is not a folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"no run folder at {run_dir}")
    out = Path(out_path) if out_path is not None else run_dir / REPORT_FILE
    out.write_text(render_report(load_run(run_dir), out.parent), encoding="utf-8")
    return out
