# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A ledger of what ``torch.distributed`` collectives are handed, with a model of oneCCL's buffer registration.

This is a model, not a measurement. On XPU, oneCCL registers the whole allocation behind the send and
receive buffers it is handed (Level Zero IPC handles, cached up to 1000 entries, LRU), and a stale
registration can keep device memory from being freed (inferred from MPICH's reports, not observed here).
The ledger mimics that on any backend: the first time an allocation is handed to a collective it is
registered and, with ``hold_buffers`` (the default, for CPU runs), pinned: the ledger holds a reference, so
the memory can never be freed and reused, as an open IPC handle keeps a peer's memory. On a real device
pass ``hold_buffers=False``: the ledger then only counts addresses and the backend's own behaviour is what
a memory sample measures. An allocation seen again is a cache hit; past ``limit`` entries the least
recently used one is released. Two things ProcessGroupXCCL
does behind the caller's back are modelled too: a list-form ``all_gather`` receives into a new hidden
flat buffer on every call, and ``barrier`` all-reduces a new 4-byte device tensor on every call. Whether
oneCCL registers that 4-byte tensor is not known, so barrier temps are counted apart from registrations.

Watched: the functions in ``COLLECTIVES`` as callers reach them through ``torch.distributed`` and as the
object collectives reach them through ``distributed_c10d`` (their sites name the object collective). The
persistent collectives call those same functions with their blocks, so what is counted is what the backend is
handed. Compiled code reaches the coordinator's collectives through vLLM-Omni's opaque ops, whose kernels call
them at run time, where they are counted. A call on a device group that hands the backend anything but
persistent blocks is an *unmanaged site*: where a new direct call would slip past the fix. Not seen: calls
made on a ``ProcessGroup`` directly. An error in the ledger's own bookkeeping is logged once and never
raised, so the collective it watches always runs.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import sys
import weakref
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from vllm.logger import init_logger

from vllm_omni.distributed import (
    collective_workspaces,
    managed_distributed,
    module_collectives,
    persistent_collectives,
    persistent_fsdp,
    request_collectives,
    request_pool,
    traced_collectives,
)

logger = init_logger(f"vllm_omni.plugins.{__name__}")

ONECCL_CACHE_LIMIT = 1000
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "barrier",
    "send",
    "recv",
    "batch_isend_irecv",
)
# Not isend and irecv: P2POp checks its op against torch.distributed's own functions, so wrapping them would
# break every batch_isend_irecv (Ring attention's); their batches are booked through batch_isend_irecv.
_SKIP_FILES = (
    str(Path(dist.__file__).parent),
    str(Path(torch._dynamo.__file__).parent),  # the frames of torch._dynamo.disable
    str(Path(torch._library.__file__).parent),  # the kernel of an opaque op: its caller is the compiled frame
    str(Path(torch.__file__).with_name("_compile.py")),  # the dynamo-disabled wrapper an op's kernel runs in
    str(Path(torch.__file__).with_name("_ops.py")),
    __file__,
    persistent_collectives.__file__,
    managed_distributed.__file__,
    traced_collectives.__file__,
    request_collectives.__file__,
    module_collectives.__file__,
    persistent_fsdp.__file__,
)
# Where each collective takes its group, by position (keyword "group" otherwise); a p2p batch's is its ops'.
_GROUP_AT = {
    "all_reduce": 2,
    "broadcast": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "all_gather_single": 2,
    "all_to_all": 2,
    "all_to_all_single": 4,
    "gather": 3,
    "scatter": 3,
    "reduce": 3,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "reduce_scatter_single": 3,
    "barrier": 0,
    "send": 2,
    "recv": 2,
}
OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


@dataclass
class _Registration:
    nbytes: int
    keep_alive: Any  # the storage itself (hold_buffers), else None; None too for a backend temp of the model
    window: int = 0  # the release window it was first seen in


