# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Tile gather for the MiniMax-H3 video VAE that reuses one workspace across requests.

The checkpoint's ``_all_gather_tiled_results`` hands the collective new send and receive buffers on
every call. oneCCL registers the allocations it is handed, and after ``empty_cache()`` each request's
buffers are new ones, so XPU memory outside PyTorch grows with every request. Here each rank copies its
tiles into its slot of a reused workspace and all-gathers in place, as PyTorch FSDP2 does: the
collective sees the same allocations, request after request.
"""

from __future__ import annotations

import math
import os
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from vllm.logger import init_logger

from vllm_omni.distributed.collective_workspaces import GrowOnlyBlock, resolve_device

logger = init_logger(__name__)

REUSE_ENV = "VLLM_OMNI_H3_VAE_GATHER_REUSE"
_GATHER_ATTR = "_all_gather_tiled_results"
_ALIGN = 128  # slots start aligned for any dtype view
_MAX_DIMS = 8
MAX_RANKS = 256  # the header buffer, allocated at install, has a row for each of up to this many ranks
# Header codes are positions in these tables, so they do not move when torch adds a dtype or a device.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "meta")
_OK, _MIXED, _UNSUPPORTED, _NO_MEMORY, _LOCAL_ERROR = range(5)
_PROBLEMS = {
    _MIXED: "tiles that are not tensors of one shape, dtype and device",
    _UNSUPPORTED: f"tiles of a dtype other than {[str(d) for d in _DTYPES]}, of more than {_MAX_DIMS} dims "
    f"or on a device type other than {list(_DEVICE_TYPES)}",
}


def reuse_mode() -> str:
    """``VLLM_OMNI_H3_VAE_GATHER_REUSE``: ``auto`` (default, XPU only), ``1`` (any device) or ``0``."""
    value = (raw := os.environ.get(REUSE_ENV, "auto")).strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{REUSE_ENV}={raw!r} is not valid; expected one of 'auto', '1' or '0'")
    return value


def slot_bytes(sp_size: int, num_tiles: int, tile_shape: Sequence[int], dtype: torch.dtype) -> int:
    """One rank's slot: room for the largest round-robin share, aligned, never empty."""
    nbytes = math.ceil(num_tiles / sp_size) * math.prod(tile_shape) * dtype.itemsize
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def workspace_bytes(sp_size: int, num_tiles: int, tile_shape: Sequence[int], dtype: torch.dtype) -> int:
    return sp_size * slot_bytes(sp_size, num_tiles, tile_shape, dtype)


def all_gather_in_place(output: torch.Tensor, rank: int, group: Any) -> None:
    """All-gather whose input is this rank's slot of ``output``: send and receive share one allocation."""
    if group is None or group.size() == 1:
        return
    slot = output.numel() // group.size()
    dist.all_gather_single(output, output.narrow(0, rank * slot, slot), group=group)


@dataclass(frozen=True)
class _Header:
    """What a rank tells its peers before any tile moves, so that every rank decides alike."""

    num_tiles: int  # -1: the caller's value is not an int
    count: int
    problem: int = _OK
    dtype: int = -1  # position in _DTYPES
    device: int = -1  # position in _DEVICE_TYPES
    shape: tuple[int, ...] = ()
    WORDS = 6 + _MAX_DIMS

    def encode(self) -> list[int]:
        words = [self.num_tiles, self.count, self.problem, self.dtype, self.device, len(self.shape), *self.shape]
        return words + [0] * (self.WORDS - len(words))

    @classmethod
    def decode(cls, words: list[int]) -> _Header:
        return cls(*words[:5], shape=tuple(words[6 : 6 + words[5]]))


