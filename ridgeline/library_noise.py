"""Known messages of the libraries Ridgeline runs on that say nothing to its user, silenced once when a
command starts (a stdlib leaf module every layer may use).

Each entry below names what it silences and why the user loses nothing: the run's own log, console
table and errors stay untouched, and anything not listed here still shows. `ridgeline --debug ...`
(or RIDGELINE_DEBUG=1) keeps everything.
"""

from __future__ import annotations

import logging
import os
import warnings

# Progress bars of other libraries (transformers' "Loading weights", datasets' "Map", the hub's
# downloads; TQDM_DISABLE: bare tqdm bars such as transformers' "de-quantizing GGUF tensors", whose
# work Ridgeline's own log line names): they draw over the run's own step bar and console table.
# tqdm reads TQDM_DISABLE when it is imported, which no command has done when this runs.
PROGRESS_BAR_VARIABLES = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")

# logger -> the level below which its records are dropped
QUIET_LOGGERS = {
    # "Matplotlib is building the font cache; this may take a moment." (once per machine)
    "matplotlib": logging.ERROR,
    # the hub client's "Retrying in 1s [Retry 1/5]" lines, one per attempt and file; a lookup that
    # fails ends in one Ridgeline message naming the key (models.source, data.sources)
    "huggingface_hub": logging.ERROR,
    # transformers' own notes on loading (unused weights of a value head's backbone, generation
    # config defaults); load failures are raised, not logged
    "transformers": logging.ERROR,
}

# (message regex, category, module regex) of Python warnings: deprecation notices addressed to
# library developers, not to someone training a model
QUIET_WARNINGS = (
    (r"", FutureWarning, r"transformers(\.|$)"),
    (r"", DeprecationWarning, r"(transformers|torch|datasets|huggingface_hub)(\.|$)"),
    (r".*TypedStorage is deprecated", UserWarning, r""),
)

_done = False


def silence_library_noise() -> None:
    """Apply the tables above once per process (later calls do nothing); with RIDGELINE_DEBUG
    set nothing is silenced."""
    global _done
    if _done:
        return
    _done = True
    from ridgeline.errors import debug_enabled

    if debug_enabled():
        return
    for name in PROGRESS_BAR_VARIABLES:
        os.environ.setdefault(name, "1")
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for message, category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    _quiet_transformers_bars()


def _quiet_transformers_bars() -> None:
    """transformers draws "Loading weights" with its own switch, not the hub's variable; its logger
    too is its own (set through its API, which ignores the stdlib level set above)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a process without transformers has none of its bars
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
