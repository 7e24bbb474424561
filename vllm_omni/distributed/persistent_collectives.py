# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Collectives that hand the backend the same buffers on every request.

On XPU, oneCCL registers every allocation a collective is handed and does not let go of it; after each
request's ``empty_cache()`` the activations a collective is called with sit at new addresses, so device
memory outside PyTorch grows with every request. Installed, every ``torch.distributed`` collective on the
request path copies its tensors into a workspace that persists across requests, runs in place there, and
copies the result back, as vLLM's custom all-reduce and PyTorch FSDP2's all-gather do. A call the layer
cannot stage with the plain collective's semantics goes to the plain collective unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.distributed_c10d as c10d
from torch._dynamo.eval_frame import skip_code
from vllm.logger import init_logger

from .collective_workspaces import (
    Region,
    WorkspacePool,
    contiguous_region,
    is_dense,
    is_persistent,
    region_of,
    regions_nbytes,
    resolve_device,
    synchronize,
)
from .staged_work import Completion, StagedWork

logger = init_logger(__name__)

SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"
KINDS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)
# Both names are patched: callers reach torch.distributed's, and the object collectives reach c10d's own.
_NAMESPACES = (dist, c10d)


def switch_mode() -> str:
    """``VLLM_OMNI_PERSISTENT_COLLECTIVES``: ``auto`` (default, XPU only), ``1`` (any device) or ``0``."""
    value = (raw := os.environ.get(SWITCH_ENV, "auto")).strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{SWITCH_ENV}={raw!r} is not valid; expected one of 'auto', '1' or '0'")
    return value


@dataclass
class _Stage:
    """How one call goes through a workspace: what to carve, copy in, run on it, and copy out.

    ``touches`` are the caller's tensors: an asynchronous call still in flight on any of their bytes is finished
    first, so that calls on one tensor act in the order they were issued.
    """

    regions: list[Region]
    copy_in: Callable[[list[torch.Tensor]], None]
    call: Callable[[list[torch.Tensor]], Any]
    copy_out: Callable[[list[torch.Tensor]], None]
    group: Any
    device: torch.device
    async_op: bool
    touches: tuple[torch.Tensor, ...] = ()


@dataclass
class _InFlight:
    """An asynchronous staged call not yet finished: its group, the bytes it reads or writes, its completion.

    ``collective`` is false for a point-to-point batch, which a barrier does not wait for (nor does gloo's).
    """

    group: Any
    spans: tuple[tuple[int, int], ...]
    completion: Completion
    collective: bool