@dataclass
class SiteBooks:
    """One call site's collectives in one request: what moved and how many buffers were new to the backend."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    fresh_buffers: int = 0  # first handed to a collective in this request: a new registration
    fresh_bytes: int = 0
    persistent_buffers: int = 0  # handed to a collective before the last release (empty_cache) and still the same
    reused_buffers: int = 0  # handed to a collective earlier in the same window
    shapes: list[str] = field(default_factory=list)  # distinct "dtype[shape]" of the tensors handed over


@dataclass
class RequestReport:
    new_registrations: int
    new_registered_bytes: int
    pinned_bytes: int
    registrations: int
    evictions: int
    barrier_temps: int
    calls: int
    new_by_site: dict[str, dict[str, int]] = field(default_factory=dict)
    releases: int = 0  # release marks (empty_cache where an accelerator run would call it) in this request
    timeline: list[str] = field(default_factory=list)  # components in call order, "release" between windows
    books: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # component -> site -> SiteBooks
    bookkeeping_errors: int = 0  # calls the ledger could not book, since it started
    unmanaged_sites: dict[str, int] = field(default_factory=dict)  # site -> calls on a device group, no blocks
    staged_bytes: dict[str, int] = field(default_factory=dict)  # component -> bytes copied into and out of blocks
    # The request pool: component -> device-group calls made while no request ran in the worker's pool
    outside_pool_context: dict[str, int] = field(default_factory=dict)
    # With the request pool, in a request: site -> calls handed memory outside the pool, at addresses the first
    # request's calls already handed over (stable) or not (fresh: the growth the pool cannot stop)
    outside_pool_stable: dict[str, int] = field(default_factory=dict)
    outside_pool_fresh: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _caller() -> tuple[FrameType | None, str | None]:
    """The first frame outside torch.distributed and this module (who handed the collective its buffers), and the
    object collective it went through, if any."""
    frame, via = sys._getframe(2), None
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FILES):
        if frame.f_code.co_name in OBJECT_COLLECTIVES:
            via = frame.f_code.co_name
        frame = frame.f_back
    return frame, via


def _site_of(frame: FrameType | None) -> str:
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


def _buffers(name: str, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Send tensors, receive tensors, and bytes of a hidden receive temp the backend makes (0 if none)."""

    def arg(index: int, key: str) -> Any:
        return args[index] if len(args) > index else kwargs.get(key)

    if name == "all_gather":
        outputs, tensor = arg(0, "tensor_list"), arg(1, "tensor")
        return [tensor], [], sum(t.nbytes for t in outputs)
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return [arg(1, "input_tensor")], [arg(0, "output_tensor")], 0
    if name in ("all_to_all_single", "reduce_scatter_tensor", "reduce_scatter_single"):
        return [arg(1, "input")], [arg(0, "output")], 0
    if name == "all_to_all":
        return list(arg(1, "input_tensor_list")), list(arg(0, "output_tensor_list")), 0
    if name == "reduce_scatter":
        return list(arg(1, "input_list")), [arg(0, "output")], 0
    if name in ("all_reduce", "broadcast", "reduce"):
        tensor = arg(0, "tensor")
        return [tensor], [tensor], 0
    if name == "gather":
        return [arg(0, "tensor")], list(arg(1, "gather_list") or []), 0
    if name == "scatter":
        return list(arg(1, "scatter_list") or []), [arg(0, "tensor")], 0
    if name == "send":
        return [arg(0, "tensor")], [], 0
    if name == "recv":
        return [], [arg(0, "tensor")], 0
    if name == "batch_isend_irecv":
        ops = list(arg(0, "p2p_op_list") or [])
        sends = [op.tensor for op in ops if getattr(op.op, "__name__", "") in ("isend", "send")]
        return sends, [op.tensor for op in ops if all(op.tensor is not t for t in sends)], 0
    return [], [], 0


