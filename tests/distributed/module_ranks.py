# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the staged collectives' tests: every kind, plain (the oracle) and staged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import BackendRecorder, bits, data, is_persistent

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def kinds(rank: int, world: int, dtype: torch.dtype, salt: int) -> dict[str, Callable[[Any], list[torch.Tensor]]]:
    """Each kind as ``run(collectives) -> tensors to compare`` (results, then inputs that must stay untouched)."""
    group = dist.group.WORLD
    splits = [1 + (rank + peer) % 3 for peer in range(world)]  # what this rank sends to each peer
    received = [1 + (peer + rank) % 3 for peer in range(world)]

    def all_reduce(op):
        def run(collectives):
            tensor = data(rank, (5, 7), dtype, salt).t()  # a transposed view: the caller's layout is kept
            return [collectives.all_reduce(tensor, group, op)]

        return run

    def all_gather_into_tensor(collectives):
        tensor = data(rank, (3, 4), dtype, salt)
        output = torch.empty(world * 3, 4, dtype=dtype)
        return [collectives.all_gather_into_tensor(output, tensor, group), tensor]

    def broadcast(collectives):
        tensor = data(rank, (6, 2), dtype, salt)
        return [collectives.broadcast(tensor, world - 1, group)]

    def all_to_all_even(collectives):
        tensor = data(rank, (world * 2, 3), dtype, salt)
        output = torch.empty_like(tensor)
        return [collectives.all_to_all_single(output, tensor, group), tensor]

    def all_to_all_uneven(collectives):
        tensor = data(rank, (sum(splits), 2), dtype, salt)
        output = torch.empty(sum(received), 2, dtype=dtype)
        return [collectives.all_to_all_single(output, tensor, group, received, splits), tensor]

    def ring_batch(collectives):
        send = data(rank, (4, 3), dtype, salt)
        recv = torch.full((4, 3), 7, dtype=dtype)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world, group),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world, group),
        ]
        for work in collectives.batch_isend_irecv(ops):
            work.wait()
        return [recv, send]

    def list_gather(collectives):
        # a list of outputs, as managed_distributed's all_gather hands it on (Ulysses calls that one)
        tensor = data(rank, (2, 5), dtype, salt)
        outputs = [torch.empty(2, 5, dtype=dtype) for _ in range(world)]
        collectives.all_gather_into_tensor(outputs, tensor, group)
        return [*outputs, tensor]

    def list_gather_strided(collectives):
        # outputs of another layout, as a caller may hand them: gathered row-major, then written into each
        tensor = data(rank, (2, 5), dtype, salt)
        outputs = [torch.empty(5, 2, dtype=dtype).t() for _ in range(world)]
        collectives.all_gather_into_tensor(outputs, tensor, group)
        return [*outputs, tensor]

    def reduce_scatter(collectives):
        tensor = data(rank, (world * 3, 2), dtype, salt)
        output = torch.empty(3, 2, dtype=dtype)
        return [collectives.reduce_scatter_tensor(output, tensor, group), tensor]

    return {
        "all_reduce_sum": all_reduce(dist.ReduceOp.SUM),
        "all_reduce_max": all_reduce(dist.ReduceOp.MAX),
        "all_gather_into_tensor": all_gather_into_tensor,
        "broadcast": broadcast,
        "all_to_all_even": all_to_all_even,
        "all_to_all_uneven": all_to_all_uneven,
        "ring_batch": ring_batch,
        "list_gather": list_gather,
        "list_gather_strided": list_gather_strided,
        "reduce_scatter": reduce_scatter,
    }


def _log_lines(logger_name: str) -> list[str]:
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(logger_name).addHandler(handler)
    return lines


def checks(rank: int, world: int) -> dict[str, Any]:
    """Bits against the plain oracle; what the backend is handed; aliasing; barrier; fallbacks on one rank."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    torch.set_num_threads(1)
    plain, staged = ModuleCollectives(persistent=False), ModuleCollectives(persistent=True)
    report: dict[str, Any] = {"equal": {}, "aliases": []}
    recorder = BackendRecorder()
    with recorder:
        for salt in range(3):  # three "requests": fresh caller tensors each time, blocks from the first on
            for dtype in DTYPES:
                expected = {name: run(plain) for name, run in kinds(rank, world, dtype, salt).items()}
                for name, run in kinds(rank, world, dtype, salt).items():
                    got = run(staged)
                    key = f"{name}/{dtype}"
                    report["equal"][key] = report["equal"].get(key, True) and [bits(t) for t in got] == [
                        bits(t) for t in expected[name]
                    ]
                    report["aliases"] += [key for t in got if is_persistent(t)]
            recorder.end_request()
    # The plain half of each request hands the backend caller tensors; the staged half only blocks. Count both.
    report["requests"] = recorder.summary()
    report["stats"] = staged.stats()

    # Staged only, three requests: the backend sees the blocks of request 1 again and nothing else.
    staged_only = BackendRecorder()
    with staged_only:
        for salt in range(3):
            for run in kinds(rank, world, torch.float32, salt).values():
                run(staged)
            staged.barrier(None, torch.device("cpu"))
            staged_only.end_request()
    report["staged_only"] = staged_only.summary()
    report["allocations_after_request_1"] = staged.stats()["block_allocations"] - report["stats"]["block_allocations"]

    # A barrier holds every rank until the last arrives.
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        time.sleep(0.5)
    staged.barrier(None, torch.device("cpu"))
    report["barrier_waited_s"] = time.monotonic() - start
    report["fallback"] = fallback_on_rank_one(rank, world)
    return report


def fallback_on_rank_one(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's allocator fails: it runs the plain collectives on its own tensors, its peers stage, none hangs."""
    from vllm_omni.distributed import collective_workspaces
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    warnings = _log_lines("vllm_omni.distributed.persistent_collectives")
    staged = ModuleCollectives(persistent=True)
    real = collective_workspaces.allocate_bytes

    def failing(nbytes, device, group=None):
        raise RuntimeError(f"injected: no memory for {nbytes} bytes")

    if rank == 1:
        collective_workspaces.allocate_bytes = failing
    try:
        results = [run(staged) for run in kinds(rank, world, torch.float32, 7).values()]
        staged.barrier(None, torch.device("cpu"))
    finally:
        collective_workspaces.allocate_bytes = real
    expected = [run(ModuleCollectives(persistent=False)) for run in kinds(rank, world, torch.float32, 7).values()]
    return {
        "equal": [[bits(t) for t in got] for got in results] == [[bits(t) for t in want] for want in expected],
        "fallbacks": staged.fallbacks,
        "warnings": warnings,
    }


def shared_blocks(rank: int, world: int) -> dict[str, Any]:
    """The modules' calls and the coordinator's on one group: one block between them."""
    from vllm_omni.distributed import persistent_collectives as pc
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    coordinators = pc.Collectives(persistent=True)
    modules = ModuleCollectives(persistent=True, blocks_of=coordinators)
    tensor = data(rank, (world * 4,), torch.float32)
    coordinators.all_reduce(tensor.clone(), None)
    modules.reduce_scatter_tensor(torch.empty(4), tensor.clone(), None)
    modules.all_to_all_single(torch.empty_like(tensor), tensor.clone(), None)
    return {"blocks": len(coordinators.blocks()), "shared": modules.blocks() == coordinators.blocks()}
