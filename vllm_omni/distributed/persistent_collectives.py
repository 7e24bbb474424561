# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Collectives that hand the backend the same buffers on every request.

On XPU, oneCCL registers every allocation a collective is handed and does not let go of it; after each
request's ``empty_cache()`` the activations a collective is called with sit at new addresses, so device
memory outside PyTorch grows with every request. Installed, every ``torch.distributed`` collective on the
request path copies its tensors into a workspace that persists across requests, runs in place there, and
copies the result back, as vLLM's custom all-reduce and PyTorch FSDP2's all-gather do. Callers see the
plain collective's semantics; the backend sees a bounded set of buffers.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.logger import init_logger

from .collective_workspaces import WorkspacePool, is_persistent, regions_nbytes, resolve_device

logger = init_logger(__name__)

SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"
_MARK = "_vllm_omni_persistent_collective"
Regions = list[tuple[torch.Size, torch.dtype]]


def switch_mode() -> str:
    """``VLLM_OMNI_PERSISTENT_COLLECTIVES``: ``auto`` (default, XPU only), ``1`` (any device) or ``0``."""
    value = (raw := os.environ.get(SWITCH_ENV, "auto")).strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{SWITCH_ENV}={raw!r} is not valid; expected one of 'auto', '1' or '0'")
    return value


@dataclass
class _Stage:
    """How one call goes through a workspace: what to carve, copy in, run on it, and copy out."""

    regions: Regions
    copy_in: Callable[[list[torch.Tensor]], None]
    call: Callable[[list[torch.Tensor]], Any]
    copy_out: Callable[[list[torch.Tensor]], None]
    group: Any
    device: torch.device
    async_op: bool


