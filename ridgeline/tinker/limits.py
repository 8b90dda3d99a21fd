"""What one Tinker server takes on: the bounds on a request's work and on the state it holds
(no third-party import: `ridgeline tinker --help` reads the defaults without the SDK installed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinkerLimits:
    max_tokens_per_request: int = 65536   # input tokens of one forward_backward / prompt + samples of one sample
    max_samples_per_request: int = 64     # num_samples of one sample call
    max_queued_requests: int = 256        # futures waiting for the worker; more are refused with 503
    max_models: int = 16                  # training clients held at once
    max_samplers: int = 4                 # engines kept (least recently used dropped; rebuilt on use)