def _group(name: str, args: tuple, kwargs: dict) -> Any:
    if name == "batch_isend_irecv":
        ops = list(args[0] if args else kwargs.get("p2p_op_list") or [])
        return ops[0].group if ops else None
    at = _GROUP_AT.get(name)
    return args[at] if at is not None and len(args) > at else kwargs.get("group")


class PoolSegments:
    """Which addresses the worker's pool holds, read from its segments (``MemPool.snapshot()``, which walks the
    device's blocks under the allocator's lock): for the census only, never on a collective's path. A pool's
    segments only grow while it lives, so an address found once stays the pool's."""

    def __init__(self, pool: Any) -> None:
        self._pool, self._starts, self._ends = pool, [], []

    def holds(self, tensor: torch.Tensor) -> bool:
        address = tensor.untyped_storage().data_ptr()
        return self._within(address) or (self._refresh() and self._within(address))

    def _within(self, address: int) -> bool:
        index = bisect.bisect_right(self._starts, address) - 1
        return index >= 0 and address < self._ends[index]

    def _refresh(self) -> bool:
        segments = sorted((s["address"], s["address"] + s["total_size"]) for s in self._pool.snapshot())
        self._starts, self._ends = [start for start, _ in segments], [end for _, end in segments]
        return True


_blocks: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()
_pool: list[weakref.ref] = []  # the newest RequestPool of this process (a worker remakes it on wake-up)
_TRACKED = "_xpu_collective_memory_tracked"


