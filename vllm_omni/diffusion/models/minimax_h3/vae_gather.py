# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Address-stable tile gather for the MiniMax-H3 video VAE.

The checkpoint's ``_all_gather_tiled_results`` hands the collective new send and receive
allocations on every call. oneCCL registers every allocation it sees and does not give the
registration back, so on XPU device memory outside PyTorch grows each request. The replacement
bound here gathers through one grow-only workspace instead: the local share is copied into this
rank's slot and gathered in place, so the collective sees the same allocation on both sides for
the life of the adapter.
"""

from __future__ import annotations

import importlib
import math
import os
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.logger import init_logger

logger = init_logger(__name__)

REUSE_ENV = "VLLM_OMNI_H3_VAE_GATHER_REUSE"
_REUSE_MODES = ("auto", "1", "0")
_GATHER_ATTR = "_all_gather_tiled_results"

# Every rank's slot starts with a fixed-size header, so a fact that only one rank knows (its share
# length, tile shape, a failed allocation) becomes known to all of them and they all take the same path.
_HEADER_WORDS = 16
_HEADER_BYTES = _HEADER_WORDS * 8
_MAGIC = 0x48335447
_FIXED_WORDS = 8  # magic, status, count, dtype, ndim, num_tiles, payload bytes, payload included
_MAX_TILE_DIMS = _HEADER_WORDS - _FIXED_WORDS
_ALIGN = 128  # slots start aligned for any dtype view
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

_OK, _MIXED_SHARE, _ALLOC_FAILED, _UNSUPPORTED = range(4)


def reuse_mode() -> str:
    """``VLLM_OMNI_H3_VAE_GATHER_REUSE``: ``auto`` (default, XPU only), ``1`` (any device) or ``0``."""
    raw = os.environ.get(REUSE_ENV)
    if raw is None:
        return "auto"
    value = raw.strip().lower()
    if value not in _REUSE_MODES:
        raise ValueError(f"{REUSE_ENV}={raw!r} is not valid; expected one of 'auto', '1' or '0'")
    return value


def round_robin_count(num_tiles: int, sp_size: int, sp_rank: int) -> int:
    """Tiles rank ``sp_rank`` owns: the checkpoint hands it ``range(sp_rank, num_tiles, sp_size)``."""
    return len(range(sp_rank, num_tiles, sp_size))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def payload_bytes(sp_size: int, num_tiles: int, tile_shape: Sequence[int], dtype: torch.dtype) -> int:
    """One rank's slot payload: the largest share, padded to alignment."""
    return _aligned(math.ceil(num_tiles / sp_size) * math.prod(tile_shape) * dtype.itemsize)


