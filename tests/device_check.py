"""A stand-in accelerator for catching device-placement mistakes on a machine without a GPU.

Why not FakeTensorMode's fake CUDA tensors, the obvious tool: on this CPU-only PyTorch build a fake
`cuda:0` parameter that requires grad aborts the whole process (`terminate called ... PyTorch is
not linked with support for cuda devices`, from autograd's device guard when it builds the
gradient edge), so no backward or optimizer step can run on it; and under FakeTensorMode every op
becomes fake, including the host-side planning the workers do on purpose on real CPU tensors
(`torch.unique` of the prompt groups, the packing layout), which then fails on data-dependent
shapes. The `meta` device has neither problem: forward, backward and the optimizer step run on
it (shapes only, no data), while host tensors stay real.

`meta` alone is lenient where CUDA is not (an embedding lookup with CPU ids, indexing with a CPU
index tensor), so `StrictDevices` adds the rule a GPU enforces, more strictly: every op that
takes tensors on two devices raises `DevicePlacementError`, except explicit transfers (`.to`,
`copy_`) and 0-dim CPU scalars (which CUDA kernels accept too). Reading a value back to the host
(`.item()`, `.tolist()`, `.cpu()` of a meta tensor) cannot give real numbers: it returns ones, so
the code's data-dependent host decisions (a finite loss, a finite grad norm) take their normal
path; the numbers themselves are tested elsewhere, on the CPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
META = torch.device("meta")
_HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}
_TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
              aten._copy_from_and_resize.default}


class DevicePlacementError(AssertionError):
    """An op received tensors on two devices: on a GPU it would fail (or silently copy)."""


def _target(args: tuple, kwargs: dict) -> str | None:
    """The device type a `to` / `_to_copy` call moves to (keyword, or a positional device)."""
    device = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    return torch.device(device).type if device is not None else None


class StrictDevices(TorchDispatchMode):
    """Within the block: mixed-device ops raise, host reads of meta tensors return ones."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if func in _HOST_READS and tensors[0].is_meta:  # .item(), .tolist(), bool(tensor)
            t = tensors[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if func.overloadpacket in (aten._to_copy, aten.to) and tensors[0].is_meta and _target(args, kwargs) == "cpu":
            return torch.ones(tensors[0].shape, dtype=kwargs.get("dtype") or tensors[0].dtype)  # .cpu(), .tolist()
        if func is aten.copy_.default and args[1].is_meta and not args[0].is_meta:  # .tolist() of many values
            return args[0].fill_(1)
        if func not in _TRANSFERS:
            devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                shapes = [f"{tuple(t.shape)}@{t.device}" for t in tensors]
                raise DevicePlacementError(f"{func} mixes devices: {', '.join(shapes)}")
        return func(*args, **kwargs)
