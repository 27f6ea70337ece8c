"""Host-to-GPU copies that do not make the host wait for the GPU.

A plain `tensor.to("cuda")` from ordinary (pageable) host memory returns only once every
kernel queued before it on the stream has run. With overlapped dispatch
(`engine/executor.py`) the host builds batch n + 1 while the GPU runs batch n, so each such
copy (a step's noise, RoPE tables, K/V page indices) would stall the host until batch n
finished, and the GPU would then wait for the host. These helpers copy through pinned
memory without blocking; PyTorch keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`x` on `device`; CPU-to-GPU copies go through pinned memory and do not block."""
    device = torch.device(device)
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def tensor_on(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(data)` built on the host and copied with `to_device`."""
    return to_device(torch.tensor(data, dtype=dtype), device)