def _copy_back(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Write an in-place collective's result as the backend would: no autograd version bump, bytes as they are."""
    if destination.dtype == torch.bool:  # a bool sum leaves counts in the bytes; copy_ would make them 0 or 1
        destination, source = destination.view(torch.uint8), source.view(torch.uint8)
    with torch.inference_mode():
        if destination.is_inference():
            destination.copy_(source)
            return
        with torch.autograd._unsafe_preserve_version_counter(destination):
            destination.copy_(source)


def _copy_gathered(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Write a gather's output as the plain gathers do: an ordinary copy in the caller's mode (versions bump)."""
    destination.copy_(source)


def _open(group: Any) -> bool:
    """Whether this rank is in ``group`` and no coalescing context holds it (what the layer may stage)."""
    try:
        if c10d._rank_not_in_group(group):
            return False
        return (group if group is not None else c10d._get_default_group()) not in c10d._world.pg_coalesce_state
    except Exception:  # no default group, or not a group: the plain collective says so
        return False


def _same_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def _spans(tensors: tuple[Any, ...]) -> tuple[tuple[int, int], ...]:
    """The address range each strided tensor's elements lie in (views of one buffer that do not meet, apart)."""
    spans = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 0:
            last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
            spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
    return tuple(spans)


def _meet(first: tuple[tuple[int, int], ...], second: tuple[tuple[int, int], ...]) -> bool:
    return any(a < d and c < b for a, b in first for c, d in second)


def _default(group: Any) -> Any:
    return group if group is not None else c10d._get_default_group()


# Reductions a workspace stages with the plain collective's semantics. AVG is not one: gloo divides in the caller's
# tensor after the sum, bumping its version and raising for integers with the sum already written.
_STAGED_REDUCTIONS = frozenset(
    (
        dist.ReduceOp.SUM,
        dist.ReduceOp.PRODUCT,
        dist.ReduceOp.MIN,
        dist.ReduceOp.MAX,
        dist.ReduceOp.BAND,
        dist.ReduceOp.BOR,
        dist.ReduceOp.BXOR,
    )
)


def _barrier_device(group: Any, device_ids: Any) -> torch.device:
    """The device torch's ``barrier`` synchronizes on for ``group`` (its own rule, in the same order)."""
    accelerator = torch._C._get_accelerator()
    if isinstance(device_ids, list):
        return torch.device(accelerator.type, device_ids[0])
    if getattr(group, "bound_device_id", None) is not None:
        return group.bound_device_id
    if accelerator.type == "cpu" or c10d._get_object_coll_device(group) == "cpu":
        return torch.device("cpu")
    return resolve_device(accelerator.type)


class PersistentCollectives:
    """Stages the collectives of tensors on one device type through per-group workspace pools."""

    def __init__(self, device_type: str, plain: dict[str, Callable]) -> None:
        self.device_type = device_type
        self.plain = plain  # what the backend is called through; a census may wrap these
        self.originals: dict[tuple[str, str], Callable] = {}  # what install replaced, by namespace and name
        self.pools: weakref.WeakKeyDictionary[Any, dict[torch.device, WorkspacePool]] = weakref.WeakKeyDictionary()
        self.staged_calls = 0
        self.copied_bytes = 0
        self.passed_through = 0
        self.fallbacks = 0
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._lock = threading.RLock()  # adopt() runs from a finalizer, which a collection may start anywhere
        self._in_flight: list[_InFlight] = []

    def all_pools(self) -> list[WorkspacePool]:
        return [pool for by_device in list(self.pools.values()) for pool in by_device.values()]

    def stats(self) -> dict[str, int]:
        pools = self.all_pools()
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
        """Whether a tensor argument is one this layer copies: dense, non-empty, on its device, not persistent."""
        return (
            type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.layout == torch.strided
            and tensor.device.type == self.device_type
            and tensor.numel() > 0
            and not (tensor.is_conj() or tensor.is_neg())  # lazy bits the backend refuses to read
            and is_dense(tensor)
            and not is_persistent(tensor)
        )

    def pool(self, group: Any, device: torch.device) -> WorkspacePool:
        group = _default(group)
        device = resolve_device(device)
        with self._lock:
            by_device = self.pools.setdefault(group, {})
            if device not in by_device:
                by_device[device] = WorkspacePool(device, group)
            return by_device[device]

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

    def pass_through(self, plain_call: Callable[[], Any], *touches: Any) -> Any:
        self.settle(touches)
        self.passed_through += 1
        return plain_call()

    def adopt(self, completion: Completion) -> None:
        """A ``StagedWork`` was collected: its collective is finished later, once the backend has (never block here)."""
        completion.dropped = True

    def track(self, completion: Completion, group: Any, touches: tuple[Any, ...], collective: bool = True) -> None:
        """Keep an asynchronous staged call until it is finished: later calls may have to finish it first."""
        with self._lock:
            self._in_flight.append(_InFlight(group, _spans(touches), completion, collective))

    def settle(self, touches: tuple[torch.Tensor, ...] = (), group: Any = None) -> None:
        """Finish the asynchronous staged calls a new call must follow, as the plain collectives are ordered.

        Those on bytes that ``touches`` also reads or writes; every collective of ``group`` (a barrier's: gloo's
        waits for its group's earlier collectives); and dropped ones the backend has completed, never blocking for
        those. An error stays with its work, for its ``wait()`` to raise.
        """
        if not self._in_flight:
            return
        spans = _spans(touches)
        with self._lock:
            self._in_flight = [f for f in self._in_flight if not f.completion.done]
            due = [
                f
                for f in self._in_flight
                if _meet(f.spans, spans)
                or (group is not None and f.group is group and f.collective)
                or (f.completion.dropped and f.completion.ready())
            ]
        for flight in due:
            with contextlib.suppress(Exception):
                flight.completion.wait()

    def finish_dropped(self) -> None:
        """Wait for every dropped work, so that its result lands before the layer goes."""
        with self._lock:
            dropped = [f.completion for f in self._in_flight if f.completion.dropped]
            self._in_flight = []
        for completion in dropped:
            with contextlib.suppress(Exception):
                completion.wait()

    def run(self, name: str, stage: _Stage, fallback: Callable[[], Any]) -> Any:
        """Run ``stage`` in a workspace; ``fallback`` instead when none can be had on this rank."""
        self.settle(stage.touches)
        nbytes = regions_nbytes(stage.regions)
        try:
            pool = self.pool(stage.group, stage.device)
            workspace = pool.acquire(nbytes)
            problem = None if workspace is not None else ("busy", f"all {pool.limit} workspaces are in use")
        except Exception as error:  # whatever the allocator raises: OutOfMemoryError on a device, RuntimeError on CPU
            workspace, problem = None, ("memory", f"no workspace of {nbytes} bytes on {stage.device}: {error}")
        if workspace is None:
            self._fallback(name, *problem)
            return self.pass_through(fallback)
        try:
            # Workspace views are normal tensors whatever the caller's mode, since the backend writes them in place;
            # the copy-in runs in inference mode, which may write them from inference tensors too. Each kind copies
            # out as its plain collective writes (see _copy_back and _copy_gathered).
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

        def copy_out() -> None:
            stage.copy_out(views)

        if not stage.async_op:
            try:
                copy_out()
            finally:
                pool.release(workspace)
            return work
        batch = isinstance(work, list)  # batch_isend_irecv: a Work per op, or one for the coalesced batch
        completion = Completion(work if batch else [work], copy_out, lambda: pool.release(workspace), stage.touches)
        self.track(completion, _default(stage.group), stage.touches, collective=not batch)
        if batch:
            return [StagedWork(completion, self.adopt) for _ in work]
        return StagedWork(completion, self.adopt)

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

    # One method per kind, with the plain collective's parameters. Each stages the call, or hands it to the plain
    # collective unchanged where staging would not keep its semantics (see the design note).

    def all_reduce(self, tensor, op, group, async_op):
        plain = self.plain["all_reduce"]
        call = lambda: plain(tensor, op=op, group=group, async_op=async_op)  # noqa: E731
        if not (self.stages(tensor) and _open(group)) or op not in _STAGED_REDUCTIONS:
            return self.pass_through(call, tensor)
        stage = _Stage(
            [region_of(tensor)],  # the caller's strides: a reduction sees elements in the same order
            lambda v: v[0].copy_(tensor),
            lambda v: plain(v[0], op=op, group=group, async_op=async_op),
            lambda v: _copy_back(tensor, v[0]),
            group,
            tensor.device,
            async_op,
            (tensor,),
        )
        return self.run("all_reduce", stage, call)

    def broadcast(self, tensor, src, group, async_op, group_src):
        plain = self.plain["broadcast"]
        kwargs = {"src": src, "group": group, "async_op": async_op, "group_src": group_src}
        call = lambda: plain(tensor, **kwargs)  # noqa: E731
        if not (self.stages(tensor) and _open(group)) or (src is None) == (group_src is None):
            return self.pass_through(call, tensor)
        is_source = dist.get_rank(group) == group_src if group_src is not None else dist.get_rank() == src
        stage = _Stage(
            [region_of(tensor)],
            (lambda v: v[0].copy_(tensor)) if is_source else (lambda v: None),
            lambda v: plain(v[0], **kwargs),
            (lambda v: None) if is_source else (lambda v: _copy_back(tensor, v[0])),
            group,
            tensor.device,
            async_op,
            (tensor,),
        )
        return self.run("broadcast", stage, call)

    def _gather_in_place(self, name, output_shape, tensor, group, async_op, copy_out, outputs) -> _Stage:
        """Copy-in to this rank's slice of one output region, one in-place all-gather, copy-out (FSDP2's pattern).

        ``output_shape`` is the caller's output for a tensor gather (the input keeps its shape), flat for a list.
        """
        gather, rank, n = self.plain[name], dist.get_rank(group), tensor.numel()
        shape = tensor.shape if len(output_shape) == tensor.dim() else torch.Size([n])

        def mine(views: list[torch.Tensor]) -> torch.Tensor:
            return views[0].view(-1)[rank * n : (rank + 1) * n].view(shape)

        return _Stage(
            [contiguous_region(output_shape, tensor.dtype)],
            lambda v: mine(v).copy_(tensor.view(shape)),
            lambda v: gather(v[0], mine(v), group=group, async_op=async_op),
            copy_out,
            group,
            tensor.device,
            async_op,
            (tensor, *outputs),
        )

    def all_gather_into_tensor(self, output_tensor, input_tensor, group, async_op, name="all_gather_into_tensor"):
        output, tensor = output_tensor, input_tensor
        plain = self.plain[name]
        call = lambda: plain(output, tensor, group=group, async_op=async_op)  # noqa: E731
        if not (self._stages_all(output, tensor) and _open(group)):
            return self.pass_through(call, output, tensor)
        concatenated = (dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else None
        if output.dtype != tensor.dtype or tuple(output.shape) != concatenated:
            return self.pass_through(call, output, tensor)  # a form not every backend takes: it decides, everywhere
        copy_out = lambda v: _copy_gathered(output, v[0])  # noqa: E731
        stage = self._gather_in_place(name, output.shape, tensor, group, async_op, copy_out, (output,))
        return self.run(name, stage, call)

    def all_gather_single(self, output_tensor, input_tensor, group, async_op):
        return self.all_gather_into_tensor(output_tensor, input_tensor, group, async_op, name="all_gather_single")

    def all_gather(self, tensor_list, tensor, group, async_op):
        plain = self.plain["all_gather"]
        call = lambda: plain(tensor_list, tensor, group=group, async_op=async_op)  # noqa: E731
        outputs_staged = isinstance(tensor_list, list) and all(self.stages(o) for o in tensor_list)
        if not (outputs_staged and self._stages_all(tensor) and _open(group)):
            return self.pass_through(call, tensor, *(tensor_list if isinstance(tensor_list, list) else ()))
        world = dist.get_world_size(group)
        if len(tensor_list) != world or any(o.shape != tensor.shape or o.dtype != tensor.dtype for o in tensor_list):
            return self.pass_through(call, tensor, *tensor_list)  # uneven: the backend's own list gather and errors

        def copy_out(views: list[torch.Tensor]) -> None:
            for output, part in zip(tensor_list, views[0].view(world, *tensor.shape).unbind(0), strict=True):
                _copy_gathered(output, part)

        flat = torch.Size([world * tensor.numel()])
        stage = self._gather_in_place("all_gather_single", flat, tensor, group, async_op, copy_out, tensor_list)
        return self.run("all_gather", stage, call)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group, async_op):
        plain = self.plain["all_to_all_single"]
        kwargs = {
            "output_split_sizes": output_split_sizes,
            "input_split_sizes": input_split_sizes,
            "group": group,
            "async_op": async_op,
        }
        call = lambda: plain(output, input, **kwargs)  # noqa: E731
        if not (self._stages_all(output, input) and _open(group)) or _same_storage(output, input):
            return self.pass_through(call, output, input)  # an output that is its input: the backend's business
        stage = _Stage(
            [region_of(input), region_of(output)],
            lambda v: v[0].copy_(input),
            lambda v: plain(v[1], v[0], **kwargs),
            lambda v: _copy_back(output, v[1]),
            group,
            input.device,
            async_op,
            (input, output),
        )
        return self.run("all_to_all_single", stage, call)

    def batch_isend_irecv(self, p2p_op_list):
        plain = self.plain["batch_isend_irecv"]
        ops = p2p_op_list if isinstance(p2p_op_list, list) else []  # what the plain one accepts
        call = lambda: plain(p2p_op_list)  # noqa: E731
        if (
            not ops
            or not all(isinstance(op, dist.P2POp) and self.stages(op.tensor) for op in ops)
            or len({op.tensor.device for op in ops}) != 1
            or len({id(op.group) for op in ops}) != 1
            or not _open(ops[0].group)
        ):
            return self.pass_through(call, *(op.tensor for op in ops if isinstance(op, dist.P2POp)))
        sends = [op.op in (dist.isend, dist.send) for op in ops]

        def copy_in(views: list[torch.Tensor]) -> None:
            for op, view, is_send in zip(ops, views, sends, strict=True):
                if is_send:
                    view.copy_(op.tensor)

        def copy_out(views: list[torch.Tensor]) -> None:
            for op, view, is_send in zip(ops, views, sends, strict=True):
                if not is_send:
                    _copy_back(op.tensor, view)

        def call_on(views: list[torch.Tensor]) -> Any:
            pairs = zip(ops, views, strict=True)
            return plain([dist.P2POp(op.op, view, peer=op.peer, group=op.group, tag=op.tag) for op, view in pairs])

        regions = [region_of(op.tensor) for op in ops]
        touches = tuple(op.tensor for op in ops)
        stage = _Stage(regions, copy_in, call_on, copy_out, ops[0].group, ops[0].tensor.device, True, touches)
        return self.run("batch_isend_irecv", stage, call)

    def barrier(self, group, async_op, device_ids, timeout):
        """An all-reduce of a one-element workspace region, then the host waits for the device, as XCCL's does.

        The group's earlier staged calls finish first, as gloo's barrier waits for the group's earlier work. A rank
        that gets no workspace all-reduces a fresh element: every rank still enters the same collective. A timeout
        bounds a synchronous barrier's wait; an asynchronous one is bounded by its ``wait()``.
        """
        plain = self.plain["barrier"]
        call = lambda: plain(group=group, async_op=async_op, device_ids=device_ids, timeout=timeout)  # noqa: E731
        if not _open(group):
            return self.pass_through(call)
        device = _barrier_device(group, device_ids)
        if device.type != self.device_type:
            return self.pass_through(call)
        self.settle(group=_default(group))
        reduce = self.plain["all_reduce"]

        def on(token: torch.Tensor) -> Any:
            if timeout is None or async_op:
                return reduce(token, group=group, async_op=async_op)
            reduce(token, group=group, async_op=True).wait(timeout)
            return None

        def on_fresh_token() -> Any:
            work = on(torch.zeros(1, dtype=torch.int32, device=device))
            if not async_op:
                synchronize(device)
            return work

        stage = _Stage(
            [contiguous_region(torch.Size([1]), torch.int32)],
            lambda v: v[0].zero_(),
            lambda v: on(v[0]),
            lambda v: synchronize(device),
            group,
            device,
            async_op,
        )
        return self.run("barrier", stage, on_fresh_token)

    def _stages_all(self, *tensors: Any) -> bool:
        """Every tensor staged, and contiguous: the forms the gathers and all-to-alls take in place."""
        return all(self.stages(t) and t.is_contiguous() for t in tensors)


_installed: PersistentCollectives | None = None


def installed() -> PersistentCollectives | None:
    """The installed layer: its ``plain`` functions are where the backend is reached, its ``stats()`` its cost."""
    return _installed


# Inside torch.compile'd code the layer is reached through custom ops, which Dynamo keeps opaque (as vLLM does for
# its own collectives) and whose eager kernels run the staged collective. Where the plain collective would break
# the graph (broadcast, barrier, async calls, p2p batches), the staged one breaks it at the same call.


def _group_name(group: Any) -> str:
    return fc._resolve_group_name(_default(group))


_calling = threading.local()  # set while the layer runs a call: torch's own functions reach it again from inside


def _eager(name: str) -> Callable:
    """The kind's staged call, or the plain one once the layer is gone, run outside any traced graph.

    A call made from inside the layer's own (torch's ``all_gather_into_tensor`` calls ``all_gather_single``) goes
    to the function the layer replaced, as it would without the layer.
    """

    def call(*args: Any) -> Any:
        layer = _installed
        if layer is None:
            return getattr(c10d, name)(*args)
        if getattr(_calling, "active", False):
            return layer.originals[c10d.__name__, name](*args)
        _calling.active = True
        try:
            return getattr(layer, name)(*args)
        finally:
            _calling.active = False

    return call


# Through torch._dynamo.disable (about 0.3 us a call): the layer's own frames are never traced, even when a
# compiled caller breaks its graph at a collective and runs it eagerly.
_run_staged = {name: torch._dynamo.disable(_eager(name), recursive=True) for name in KINDS}
_REDUCE_OPS = {name: op for op, name in fc.REDUCE_OP_TO_STR.items()}
_TORCH = {name: getattr(c10d, name) for name in KINDS}  # torch's own, as imported before any install


# The kernels see tensors as the functional collectives do, row-major: a view with gaps or permuted strides is
# reduced in the same element order as the plain collective under torch.compile, then written back.


def _write_back(destination: torch.Tensor, result: torch.Tensor) -> None:
    if result is not destination:
        destination.copy_(result)


@torch.library.custom_op("vllm_omni::persistent_all_reduce", mutates_args=("tensor",))
def _all_reduce_op(tensor: torch.Tensor, op: str, group_name: str) -> None:
    work = tensor.contiguous()
    _run_staged["all_reduce"](work, _REDUCE_OPS[op], c10d._resolve_process_group(group_name), False)
    _write_back(tensor, work)


@torch.library.custom_op("vllm_omni::persistent_all_gather_into_tensor", mutates_args=("output",))
def _all_gather_op(output: torch.Tensor, tensor: torch.Tensor, group_name: str) -> None:
    gathered = output.contiguous()
    group = c10d._resolve_process_group(group_name)
    _run_staged["all_gather_into_tensor"](gathered, tensor.contiguous(), group, False)
    _write_back(output, gathered)


@torch.library.custom_op("vllm_omni::persistent_all_to_all_single", mutates_args=("output",))
def _all_to_all_op(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group_name: str,
) -> None:
    received = output.contiguous()
    group = c10d._resolve_process_group(group_name)
    _run_staged["all_to_all_single"](received, tensor.contiguous(), output_split_sizes, input_split_sizes, group, False)
    _write_back(output, received)


for _op in (_all_reduce_op, _all_gather_op, _all_to_all_op):
    _op.register_fake(lambda *args: None)
    # Every rank runs a collective even where its result goes unused: not dead code to FX's or Inductor's passes
    # (torch marks its functional collectives' wait the same way).
    torch.fx.node.has_side_effect(_op._opoverload)


def _traced_as_torch(*tensors: torch.Tensor) -> bool:
    """Whether autograd records through this traced call: torch's functional collective then has a backward (it
    reduces the gradients too) that the custom ops do not, so the call is traced as torch traces the plain one."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if torch.compiler.is_compiling() and not async_op:
        if _traced_as_torch(tensor):
            # Dynamo turns the op into its string only where dist.all_reduce is torch's own; the layer's is installed.
            return _TORCH["all_reduce"](tensor, fc.REDUCE_OP_TO_STR[op], group, async_op)
        return _all_reduce_op(tensor, fc.REDUCE_OP_TO_STR[op], _group_name(group))
    return _run_staged["all_reduce"](tensor, op, group, async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    return _run_staged["broadcast"](tensor, src, group, async_op, group_src)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if torch.compiler.is_compiling() and not async_op:
        if _traced_as_torch(output_tensor, input_tensor):
            return _TORCH["all_gather_into_tensor"](output_tensor, input_tensor, group, async_op)
        return _all_gather_op(output_tensor, input_tensor, _group_name(group))
    return _run_staged["all_gather_into_tensor"](output_tensor, input_tensor, group, async_op)


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    if torch.compiler.is_compiling() and not async_op:
        if _traced_as_torch(output_tensor, input_tensor):
            return _TORCH["all_gather_single"](output_tensor, input_tensor, group, async_op)
        return _all_gather_op(output_tensor, input_tensor, _group_name(group))
    return _run_staged["all_gather_single"](output_tensor, input_tensor, group, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if torch.compiler.is_compiling() and not async_op:
        uneven = len(tensor_list) != dist.get_world_size(group) or any(t.shape != tensor.shape for t in tensor_list)
        if uneven or _traced_as_torch(tensor, *tensor_list):
            return _TORCH["all_gather"](tensor_list, tensor, group, async_op)
        output = tensor.new_empty((len(tensor_list) * tensor.shape[0], *tensor.shape[1:]))
        _all_gather_op(output, tensor, _group_name(group))
        for destination, part in zip(tensor_list, output.chunk(len(tensor_list)), strict=True):
            destination.copy_(part)
        return None
    return _run_staged["all_gather"](tensor_list, tensor, group, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    if torch.compiler.is_compiling() and not async_op:
        if _traced_as_torch(output, input):
            return _TORCH["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, async_op)
        return _all_to_all_op(output, input, output_split_sizes, input_split_sizes, _group_name(group))
    return _run_staged["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, async_op)


def batch_isend_irecv(p2p_op_list):
    return _run_staged["batch_isend_irecv"](p2p_op_list)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    return _run_staged["barrier"](group, async_op, device_ids, timeout)


STAGED = {name: globals()[name] for name in KINDS}  # what install puts in torch.distributed, by name
for _staged in STAGED.values():
    # Inlined where Dynamo traces a caller, never compiled as a frame of its own: a graph break at a collective then
    # costs the one break the plain collective costs.
    skip_code(_staged.__code__)


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
    # The backend is reached through whatever torch.distributed held (a profiler's wrapper, say), called with the
    # arguments the staged function received by the names of distributed_c10d's own signature.
    layer = PersistentCollectives(device_type, {name: getattr(dist, name) for name in KINDS})
    layer.originals = {(ns.__name__, name): getattr(ns, name) for ns in _NAMESPACES for name in KINDS}
    _installed = layer
    for namespace in _NAMESPACES:
        for name in KINDS:
            setattr(namespace, name, STAGED[name])
    logger.info(
        "[PERSISTENT_COLLECTIVES] installed: %s of %s tensors go through persistent workspaces",
        ", ".join(KINDS),
        device_type,
    )
    return True


def uninstall_persistent_collectives() -> None:
    """Put back what install replaced; the workspaces are freed with the layer."""
    global _installed
    if _installed is None:
        return
    for namespace in _NAMESPACES:
        for name in KINDS:
            if getattr(namespace, name, None) is STAGED[name]:
                setattr(namespace, name, _installed.originals[namespace.__name__, name])
    _installed.finish_dropped()
    _installed = None
