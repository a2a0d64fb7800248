"""Small host values to the device without the host waiting on the device.

``torch.tensor(values, device="cuda")`` builds the tensor in pageable host memory and copies it with a
blocking copy: the host waits until the stream reaches the copy, i.e. until every kernel queued before
it has finished.  Inside a step launch that wait serialises the host with the device, and with async
scheduling (``async_scheduling.py``) it waits for the step running ahead, which undoes the overlap.
:func:`to_device` builds the tensor in pinned memory and copies it asynchronously instead (PyTorch's
caching host allocator keeps the pinned block until the copy has run).  Every per-step host-to-device
tensor of the engine goes through it; ``tests/engine/test_async_scheduling.py`` checks on CUDA that a decode
step's launch performs no synchronising operation (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a flat sequence of Python numbers or bools) as a 1-D ``dtype`` tensor on ``device``.

    On CUDA the copy is asynchronous on the current stream (pinned source); the host does not wait.
    On the CPU it is the plain tensor.

    Raises:
        whatever ``torch.tensor`` raises for values that do not fit ``dtype``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