class _Completion:
    """Waits for a staged collective's works exactly once (gloo cannot wait on a send twice), then finishes it."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], None]) -> None:
        self.works = works
        self.done = False
        self._finish = finish
        self._lock = threading.Lock()

    def wait(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            if not self.done:
                for work in self.works:
                    work.wait(*args, **kwargs)
                self.done = True
                self._finish()


class StagedWork:
    """The ``Work`` of an asynchronous staged collective: copies out and frees the workspace once waited on.

    Every ``StagedWork`` of one ``batch_isend_irecv`` waits for the whole batch, since its receives are copied
    out together.
    """

    def __init__(self, completion: _Completion) -> None:
        self._completion = completion

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._completion.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        if not (self._completion.done or all(work.is_completed() for work in self._completion.works)):
            return False
        self.wait()
        return True

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._completion.works)

    def exception(self) -> Any:
        return next((e for e in (work.exception() for work in self._completion.works) if e is not None), None)

    def get_future(self) -> Any:
        raise NotImplementedError(
            f"get_future() on a collective staged through a persistent workspace: call wait() instead, or set "
            f"{SWITCH_ENV}=0"
        )


class PersistentCollectives:
    """Stages the collectives of tensors on one device type through per-group workspace pools."""

    def __init__(self, device_type: str, plain: dict[str, Callable]) -> None:
        self.device_type = device_type
        self.originals = dict(plain)  # what install replaced in torch.distributed
        self.plain = plain  # what the backend is called through; a census may wrap these
        self.pools: dict[tuple[int, torch.device], WorkspacePool] = {}
        self.staged_calls = 0
        self.copied_bytes = 0
        self.passed_through = 0
        self.fallbacks = 0
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def stats(self) -> dict[str, int]:
        pools = list(self.pools.values())
        return {
            "staged_calls": self.staged_calls,
            "copied_bytes": self.copied_bytes,
            "passed_through": self.passed_through,
            "fallbacks": self.fallbacks,
            "workspaces": sum(len(p.workspaces) for p in pools),
            "workspace_allocations": sum(p.allocations for p in pools),
            "resident_bytes": sum(p.resident_bytes for p in pools),
            "peak_busy_per_group": max((p.peak_busy for p in pools), default=0),
        }

    def stages(self, tensor: Any) -> bool:
        """Whether a tensor argument is one this layer copies: a dense tensor on its device, not persistent."""
        return (
            type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.layout == torch.strided
            and tensor.device.type == self.device_type
            and tensor.numel() > 0
            and not is_persistent(tensor)
        )

    def pool(self, group: Any, device: torch.device) -> WorkspacePool:
        group = group if group is not None else dist.distributed_c10d._get_default_group()
        key = (id(group), resolve_device(device))
        with self._lock:
            if key not in self.pools:
                self.pools[key] = WorkspacePool(key[1], group)
            return self.pools[key]

    def reserve(self, nbytes: int, group: Any = None, device: torch.device | str | None = None) -> int:
        """Grow one of ``group``'s workspaces to ``nbytes`` now, before the first request; returns its size.

        For a caller that knows its largest collective: the first request then allocates nothing of that size.
        """
        if not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"nbytes={nbytes!r}: expected a positive int")
        pool = self.pool(group, torch.device(device if device is not None else self.device_type))
        workspace = pool.acquire(nbytes)
        if workspace is None:
            raise RuntimeError(f"all {pool.limit} workspaces of the group on {pool.device} are in use")
        pool.release(workspace)
        return workspace.nbytes

    def run(self, name: str, stage: _Stage, plain_call: Callable[[], Any]) -> Any:
        """Run ``stage`` in a workspace; ``plain_call`` instead when none can be had on this rank."""
        pool = self.pool(stage.group, stage.device)
        nbytes = regions_nbytes(stage.regions)
        try:
            workspace = pool.acquire(nbytes)
            if workspace is None:
                self._fallback(name, "busy", f"all {pool.limit} workspaces of its group on {pool.device} are in use")
        except torch.OutOfMemoryError:
            workspace = None
            self._fallback(name, "memory", f"no memory for a workspace of {nbytes} bytes on {pool.device}")
        if workspace is None:
            self.passed_through += 1
            return plain_call()
        try:
            # Workspace views are normal tensors whatever the caller's mode, since the backend writes them in place;
            # the copies run in inference mode, which may write both normal and inference tensors.
            with torch.inference_mode(False), torch.no_grad():
                views = workspace.carve(stage.regions)
            with torch.inference_mode():
                stage.copy_in(views)
            work = stage.call(views)
        except BaseException:
            pool.release(workspace)
            raise
        self.staged_calls += 1
        self.copied_bytes += 2 * nbytes  # every region in and out: an upper bound (a broadcast copies one way)

        def finish() -> None:
            try:
                with torch.inference_mode():
                    stage.copy_out(views)
            finally:
                pool.release(workspace)

        if not stage.async_op:
            finish()
            return work
        if isinstance(work, list):  # batch_isend_irecv: a Work per op, or one for the coalesced batch
            completion = _Completion(work, finish)
            return [StagedWork(completion) for _ in work]
        return StagedWork(_Completion([work], finish))

    def _fallback(self, name: str, kind: str, reason: str) -> None:
        """Logged once per collective and kind of reason: the call runs on the caller's own buffers."""
        self.fallbacks += 1
        if (name, kind) not in self._fallbacks_logged:
            self._fallbacks_logged.add((name, kind))
            logger.warning(
                "[PERSISTENT_COLLECTIVES] %s ran as the plain collective on this rank (later ones are counted): %s",
                name,
                reason,
            )


def _no_copy(views: list[torch.Tensor]) -> None:
    return None