def _describe(tasks: Sequence[Any], num_tiles: Any) -> _Header:
    header = _Header(num_tiles if isinstance(num_tiles, int) and not isinstance(num_tiles, bool) else -1, len(tasks))
    if not tasks:
        return header
    first = tasks[0]
    kind = (first.shape, first.dtype, first.device) if isinstance(first, torch.Tensor) else None
    if kind is None or any(not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != kind for t in tasks):
        return replace(header, problem=_MIXED)
    if first.dtype not in _DTYPES or first.dim() > _MAX_DIMS or first.device.type not in _DEVICE_TYPES:
        return replace(header, problem=_UNSUPPORTED)
    return replace(
        header,
        dtype=_DTYPES.index(first.dtype),
        device=_DEVICE_TYPES.index(first.device.type),
        shape=tuple(first.shape),
    )


def _agree(headers: list[_Header]) -> None:
    """Every rank runs this on the same headers, so every rank raises the same error, or none does."""
    sp_size = len(headers)
    prefix = f"MiniMax-H3 tile gather over sp_size={sp_size}:"

    def ranks_with(problem: int) -> list[int]:
        return [r for r, h in enumerate(headers) if h.problem == problem]

    if failed := ranks_with(_LOCAL_ERROR):
        raise RuntimeError(f"{prefix} rank(s) {failed} failed before the exchange; the cause is in their traceback")
    num_tiles = {h.num_tiles for h in headers}
    if len(num_tiles) > 1 or min(num_tiles) < sp_size:
        raise ValueError(
            f"{prefix} num_tiles per rank {[h.num_tiles for h in headers]} (-1: not an int); expected one int "
            ">= sp_size on every rank, so that every rank owns a tile"
        )
    n = num_tiles.pop()
    for problem, what in _PROBLEMS.items():
        if ranks := ranks_with(problem):
            raise ValueError(f"{prefix} rank(s) {ranks} hold {what}")
    if wrong := [f"rank {r} holds {h.count}" for r, h in enumerate(headers) if h.count != len(range(r, n, sp_size))]:
        raise ValueError(
            f"{prefix} {'; '.join(wrong)} tile(s); round-robin ownership of {n} tiles gives rank r "
            f"len(range(r, {n}, {sp_size})) tiles"
        )
    if len({h.device for h in headers}) > 1:
        raise ValueError(
            f"{prefix} ranks hold tiles on different device types {[_DEVICE_TYPES[h.device] for h in headers]}; "
            "expected every rank's tiles on its own device of one type"
        )
    if len({(h.dtype, h.shape) for h in headers}) > 1:
        raise ValueError(
            f"{prefix} ranks hold tiles of different dtypes or shapes "
            f"{[f'{_DTYPES[h.dtype]}{list(h.shape)}' for h in headers]}; the checkpoint's decoder makes tiles of "
            f"one shape. Set {REUSE_ENV}=0 to use the checkpoint's variable-shape gather"
        )
    if short := ranks_with(_NO_MEMORY):
        raise torch.OutOfMemoryError(
            f"{prefix} rank(s) {short} could not allocate the "
            f"{workspace_bytes(sp_size, n, headers[0].shape, _DTYPES[headers[0].dtype])} bytes of the tile-gather "
            f"workspace. Free device memory, or set {REUSE_ENV}=0 to use the checkpoint's gather"
        )


def _check_parallel(state: Any, group: Any, size: int, rank: int) -> None:
    """The checkpoint's parallel state must name the group the gather runs over, and this rank of it."""
    named = (state.get("sp_size"), state.get("sp_rank")) if isinstance(state, Mapping) else None
    valid = named is not None and all(type(v) is int for v in named) and state.get("sp_process_group") is group
    if not valid or named != (size, rank):
        raise RuntimeError(
            f"MiniMax-H3 tile gather: parallel state {state!r}; expected sp_size={size} and sp_rank={rank}, those of "
            "its sp_process_group (none: sp_size=1, sp_rank=0), as MiniMaxH3VideoVAE.set_parallel_size fills it "
            "once torch.distributed is initialised"
        )


