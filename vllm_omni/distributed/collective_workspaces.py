# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Device memory for collectives that stays at one address across requests.

On XPU, oneCCL registers every allocation a collective is handed and keeps it registered; a block that is
allocated once and reused is registered once. This module only decides when such memory is allocated; the
collectives that use it live in ``persistent_collectives`` and the MiniMax-H3 ``vae_gather``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

ALIGN = 512  # oneCCL's preferred alignment, and a multiple of every dtype's size

_persistent: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()


def resolve_device(device: torch.device | str) -> torch.device:
    """``xpu`` as ``xpu:<current>``, so that one card is never taken for two."""
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.device(device.type, torch.get_device_module(device.type).current_device())


def synchronize(device: torch.device) -> None:
    if device.type not in ("cpu", "meta"):
        torch.get_device_module(device.type).synchronize(device)


def current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is queued on now; None where there are no streams."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device.type).current_stream(device)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def allocate_bytes(nbytes: int, device: torch.device, group: Any = None) -> torch.Tensor:
    """A flat uint8 block, from the group's backend where it hands out memory it registers once."""
    try:
        backend = group._get_backend(device)
    except (AttributeError, RuntimeError, ValueError):  # no group, or no backend for this device type
        backend = None
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is not None and supports(device):
        block = backend.allocate_tensor(nbytes, dtype=torch.uint8, device=device)
    else:
        with torch.inference_mode(False):  # a normal tensor even when the first caller is in inference mode
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _persistent[block.data_ptr()] = block.untyped_storage()  # one Python object per storage while it lives
    return block


def is_persistent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a block from ``allocate_bytes`` that is still alive (for diagnostics)."""
    storage = tensor.untyped_storage()
    return _persistent.get(storage.data_ptr()) is storage


class GrowOnlyBlock:
    """One byte block that only grows: the same requests find it at the same address from the second on.

    ``busy`` marks a collective still running on it; a caller that finds it busy uses its own tensors instead.
    """

    _MAX_VIEWS = 64  # views kept per block: a view costs more host time to build than most copies into it

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.device: torch.device | None = None
        self.allocs = 0
        self.busy = False
        self.stream: Any = None  # the stream of its last use, where the device has streams
        self._views: dict[tuple, torch.Tensor] = {}

    nbytes = property(lambda self: 0 if self.block is None else self.block.numel())
    data_ptr = property(lambda self: 0 if self.block is None else self.block.data_ptr())

    def ensure(self, nbytes: int, device: torch.device | str, group: Any = None) -> bool:
        """Hold at least ``nbytes`` on ``device``; returns whether that took a new allocation.

        Raises what the allocator raises; the block is then empty.
        """
        device = resolve_device(device)
        if self.block is not None and self.block.device == device and self.nbytes >= nbytes:
            return False
        self.drop()
        self.block, self.device = allocate_bytes(nbytes, device, group), device
        self.allocs += 1
        return True

    def view(self, shape, dtype: torch.dtype, offset: int = 0, strides: tuple[int, ...] | None = None) -> torch.Tensor:
        """A ``dtype`` view of ``shape`` at byte ``offset`` (a multiple of ``ALIGN``): row-major, or laid out
        densely with ``strides``. Never hand it to a caller: it aliases the block."""
        key = (shape, dtype, offset, strides)
        view = self._views.get(key)
        if view is None:
            numel = torch.Size(shape).numel()
            with torch.inference_mode(False):  # kept: written later in and out of inference mode alike
                flat = self.block[offset : offset + numel * dtype.itemsize].view(dtype)
                view = flat.view(shape) if strides is None else flat.as_strided(shape, strides)
            if len(self._views) >= self._MAX_VIEWS:
                self._views.clear()
            self._views[key] = view
        return view

    def use_on(self, device: torch.device) -> None:
        """Order a use on ``device``'s current stream after the last use, where that was on another stream: the last
        use's copies out are queued there, and this use writes the block."""
        stream = current_stream(device)
        if stream is not None:
            if self.stream is not None and stream != self.stream:
                stream.wait_stream(self.stream)
            self.stream = stream

    def drop(self) -> None:
        """Free the block once the device is done with it: old and new blocks never coexist."""
        if self.block is not None:
            synchronize(self.block.device)  # collectives and copies queued on it finish before the memory is reused
            self.block = self.device = self.stream = None
            self._views.clear()