def track_kept_memory() -> None:
    """From now on, remember each block ``collective_workspaces`` allocates (the VAE gather's, staging's, FSDP2's:
    the memory the fix keeps in place) and the newest request pool. Call it before the model loads. Idempotent."""
    allocate = collective_workspaces.allocate_bytes
    if not getattr(allocate, _TRACKED, False):

        @functools.wraps(allocate)
        def allocate_and_remember(*args: Any, **kwargs: Any) -> torch.Tensor:
            block = allocate(*args, **kwargs)
            _blocks[block.data_ptr()] = block.untyped_storage()  # one Python object per storage while it lives
            return block

        setattr(allocate_and_remember, _TRACKED, True)
        collective_workspaces.allocate_bytes = allocate_and_remember
    init = request_pool.RequestPool.__init__
    if not getattr(init, _TRACKED, False):

        @functools.wraps(init)
        def init_and_remember(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _pool[:] = [weakref.ref(self)]

        setattr(init_and_remember, _TRACKED, True)
        request_pool.RequestPool.__init__ = init_and_remember


def is_persistent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a live block allocated since ``track_kept_memory()``."""
    storage = tensor.untyped_storage()
    return _blocks.get(storage.data_ptr()) is storage


def worker_pool() -> request_pool.RequestPool | None:
    """This process's request pool, where the worker has one."""
    return _pool[0]() if _pool else None


def _managed(name: str, tensors: list[torch.Tensor], pooled: list[bool] | None) -> bool:
    """Whether a call on a device group hands the backend only persistent blocks and no temp of its own, or, in a
    request running in the worker's pool (``pooled``: whether it holds each tensor), only the pool's memory and
    blocks (the backend's temps are the pool's)."""
    if pooled is not None:
        return all(inside or is_persistent(t) for t, inside in zip(tensors, pooled, strict=True))
    hidden_temp = name in ("barrier", "all_gather")  # XCCL's barrier and list gather make tensors of their own
    return not hidden_temp and bool(tensors) and all(is_persistent(t) for t in tensors)


class CollectiveLedger:
    """Context manager that sees every collective in the process; ``end_request()`` closes one request's books."""

    def __init__(
        self,
        limit: int | None = ONECCL_CACHE_LIMIT,
        classify: Callable[[FrameType | None], str] | None = None,
        *,
        hold_buffers: bool = True,
    ) -> None:
        """``classify`` names the component of a collective from its caller's frame (default: one component)."""
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit={limit!r}: expected a positive int (oneCCL's default is 1000) or None")
        track_kept_memory()
        self.limit = limit
        self.hold_buffers = hold_buffers
        self.bookkeeping_errors = 0
        self._classify = classify or (lambda frame: "all")
        self._window = 0
        self._registry: OrderedDict[Any, _Registration] = OrderedDict()
        self._hidden_ids = itertools.count()
        self._restore: list[Callable[[], None]] = []
        self._depth = 0
        self._pool_segments: PoolSegments | None = None
        self._outside_first: set[int] = set()  # addresses outside the pool the first request's calls handed over
        self._reset_request()
        self.requests: list[RequestReport] = []

    def _reset_request(self) -> None:
        self._new: Counter[tuple[str, str]] = Counter()
        self._new_bytes = 0
        self._evictions = 0
        self._barriers = 0
        self._calls = 0
        self._releases = 0
        self._timeline: list[str] = []
        self._books: dict[str, dict[str, SiteBooks]] = defaultdict(lambda: defaultdict(SiteBooks))
        self._unmanaged: Counter[str] = Counter()
        self._staged: Counter[str] = Counter()
        self._outside_pool_context: Counter[str] = Counter()
        self._outside_pool: dict[str, Counter[str]] = {"stable": Counter(), "fresh": Counter()}

    @property
    def active(self) -> bool:
        return bool(self._restore)

    def __enter__(self) -> CollectiveLedger:
        if self._restore:
            raise RuntimeError("CollectiveLedger is already active")
        for name in COLLECTIVES:
            wrapped = self._wrap(name, getattr(dist, name))
            for namespace in (dist, c10d):  # callers reach the first, the object collectives the second
                self._restore.append(functools.partial(setattr, namespace, name, getattr(namespace, name)))
                setattr(namespace, name, wrapped)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for restore in self._restore:
            restore()
        self._restore.clear()

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)  # keeps __name__: P2POp.op is read by name
        @torch._dynamo.disable
        def observed(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # a collective implemented through another one is counted once
                self._observe_safely(name, args, kwargs)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return observed

    def mark_release(self) -> None:
        """Where an accelerator run would release cached memory: buffers seen before now count as survivors."""
        self._window += 1
        self._releases += 1
        if self._timeline[-1:] != ["release"]:
            self._timeline.append("release")

    def _observe_safely(self, name: str, args: tuple, kwargs: dict) -> None:
        """Book the call; a failure here must not keep this rank from the collective its peers are in."""
        try:
            self._observe(name, args, kwargs)
        except Exception:
            self.bookkeeping_errors += 1
            if self.bookkeeping_errors == 1:
                logger.exception(
                    "[COLLECTIVE_CENSUS] could not book a %s call; it ran unbooked (later such errors only counted)",
                    name,
                )

    def _observe(self, name: str, args: tuple, kwargs: dict) -> None:
        self._calls += 1
        frame, via = _caller()
        site = f"{name} ({via}) @ {_site_of(frame)}" if via else f"{name} @ {_site_of(frame)}"
        component = self._classify(frame)
        if self._timeline[-1:] != [component]:
            self._timeline.append(component)
        books = self._books[component][site]
        books.calls += 1
        sends, recvs, hidden_bytes = _buffers(name, args, kwargs)
        group = _group(name, args, kwargs)
        if group is not None and persistent_collectives.cpu_twin(group) is group:
            return  # the control plane's gloo group: no device backend, nothing it could register
        pooled = self._pool_membership(site, sends + recvs)
        if not _managed(name, sends + recvs, pooled):
            self._unmanaged[site] += 1
        if (pool := worker_pool()) is not None and not pool.active:
            self._outside_pool_context[component] += 1
        if name == "barrier":
            self._barriers += 1
            return
        books.bytes_sent += sum(t.nbytes for t in sends)
        books.bytes_received += sum(t.nbytes for t in recvs) + hidden_bytes
        for tensor in sends[:1] + recvs[:1]:
            kind = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
            if kind not in books.shapes:
                books.shapes.append(kind)
        seen: dict[int, tuple[str, torch.UntypedStorage]] = {}
        for side, tensors in (("send", sends), ("recv", recvs)):
            for tensor in tensors:
                storage = tensor.untyped_storage()
                base = storage.data_ptr()
                previous = seen.get(base)
                seen[base] = (side if previous is None or previous[0] == side else "send+recv", storage)
        for base, (side, storage) in seen.items():
            keep_alive = storage if self.hold_buffers else None
            self._register((str(storage.device), base), storage.nbytes(), site, side, keep_alive, books)
        if hidden_bytes:
            key = ("hidden", next(self._hidden_ids))
            self._register(key, hidden_bytes, site, "recv (backend temp)", None, books)

    def _register(self, key: Any, nbytes: int, site: str, side: str, keep_alive: Any, books: SiteBooks) -> None:
        if key in self._registry:
            self._registry.move_to_end(key)
            if self._registry[key].window < self._window:
                books.persistent_buffers += 1
            else:
                books.reused_buffers += 1
            return
        books.fresh_buffers += 1
        books.fresh_bytes += nbytes
        self._registry[key] = _Registration(nbytes, keep_alive, self._window)
        self._new[(site, side)] += 1
        self._new_bytes += nbytes
        if self.limit is not None and len(self._registry) > self.limit:
            self._registry.popitem(last=False)
            self._evictions += 1

    def _pool_membership(self, site: str, tensors: list[torch.Tensor]) -> list[bool] | None:
        """In a request running in the worker's pool, whether the pool holds each tensor; books the call where it
        hands over memory outside the pool, as stable or fresh. None outside the request pool's requests."""
        pool = worker_pool()
        if pool is None or not pool.active:
            return None
        if self._pool_segments is None or self._pool_segments._pool is not pool:
            self._pool_segments = PoolSegments(pool)
        pooled = [self._pool_segments.holds(t) for t in tensors]
        outside = {t.untyped_storage().data_ptr() for t, inside in zip(tensors, pooled, strict=True) if not inside}
        outside = {address for address in outside if address}
        if outside and not self.requests:
            self._outside_first |= outside
            self._outside_pool["stable"][site] += 1
        elif outside:
            self._outside_pool["stable" if outside <= self._outside_first else "fresh"][site] += 1
        return pooled

    def pinned_bytes(self) -> int:
        return sum(r.nbytes for r in self._registry.values())

    def add_staged(self, nbytes: int) -> None:
        """Book a copy into or out of a persistent block under its caller's component."""
        self._staged[self._classify(sys._getframe(2))] += nbytes

    def end_request(self) -> RequestReport:
        by_site: dict[str, dict[str, int]] = defaultdict(dict)
        for (site, side), count in sorted(self._new.items()):
            by_site[site][side] = count
        report = RequestReport(
            new_registrations=sum(self._new.values()),
            new_registered_bytes=self._new_bytes,
            pinned_bytes=self.pinned_bytes(),
            registrations=len(self._registry),
            evictions=self._evictions,
            barrier_temps=self._barriers,
            calls=self._calls,
            new_by_site=dict(by_site),
            releases=self._releases,
            timeline=list(self._timeline),
            books={c: {site: asdict(b) for site, b in sites.items()} for c, sites in self._books.items()},
            bookkeeping_errors=self.bookkeeping_errors,
            unmanaged_sites=dict(self._unmanaged),
            staged_bytes=dict(self._staged),
            outside_pool_context=dict(self._outside_pool_context),
            outside_pool_stable=dict(self._outside_pool["stable"]),
            outside_pool_fresh=dict(self._outside_pool["fresh"]),
        )
        self.requests.append(report)
        self._reset_request()
        return report