def _weak(fn: Callable[[], Mapping]) -> Callable[[], Mapping | None]:
    """A bound method held weakly (the adapter owns the gather, not the reverse); other callables as they are."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        method = weakref.WeakMethod(fn)
        return lambda: None if (bound := method()) is None else bound()
    return fn


class TileGatherReuse:
    """Replacement for the checkpoint's ``_all_gather_tiled_results``, bound on one checkpoint instance.

    Returns what the checkpoint's gather returns, ``num_tiles`` tiles in global order (rank r's k-th
    tile is tile ``k * sp_size + r``), copied out of the workspace. Two collectives per gather, the
    headers then the tiles; no state kept between calls needs to match across ranks.
    """

    def __init__(self, parallel_state: Callable[[], Mapping], device: torch.device) -> None:
        self._parallel_state = _weak(parallel_state)
        self.device = resolve_device(device)
        self.workspace, headers = GrowOnlyBlock(), GrowOnlyBlock()
        # Allocated now: no rank may need memory before the exchange that tells its peers it failed.
        headers.ensure(MAX_RANKS * _Header.WORDS * 8, self.device)
        self._headers = headers.block.view(torch.int64)
        self._hits = 0
        self._geometries: Counter[str] = Counter()
        self._group: Any = None  # the last gather's group

    @torch.no_grad()  # a tile that requires grad must not fail one rank alone
    def __call__(self, tasks: list[torch.Tensor], num_tiles: int) -> list[torch.Tensor]:
        # The exchange runs over the state's group as it is, so that a rank whose state is wrong still tells its
        # peers; where the state names no group (or cannot be read), over the group of this rank's last gather.
        # Only a rank with neither, on its first gather, has no way to tell them.
        state, group, error = None, None, None
        try:
            state = self._parallel_state()
            group = state.get("sp_process_group") if isinstance(state, Mapping) else None
        except Exception as exc:
            error = exc
        group = group if group is not None else self._group
        size, rank = (group.size(), group.rank()) if group is not None else (1, 0)
        if size > MAX_RANKS:  # the same on every rank of the group
            raise ValueError(f"MiniMax-H3 tile gather over {size} ranks; at most {MAX_RANKS} are supported")
        mine, grew = _Header(-1, -1, _LOCAL_ERROR), False
        try:
            if error is not None:
                raise error
            _check_parallel(state, group, size, rank)
            mine = _describe(tasks, num_tiles)
            if mine.dtype >= 0 and mine.num_tiles >= size and mine.count == len(range(rank, num_tiles, size)):
                grew = self._copy_in(tasks, mine, size, rank, group)
        except Exception as exc:  # any local failure is told to the peers below, never left for them to wait on
            error = exc
            mine = replace(mine, problem=_NO_MEMORY if isinstance(exc, torch.OutOfMemoryError) else _LOCAL_ERROR)

        headers = self._headers[: size * _Header.WORDS].view(size, -1)
        headers[rank].copy_(torch.tensor(mine.encode(), dtype=torch.int64))
        all_gather_in_place(headers.view(-1), rank, group)
        try:
            _agree([_Header.decode(row) for row in headers.tolist()])  # the one host sync; raises on every rank
        except Exception as agreed:
            raise agreed from error

        # Past _agree every rank, this one included, has filled its slot.
        self._group = group
        dtype, shape = _DTYPES[mine.dtype], mine.shape
        slots = self._slots(size, num_tiles, shape, dtype)
        all_gather_in_place(slots.view(-1), rank, group)
        rows = math.ceil(num_tiles / size)
        shares = slots.view(dtype)[:, : rows * math.prod(shape)].view(size, rows, *shape).clone()
        self._hits += not grew
        geometry = f"sp{size}/{num_tiles}x{shape}/{dtype}"
        self._geometries[geometry] += 1
        logger.debug(
            "[H3_VAE_GATHER] reuse=%s geometry=%s workspace_bytes=%d workspace_ptr=0x%x hits=%d allocs=%d",
            "alloc" if grew else "hit",
            geometry,
            self.workspace.nbytes,
            self.workspace.data_ptr,
            self._hits,
            self.workspace.allocs,
        )
        return [shares[g % size, g // size] for g in range(num_tiles)]

    def _slots(self, size: int, num_tiles: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        slot = slot_bytes(size, num_tiles, shape, dtype)
        return self.workspace.block[: size * slot].view(size, slot)

    def _copy_in(self, tasks: list[torch.Tensor], mine: _Header, size: int, rank: int, group: Any) -> bool:
        """This rank's tiles into its own slot, the collective's input; returns whether the workspace grew."""
        dtype, shape = _DTYPES[mine.dtype], mine.shape
        grew = self.workspace.ensure(workspace_bytes(size, mine.num_tiles, shape, dtype), tasks[0].device, group)
        share = self._slots(size, mine.num_tiles, shape, dtype)[rank].view(dtype)[: mine.count * math.prod(shape)]
        torch.stack(tasks, out=share.view(mine.count, *shape))
        return grew

    def stats(self) -> dict[str, Any]:
        return {
            "hits": self._hits,
            "allocs": self.workspace.allocs,
            "workspace_bytes": self.workspace.nbytes,
            "workspace_ptr": self.workspace.data_ptr,
            "geometries": dict(self._geometries),
        }

    def release(self) -> None:
        """Drop the workspace, at shutdown; the next gather allocates a new one."""
        self.workspace.drop()


def get_tile_gather(adapter: Any) -> TileGatherReuse | None:
    """The gather installed on ``adapter``'s checkpoint, if any (for its stats)."""
    gather = getattr(getattr(adapter, "model", None), "__dict__", {}).get(_GATHER_ATTR)
    return gather if isinstance(gather, TileGatherReuse) else None


