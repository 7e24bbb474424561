# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Device memory for collectives that stays at one address across requests.

On XPU, oneCCL registers every allocation a collective is handed and keeps it registered; a block that is
allocated once and reused is registered once. This module only decides when such memory is allocated.
"""

from __future__ import annotations

from typing import Any

import torch


def resolve_device(device: torch.device | str) -> torch.device:
    """``xpu`` as ``xpu:<current>``, so that one card is never taken for two."""
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.device(device.type, torch.get_device_module(device.type).current_device())


def synchronize(device: torch.device) -> None:
    if device.type not in ("cpu", "meta"):
        torch.get_device_module(device.type).synchronize(device)


def allocate_bytes(nbytes: int, device: torch.device, group: Any = None) -> torch.Tensor:
    """A flat uint8 block, from the group's backend where it hands out memory it registers once."""
    try:
        backend = group._get_backend(device)
    except (AttributeError, RuntimeError, ValueError):  # no group, or no backend for this device type
        backend = None
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is not None and supports(device):
        return backend.allocate_tensor(nbytes, dtype=torch.uint8, device=device)
    with torch.inference_mode(False):  # a normal tensor even when the first caller is in inference mode
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


class GrowOnlyBlock:
    """One byte block that only grows: the same requests find it at the same address from the second on."""

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.allocs = 0

    nbytes = property(lambda self: 0 if self.block is None else self.block.numel())
    data_ptr = property(lambda self: 0 if self.block is None else self.block.data_ptr())
    device = property(lambda self: None if self.block is None else self.block.device)

    def ensure(self, nbytes: int, device: torch.device | str, group: Any = None) -> bool:
        """Hold at least ``nbytes`` on ``device``; returns whether that took a new allocation.

        Raises what the allocator raises; the block is then empty.
        """
        device = resolve_device(device)
        if self.device == device and self.nbytes >= nbytes:
            return False
        self.drop()
        self.block = allocate_bytes(nbytes, device, group)
        self.allocs += 1
        return True

    def drop(self) -> None:
        """Free the block once the device is done with it: old and new blocks never coexist."""
        if self.block is not None:
            synchronize(self.block.device)  # collectives and copies queued on it finish before the memory is reused
            self.block = None
