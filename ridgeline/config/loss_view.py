"""What a policy loss receives as ``config``: the ``trainer.algorithm`` section as SkyRL 0.3.1 hands
it to its losses (an OmegaConf map, read-only) with SkyRL's derived ``max_seq_len``.

Kept as a map for the losses users wrote for SkyRL 0.3.1, which may read it with ``config.get(...)``
or ``config["..."]`` besides attributes; Ridgeline's own code reads the typed ``AlgorithmConfig``.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from ridgeline.config.schema import AlgorithmConfig, DPOConfig

__all__ = ["LossConfig", "loss_config"]

LossConfig = DictConfig  # the type a policy loss's `config` has (attribute reads are AlgorithmConfig's keys)


def loss_config(algorithm: AlgorithmConfig, max_seq_len: int | None, dpo: DPOConfig | None = None) -> LossConfig:
    """``algorithm`` plus ``max_seq_len`` as a read-only map (a loss written for SkyRL reads
    ``config.max_seq_len``; None: no such constant, as for the Tinker losses' sums), and for the
    `dpo` loss of `ridgeline dpo` the ``dpo`` section."""
    section = OmegaConf.create(dataclasses.asdict(algorithm))
    if max_seq_len is not None:
        section.max_seq_len = max_seq_len
    if dpo is not None:
        section.dpo = dataclasses.asdict(dpo)
    OmegaConf.set_readonly(section, True)
    return section
