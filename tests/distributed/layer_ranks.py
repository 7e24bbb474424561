# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the persistent-collectives tests: every collective kind, plain and staged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Values that differ per rank, call and element, and whose float sums are not exact in low precision."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 3.7).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=generator, dtype=dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).clone()


class BackendRecorder:
    """Wraps the layer's ``plain`` functions and records the storages every backend call was handed."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.calls: list[tuple[str, list[int]]] = []
        self.saved = dict(layer.plain)
        for name, fn in self.saved.items():
            layer.plain[name] = self._recording(name, fn)

    def _recording(self, name: str, fn: Callable) -> Callable:
        def record(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            for value in (*args, *kwargs.values()):
                if isinstance(value, list):
                    tensors += [
                        getattr(v, "tensor", v) for v in value if isinstance(getattr(v, "tensor", v), torch.Tensor)
                    ]
            self.calls.append((name, [t.untyped_storage().data_ptr() for t in tensors]))
            return fn(*args, **kwargs)

        return record

    def take(self) -> list[tuple[str, list[int]]]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        self.layer.plain.update(self.saved)


def kinds(rank: int, world: int, dtype: torch.dtype, salt: int) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One call of each kind on fresh tensors; each returns the tensors the caller reads afterwards."""

    def all_reduce() -> list[torch.Tensor]:
        tensor = data(rank, (5, 33), dtype, salt)
        dist.all_reduce(tensor)
        return [tensor]

    def all_reduce_sum_transposed() -> list[torch.Tensor]:
        tensor = data(rank, (33, 6), dtype, salt).t()
        dist.all_reduce(tensor)
        return [tensor]

    def all_reduce_max_non_contiguous() -> list[torch.Tensor]:
        tensor = data(rank, (33, 6), dtype, salt).t()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [tensor]

    def broadcast() -> list[torch.Tensor]:
        tensor = data(rank, (7, 3, 5), dtype, salt)
        dist.broadcast(tensor, src=world - 1)
        return [tensor]

    def all_gather_into_tensor() -> list[torch.Tensor]:
        output = torch.zeros((world * 4, 9), dtype=dtype)
        dist.all_gather_into_tensor(output, data(rank, (4, 9), dtype, salt))
        return [output]

    def all_gather_into_flat() -> list[torch.Tensor]:
        output = torch.zeros(world * 12, dtype=dtype)
        dist.all_gather_into_tensor(output, data(rank, (12,), dtype, salt))
        return [output]

    def all_gather_list() -> list[torch.Tensor]:
        outputs = [torch.zeros((9, 4), dtype=dtype).t() for _ in range(world)]  # non-contiguous outputs
        dist.all_gather(outputs, data(rank, (4, 9), dtype, salt))
        return outputs

    def all_to_all_single() -> list[torch.Tensor]:
        output = torch.zeros((world * 3, 5), dtype=dtype)
        dist.all_to_all_single(output, data(rank, (world * 3, 5), dtype, salt))
        return [output]

    def all_to_all_single_uneven() -> list[torch.Tensor]:
        sends = [1 + (rank + peer) % 3 for peer in range(world)]
        receives = [1 + (peer + rank) % 3 for peer in range(world)]
        output = torch.zeros((sum(receives), 2), dtype=dtype)
        dist.all_to_all_single(output, data(rank, (sum(sends), 2), dtype, salt), receives, sends)
        return [output]

    def ring_batch() -> list[torch.Tensor]:
        send, received = data(rank, (6, 8), dtype, salt), torch.zeros((6, 8), dtype=dtype)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, received, (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [received]

    return {fn.__name__: fn for fn in (
        all_reduce, all_reduce_sum_transposed, all_reduce_max_non_contiguous, broadcast, all_gather_into_tensor,
        all_gather_into_flat, all_gather_list,
        all_to_all_single, all_to_all_single_uneven, ring_batch,
    )}  # fmt: skip


@contextlib.contextmanager
def allocator_raises(error: BaseException, failing: bool) -> Iterator[None]:
    """Within, the workspaces' allocator raises ``error`` on this rank if ``failing``."""
    from vllm_omni.distributed import collective_workspaces

    real_allocate = collective_workspaces.allocate_bytes

    def raising(*args, **kwargs):
        raise error

    if failing:
        collective_workspaces.allocate_bytes = raising
    try:
        yield
    finally:
        collective_workspaces.allocate_bytes = real_allocate


def one_rank_cannot_allocate(rank: int, world: int, layer: Any, error: BaseException) -> dict[str, Any]:
    """Rank 1's allocator raises ``error`` for three all-reduces; what every rank then holds and counted."""
    before = layer.stats()["fallbacks"]
    with allocator_raises(error, failing=rank == 1):
        big = [torch.full((1 << 16,), float(rank + call)) for call in range(3)]
        for tensor in big:
            dist.all_reduce(tensor)
    return {
        "values": [float(t[0]) for t in big],
        "expected": [float(sum(r + call for r in range(world))) for call in range(3)],
        "fallbacks": layer.stats()["fallbacks"] - before,
        "warned": sorted(layer._fallbacks_logged),
    }


def checks(rank: int, world: int) -> dict[str, Any]:
    from vllm_omni.distributed import collective_workspaces, persistent_collectives
    from vllm_omni.distributed.persistent_collectives import install_persistent_collectives, installed

    report: dict[str, Any] = {"equal": {}, "addresses": {}, "aliases": [], "fallback": {}}
    plain_results: dict[str, list[torch.Tensor]] = {}
    for dtype in DTYPES:  # plain first, before the layer exists
        for name, run in kinds(rank, world, dtype, salt=1).items():
            plain_results[f"{name}/{dtype}"] = [bits(t) for t in run()]

    assert install_persistent_collectives(enabled=True, device_type="cpu")
    layer = installed()
    # Sized before the first call: the largest collective below (a 5 x 33 int64 all-reduce) allocates nothing.
    reserved = layer.reserve(5 * 33 * 8)
    report["reserved"] = {"bytes": reserved, "allocations": layer.stats()["workspace_allocations"]}
    dist.all_reduce(data(rank, (5, 33), torch.int64))
    report["reserved"]["allocations_after_first_call"] = layer.stats()["workspace_allocations"]
    try:
        layer.reserve(0)
    except ValueError as error:
        report["reserved"]["bad"] = str(error)
    recorder = BackendRecorder(layer)

    # Values, bit for bit, and where the backend was handed its buffers.
    workspaces = lambda: {w.block.untyped_storage().data_ptr() for p in layer.all_pools() for w in p.workspaces}  # noqa: E731
    for request in range(3):
        handed: set[int] = set()
        for dtype in DTYPES:
            for name, run in kinds(rank, world, dtype, salt=1).items():
                got = run()
                calls = recorder.take()
                report["equal"][f"{name}/{dtype}"] = all(
                    torch.equal(bits(t), want) for t, want in zip(got, plain_results[f"{name}/{dtype}"], strict=True)
                )
                ptrs = {p for _, call in calls for p in call}
                handed |= ptrs
                if any(t.untyped_storage().data_ptr() in workspaces() for t in got):
                    report["aliases"].append(name)
                if any(p in {t.untyped_storage().data_ptr() for t in got} for p in ptrs):
                    report["aliases"].append(f"{name}: the caller's tensor reached the backend")
        report["addresses"][request] = {
            "handed": sorted(handed),
            "workspaces": sorted(workspaces()),
            "allocations": layer.stats()["workspace_allocations"],
        }

    # In-place: an all-reduce's result is in the very tensor the caller passed.
    tensor = data(rank, (8,), torch.float32, salt=2)
    before = (id(tensor), tensor.data_ptr())
    dist.all_reduce(tensor)
    report["in_place"] = before == (id(tensor), tensor.data_ptr())

    # Asynchronous: nothing is copied out before wait(); two in flight hold two workspaces.
    first, second = torch.full((16,), float(rank)), torch.full((1024,), float(rank))
    work_1 = dist.all_reduce(first, async_op=True)
    work_2 = dist.all_reduce(second, async_op=True)
    (pool,) = layer.all_pools()
    report["async"] = {
        "busy_in_flight": sum(w.busy for w in pool.workspaces),
        "untouched_before_wait": bool((first == rank).all() and (second == rank).all()),
        "work_type": type(work_1).__name__,
    }
    work_2.wait()
    work_1.wait()
    total = float(sum(range(world)))
    report["async"]["after_wait"] = bool((first == total).all() and (second == total).all())
    report["async"]["busy_after_wait"] = sum(w.busy for w in pool.workspaces)
    try:
        dist.all_reduce(torch.ones(4), async_op=True).get_future()
    except NotImplementedError as error:
        report["async"]["get_future"] = str(error)

    # A persistent block goes to the backend as it is: no second staging.
    block = collective_workspaces.allocate_bytes(64, torch.device("cpu"), None).view(torch.float32)
    block.fill_(1.0)
    recorder.take()
    dist.all_reduce(block)
    report["persistent_passed_through"] = [block.untyped_storage().data_ptr()] == recorder.take()[0][1]

    # Rank 1 cannot grow a workspace: it runs the plain collective, once logged; every rank gets the result.
    logged: list[str] = []
    real_fallback = layer._fallback
    layer._fallback = lambda name, kind, reason: (logged.append(reason), real_fallback(name, kind, reason))
    no_memory = torch.OutOfMemoryError("stand-in: no device memory for the workspace")
    report["fallback"] = {**one_rank_cannot_allocate(rank, world, layer, no_memory), "reasons": logged}
    recorder.close()
    persistent_collectives.uninstall_persistent_collectives()
    report["uninstalled"] = dist.all_reduce is layer.originals["torch.distributed", "all_reduce"]
    return report