def install_tile_gather_reuse(adapter: Any, *, enabled: bool | None = None) -> bool:
    """Bind the reusing gather on ``adapter.model``; returns whether it is installed.

    ``enabled=None`` follows ``VLLM_OMNI_H3_VAE_GATHER_REUSE``; there a checkpoint without the gather is
    logged and left alone, while ``enabled=True`` raises for it. Bound on the instance, not the class: the
    class is remote code shared by every component loaded from the checkpoint. Idempotent.
    """
    if get_tile_gather(adapter) is not None:
        return True
    device = torch.device(getattr(adapter, "_device_target", "cpu"))
    mode = "forced" if enabled is not None else reuse_mode()
    if enabled is None:
        enabled = mode == "1" or (mode == "auto" and device.type == "xpu")
    if not enabled:
        return False
    checkpoint, state = getattr(adapter, "model", None), getattr(adapter, "_native_parallel_state", None)
    if not callable(getattr(type(checkpoint), _GATHER_ATTR, None)) or not callable(state):
        problem = (
            f"{type(adapter).__name__} (.model: {type(checkpoint).__name__}); expected a MiniMaxH3VideoVAE with "
            f"_native_parallel_state() whose .model, the checkpoint's AutoencoderKL, has {_GATHER_ATTR}"
        )
        if mode == "forced":
            raise TypeError(f"install_tile_gather_reuse: {problem}")
        logger.warning("[H3_VAE_GATHER] tile gather reuse not installed, the checkpoint's gather stays: %s", problem)
        return False
    previous = vars(checkpoint).get(_GATHER_ATTR)
    setattr(checkpoint, _GATHER_ATTR, TileGatherReuse(state, device))
    logger.info(
        "[H3_VAE_GATHER] tile gather reuse installed on %s device=%s mode=%s%s",
        type(checkpoint).__name__,
        device.type,
        mode,
        f" (replaced instance override {getattr(previous, '__qualname__', previous)!s})" if previous else "",
    )
    return True


def remove_tile_gather_reuse(adapter: Any) -> bool:
    """Restore the checkpoint's own method and drop the workspace; returns whether one was installed."""
    gather = get_tile_gather(adapter)
    if gather is not None:
        gather.release()
        delattr(adapter.model, _GATHER_ATTR)
    return gather is not None