def workspace_bytes(sp_size: int, num_tiles: int, tile_shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a gather of this geometry needs: one header and one payload per rank."""
    return sp_size * (_HEADER_BYTES + payload_bytes(sp_size, num_tiles, tile_shape, dtype))


def allocate_bytes(nbytes: int, device: torch.device, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A flat uint8 block, from the group's backend where it hands out memory it registers once."""
    backend = None
    if group is not None and hasattr(group, "_get_backend"):
        try:
            backend = group._get_backend(device)
        except (RuntimeError, ValueError):  # no backend for this device type in the group
            backend = None
    supports = getattr(backend, "supports_tensor_alloc", None)  # absent from older torch
    if supports is not None and supports(device):
        return backend.allocate_tensor(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def all_gather_flat(output: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Equal-size all-gather of flat tensors: ``all_gather_single`` where torch has it (gloo wants flat output)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, inp, group=group)


def all_gather_in_place(output: torch.Tensor, rank: int, group: Any) -> None:
    """One all-gather whose input is this rank's slot of ``output``, as PyTorch FSDP2 does.

    Send and receive then lie in one allocation, so a stable ``output`` keeps both sides stable.
    """
    slot = output.numel() // group.size()
    all_gather_flat(output, output.narrow(0, rank * slot, slot), group)


class TileGatherWorkspace:
    """One grow-only byte block; gathers are carved from its front.

    Kept apart from the collective: it only decides when memory is allocated. It grows only when a
    larger geometry arrives and drops the old block first, so one block for the largest geometry
    seen is ever resident.
    """

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None
        self.allocs = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._block is None else self._block.numel()

    @property
    def data_ptr(self) -> int:
        return 0 if self._block is None else self._block.data_ptr()

    @property
    def device(self) -> torch.device | None:
        return None if self._block is None else self._block.device

    def ensure(self, nbytes: int, device: torch.device, group: Any) -> tuple[torch.Tensor, bool]:
        """The first ``nbytes`` of the block on ``device``, and whether it had to be allocated."""
        block = self._block
        if block is not None and block.device == device and block.numel() >= nbytes:
            return block[:nbytes], False
        if block is not None and block.device != device:
            logger.warning(
                "[H3_VAE_GATHER] tiles moved from %s to %s; reallocating the gather workspace", block.device, device
            )
        self._block = block = None
        self._block = allocate_bytes(nbytes, device, group)
        self.allocs += 1
        return self._block[:nbytes], True

    def release(self) -> None:
        self._block = None


@dataclass(frozen=True)
class _Parallel:
    size: int
    rank: int
    group: Any


@dataclass(frozen=True)
class _Share:
    status: int
    count: int
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    device: torch.device | None = None

    def payload_bytes(self, sp_size: int, num_tiles: int) -> int:
        return payload_bytes(sp_size, num_tiles, self.shape, self.dtype) if self.status == _OK and self.count else 0

    def header(self, num_tiles: int, payload: int, included: bool) -> list[int]:
        words = [_MAGIC, self.status, self.count, _DTYPE_CODE.get(self.dtype, -1), len(self.shape), num_tiles]
        words += [payload, int(included), *self.shape[:_MAX_TILE_DIMS]]
        return words + [0] * (_HEADER_WORDS - len(words))


def _describe_share(tasks: Sequence[Any]) -> _Share:
    if not all(isinstance(t, torch.Tensor) for t in tasks):
        return _Share(_MIXED_SHARE, len(tasks))
    if not tasks:
        return _Share(_OK, 0)
    first = tasks[0]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tasks):
        return _Share(_MIXED_SHARE, len(tasks))
    status = _OK if first.dim() <= _MAX_TILE_DIMS else _UNSUPPORTED
    return _Share(status, len(tasks), tuple(first.shape), first.dtype, first.device)


@dataclass(frozen=True)
class _Plan:
    fallback_reason: str | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    payload: int = 0  # bytes of one rank's slot payload
    delivered: bool = False  # every rank's payload already came with its header


def _plan(headers: list[list[int]], num_tiles: int) -> _Plan:
    """Decide from every rank's header; each rank computes the same answer, so all act alike."""
    sp_size = len(headers)
    if any(h[0] != _MAGIC for h in headers):
        raise RuntimeError("MiniMax-H3 tile gather: a peer is not running the same gather (bad header)")
    if len({h[5] for h in headers}) > 1:
        raise ValueError(f"MiniMax-H3 tile gather: ranks disagree on num_tiles {[h[5] for h in headers]}")
    wrong = [
        f"rank {r} holds {h[2]} tile(s), expected {round_robin_count(num_tiles, sp_size, r)}"
        for r, h in enumerate(headers)
        if h[2] != round_robin_count(num_tiles, sp_size, r)
    ]
    if wrong:
        raise ValueError(
            f"MiniMax-H3 tile gather: local shares do not match round-robin ownership of {num_tiles} tiles "
            f"over {sp_size} ranks: " + "; ".join(wrong)
        )
    mixed = [r for r, h in enumerate(headers) if h[1] == _MIXED_SHARE]
    if mixed:
        raise ValueError(
            f"MiniMax-H3 tile gather: rank(s) {mixed} hold tiles that are not tensors of one shape, dtype and "
            "device; the equal-shape gather and the checkpoint's gather both need one per share"
        )
    failed = [r for r, h in enumerate(headers) if h[1] == _ALLOC_FAILED]
    if failed:
        return _Plan(f"workspace allocation failed on rank(s) {failed}")
    if any(h[1] == _UNSUPPORTED for h in headers):
        return _Plan(f"tiles have more than {_MAX_TILE_DIMS} dimensions")
    dtypes = {h[3] for h in headers}
    if len(dtypes) > 1:
        names = [str(_DTYPES[h[3]]) for h in headers]
        raise ValueError(f"MiniMax-H3 tile gather: ranks hold tiles of different dtypes {names}; expected one dtype")
    shapes = {tuple(h[_FIXED_WORDS : _FIXED_WORDS + h[4]]) for h in headers}
    if len(shapes) > 1:
        return _Plan(f"ranks hold tiles of different shapes {sorted(shapes)}")
    return _Plan(None, shapes.pop(), _DTYPES[dtypes.pop()], headers[0][6], all(h[7] for h in headers))


class StableTileGather:
    """Replacement for the checkpoint's ``_all_gather_tiled_results``, bound on one checkpoint instance.

    Returns what the checkpoint's gather returns: ``num_tiles`` tensors in global tile order, none
    aliasing the workspace. Errors are symmetric: ``num_tiles < sp_size`` raises on every rank before
    any collective; a share whose length is not its round-robin count, a share mixing shapes, dtypes or
    devices, ranks holding different dtypes or disagreeing on ``num_tiles`` raise the same ``ValueError``
    on every rank once the headers are exchanged. Ranks holding different tile shapes, tiles of more than
    8 dimensions, or a workspace allocation that failed on any rank send every rank to the checkpoint's
    own gather, with one warning per reason. Only a rank that cannot allocate even the slots agreed by the
    previous gather raises alone; its peers then wait for the process group's timeout.
    """

    def __init__(
        self,
        checkpoint_gather: Callable[[list[torch.Tensor], int], list[torch.Tensor]],
        parallel_state: Callable[[], Mapping[str, Any]],
        default_device: torch.device,
    ) -> None:
        self.checkpoint_gather = checkpoint_gather
        self._parallel_state = parallel_state
        self._default_device = default_device
        self.workspace = TileGatherWorkspace()
        self._agreed_payload = 0
        self._hits = 0
        self._fallbacks = 0
        self._geometries: Counter[str] = Counter()
        self._warned: set[str] = set()

    @torch.no_grad()  # a tile that requires grad must not make one rank fail alone before the collective
    def __call__(self, tasks: list[torch.Tensor], num_tiles: int) -> list[torch.Tensor]:
        par = self._read_parallel()
        if isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < par.size:
            raise ValueError(
                f"MiniMax-H3 tile gather: num_tiles={num_tiles!r} over sp_size={par.size} ranks; expected an int "
                f">= sp_size so that every rank owns at least one tile"
            )
        if par.size == 1:
            return self._gather_single_rank(tasks, num_tiles)

        share = _describe_share(tasks)
        device = share.device or self.workspace.device or torch.device(self._default_device)
        payload = share.payload_bytes(par.size, num_tiles)
        # The first exchange has slots of the size the last gather agreed on, the same on every rank; a
        # share that fits rides along with its header, so a repeated geometry takes one collective.
        offered = self._agreed_payload
        slot = _HEADER_BYTES + offered
        try:
            block, grew = self.workspace.ensure(par.size * (_HEADER_BYTES + max(offered, payload)), device, par.group)
        except torch.OutOfMemoryError:
            share, payload = _Share(_ALLOC_FAILED, share.count), 0
            block, grew = self.workspace.ensure(par.size * slot, device, par.group)

        included = share.status == _OK and payload <= offered
        slots = block[: par.size * slot].view(par.size, slot)
        header = torch.tensor(share.header(num_tiles, payload, included), dtype=torch.int64)
        slots[par.rank, :_HEADER_BYTES].view(torch.int64).copy_(header)
        if included:
            self._copy_in(tasks, slots[par.rank, _HEADER_BYTES:], share)
        all_gather_in_place(slots.view(-1), par.rank, par.group)
        plan = _plan(slots[:, :_HEADER_BYTES].contiguous().view(torch.int64).tolist(), num_tiles)

        if plan.fallback_reason is not None:
            self._fallbacks += 1
            self._warn_once(plan.fallback_reason)
            return self.checkpoint_gather(tasks, num_tiles)
        collectives = 1
        if plan.delivered:
            payloads = slots[:, _HEADER_BYTES : _HEADER_BYTES + plan.payload]
        else:
            payloads = block[: par.size * plan.payload].view(par.size, plan.payload)
            self._copy_in(tasks, payloads[par.rank], share)
            if plan.payload:
                all_gather_in_place(payloads.view(-1), par.rank, par.group)
            collectives = 2
        self._agreed_payload = plan.payload
        self._record(grew, par, num_tiles, plan, block.numel(), collectives)
        return self._copy_out(payloads, num_tiles, par.size, plan)

    @staticmethod
    def _copy_in(tasks: list[torch.Tensor], slot: torch.Tensor, share: _Share) -> None:
        """Stack this rank's share into its own slot: the collective's input is part of its output."""
        if share.status != _OK or not share.count:
            return
        nbytes = share.count * math.prod(share.shape) * share.dtype.itemsize
        if nbytes:
            torch.stack(tasks, out=slot[:nbytes].view(share.dtype).view(share.count, *share.shape))

    @staticmethod
    def _copy_out(payloads: torch.Tensor, num_tiles: int, sp_size: int, plan: _Plan) -> list[torch.Tensor]:
        """The one copy out of the workspace: every tile, in global order ``k * sp_size + rank``."""
        max_tasks = math.ceil(num_tiles / sp_size)
        tile_bytes = math.prod(plan.shape) * plan.dtype.itemsize
        shares = payloads[:, : max_tasks * tile_bytes].view(plan.dtype).unflatten(1, (max_tasks, *plan.shape))
        out = torch.empty((num_tiles, *plan.shape), dtype=plan.dtype, device=payloads.device)
        full_rows, rest = divmod(num_tiles, sp_size)
        if full_rows:
            out[: full_rows * sp_size].view(full_rows, sp_size, *plan.shape).copy_(
                shares[:, :full_rows].transpose(0, 1)
            )
        if rest:
            out[full_rows * sp_size :].copy_(shares[:rest, full_rows])
        return list(out.unbind(0))

    def _gather_single_rank(self, tasks: list[torch.Tensor], num_tiles: int) -> list[torch.Tensor]:
        share = _describe_share(tasks)
        if share.count != num_tiles or share.status == _MIXED_SHARE:
            raise ValueError(
                f"MiniMax-H3 tile gather: sp_size=1 expects all {num_tiles} tiles as tensors of one shape, dtype and "
                f"device, got {len(tasks)} ({'mixed' if share.status == _MIXED_SHARE else 'uniform'})"
            )
        return [tile.clone() for tile in tasks]

    def _read_parallel(self) -> _Parallel:
        state = self._parallel_state()
        if not isinstance(state, Mapping) or any(k not in state for k in ("sp_size", "sp_rank", "sp_process_group")):
            raise RuntimeError(
                f"MiniMax-H3 tile gather: the checkpoint's parallel state {state!r} lacks sp_size, sp_rank or "
                "sp_process_group; expected the dict filled by MiniMaxH3VideoVAE.set_parallel_size"
            )
        size, rank, group = state["sp_size"], state["sp_rank"], state["sp_process_group"]
        if not isinstance(size, int) or not isinstance(rank, int) or size < 1 or not 0 <= rank < size:
            raise RuntimeError(
                f"MiniMax-H3 tile gather: parallel state sp_size={size!r}, sp_rank={rank!r}; expected ints with "
                "0 <= sp_rank < sp_size"
            )
        if size > 1:
            if group is None:
                raise RuntimeError(
                    f"MiniMax-H3 tile gather: sp_size={size} but sp_process_group is None; initialise "
                    "torch.distributed and call set_parallel_size before a parallel decode"
                )
            if group.size() != size:
                raise RuntimeError(
                    f"MiniMax-H3 tile gather: sp_process_group has {group.size()} ranks but sp_size={size}"
                )
        return _Parallel(size, rank, group)

    def _record(self, grew: bool, par: _Parallel, num_tiles: int, plan: _Plan, need: int, collectives: int) -> None:
        self._hits += 0 if grew else 1
        self._geometries[f"sp{par.size}/{num_tiles}x{tuple(plan.shape)}/{plan.dtype}"] += 1
        logger.debug(
            "[H3_VAE_GATHER] reuse=%s shape=%s dtype=%s need_bytes=%d workspace_bytes=%d workspace_ptr=0x%x "
            "collectives=%d hits=%d allocs=%d",
            "alloc" if grew else "hit",
            (par.size, math.ceil(num_tiles / par.size), *plan.shape),
            plan.dtype,
            need,
            self.workspace.nbytes,
            self.workspace.data_ptr,
            collectives,
            self._hits,
            self.workspace.allocs,
        )

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("[H3_VAE_GATHER] falling back to the checkpoint's gather on every rank: %s", reason)

    def stats(self) -> dict[str, Any]:
        return {
            "hits": self._hits,
            "allocs": self.workspace.allocs,
            "fallbacks": self._fallbacks,
            "workspace_bytes": self.workspace.nbytes,
            "workspace_ptr": self.workspace.data_ptr,
            "geometries": dict(self._geometries),
        }

    def reserve(
        self,
        tile_shape: Sequence[int],
        dtype: torch.dtype,
        num_tiles: int,
        *,
        sp_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> int:
        """Size the workspace for a geometry before the first request; returns its bytes."""
        state = self._parallel_state()
        size = sp_size if sp_size is not None else int(state.get("sp_size", 1))
        group = state.get("sp_process_group")
        nbytes = workspace_bytes(size, num_tiles, tile_shape, dtype)
        self.workspace.ensure(nbytes, torch.device(device or self._default_device), group)
        return self.workspace.nbytes

    def release(self) -> None:
        """Drop the workspace, at shutdown; the next gather allocates a new one."""
        self.workspace.release()


def _checkpoint_of(adapter: Any) -> torch.nn.Module:
    checkpoint = getattr(adapter, "model", None)
    if checkpoint is None:
        raise TypeError(
            f"install_tile_gather_reuse expects a MiniMaxH3VideoVAE adapter with .model (the checkpoint's "
            f"AutoencoderKL), got {type(adapter).__name__} without .model"
        )
    if not callable(getattr(type(checkpoint), _GATHER_ATTR, None)):
        raise TypeError(
            f"install_tile_gather_reuse: {type(checkpoint).__name__} has no method {_GATHER_ATTR}; expected the "
            "MiniMax-H3 checkpoint's AutoencoderKL"
        )
    return checkpoint


def _parallel_state_reader(adapter: Any, checkpoint: torch.nn.Module) -> Callable[[], Mapping[str, Any]]:
    reader = getattr(adapter, "_native_parallel_state", None)
    if callable(reader):
        return reader
    package = type(checkpoint).__module__.rpartition(".")[0]
    return importlib.import_module(f"{package}.parallel").get_parallel_state


def get_tile_gather(adapter: Any) -> StableTileGather | None:
    """The override installed on ``adapter``'s checkpoint, if any (for stats, reserve and release)."""
    checkpoint = getattr(adapter, "model", None)
    gather = vars(checkpoint).get(_GATHER_ATTR) if checkpoint is not None else None
    return gather if isinstance(gather, StableTileGather) else None


def install_tile_gather_reuse(adapter: Any, *, enabled: bool | None = None) -> bool:
    """Bind the address-stable gather on ``adapter.model``; returns whether it is installed.

    ``enabled=None`` follows ``VLLM_OMNI_H3_VAE_GATHER_REUSE``. Binding on the instance, not the
    class, because the class is remote code shared by every component loaded from the checkpoint.
    Idempotent; ``enabled=False`` installs nothing and leaves an existing override in place.
    """
    checkpoint = _checkpoint_of(adapter)
    existing = get_tile_gather(adapter)
    if existing is not None:
        return True
    device = torch.device(getattr(adapter, "_device_target", "cpu"))
    if enabled is None:
        mode = reuse_mode()
        enabled = mode == "1" or (mode == "auto" and device.type == "xpu")
    else:
        mode = "forced"
    if not enabled:
        return False

    previous = vars(checkpoint).get(_GATHER_ATTR)
    gather = StableTileGather(
        types.MethodType(getattr(type(checkpoint), _GATHER_ATTR), checkpoint),
        _parallel_state_reader(adapter, checkpoint),
        device,
    )
    setattr(checkpoint, _GATHER_ATTR, gather)
    logger.info(
        "[H3_VAE_GATHER] address-stable tile gather installed on %s device=%s mode=%s%s",
        type(checkpoint).__name__,
        device.type,
        mode,
        f" (replaced instance override {getattr(previous, '__qualname__', previous)!s})" if previous else "",
    )
    return True


def remove_tile_gather_reuse(adapter: Any) -> bool:
    """Restore the checkpoint's own method and drop the workspace; returns whether one was installed."""
    gather = get_tile_gather(adapter)
    if gather is None:
        return False
    gather.release()
    delattr(adapter.model, _GATHER_ATTR)
    return True


__all__ = [
    "REUSE_ENV",
    "StableTileGather",
    "TileGatherWorkspace",
    "all_gather_flat",
    "all_gather_in_place",
    "get_tile_gather",
    "install_tile_gather_reuse",
    "remove_tile_gather_reuse",
    "reuse_mode",
    "round_robin_count",
    "workspace_bytes",
]
