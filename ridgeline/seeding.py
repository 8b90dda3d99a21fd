"""Sampling seeds derived from one base seed (a stdlib leaf module every layer may use).

Every place that needs a seed of its own (a training rollout, a turn of the agent loop, an engine
of a group, a request of a batch, a dynamic-sampling draw) derives it from the seed it was given
and the names of what it stands for:

    derive_seed(trainer.seed, "train", global_step, round_index)   # the rollout's seed
    derive_seed(rollout_seed, "turn", turn)                         # each turn of the agent loop
    derive_seed(turn_seed, "engine", engine_index)                  # each engine of a group

The components are hashed (BLAKE2b of their JSON form), so two different paths give two unrelated
63-bit seeds. Arithmetic formulas collide: with `seed + 7_919 * turn` in the generator and
`seed + 7_919 * engine` in the engine group, engine 1's turn-0 seed was engine 0's turn-1 seed.
The hash is not Python's `hash()`, so every process (Ray actors included) derives the same seeds
whatever PYTHONHASHSEED is.
"""

from __future__ import annotations

import hashlib
import json
from typing import overload

SEED_BITS = 63  # fits a signed 64-bit integer: torch, vLLM and SGLang all take it


def derive_seed(base: int, *components: str | int) -> int:
    """A seed in [0, 2**63) for `components` under `base`: the first 8 bytes of
    BLAKE2b(JSON([base, *components])) with the top bit cleared. "1" and 1 are different
    components (JSON keeps their types apart)."""
    payload = json.dumps([int(base), *components], separators=(",", ":")).encode()
    digest = hashlib.blake2b(payload, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


@overload
def request_seeds(seed: int, n: int) -> list[int]: ...
@overload
def request_seeds(seed: int | None, n: int) -> list[int | None]: ...
def request_seeds(seed: int | None, n: int) -> list[int | None] | list[int]:
    """One seed per request of a batch, `derive_seed(seed, "request", i)`: the batch is
    reproducible and the samples of one prompt (GRPO sends it n_samples_per_prompt times) differ.
    No seed: None for every request (the engine draws its own)."""
    if seed is None:
        unseeded: list[int | None] = [None] * n
        return unseeded
    return [derive_seed(seed, "request", i) for i in range(n)]
