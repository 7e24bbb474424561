# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Device memory for collectives that stays at one address across requests.

On XPU, oneCCL registers every allocation a collective is handed and keeps it registered; a buffer that
is allocated once and reused is registered once. This module only decides when such memory is allocated
and by whom it is in use; the collectives that stage through it live in ``persistent_collectives``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

# Start offsets of carved regions: a multiple of every dtype's size, and of oneCCL's preferred alignment.
ALIGN = 512
# Workspaces per (process group, device): one for the synchronous collective in progress plus up to seven
# asynchronous ones in flight (a coordinator broadcasts a tensor dict with one async broadcast per tensor).
MAX_WORKSPACES = 8

# A carved region: the shape, strides and dtype of one tensor laid out densely (strides may be permuted).
Region = tuple[torch.Size, tuple[int, ...], torch.dtype]

# data_ptr of a persistent block -> weak reference to its storage.
_persistent: dict[int, weakref.ref] = {}
_persistent_lock = threading.Lock()


def resolve_device(device: torch.device | str) -> torch.device:
    """``xpu`` as ``xpu:<current>``, so that one card is never taken for two."""
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.device(device.type, torch.get_device_module(device.type).current_device())


def device_module(device: torch.device) -> Any:
    """The device's torch module (streams, events), or None where host order is device order."""
    return None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)


def synchronize(device: torch.device) -> None:
    if (module := device_module(device)) is not None:
        module.synchronize(device)


def allocate_bytes(nbytes: int, device: torch.device, group: Any) -> torch.Tensor:
    """A flat uint8 block, from the group's backend where it hands out memory it registers once.

    The block is recorded as persistent, so that ``persistent_collectives`` hands it to the backend as it is
    instead of staging it a second time.
    """
    try:
        backend = group._get_backend(device)
    except (AttributeError, RuntimeError, ValueError):  # no group, or no backend for this device type
        backend = None
    supports = getattr(backend, "supports_tensor_alloc", None)  # absent before torch 2.9
    if supports is not None and supports(device):
        block = backend.allocate_tensor(nbytes, dtype=torch.uint8, device=device)
    else:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _mark_persistent(block)
    return block


def _mark_persistent(block: torch.Tensor) -> None:
    storage = block.untyped_storage()  # one Python object per storage, alive while any view of it is
    ptr = storage.data_ptr()

    def forget(ref: weakref.ref) -> None:
        with _persistent_lock:
            if _persistent.get(ptr) is ref:
                del _persistent[ptr]

    with _persistent_lock:
        _persistent[ptr] = weakref.ref(storage, forget)


def is_persistent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a block from ``allocate_bytes`` that is still alive."""
    return _persistent.get(tensor.untyped_storage().data_ptr(), lambda: None)() is tensor.untyped_storage()


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill ``numel`` consecutive slots, in some order of dims: no gaps, no overlaps."""
    expected = 1
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1]
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def region_of(tensor: torch.Tensor) -> Region:
    """A region laid out exactly as ``tensor`` (which must be dense): the backend sees the same element order."""
    return tensor.shape, tensor.stride(), tensor.dtype


def contiguous_region(shape: torch.Size, dtype: torch.dtype) -> Region:
    strides, step = [], 1
    for size in reversed(shape):  # row-major, as torch lays out a new tensor (an empty dim steps by 1)
        strides.append(step)
        step *= max(size, 1)
    return shape, tuple(reversed(strides)), dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def regions_nbytes(regions: list[Region]) -> int:
    return sum(_aligned(shape.numel() * dtype.itemsize) for shape, _, dtype in regions)


class Workspace:
    """One grow-only block; in use by at most one collective at a time.

    ``ready`` is an event recorded on the stream that released it: the next user's stream waits on it, so a
    copy-out still queued on one stream is never overwritten by a copy-in queued on another.
    """

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.busy = False
        self.ready: Any = None

    nbytes = property(lambda self: 0 if self.block is None else self.block.numel())

    def carve(self, regions: list[Region]) -> list[torch.Tensor]:
        """Views with the regions' shapes, strides and dtypes, one after the other at aligned offsets."""
        views, offset = [], 0
        for shape, stride, dtype in regions:
            nbytes = shape.numel() * dtype.itemsize
            views.append(self.block[offset : offset + nbytes].view(dtype).as_strided(shape, stride))
            offset += _aligned(nbytes)
        return views


class WorkspacePool:
    """The workspaces of one process group on one device.

    ``acquire`` hands out the smallest free workspace that fits, else grows the largest free one, else adds
    one while there are fewer than ``limit``. With the same requests in the same order the choices repeat,
    so from the second request on nothing grows. Choices are local: a collective's buffers need not match
    across ranks. The pool holds its group weakly: it dies with the group.
    """

    def __init__(self, device: torch.device, group: Any, limit: int = MAX_WORKSPACES) -> None:
        self.device = device
        self._group = weakref.ref(group) if group is not None else lambda: None
        self.limit = limit
        self.workspaces: list[Workspace] = []
        self.allocations = 0
        self.peak_busy = 0
        self._lock = threading.RLock()  # a dropped work may release from a finalizer in the middle of an acquire

    @property
    def resident_bytes(self) -> int:
        return sum(w.nbytes for w in self.workspaces)

    def acquire(self, nbytes: int) -> Workspace | None:
        """A workspace of at least ``nbytes`` marked busy, ordered after its last user; None when all are busy.

        Raises what the allocator raises when growing fails; the workspace is then empty and free.
        """
        with self._lock:
            free = [w for w in self.workspaces if not w.busy]
            fitting = [w for w in free if w.nbytes >= nbytes]
            if fitting:
                chosen = min(fitting, key=lambda w: w.nbytes)
            elif free:
                chosen = max(free, key=lambda w: w.nbytes)
            elif len(self.workspaces) < self.limit:
                chosen = Workspace()
                self.workspaces.append(chosen)
            else:
                return None
            chosen.busy = True
            self.peak_busy = max(self.peak_busy, sum(w.busy for w in self.workspaces))
        if chosen.ready is not None:
            chosen.ready.wait()  # on this caller's current stream
            chosen.ready = None
        if chosen.nbytes < nbytes:
            try:
                self._grow(chosen, nbytes)
            except BaseException:
                self.release(chosen)
                raise
        return chosen

    def _grow(self, workspace: Workspace, nbytes: int) -> None:
        if workspace.block is not None:
            # Earlier collectives and copies on this block were queued on the device; they must finish
            # before the memory can go to another allocation. Old and new blocks never coexist.
            synchronize(self.device)
            workspace.block = None
        with torch.inference_mode(False):  # a normal tensor, even when the first caller is in inference mode
            workspace.block = allocate_bytes(_aligned(nbytes), self.device, self._group())
        self.allocations += 1

    def release(self, workspace: Workspace) -> None:
        if workspace.block is not None and (module := device_module(self.device)) is not None:
            workspace.ready = module.Event()
            workspace.ready.record()  # on the releasing caller's current stream
        with self._lock:
            workspace.busy = False
