"""`ridgeline doctor`'s checks of what a run reads: its models, its data files and the environments
its rows name. Each is looked at the way the run will look at it, without downloading anything:

- a model: a local folder (its config and tokenizer load), a `.gguf` file in a folder, a model
  built in memory (`tiny://`, `random://`), or a hub id (in the local Hugging Face cache, or on a
  hub that answers: one short request, the run downloads it);
- a data entry: a file (every row read and checked), a file `data.prepare` writes at start, a
  dataset folder, or a hub dataset (on a hub that answers);
- the environments: each distinct env of the rows built, started and closed (as before training);
  a warning when a chosen `environment.env_class` applies to no row.

A FAIL carries the run's own message (naming the key and the fix), so "ready" means the run will
get past loading what it names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TYPE_CHECKING

from ridgeline.entrypoints.doctor_facts import FAIL, NOT_CHECKED, OK, WARN, Check
from ridgeline.errors import UserError

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

DATA_KEYS = ("data.train_data", "data.val_data")


def input_checks(cfg: RidgelineConfig) -> list[Check]:
    """The models, then the data entries, then the rows' environments of `cfg`."""
    checks = [model_check(spec) for spec in model_specs(cfg)]
    data_checks, datasets = data_input_checks(cfg)
    return checks + data_checks + [environment_check(cfg, datasets)]


def model_specs(cfg: RidgelineConfig) -> list:
    """The models the run loads: the policy, the reference when a KL term needs it, the critic when set."""
    from ridgeline.models.loading import critic_spec, policy_spec, ref_spec
    from ridgeline.training.build import needs_ref

    specs = [s for s in (policy_spec(cfg), ref_spec(cfg) if needs_ref(cfg) else None, critic_spec(cfg)) if s]
    # the reference at the policy's path is the same model, named by the same key
    return list({(s.config_key, s.path, s.gguf_file): s for s in specs}.values())


def model_check(spec) -> Check:
    """Where `spec`'s model is, and (for a local folder) that its config and tokenizer load."""
    from huggingface_hub import try_to_load_from_cache

    from ridgeline.models.loading import is_built_locally, load_tokenizer, model_config, resolve_path
    from ridgeline.models.source import locate_model

    name, path = spec.config_key, spec.path
    try:
        if is_built_locally(spec):
            model_config(spec)
            return Check(name, OK, f"{path}: built in memory from its name (no files)")
        folder = resolve_path(path, name)
        locate_model(folder, name, spec.gguf_file)  # a folder, a .gguf file, or the hub's cache / answer
        if spec.gguf_file:
            return Check(name, OK, f"{path}: {spec.gguf_file} found in {folder} (dequantized once, at first load)")
        if Path(folder).expanduser().is_dir():
            model_config(spec)
            load_tokenizer(spec)
            return Check(name, OK, f"{path}: model folder; its config and tokenizer load")
        if isinstance(try_to_load_from_cache(folder, "config.json"), str):
            return Check(name, OK, f"{path}: hub model in the local Hugging Face cache")
        return Check(name, OK, f"{path}: hub model, the hub answers (the run downloads it at first use)")
    except UserError as exc:
        return Check(name, FAIL, str(exc))


def data_input_checks(cfg: RidgelineConfig) -> tuple[list[Check], dict[str, Any]]:
    """One check per entry of `data.train_data` and `data.val_data`; and the datasets read
    (config key (entry) -> PromptDataset) for the environment check."""
    from ridgeline.data import DatasetError, PromptDataset
    from ridgeline.data.sources import is_data_file, is_hub_dataset, locate_hub_dataset

    prepare = cfg.data.prepare
    checks, datasets = [], {}
    for key, entries in zip(DATA_KEYS, (cfg.data.train_data, cfg.data.val_data)):
        for entry in map(str, entries):
            try:
                if is_data_file(entry) and not Path(entry).exists() and prepare is not None:
                    checks.append(Check(key, OK, f"{entry}: written at start by data.prepare "
                                                 f"(dataset {prepare['dataset']})"))
                    continue
                if is_hub_dataset(entry):
                    locate_hub_dataset(entry, key)
                    checks.append(Check(key, OK, f"{entry}: hub dataset, the hub answers (the run downloads it)"))
                    continue
                data = PromptDataset([entry], default_env_class=cfg.environment.env_class, config_key=key)
            except DatasetError as exc:
                checks.append(Check(key, FAIL, str(exc)))
                continue
            datasets[f"{key} ({entry})"] = data
            checks.append(Check(key, OK, f"{entry}: {len(data)} rows read and checked"))
    return checks, datasets


def environment_check(cfg: RidgelineConfig, datasets: dict[str, Any]) -> Check:
    """The environments of the rows read, each built, started and closed as before training."""
    from ridgeline.trainer.builders import check_environments, load_environments, unused_env_class_note

    name = "environments"
    if not datasets:
        return Check(name, NOT_CHECKED, "no data rows could be read here (yet): the run checks them at start")
    try:
        override = load_environments(cfg.environment)
        check_environments(cfg.environment, cfg.data, cfg.generator.max_turns, datasets, override)
    except UserError as exc:
        return Check(name, FAIL, str(exc))
    classes = sorted({override or row.env_class for data in datasets.values() for row in data})
    note = None if override else unused_env_class_note(cfg.environment, datasets,
                                                       prepared=cfg.data.prepare is not None)
    return Check(name, WARN, note) if note else Check(name, OK, f"{', '.join(classes)}: each builds, starts and "
                                                                "closes on the rows read")
