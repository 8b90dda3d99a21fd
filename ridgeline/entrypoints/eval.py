"""`ridgeline eval [--checkpoint DIR] [--output DIR] [overrides...]`: score a model on datasets
without training.

The overrides are the trainer's (Hydra), so a preset evaluates what it trains on:

    ridgeline eval +experiment=quickstart trainer.policy.model.path=runs/quickstart/final_model
    ridgeline eval +experiment=tiny --checkpoint runs/tiny/final_model generator.eval_n_samples_per_prompt=8

With `--checkpoint`, the config is the one of the run that wrote the checkpoint (the checkpoint's
`config.yaml`, or the run folder's beside `final_model`: its reward, data and export path), with
the command line's keys on top; a preset named on the command line is replaced by it.

What is read: `data.val_data` (the files to score; `data.prepare` writes them first when missing),
`trainer.policy.model.path` / `gguf_file` (the model) unless `--checkpoint` names one,
`generator.eval_sampling_params`, `generator.eval_n_samples_per_prompt`, `generator.model_dtype`,
`generator.max_num_seqs`, the environment settings, `trainer.eval_batch_size`,
`trainer.max_prompt_length` and `trainer.seed`.

What is written to `--output` (default SkyRL-Train's eval-only dump folder,
`<trainer.export_path>/dumped_evals/eval_only`, or under the run's folder with `trainer.exports_per_run`): the eval dump (`<data_source>.jsonl`, every
sample, and `aggregated_results.jsonl`, the metrics; ridgeline.tracking.dumps) and `config.yaml`
(the resolved config); the metrics table is printed. Each file of `data.val_data` is reported by
its rows' data_source; when two files share a data source, each is reported as
`<data_source>/<file stem>` (metric key `eval/<data_source>_<file stem>/...`) so they stay apart.

`python -m ridgeline.entrypoints.eval ...` runs the same thing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ridgeline.errors import UserError

# torch, transformers and the rest load inside the functions: `ridgeline --help` and
# `ridgeline prepare` build this parser too and should not pay for them.
if TYPE_CHECKING:
    from ridgeline.config.schema import RidgelineConfig

    from ridgeline.data import PromptDataset, PromptRow
    from ridgeline.inference.types import InferenceEngine

log = logging.getLogger("ridgeline.eval")

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# ------------------------------------------------------------------------------------ CLI
def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add `eval` to an argparse subparsers object (sets `args.func = run`)."""
    parser = subparsers.add_parser(
        "eval", help="score a model or checkpoint on data.val_data without training",
        description="ridgeline eval [--checkpoint DIR] [--output DIR] +experiment=quickstart "
                    "trainer.policy.model.path=runs/quickstart/final_model ...")
    # REMAINDER: inside `ridgeline`'s subcommand parser, options after the first override would
    # be refused; `run` picks them out of the overrides instead, so any order works.
    _add_arguments(parser, overrides_nargs=argparse.REMAINDER)
    parser.set_defaults(func=run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser, overrides_nargs: str = "*") -> None:
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="folder with the policy weights to score: a Hugging Face model folder "
                             "(config.json + weights), safetensors files or LoRA adapters for the model "
                             "of trainer.policy.model.path, or a training checkpoint")
    parser.add_argument("--output", type=Path, default=None,
                        help="where the eval dump and config.yaml go "
                             "(default: <trainer.export_path>/dumped_evals/eval_only; the run's folder with "
                             "trainer.exports_per_run=true, as the presets set)")
    parser.add_argument("overrides", nargs=overrides_nargs,
                        help="Hydra overrides, e.g. +experiment=tiny trainer.seed=1")


def _standalone_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ridgeline eval", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments of `ridgeline eval`, options and overrides in any order."""
    return _standalone_parser().parse_intermixed_args(argv)


