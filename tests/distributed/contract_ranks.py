# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the contract tests: the staged collectives beside the plain ones where they used to
depart (batches in flight, a group this rank is not in, the batch's work), capped blocks, and streams."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import bits, data

CAP_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"
MIB = 1 << 20


def _ring_ops(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, group: Any = None):
    return [
        dist.P2POp(dist.isend, send, (rank + 1) % world, group),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world, group),
    ]


def batches_in_flight(rank: int, world: int) -> dict[str, Any]:
    """Each rank posts its send and its receive as two batches before waiting either: the receive that matches a
    peer's first batch is in this rank's second. Torch posts both at once; so must the staged batch."""
    from vllm_omni.distributed import persistent_collectives as pc

    def run(batch_isend_irecv) -> tuple[list[bytes], float]:
        send, recv = data(rank, (64, 3), torch.float32), torch.zeros(64, 3)
        start = time.monotonic()
        sends = batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world)])
        receives = batch_isend_irecv([dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
        for work in (*sends, *receives):
            work.wait()
        return [bits(recv), bits(send)], time.monotonic() - start

    staged = pc.Collectives(persistent=True)
    plain, _ = run(dist.batch_isend_irecv)
    got = [run(staged.batch_isend_irecv) for _ in range(3)]  # three "requests": the pool's blocks are reused
    return {
        "equal": all(result == plain for result, _ in got),
        "slowest_s": max(seconds for _, seconds in got),
        "fallbacks": staged.fallbacks,
        "blocks": len(staged.blocks()),
        "allocations": staged.stats()["block_allocations"],
    }


def abandoned_batches(rank: int, world: int) -> dict[str, Any]:
    """Batches nobody waits (their caller raised between post and wait) keep their blocks; once the group's pool is
    full, the next batch waits for the oldest (its peers posted its match long ago) and takes its block."""
    from vllm_omni.distributed import persistent_collectives as pc

    staged = pc.Collectives(persistent=True)
    dropped = [(data(rank, (4, 3), torch.float32, salt), torch.zeros(4, 3)) for salt in range(pc.MAX_BATCHES)]
    for send, recv in dropped:
        staged.batch_isend_irecv(_ring_ops(rank, world, send, recv))
    full = len(staged.blocks())
    results = []
    for salt in (100, 101):
        mine, theirs = data(rank, (4, 3), torch.float32, salt), torch.zeros(4, 3)
        for work in staged.batch_isend_irecv(_ring_ops(rank, world, mine, theirs)):
            work.wait()
        results.append(bits(theirs) == bits(data((rank - 1) % world, (4, 3), torch.float32, salt)))
    landed = [bits(recv) == bits(data((rank - 1) % world, (4, 3), torch.float32, salt)) for salt, (_, recv) in
              enumerate(dropped)]  # fmt: skip
    blocks = (full, len(staged.blocks()))
    return {"equal": all(results), "fallbacks": staged.fallbacks, "landed": landed, "blocks": blocks}


def batch_work(rank: int, world: int) -> dict[str, Any]:
    """What a caller of torch's batch may ask of its work, asked of the staged batch's and of plain gloo's."""
    from vllm_omni.distributed import persistent_collectives as pc

    def ask(batch_isend_irecv, how: str) -> dict[str, Any]:
        send, recv = data(rank, (5, 2), torch.float32), torch.zeros(5, 2)
        works = batch_isend_irecv(_ring_ops(rank, world, send, recv))
        pending = [work.is_completed() for work in works]  # gloo completes a point-to-point work once waited
        try:
            for work in works:
                work.get_future().wait() if how == "future" else work.wait(timeout=timedelta(seconds=60))
        except RuntimeError as error:  # gloo's point-to-point works have no future: the staged batch's neither
            for work in works:
                work.wait()
            return {"raised": str(error)}
        return {
            "received": bits(recv) == bits(data((rank - 1) % world, (5, 2), torch.float32)),
            "completed": (any(pending), all(work.is_completed() for work in works)),
            "exception": [work.exception() for work in works if work.exception() is not None],
        }

    staged = pc.Collectives(persistent=True)
    report = {}
    for how in ("wait", "future"):
        report[how] = {"plain": ask(dist.batch_isend_irecv, how), "staged": ask(staged.batch_isend_irecv, how)}
    report["fallbacks"] = staged.fallbacks
    return report


def non_member(rank: int, world: int) -> dict[str, Any]:
    """A collective on a group this rank is not in: torch warns and returns, the tensors untouched."""
    from vllm_omni.distributed import persistent_collectives as pc

    pair = dist.new_group([0, 1])
    report: dict[str, Any] = {}
    for name, collectives in (("plain", pc.Collectives(persistent=False)), ("staged", pc.Collectives(True))):
        tensors = [data(rank, (2, 4), torch.float32, salt) for salt in range(4)]
        kept = [bits(t) for t in tensors]
        outcome = "ok"
        try:
            collectives.all_reduce(tensors[0], pair)
            collectives.broadcast(tensors[1], 0, pair)
            collectives.all_gather_into_tensor(torch.zeros(4, 4), tensors[2], pair)
            collectives.all_to_all_single(torch.zeros(2, 4), tensors[3], pair)
            collectives.barrier(pair, torch.device("cpu"))
        except Exception as error:  # noqa: BLE001 - reported: the staged one must do what the plain one does
            outcome = f"{type(error).__name__}: {error}"
        report[name] = {"outcome": outcome, "untouched": [bits(t) for t in tensors] == kept}
    dist.barrier()
    return report


def capped_blocks(rank: int, world: int) -> dict[str, Any]:
    """Calls of several MiB through blocks capped at 1 MiB, each kind beside the plain collective."""
    from vllm_omni.distributed import persistent_collectives as pc

    os.environ[CAP_ENV] = "1"
    group = dist.group.WORLD
    per_peer = (3 * MIB) // (4 * world) + 5  # elements: a last chunk shorter than the others

    def kinds(salt: int) -> dict[str, Any]:
        return {
            "broadcast": lambda c: [c.broadcast(data(rank, (3 * MIB // 4 + 7,), torch.float32, salt), 1, group)],
            "all_gather": lambda c: [
                c.all_gather_into_tensor(
                    torch.empty(world * (MIB // 4 + 3), dtype=torch.float32),
                    data(rank, (MIB // 4 + 3,), torch.float32, salt),
                    group,
                )
            ],
            "all_to_all": lambda c: [
                c.all_to_all_single(
                    torch.empty(world * per_peer, dtype=torch.float32),
                    data(rank, (world * per_peer,), torch.float32, salt),
                    group,
                )
            ],
            "all_reduce_int": lambda c: [c.all_reduce(data(rank, (3 * MIB // 8 + 1,), torch.int64, salt), group)],
            "list_gather": lambda c: c.all_gather_into_tensor(
                [torch.empty(MIB // 8 + 1, dtype=torch.bfloat16) for _ in range(world)],
                data(rank, (MIB // 8 + 1,), torch.bfloat16, salt),
                group,
            ),
        }

    plain, staged = pc.Collectives(persistent=False), pc.Collectives(persistent=True)
    report: dict[str, Any] = {"equal": {}}
    for salt in range(2):
        for name, run in kinds(salt).items():
            same = [bits(t) for t in run(staged)] == [bits(t) for t in run(plain)]
            report["equal"][name] = report["equal"].get(name, True) and same
    report["chunked_calls"] = staged.chunked_calls
    report["resident_bytes"] = staged.stats()["resident_bytes"]
    report["allocations"] = staged.stats()["block_allocations"]

    # A floating-point sum on more than two ranks: chunks would change its bits, so it is staged whole.
    tensor = data(rank, (3 * MIB // 4,), torch.float32)
    whole = staged.all_reduce(tensor.clone(), group)
    report["float_equal"] = bits(whole) == bits(plain.all_reduce(tensor.clone(), group))
    chunked = torch.cat([plain.all_reduce(part.clone(), group) for part in tensor.split(MIB // 4)])
    report["chunks_would_differ"] = bits(chunked) != bits(whole)
    report["float_resident_bytes"] = staged.stats()["resident_bytes"]
    return report


def capped_blocks_two_ranks(rank: int, world: int) -> dict[str, Any]:
    """On two ranks a floating-point sum is the same in any order: it goes in chunks, with the plain bits."""
    from vllm_omni.distributed import persistent_collectives as pc

    os.environ[CAP_ENV] = "1"
    plain, staged = pc.Collectives(persistent=False), pc.Collectives(persistent=True)
    tensor = data(rank, (3 * MIB // 4 + 3,), torch.bfloat16)
    got = staged.all_reduce(tensor.clone(), None)
    return {
        "equal": bits(got) == bits(plain.all_reduce(tensor.clone(), None)),
        "chunked_calls": staged.chunked_calls,
        "resident_bytes": staged.stats()["resident_bytes"],
    }


def capped_fallback(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 gets no block: it runs the same chunks on its own tensors, so its peers' chunked calls still match."""
    from vllm_omni.distributed import collective_workspaces
    from vllm_omni.distributed import persistent_collectives as pc

    os.environ[CAP_ENV] = "1"

    def failing(nbytes, device, group=None):
        raise RuntimeError(f"injected: no memory for {nbytes} bytes")

    real = collective_workspaces.allocate_bytes
    if rank == 1:
        collective_workspaces.allocate_bytes = failing
    staged, plain = pc.Collectives(persistent=True), pc.Collectives(persistent=False)
    calls = {
        "broadcast": lambda c: c.broadcast(data(rank, (MIB // 2 + 1,), torch.float32), 0, None),
        "all_gather": lambda c: c.all_gather_into_tensor(
            torch.empty(world * MIB // 8), data(rank, (MIB // 8,), torch.float32), None
        ),
        "all_to_all": lambda c: c.all_to_all_single(
            torch.empty(world * MIB // 8), data(rank, (world * MIB // 8,), torch.float32), None
        ),
        "all_reduce_int": lambda c: c.all_reduce(data(rank, (MIB // 4,), torch.int64), None),
    }
    try:
        equal = all(bits(call(staged)) == bits(call(plain)) for call in calls.values())
    finally:
        collective_workspaces.allocate_bytes = real
    return {"equal": equal, "fallbacks": staged.fallbacks}


class StandInStream:
    """Test-only: a device stream the test makes current, recording what the collectives order on it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: StandInStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def streams(rank: int, world: int) -> dict[str, Any]:
    """The device branch on CPU ranks: a stand-in stream API says which stream is current; a use of a block on
    another stream than its last must be ordered after that one before anything is written to the block."""
    from vllm_omni.distributed import collective_workspaces
    from vllm_omni.distributed import persistent_collectives as pc

    log: list[str] = []
    side, main = StandInStream("side", log), StandInStream("main", log)
    current = [main]
    collective_workspaces.current_stream = lambda device: current[0]
    real_write = pc._write

    def logged_write(destination, source):
        log.append(f"copy on {current[0].name}")
        real_write(destination, source)

    pc._write = logged_write
    staged = pc.Collectives(persistent=True)
    plan = ["main", "main", "side", "side", "main"]
    for salt, name in enumerate(plan):
        current[0] = side if name == "side" else main
        log.append(f"call on {name}")
        staged.all_reduce(data(rank, (16,), torch.float32, salt), None)
    return {"log": log, "blocks": len(staged.blocks())}


def four_rank_checks(rank: int, world: int) -> dict[str, Any]:
    """The four-rank checks in one start of the ranks (each start costs seconds of imports), the cap set first: it
    is read once per process. Batches left in flight come last."""
    os.environ[CAP_ENV] = "1"
    checks = (non_member, capped_blocks, capped_fallback, abandoned_batches)
    return {check.__name__: check(rank, world) for check in checks}


def three_rank_checks(rank: int, world: int) -> dict[str, Any]:
    return {check.__name__: check(rank, world) for check in (batches_in_flight, batch_work)}
