"""No key of either SkyRL generation is silently ignored: every leaf key of SkyRL-Train 0.3.1's
ppo_base_config.yaml and of skyrl 0.4's SkyRLTrainConfig (tests/data/skyrl_config_keys.json, its
"source" says how they were listed) is a field here that code reads (or that refuses a value it does
not act on), an alias of one, a key inside a free-form map that is handed on whole, or named in a
one-line refusal or notice (ridgeline.config.support.LATER_KEYS, Megatron / DeepSpeed sections)."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

from ridgeline.config.schema import all_keys, leaf_fields
from ridgeline.config.support import DEFAULTS_NOT_ACTED_ON, UNREAD_KEYS, VALUE_RENAMES, later_key, renamed_key
from ridgeline.config.validate import configures_unbuilt, under_free_form

DATA = json.loads((Path(__file__).parent / "data" / "skyrl_config_keys.json").read_text())
RIDGELINE = Path(__file__).resolve().parents[1] / "ridgeline"

# SkyRL 0.4's trainer.algorithm keys whose fields come with the algorithm side of issue 28
# (ridgeline/config/schema/algorithm.py); skipped until they are in the schema
ALGORITHM_PREFIXES = ("trainer.algorithm.off_policy_correction.", "trainer.algorithm.dppo.",
                      "trainer.algorithm.cispo.cispo_anchor", "trainer.algorithm.max_seq_len",
                      "trainer.algorithm.temperature", "trainer.algorithm.zero_variance_filter_tol")


# fields read under a name composed per role (ridgeline/distributed/placement.py: p[f"{r}_num_nodes"])
COMPOSED = {f"trainer.placement.{role}_{what}" for role in ("policy", "ref", "critic")
            for what in ("num_nodes", "num_gpus_per_node")}


@lru_cache(maxsize=1)
def _sources() -> str:
    """Ridgeline's code outside the schema, where a field must be read."""
    return "\n".join(p.read_text() for p in RIDGELINE.rglob("*.py") if "config/schema" not in p.as_posix())


def _field(key: str):
    return next((f for k, _, f in leaf_fields() if k == key), None)


def how_handled(key: str) -> str | None:
    """How Ridgeline takes `key`, or None (silently ignored)."""
    if key in VALUE_RENAMES or renamed_key(key) is not None:
        return "alias"
    if key in UNREAD_KEYS:
        return "notice"
    if configures_unbuilt(key):
        return "refused with its backend"
    if later_key(key) is not None:
        return "later key: refused or one notice"
    if under_free_form(key) and key not in all_keys():
        return "inside a free-form map"
    field = _field(key)
    if field is None:
        return None
    if field.metadata["not_built"] or key in DEFAULTS_NOT_ACTED_ON:
        return "field: refused / said at start"
    if key in COMPOSED:
        return "field read by a composed name"
    leaf = key.rpartition(".")[2]
    # read by code: the attribute (or, for a map entry, the name) appears in Ridgeline's code
    if re.search(rf"\.{re.escape(leaf)}\b|[\"']{re.escape(leaf)}[\"']", _sources()):
        return "field read by code"
    return None


@pytest.mark.parametrize("release", ["0.3.1", "0.4"])
def test_every_skyrl_key_is_read_aliased_or_named(release):
    algorithm_built = "trainer.algorithm.off_policy_correction.tis_ratio_type" in all_keys()
    missing = [key for key in DATA[release] if how_handled(key) is None
               and (algorithm_built or not key.startswith(ALGORITHM_PREFIXES))]
    assert missing == []


def test_the_key_lists_are_whole():
    assert len(DATA["0.3.1"]) == 263 and len(DATA["0.4"]) == 415
    assert "trainer.policy.torch_profiler_config.enable" in DATA["0.4"] and "generator.async_engine" in DATA["0.3.1"]