def _options_among_overrides(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with any --checkpoint/--output that followed an override taken out of the overrides."""
    late = parse_args(list(args.overrides))
    return argparse.Namespace(**{**vars(args), "overrides": late.overrides,
                                 "checkpoint": late.checkpoint or args.checkpoint,
                                 "output": late.output or args.output})


def run(args: argparse.Namespace) -> int:
    """Load the config from `args.overrides`, evaluate, print the table; the exit code. What the
    user fixes (config, data, model, --checkpoint) raises a `UserError` the caller reports
    (`ridgeline.errors.report_user_errors`)."""
    from ridgeline.config import load_config
    from ridgeline.entrypoints.run import setup_logging

    args = _options_among_overrides(args)
    setup_logging()
    run_config = checkpoint_run_config(args.checkpoint) if args.checkpoint is not None else None
    if run_config is not None:
        log.info("--checkpoint %s: the config of the run that wrote it (%s), then the command line's keys",
                 args.checkpoint, run_config)
    elif args.checkpoint is not None:
        log.info("--checkpoint %s: no config.yaml of the run that wrote it beside it; the command line's "
                 "config is used", args.checkpoint)
    cfg = load_config(args.overrides, run_config=run_config)
    from ridgeline.entrypoints.preflight import preflight
    preflight(cfg, uses_ranks=False)   # an engine this machine cannot run: doctor's message before any loading
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = evaluate_model(cfg, checkpoint=args.checkpoint, output=args.output)
    print(format_table(report.metrics))
    print(f"{report.num_samples} samples in {report.seconds:.1f} s; metrics and samples (one file per data "
          f"source) in {report.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ridgeline.entrypoints.eval [--checkpoint DIR] [--output DIR] [overrides...]`."""
    from ridgeline.entrypoints.command import run_command
    return run_command("eval", add_parser, run, argv)


# ------------------------------------------------------------------------------------ evaluation
class CheckpointArgumentError(UserError, ValueError):
    """`--checkpoint` names no folder, one without model weights, or weights of another model."""


@dataclass
class EvalReport:
    metrics: dict[str, float]
    output: Path          # the eval dump (ridgeline.tracking.dumps) and config.yaml
    num_samples: int
    seconds: float


def evaluate_model(cfg: RidgelineConfig, checkpoint: Path | None = None, output: Path | None = None) -> EvalReport:
    """Build tokenizer, model, engine and generator from `cfg`, score every row of
    `data.val_data` with `generator.eval_n_samples_per_prompt` samples, and write the results.
    With `generator.enable_http_endpoint` the engine also answers HTTP requests while it evaluates."""
    import copy

    from ridgeline.config import save_config
    from ridgeline.inference.endpoint import EndpointSettings, HttpEndpoint, check_address
    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.tracking.dumps import eval_dump_folder
    from ridgeline.models.device import use_device
    from ridgeline.models.loading import configure_chat_template
    from ridgeline.trainer.builders import (build_generator, check_environments, load_environments,
                                            prepare_data, seed_everything)
    from ridgeline.trainer.evaluation import run_eval

    t, g = cfg.trainer, cfg.generator
    if g.enable_http_endpoint:  # a taken port stops here, before any model loads
        check_address(g.http_endpoint_host, g.http_endpoint_port)
    seed_everything(t.seed)
    output = Path(output) if output is not None else eval_dump_folder(t.exports_dir, None)
    cfg = copy.deepcopy(cfg)  # a copy; the caller's stays as it is
    engine: InferenceEngine
    if g.run_engines_locally and g.backend == "hf":
        tokenizer, model = load_policy(cfg, checkpoint)
        engine = HFEngine(model, tokenizer, dtype=next(model.parameters()).dtype, max_num_seqs=g.max_num_seqs,
                          device=use_device(t.device))
        del model  # the engine holds its own copy
    else:  # vLLM / SGLang load a model folder themselves; remote servers serve what they hold
        from ridgeline.inference.build import build_engine

        engine = build_engine(cfg, tokenizer := engine_tokenizer(cfg, checkpoint))
    configure_chat_template(tokenizer, g)
    prepare_data(cfg.data, cfg.environment)
    datasets = val_datasets(cfg, tokenizer)
    env_override = load_environments(cfg.environment)
    # every row's env builds and starts before any sample is generated (as before training)
    check_environments(cfg.environment, cfg.data, cfg.generator.max_turns,
                       {f"data.val_data ({file})": data for file, data in datasets.items()}, env_override)
    labelled = labelled_rows(datasets)
    endpoint = None
    try:
        if g.enable_http_endpoint:
            endpoint = HttpEndpoint(engine, tokenizer, EndpointSettings.from_config(cfg))
            engine = endpoint.engine
            endpoint.start()
        generator = build_generator(cfg.generator, cfg.environment, engine, tokenizer)
        metrics, acc = run_eval(generator, labelled, cfg, env_override=env_override)
    finally:
        if endpoint is not None:
            endpoint.close()
        engine.close()
    seconds = metrics["timing/eval"]
    acc.dump(output, extra_metrics={"timing/eval": seconds})
    save_config(cfg, output / "config.yaml")
    return EvalReport(acc.metrics(), output, len(acc.records), seconds)


def engine_tokenizer(cfg: RidgelineConfig, checkpoint: Path | None):
    """The tokenizer for an engine that loads its own weights; `checkpoint` (a Hugging Face folder
    or a training checkpoint) becomes `trainer.policy.model.path` for vLLM / SGLang."""
    from ridgeline.models.loading import load_tokenizer, policy_spec

    if checkpoint is None:
        return load_tokenizer(policy_spec(cfg))
    if not cfg.generator.run_engines_locally:
        raise CheckpointArgumentError("--checkpoint with remote engines: the servers score the weights they "
                                      "hold. Load the checkpoint on the servers (e.g. `ridgeline serve "
                                      "trainer.policy.model.path=CHECKPOINT`) and run eval without --checkpoint.")
    tokenizer = _use_hf_checkpoint(cfg, _checkpoint_folder(checkpoint))
    if tokenizer is None:
        raise CheckpointArgumentError(f"--checkpoint {checkpoint}: generator.backend={cfg.generator.backend} "
                                      "loads a Hugging Face model folder (config.json + weights); export one "
                                      "with `ridgeline export`, or use generator.backend=hf")
    return tokenizer


def checkpoint_run_config(checkpoint: Path) -> Path | None:
    """The `config.yaml` of the run that wrote `checkpoint`: a training checkpoint's own, or the run
    folder's beside `final_model`; None when neither is there (an export, a downloaded model)."""
    folder = _checkpoint_folder(checkpoint)  # a training checkpoint's policy/, or the folder itself
    for candidate in (folder, *list(folder.resolve().parents)[:2]):
        path = candidate / "config.yaml"
        if path.is_file() and _is_run_config(path):
            return path
    return None


def _is_run_config(path: Path) -> bool:
    """A config a Ridgeline run saved (not some other program's config.yaml)."""
    from ridgeline.config import ConfigError, saved_values

    try:
        trainer = saved_values(path).get("trainer")
    except (ConfigError, ValueError, OSError):  # unreadable YAML, or no map: not a run's
        return False
    return isinstance(trainer, dict) and trainer.get("run_dir") is not None


def _checkpoint_folder(checkpoint: Path) -> Path:
    """`--checkpoint` as the folder to read: a training checkpoint's policy, or the folder itself."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointArgumentError(f"--checkpoint {checkpoint}: no such folder")
    return _training_checkpoint_policy(checkpoint)


def _use_hf_checkpoint(cfg: RidgelineConfig, folder: Path):
    """When `folder` holds a Hugging Face model (config.json + weights): name it as the policy in
    `cfg`, so the saved config.yaml says which model was scored, and return its tokenizer (the base
    model's when it saved none). Otherwise None."""
    from ridgeline.models.loading import load_tokenizer, policy_spec

    if not ((folder / "config.json").exists() and any((folder / f).exists() for f in HF_WEIGHT_FILES)):
        return None
    has_tokenizer = any((folder / f).exists() for f in TOKENIZER_FILES)
    tokenizer = load_tokenizer(_folder_spec(cfg, folder) if has_tokenizer else policy_spec(cfg))
    cfg.trainer.policy.model.path, cfg.trainer.policy.model.gguf_file = str(folder), None
    return tokenizer


def _folder_spec(cfg: RidgelineConfig, folder: Path):
    """A Hugging Face folder (an export, a checkpoint's policy) as it was saved: its config.json
    already holds the run's model config overrides."""
    from ridgeline.models.loading import ModelSpec

    return ModelSpec(path=str(folder), seed=cfg.trainer.seed,
                     use_fast_tokenizer=not cfg.trainer.disable_fast_tokenizer)


def load_policy(cfg: RidgelineConfig, checkpoint: Path | None) -> tuple:
    """(tokenizer, model) in the engine's dtype: from `trainer.policy.model`, or from
    `checkpoint` when given.

    A checkpoint folder is either a Hugging Face model folder (config.json + weights; its
    tokenizer too when saved there, else the base model's), or bare `*.safetensors` files holding
    the state dict of the model `trainer.policy.model.path` names. `cfg` is updated to name what
    was loaded, so the saved config.yaml says which model was scored."""
    import torch

    from ridgeline.models import lora
    from ridgeline.models.loading import engine_spec, load_model, load_state_into, load_tokenizer, read_safetensors
    from ridgeline.trainer.builders import engine_dtype

    dtype = engine_dtype(cfg.generator.model_dtype)
    base = engine_spec(cfg)  # the policy with the engines' model config (generator.rope_*)
    if checkpoint is None:
        tokenizer = load_tokenizer(base)
        return tokenizer, load_model(base, dtype, tokenizer)
    checkpoint = _checkpoint_folder(checkpoint)
    tokenizer = _use_hf_checkpoint(cfg, checkpoint)
    if tokenizer is not None:
        log.info("scoring the Hugging Face model in %s", checkpoint)
        return tokenizer, load_model(_folder_spec(cfg, checkpoint), dtype, tokenizer)
    has_tokenizer = any((checkpoint / f).exists() for f in TOKENIZER_FILES)
    if lora.is_adapter_folder(checkpoint):  # a LoRA run's checkpoint: its adapters merged into the base
        tokenizer = load_tokenizer(_folder_spec(cfg, checkpoint) if has_tokenizer else base)
        log.info("scoring %s with the LoRA adapters of %s merged in", base.path, checkpoint)
        merged = lora.load_merged(load_model(base, torch.float32, tokenizer), checkpoint)
        # transformers wraps PreTrainedModel.to with functools.wraps: mypy reads the bound call as unbound
        return tokenizer, merged.to(dtype)  # type: ignore[arg-type]
    shards = sorted(checkpoint.glob("*.safetensors"))
    if not shards:
        raise CheckpointArgumentError(f"--checkpoint {checkpoint}: holds neither a Hugging Face model "
                              f"(config.json + {' or '.join(HF_WEIGHT_FILES[::2])}) nor *.safetensors files")
    tokenizer = load_tokenizer(_folder_spec(cfg, checkpoint) if has_tokenizer else base)
    model = load_model(base, dtype, tokenizer)
    try:
        load_state_into(model, read_safetensors(shards))
    except ValueError as err:
        raise CheckpointArgumentError(f"checkpoint weights do not fit the model of trainer.policy.model.path: "
                                      f"{err}") from None
    log.info("scoring %s with the weights of %s", base.path, checkpoint)
    return tokenizer, model


def _training_checkpoint_policy(folder: Path) -> Path:
    """A training checkpoint (`global_step_N`, or a `ckpt_path` holding some: the latest complete
    one) -> its `policy` folder (Hugging Face model, or LoRA adapters); any other folder is
    returned as it is."""
    from ridgeline.models.lora import is_adapter_folder
    from ridgeline.trainer import checkpoint as ckpt

    policy = folder / "policy"
    try:
        if (policy / "config.json").exists() or is_adapter_folder(policy) or ckpt.latest_checkpoint(folder) is not None:
            return ckpt.resolve_checkpoint(folder) / "policy"
    except ckpt.CheckpointError as err:
        raise CheckpointArgumentError(f"--checkpoint {folder}: {err}") from None
    return folder


def val_datasets(cfg: RidgelineConfig, tokenizer) -> dict[str, PromptDataset]:
    """Each entry of `data.val_data` (file or dataset name) -> its usable rows."""
    from ridgeline.data import DatasetError, PromptDataset

    t = cfg.trainer
    files = list(cfg.data.val_data)
    if not files:
        raise DatasetError("data.val_data is empty: name the dataset files to score, "
                           "e.g. data.val_data=[data/validation.parquet]")
    return {f: PromptDataset([f], default_env_class=cfg.environment.env_class, max_prompt_tokens=t.max_prompt_length,
                             tokenizer=tokenizer, config_key="data.val_data") for f in files}


def labelled_rows(datasets: dict[str, PromptDataset]) -> list[tuple[str, PromptRow]]:
    """Every row of the datasets, in file order, with the name it is reported under: its
    data_source, or `<data_source>/<file stem>` when that source is in several files."""
    files_of: dict[str, set[str]] = {}
    for file, data in datasets.items():
        for source in data.data_sources():
            files_of.setdefault(source, set()).add(file)
    return [(row.data_source if len(files_of[row.data_source]) == 1 else f"{row.data_source}/{Path(file).stem}", row)
            for file, data in datasets.items() for row in data]


# ------------------------------------------------------------------------------------ table
def format_table(metrics: dict[str, float]) -> str:
    """The `eval/<source>/<metric>` metrics as a table: one line per source, `all` last."""
    table: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval":
            table.setdefault(parts[1], {})[parts[2]] = value
    if not table:
        return "(no eval metrics)"
    ks = sorted({int(name[len("pass_at_"):]) for row in table.values() for name in row if name.startswith("pass_at_")})
    columns = ["num_prompts"] + [f"pass_at_{k}" for k in ks] + ["avg_score", "accuracy"]
    headers = ["prompts"] + [f"pass@{k}" for k in ks] + ["avg_score", "solved"]
    sources = sorted(s for s in table if s != "all") + (["all"] if "all" in table else [])
    width = max(len("source"), *(len(s) for s in sources))
    lines = ["source".ljust(width) + "".join(f"  {h:>9}" for h in headers)]
    for source in sources:
        cells = [_cell(table[source].get(c)) for c in columns]
        lines.append(source.ljust(width) + "".join(f"  {c:>9}" for c in cells))
    from ridgeline.trainer.metrics import SOLVED_THRESHOLD

    # pass@k is SkyRL's (any positive reward passes), so a format reward alone reads as a pass
    lines.append(f"pass@k: samples with a reward > 0 (SkyRL's rule: a format reward counts); "
                 f"solved: samples with a reward >= {SOLVED_THRESHOLD:g}")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if isinstance(value, int) else f"{value:.4f}"


if __name__ == "__main__":
    sys.exit(main())