def _region(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return tensor.shape, tensor.dtype


# Each ``_stage_<name>`` returns how a call is staged, or None to hand it to the plain collective unchanged
# (what the layer does not stage: other devices, persistent or empty tensors, forms the backend would refuse).


def _stage_all_reduce(layer: PersistentCollectives, a: dict) -> _Stage | None:
    tensor = a["tensor"]
    if not layer.stages(tensor):
        return None
    plain = layer.plain["all_reduce"]
    return _Stage(
        [_region(tensor)],
        lambda v: v[0].copy_(tensor),
        lambda v: plain(v[0], op=a["op"], group=a["group"], async_op=a["async_op"]),
        lambda v: tensor.copy_(v[0]),
        a["group"],
        tensor.device,
        a["async_op"],
    )


def _stage_broadcast(layer: PersistentCollectives, a: dict) -> _Stage | None:
    tensor = a["tensor"]
    if not layer.stages(tensor):
        return None
    if a["group_src"] is not None:
        is_source = dist.get_rank(a["group"]) == a["group_src"]
    elif a["src"] is not None:
        is_source = dist.get_rank() == a["src"]
    else:
        return None
    plain = layer.plain["broadcast"]
    kwargs = {k: a[k] for k in ("src", "group", "async_op", "group_src")}
    return _Stage(
        [_region(tensor)],
        (lambda v: v[0].copy_(tensor)) if is_source else _no_copy,
        lambda v: plain(v[0], **kwargs),
        _no_copy if is_source else (lambda v: tensor.copy_(v[0])),
        a["group"],
        tensor.device,
        a["async_op"],
    )


def _gather_into(
    layer: PersistentCollectives, output_shape: torch.Size, tensor: torch.Tensor, group: Any, async_op: bool, copy_out
) -> _Stage:
    """Copy-in to this rank's slice of one output region, one in-place all-gather, copy-out (FSDP2's pattern).

    ``output_shape`` is the caller's own output (the input keeps its shape: the backend accepted the pair), or
    flat for a list gather (the input is flattened too).
    """
    rank = dist.get_rank(group)
    plain = layer.plain["all_gather_into_tensor"]
    n = tensor.numel()
    shape = tensor.shape if len(output_shape) > 1 else torch.Size([n])

    def mine(views: list[torch.Tensor]) -> torch.Tensor:
        return views[0].view(-1)[rank * n : (rank + 1) * n].view(shape)

    return _Stage(
        [(output_shape, tensor.dtype)],
        lambda v: mine(v).copy_(tensor.reshape(shape)),
        lambda v: plain(v[0], mine(v), group=group, async_op=async_op),
        copy_out,
        group,
        tensor.device,
        async_op,
    )


def _stage_all_gather_into_tensor(layer: PersistentCollectives, a: dict) -> _Stage | None:
    output, tensor = a["output_tensor"], a["input_tensor"]
    world = dist.get_world_size(a["group"])
    if not (layer.stages(output) and layer.stages(tensor)):
        return None
    if output.dtype != tensor.dtype or output.numel() != world * tensor.numel():
        return None  # the backend's own error
    return _gather_into(layer, output.shape, tensor, a["group"], a["async_op"], lambda v: output.copy_(v[0]))


def _stage_all_gather(layer: PersistentCollectives, a: dict) -> _Stage | None:
    outputs, tensor = a["tensor_list"], a["tensor"]
    world = dist.get_world_size(a["group"])
    if not (layer.stages(tensor) and len(outputs) == world and all(layer.stages(o) for o in outputs)):
        return None
    if any(o.shape != tensor.shape or o.dtype != tensor.dtype for o in outputs):
        return None  # uneven: the backend's own list gather, and its own errors

    def copy_out(views: list[torch.Tensor]) -> None:
        for output, part in zip(outputs, views[0].view(world, *tensor.shape).unbind(0), strict=True):
            output.copy_(part)

    return _gather_into(layer, torch.Size([world * tensor.numel()]), tensor, a["group"], a["async_op"], copy_out)


def _stage_all_to_all_single(layer: PersistentCollectives, a: dict) -> _Stage | None:
    output, tensor = a["output"], a["input"]
    if not (layer.stages(output) and layer.stages(tensor) and output.is_contiguous() and tensor.is_contiguous()):
        return None  # the backend refuses non-contiguous tensors here; let it say so
    plain = layer.plain["all_to_all_single"]
    kwargs = {k: a[k] for k in ("output_split_sizes", "input_split_sizes", "group", "async_op")}
    return _Stage(
        [_region(tensor), _region(output)],
        lambda v: v[0].copy_(tensor),
        lambda v: plain(v[1], v[0], **kwargs),
        lambda v: output.copy_(v[1]),
        a["group"],
        tensor.device,
        a["async_op"],
    )


def _stage_batch_isend_irecv(layer: PersistentCollectives, a: dict) -> _Stage | None:
    ops = list(a["p2p_op_list"])
    if not ops or not all(layer.stages(op.tensor) for op in ops):
        return None
    if len({op.tensor.device for op in ops}) != 1 or len({id(op.group) for op in ops}) != 1:
        return None
    sends = [op.op in (dist.isend, dist.send) for op in ops]
    plain = layer.plain["batch_isend_irecv"]

    def copy_in(views: list[torch.Tensor]) -> None:
        for op, view, is_send in zip(ops, views, sends, strict=True):
            if is_send:
                view.copy_(op.tensor)

    def copy_out(views: list[torch.Tensor]) -> None:
        for op, view, is_send in zip(ops, views, sends, strict=True):
            if not is_send:
                op.tensor.copy_(view)

    def call(views: list[torch.Tensor]) -> Any:
        pairs = zip(ops, views, strict=True)
        return plain([dist.P2POp(op.op, view, peer=op.peer, group=op.group, tag=op.tag) for op, view in pairs])

    regions = [_region(op.tensor) for op in ops]
    return _Stage(regions, copy_in, call, copy_out, ops[0].group, ops[0].tensor.device, True)


_STAGES = {
    "all_reduce": _stage_all_reduce,
    "broadcast": _stage_broadcast,
    "all_gather": _stage_all_gather,
    "all_gather_into_tensor": _stage_all_gather_into_tensor,
    "all_gather_single": _stage_all_gather_into_tensor,
    "all_to_all_single": _stage_all_to_all_single,
    "batch_isend_irecv": _stage_batch_isend_irecv,
}

_installed: PersistentCollectives | None = None


def _wrap(layer: PersistentCollectives, name: str, original: Callable) -> Callable:
    signature = inspect.signature(original)
    make_stage = _STAGES[name]

    def collective(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        stage = make_stage(layer, a)
        if stage is None:
            layer.passed_through += 1
            return layer.plain[name](*args, **kwargs)
        return layer.run(name, stage, lambda: layer.plain[name](*args, **kwargs))

    functools.update_wrapper(collective, original)
    setattr(collective, _MARK, True)
    return collective


def installed() -> PersistentCollectives | None:
    """The installed layer: its ``plain`` functions are where the backend is reached, its ``stats()`` its cost."""
    return _installed


def install_persistent_collectives(*, enabled: bool | None = None, device_type: str | None = None) -> bool:
    """Stage the ``torch.distributed`` collectives of this process through persistent workspaces; idempotent.

    ``enabled=None`` follows ``VLLM_OMNI_PERSISTENT_COLLECTIVES``: ``auto`` installs on XPU only. ``device_type``
    (default: XPU when present, else the current accelerator's, else CPU) is whose tensors are staged.
    Returns whether the layer is installed.
    """
    global _installed
    if _installed is not None:
        return True
    if enabled is None:
        mode = switch_mode()
        enabled = mode == "1" or (mode == "auto" and torch.xpu.is_available())
    if not enabled:
        return False
    if device_type is None:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device_type = "xpu" if torch.xpu.is_available() else (accelerator.type if accelerator else "cpu")
    # What the stages call the backend through: the same functions (list gathers use all_gather_into_tensor).
    plain = {name: getattr(dist, name) for name in _STAGES if hasattr(dist, name)}
    layer = PersistentCollectives(device_type, plain)
    for name in _STAGES:
        if name in plain:
            setattr(dist, name, _wrap(layer, name, plain[name]))
    _installed = layer
    logger.info(
        "[PERSISTENT_COLLECTIVES] installed: %s of %s tensors go through persistent workspaces",
        ", ".join(n for n in _STAGES if n in plain),
        device_type,
    )
    return True


def uninstall_persistent_collectives() -> None:
    """Put the plain collectives back; the workspaces are freed with the layer."""
    global _installed
    if _installed is None:
        return
    for name in _STAGES:
        if getattr(getattr(dist, name, None), _MARK, False):
            setattr(dist, name, _installed.originals[name])
    _installed = None
