# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the contract tests: every case once plain and once staged, observed alike.

A case returns what its caller could observe: results as bits, what was returned, what was raised. The test
compares the staged observation with the plain one, which is the oracle.
"""

from __future__ import annotations

import gc
import re
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.layer_ranks import BackendRecorder, allocator_raises, bits, data, one_rank_cannot_allocate


def observe(case: Callable[[], Any]) -> dict[str, Any]:
    """Run a case; what it returned (tensors as bits, works by type) or what it raised."""
    try:
        value = case()
    except Exception as error:  # the plain collective's error is part of its contract
        # How far a version counter moved is the backend's own business (gloo bumps once per chunk it writes).
        message = re.sub(r"version \d+", "version N", str(error).splitlines()[0])
        return {"raised": type(error).__name__, "message": message}
    if isinstance(value, dict):
        return {k: bits(v).tolist() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return {"value": value}


def cases(rank: int, world: int, groups: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    outside = groups["outside"]  # ranks 1 and 2: rank 0 and rank 3 are not in it
    first, second = groups["first"], groups["second"]  # every rank, with a short timeout: a hang is an error

    def outside_group_sync() -> dict:
        tensors = {k: data(rank, (4, 6), torch.float32, salt) for k, salt in (("reduce", 1), ("bcast", 2), ("a2a", 3))}
        output = torch.zeros(4, 6)
        returned = [
            dist.all_reduce(tensors["reduce"], group=outside),
            dist.broadcast(tensors["bcast"], src=1, group=outside),
            dist.all_to_all_single(output, tensors["a2a"], group=outside),
        ]
        return {**tensors, "output": output, "returned": [type(r).__name__ for r in returned]}

    def outside_group_async() -> dict:
        tensor = data(rank, (5,), torch.float32, 4)
        work = dist.all_reduce(tensor, group=outside, async_op=True)
        if work is not None:
            work.wait()
        return {"tensor": tensor, "work": type(work).__name__ if work is None else "a work"}

    def coalesced() -> dict:
        first, second = data(rank, (3, 4), torch.float32, 5), data(rank, (7,), torch.float32, 6)
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(first)
            dist.all_reduce(second)
        manager.wait()
        return {"first": first, "second": second}

    def transposed_sum() -> dict:
        tensor = data(rank, (33, 96), torch.float32, 7).t()  # 4 ranks: each element's ring chunk is its memory slot
        dist.all_reduce(tensor)
        return {"tensor": tensor, "strides": list(tensor.stride())}

    def strided_with_gaps() -> dict:
        base = data(rank, (10, 20), torch.float32, 8)
        dist.all_reduce(base[:, ::2])
        return {"base": base}

    def saved_for_backward() -> dict:
        x = data(rank, (6,), torch.float32, 9).requires_grad_()
        y = x.exp()  # exp saves its output for backward
        before = y._version
        dist.all_reduce(y)
        bump = y._version - before
        y.sum().backward()
        return {"version_bump": bump, "grad": x.grad}

    def flat_output_2d_input() -> dict:
        output = torch.zeros(world * 6)
        dist.all_gather_into_tensor(output, data(rank, (2, 3), torch.float32, 10))
        return {"output": output}

    def flat_output_0d_input() -> dict:
        output = torch.zeros(world)
        dist.all_gather_into_tensor(output, data(rank, (), torch.float32, 11))
        return {"output": output}

    def stacked_output() -> dict:
        output = torch.zeros(world, 5)
        dist.all_gather_single(output, data(rank, (5,), torch.float32, 12))
        return {"output": output}

    def dropped_works() -> dict:
        # More than a pool's 8 workspaces, each work dropped at once. Plain, a dropped work's result lands whenever
        # the backend's threads finish it; staged, at the layer's next call once the backend has finished it.
        # Integers make every sum exact; the same number of later calls on every rank keeps the ranks in step.
        tensors = [data(rank, (16,), torch.int64, 20 + i) for i in range(10)]
        for tensor in tensors:
            dist.all_reduce(tensor, async_op=True)
        gc.collect()
        for _ in range(20):
            time.sleep(0.01)
            dist.all_reduce(torch.zeros(1))
        sums = [sum(data(r, (16,), torch.int64, 20 + i) for r in range(world)) for i in range(10)]
        return {"landed": all(torch.equal(t, s) for t, s in zip(tensors, sums, strict=True))}

    def dropped_work_then_another_group() -> dict:
        # Rank 0 drops a work on one group, then joins a collective on another that its peers enter first.
        a, b = torch.full((4,), float(rank)), torch.full((4,), 10.0 * rank)
        if rank == 0:
            dist.all_reduce(a, group=first, async_op=True)
            dist.all_reduce(b, group=second)
        else:
            dist.all_reduce(b, group=second)
            dist.all_reduce(a, group=first)
        for _ in range(10):
            time.sleep(0.01)
            dist.all_reduce(torch.zeros(1), group=second)
        return {"a": a, "b": b}

    def gather_output_saved_for_backward() -> dict:
        weight = torch.ones(world * 3, requires_grad=True)
        output, parts = torch.zeros(world * 3), [torch.zeros(3) for _ in range(world)]
        loss = (weight * output).sum() + sum((weight[:3] * p).sum() for p in parts)
        dist.all_gather_into_tensor(output, data(rank, (3,), torch.float32, 13))
        dist.all_gather(parts, data(rank, (3,), torch.float32, 14))
        loss.backward()  # plain raises: the gathers bumped the outputs' versions
        return {"grad": weight.grad}

    def bool_sum() -> dict:
        tensor = torch.tensor([True, False, rank % 2 == 0, True])
        dist.all_reduce(tensor)
        return {"bytes": tensor.view(torch.uint8)}

    def conjugated_complex() -> dict:
        tensor = torch.complex(data(rank, (5,), torch.float32, 15), data(rank, (5,), torch.float32, 16)).conj()
        dist.all_reduce(tensor)
        return {"tensor": torch.view_as_real(tensor.resolve_conj())}

    def p2p_as_a_tuple() -> dict:
        send, received = data(rank, (4,), torch.float32, 17), torch.zeros(4)
        ops = (dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return {"received": received}

    def all_to_all_in_place() -> dict:
        tensor = data(rank, (world * 2,), torch.float32, 18)
        dist.all_to_all_single(tensor, tensor)
        return {"tensor": tensor}

    def object_collectives() -> dict:
        # Each packs its objects into tensors on the group's device and calls distributed_c10d's own broadcast and
        # list all_gather: the names the layer patches beside torch.distributed's.
        objects = [{"rank": rank, "prompt": "x" * (7 * rank + 1)}, None]
        dist.broadcast_object_list(objects, src=world - 1)
        gathered = [None] * world
        dist.all_gather_object(gathered, ("shape", rank, [rank] * rank))
        return {"broadcast": objects, "gathered": [list(g) for g in gathered]}

    def chained_on_one_tensor() -> dict:
        # The second call reads what the first wrote, as the backend runs a group's calls in the order issued.
        tensor = data(rank, (6,), torch.int64, 19)
        work = dist.all_reduce(tensor, async_op=True)
        dist.all_reduce(tensor)
        work.wait()
        return {"tensor": tensor}

    def average_saved_for_backward() -> dict:
        x = data(rank, (6,), torch.float32, 21).requires_grad_()
        y = x.exp()
        before = y._version
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        bump = y._version - before
        y.sum().backward()  # plain raises: the division bumped the version
        return {"version_bump": bump, "grad": x.grad}

    def average_of_integers() -> dict:
        tensor = data(rank, (6,), torch.int64, 22)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
            raised = None
        except RuntimeError as error:  # plain: the sum is written, then the division refuses integers
            raised = str(error).splitlines()[0]
        return {"tensor": tensor, "raised": raised}

    def barrier_after_async_work() -> dict:
        # gloo's barrier waits for the group's earlier work: its result is there before wait() is called.
        tensor = data(rank, (6,), torch.int64, 23)
        work = dist.all_reduce(tensor, async_op=True)
        dist.barrier()
        seen = tensor.clone()
        work.wait()
        return {"seen": seen, "tensor": tensor}

    def barrier_with_a_timeout_on_one_rank() -> dict:
        if rank == 0:
            dist.barrier(group=first, timeout=timedelta(seconds=30))
        else:
            dist.barrier(group=first)
        dist.barrier(group=first, async_op=True).wait()
        return {"passed": True}

    def sends_and_receives_on_views_of_one_buffer() -> dict:
        # Two batches on disjoint halves of one buffer: neither waits for the other, as plain ones do not.
        buffer = data(rank, (8,), torch.float32, 24)
        sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer[:4], (rank + 1) % world, group=first)])
        receives = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer[4:], (rank - 1) % world, group=first)])
        for work in sends + receives:
            work.wait()
        return {"buffer": buffer}

    def two_groups_on_disjoint_views_in_either_order() -> dict:
        # gloo orders calls within a group only: rank 0 enters the groups in the other order.
        buffer = data(rank, (8,), torch.float32, 25)
        if rank == 0:
            work = dist.all_reduce(buffer[:4], group=first, async_op=True)
            dist.all_reduce(buffer[4:], group=second)
            work.wait()
        else:
            dist.all_reduce(buffer[4:], group=second)
            dist.all_reduce(buffer[:4], group=first)
        return {"buffer": buffer}

    def barrier_after_a_send() -> dict:
        # gloo's barrier does not wait for point-to-point work: rank 1 receives only after the barrier.
        tensor = data(rank, (4,), torch.float32, 26)
        if rank == 0:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, 1, group=first)])
            dist.barrier(group=first)
            for work in works:
                work.wait()
        else:
            dist.barrier(group=first)
            if rank == 1:
                for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, 0, group=first)]):
                    work.wait()
        return {"tensor": tensor}

    def wait_that_times_out_then_succeeds() -> dict:
        # Rank 0 gives up waiting once, runs another collective, then waits again; its peers arrive late.
        tensor, other = data(rank, (4,), torch.float32, 27), data(rank, (4,), torch.float32, 28)
        if rank == 0:
            work = dist.all_reduce(tensor, group=first, async_op=True)
            try:
                work.wait(timedelta(milliseconds=200))
                first_wait = "completed"
            except RuntimeError:
                first_wait = "timed out"
            dist.all_reduce(other, group=first)
            work.wait()
        else:
            time.sleep(1.0)
            dist.all_reduce(tensor, group=first)
            dist.all_reduce(other, group=first)
            first_wait = None
        return {"tensor": tensor, "other": other, "first_wait": first_wait}

    return {fn.__name__: fn for fn in (
        outside_group_sync, outside_group_async, coalesced, transposed_sum, strided_with_gaps, saved_for_backward,
        flat_output_2d_input, flat_output_0d_input, stacked_output, dropped_works, object_collectives,
        dropped_work_then_another_group, gather_output_saved_for_backward, bool_sum, conjugated_complex,
        p2p_as_a_tuple, all_to_all_in_place, chained_on_one_tensor, average_saved_for_backward, average_of_integers,
        barrier_after_async_work, barrier_with_a_timeout_on_one_rank, sends_and_receives_on_views_of_one_buffer,
        two_groups_on_disjoint_views_in_either_order, barrier_after_a_send, wait_that_times_out_then_succeeds,
    )}  # fmt: skip


def signature_less(fn: Callable) -> Callable:
    """A profiler-style wrapper installed before the layer: ``(*args, **kwargs)``, no ``functools.wraps``."""

    def recorded(*args, **kwargs):
        signature_less.calls += 1
        return fn(*args, **kwargs)

    return recorded


signature_less.calls = 0


def checks(rank: int, world: int) -> dict[str, Any]:
    from vllm_omni.distributed.persistent_collectives import (
        KINDS,
        install_persistent_collectives,
        installed,
        uninstall_persistent_collectives,
    )

    short = timedelta(seconds=20)
    groups = {
        "outside": dist.new_group([1, 2]),
        "first": dist.new_group(list(range(world)), timeout=short),
        "second": dist.new_group(list(range(world)), timeout=short),
    }
    report: dict[str, Any] = {"plain": {}, "staged": {}}
    for name, case in cases(rank, world, groups).items():
        report["plain"][name] = observe(case)

    # A recorder wraps every collective before the layer, the way a profiler does: without a signature.
    wrapped = {name: getattr(dist, name) for name in KINDS}
    for name in KINDS:
        setattr(dist, name, signature_less(wrapped[name]))
    assert install_persistent_collectives(enabled=True, device_type="cpu")
    layer = installed()
    recorder = BackendRecorder(layer)
    for name, case in cases(rank, world, groups).items():
        before = layer.stats()
        report["staged"][name] = observe(case)
        report["staged"][name]["_handed"] = sorted({name for name, _ in recorder.take()})
        report["staged"][name]["_staged"] = layer.stats()["staged_calls"] - before["staged_calls"]
        report["staged"][name]["_fallbacks"] = layer.stats()["fallbacks"] - before["fallbacks"]
        report["staged"][name]["_passed"] = layer.stats()["passed_through"] - before["passed_through"]
    report["busy_after_all"] = sum(w.busy for p in layer.all_pools() for w in p.workspaces)
    report["recorder_calls"] = signature_less.calls
    recorder.close()

    # Any allocator error on one rank (the CPU allocator's is a RuntimeError): that rank runs the plain collective.
    cpu_allocator_error = RuntimeError("stand-in: DefaultCPUAllocator: can't allocate memory")
    report["allocator_error"] = one_rank_cannot_allocate(rank, world, layer, cpu_allocator_error)

    # A waited work still referenced does not keep a grown workspace's old block alive.
    fresh = dist.new_group(list(range(world)))
    kept = dist.all_reduce(torch.ones(8), group=fresh, async_op=True)
    kept.wait()
    (pool,) = layer.pools[fresh].values()
    (workspace,) = pool.workspaces
    old_block = weakref.ref(workspace.block.untyped_storage())
    dist.all_reduce(torch.ones(1 << 14), group=fresh)
    gc.collect()
    report["lifetime"] = {
        "old_block_freed": old_block() is None,
        "resident_is_live": pool.resident_bytes == workspace.block.numel(),
        "kept": kept is not None,
    }

    # Pools die with their group.
    pools_before = len(layer.pools)
    for _ in range(10):
        group = dist.new_group(list(range(world)))
        dist.all_reduce(torch.ones(4096), group=group)
        dist.destroy_process_group(group)
        del group
    gc.collect()
    report["pools"] = {"before": pools_before, "after": len(layer.pools)}

    # A barrier: an all-reduce of a workspace region; it holds every rank until the last arrives.
    recorder = BackendRecorder(layer)
    if rank == 0:
        time.sleep(1.0)
    arrived = time.time()  # one clock for every rank on this machine
    dist.barrier()
    report["barrier"] = {"arrived": arrived, "left": time.time(), "calls": [name for name, _ in recorder.take()]}

    # A barrier on a rank that gets no workspace (a new group's first call, its allocator failing on rank 1).
    fresh = dist.new_group(list(range(world)), timeout=short)
    before = layer.stats()["fallbacks"]
    with allocator_raises(cpu_allocator_error, failing=rank == 1):
        report["barrier_without_workspace"] = observe(lambda: {"returned": dist.barrier(group=fresh)})
    report["barrier_without_workspace"]["fallbacks"] = layer.stats()["fallbacks"] - before
    report["barrier_without_workspace"]["calls"] = [name for name, _ in recorder.take()]
    recorder.close()
    uninstall_persistent_collectives()
    for name in KINDS:
        setattr(dist, name, wrapped[name])
    return report
