"""Which attention backend fits which NVIDIA GPU, as pure rules on the compute capability.

Used by `ridgeline doctor` and by the SGLang engine (``generator.engine_init_kwargs.attention_backend``).
A capability is ``(major, minor)`` as returned by ``torch.cuda.get_device_capability()``:
A100 = (8, 0), RTX 3090 = (8, 6), L4/RTX 4090 = (8, 9), H100 = (9, 0), B200 = (10, 0),
RTX 5090 = (12, 0).

| backend      | runs on            |
|--------------|--------------------|
| fa3          | SM 8.0 - 9.0       |
| flashinfer   | SM >= 8.0          |
| triton       | SM >= 7.0          |
| torch_native | any CUDA GPU       |
"""

from __future__ import annotations

__all__ = ["fitting_attention_backend", "attention_backend_problem", "format_capability"]

# FlashAttention-3 kernels are built for Ampere..Hopper only; Blackwell (SM 10.x, 12.x) has none.
_FA3_MIN, _FA3_MAX = (8, 0), (9, 0)
_FLASHINFER_MIN = (8, 0)


def format_capability(capability: tuple[int, int]) -> str:
    return f"SM {capability[0]}.{capability[1]}"


def fitting_attention_backend(capability: tuple[int, int]) -> str:
    """The attention backend to ask for on a GPU of compute ``capability``.

    * SM 8.0 - 9.0 (Ampere, Ada, Hopper): ``fa3``.
    * any other SM >= 8.0 (Blackwell 10.x / 12.x): ``flashinfer``, which ships kernels for them.
    * SM 7.x (Volta, Turing: V100, T4): ``triton``, the portable fallback SGLang itself picks
      when FlashInfer is unavailable; it is far faster than ``torch_native`` (a reference path
      over PyTorch SDPA meant for debugging).
    * below SM 7.0 (Pascal and older): ``torch_native``, because Triton does not compile for
      GPUs older than Volta.
    """
    cap = tuple(capability)
    if _FA3_MIN <= cap <= _FA3_MAX:
        return "fa3"
    if cap >= _FLASHINFER_MIN:
        return "flashinfer"
    if cap >= (7, 0):
        return "triton"
    return "torch_native"


def attention_backend_problem(backend: str, capability: tuple[int, int] | None) -> str | None:
    """Why ``backend`` cannot run on a GPU of compute ``capability`` (None: no CUDA GPU), or None
    when it can. Names the engine does not list here are left to the engine to judge."""
    if backend == "fa3":
        needs, fits = "a GPU of compute capability 8.0-9.0 (Ampere/Hopper)", (
            capability is not None and _FA3_MIN <= tuple(capability) <= _FA3_MAX)
    elif backend == "flashinfer":
        needs, fits = "a GPU of compute capability 8.0 or newer (Ampere and later)", (
            capability is not None and tuple(capability) >= _FLASHINFER_MIN)
    else:
        return None
    if fits:
        return None
    if capability is None:
        return (f"attention_backend={backend} needs {needs}; this machine has no CUDA GPU. "
                "Fix: run on a GPU machine")
    return (f"attention_backend={backend} needs {needs}; this GPU is {format_capability(capability)}. "
            f"Fix: generator.engine_init_kwargs.attention_backend={fitting_attention_backend(capability)}")
