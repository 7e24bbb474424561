# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What the gloo ranks of the persistent-collectives tests share: a recorder of what the backend is handed, the
switch, and data that differs per rank."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

WATCHED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)


_blocks: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()


def _remember_blocks() -> None:
    """From this module's import on, every block ``collective_workspaces`` allocates in this rank is remembered."""
    from vllm_omni.distributed import collective_workspaces

    allocate = collective_workspaces.allocate_bytes

    def allocate_and_remember(*args: Any, **kwargs: Any) -> torch.Tensor:
        block = allocate(*args, **kwargs)
        _blocks[block.data_ptr()] = block.untyped_storage()
        return block

    collective_workspaces.allocate_bytes = allocate_and_remember


def is_persistent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a live block allocated since this module was imported."""
    storage = tensor.untyped_storage()
    return _blocks.get(storage.data_ptr()) is storage


_remember_blocks()


class BackendRecorder:
    """Test-only: in this rank, records the storages ``torch.distributed``'s collectives are handed, per request.

    A call is unmanaged where it hands the backend anything but persistent blocks, or is a barrier or a list
    gather (XCCL makes temporaries of its own for those).
    """

    def __init__(self) -> None:
        self.requests: list[list[tuple[str, list[tuple[int, bool]]]]] = [[]]
        self._saved: dict[str, Callable] = {}
        self._depth = 0

    def __enter__(self) -> BackendRecorder:
        for name in WATCHED:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._recording(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        if not self.requests[-1]:
            self.requests.pop()

    def _recording(self, name: str, original: Callable) -> Callable:
        @torch._dynamo.disable
        def record(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # torch's all_gather_into_tensor calls all_gather_single: one call
                values = [*args, *kwargs.values()]
                flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
                tensors = [getattr(v, "tensor", v) for v in flat if isinstance(getattr(v, "tensor", v), torch.Tensor)]
                handed = [(t.untyped_storage().data_ptr(), is_persistent(t)) for t in tensors]
                self.requests[-1].append((name, handed))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return record

    def end_request(self) -> None:
        self.requests.append([])

    @staticmethod
    def fresh_across(recorders: list[BackendRecorder]) -> int:
        """Storages the last recorder's calls handed the backend that no earlier one did."""
        seen = {ptr for r in recorders[:-1] for calls in r.requests for _, tensors in calls for ptr, _ in tensors}
        last = {ptr for calls in recorders[-1].requests for _, tensors in calls for ptr, _ in tensors}
        return len(last - seen)

    def summary(self) -> list[dict[str, int]]:
        seen: set[int] = set()
        rows = []
        for calls in self.requests:
            handed = {ptr for _, tensors in calls for ptr, _ in tensors}
            unmanaged = [
                name
                for name, tensors in calls
                if name in ("barrier", "all_gather") or not tensors or not all(p for _, p in tensors)
            ]
            rows.append({"calls": len(calls), "fresh": len(handed - seen), "unmanaged": len(unmanaged)})
            seen |= handed
        return rows


SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"


def run_switched(
    switch: str, module: Callable, inputs: list[torch.Tensor], compiled: bool = False
) -> tuple[list[bytes], dict[str, int] | None]:
    """``module`` on each input in inference mode with the switch set: the results' bits and the recorded calls.
    A process stages or not for its life, and compiled code reads it once: a compiled ``module`` compiles again.
    Compiled with staging off, its collectives are torch's functional ones, which call no Python function a
    recorder could stand in for: nothing is recorded (None)."""
    os.environ[SWITCH_ENV] = switch
    torch._dynamo.reset()
    recorder = BackendRecorder() if switch != "0" or not compiled else contextlib.nullcontext()
    with torch.inference_mode(), recorder:
        results = [bits(module(x)) for x in inputs]
    if not isinstance(recorder, BackendRecorder):
        return results, None
    (request,) = recorder.summary()
    return results, request


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Values that differ per rank, call and element, and whose float sums are not exact in low precision."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 3.7).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=generator, dtype=dtype)


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def close_floats(first: list[bytes], second: list[bytes], rtol: float = 1e-5) -> bool:
    """Whether float32 results given as ``bits`` agree to ``rtol``: what Inductor keeps where it fuses the code around
    torch's functional collectives otherwise than around registered ops."""
    as_floats = [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in (*first, *second)]
    pairs = zip(as_floats[: len(first)], as_floats[len(first) :], strict=True)
    return len(first) == len(second) and all(torch.allclose(a, b, rtol=rtol, atol=rtol) for a, b in pairs)


CAP_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"
MIB = 1 << 20


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


def capped_disagreement(rank: int, world: int) -> dict[str, Any]:
    """Above the cap, ranks that differ in what only each knows: rank 1's tensors require grad, rank 2's have gaps
    (staged through a row-major copy: the oracle is the plain collective on its elements, as a device backend takes
    no tensor with gaps), rank 3 gets no block. Every rank still runs as many pieces as its peers, so all finish
    with the plain bits."""
    from vllm_omni.distributed import collective_workspaces
    from vllm_omni.distributed import persistent_collectives as pc

    os.environ[CAP_ENV] = "1"  # read once per process: these ranks run this check alone

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            return tensor.requires_grad_(True) if tensor.is_floating_point() else tensor
        if rank == 2:  # every other element of a tensor twice the size
            gapped = torch.zeros(2 * tensor.numel(), dtype=tensor.dtype)[::2]
            return gapped.copy_(tensor)
        return tensor

    def failing(nbytes, device, group=None):
        raise RuntimeError(f"injected: no memory for {nbytes} bytes")

    calls = {
        "all_reduce_int": lambda c, make: c.all_reduce(make(data(rank, (MIB // 4 + 3,), torch.int64)), None),
        "broadcast": lambda c, make: c.broadcast(make(data(rank, (MIB // 2 + 5,), torch.float32)), 0, None),
        "broadcast_from_gapped": lambda c, make: c.broadcast(make(data(rank, (MIB // 2 + 5,), torch.float32)), 2, None),
    }
    real = collective_workspaces.allocate_bytes
    if rank == 3:
        collective_workspaces.allocate_bytes = failing
    staged, plain = pc.Collectives(persistent=True), pc.Collectives(persistent=False)
    try:
        equal = {
            name: bits(call(staged, own).detach()) == bits(call(plain, lambda tensor: tensor).detach())
            for name, call in calls.items()
        }
    finally:
        collective_workspaces.allocate_bytes = real
    return {"equal": equal, "chunked_calls": staged.chunked_calls}


def rising_sizes(rank: int, world: int) -> dict[str, Any]:
    """Calls whose size rises a little each time, as a request's might: a block grows to at least twice what it held
    (within the cap), so few of them make a new block."""
    from vllm_omni.distributed import persistent_collectives as pc

    os.environ[CAP_ENV] = "1"
    staged = pc.Collectives(persistent=True)
    sizes = [int(16 * 1024 * 1.25**step) for step in range(12)]  # bytes: 16 KiB up to 186 KiB, below the cap
    for numel in sizes:
        staged.all_reduce(data(rank, (numel // 4,), torch.float32), None)
    (block,) = staged.blocks()
    return {"calls": len(sizes), "allocations": block.allocs, "resident_bytes": block.nbytes}


class StandInStream:
    """Test-only: a device stream the test makes current, recording what the collectives order on it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: StandInStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def streams(rank: int, world: int) -> dict[str, Any]:
    """The device branch on CPU ranks: a stand-in stream API says which stream is current; a use of a block on
    another stream than its last must be ordered after that one before anything is written to the block."""
    from vllm_omni.distributed import persistent_collectives as pc

    log: list[str] = []
    side, main = StandInStream("side", log), StandInStream("main", log)
    current = [main]
    pc.current_stream = lambda device: current[0]
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


def busy_block(rank: int, world: int) -> dict[str, Any]:
    """A call that finds its block in use runs on the caller's tensors: same bits, nothing overwritten."""
    from vllm_omni.distributed import persistent_collectives as pc

    staged = pc.Collectives(persistent=True)
    tensor = data(rank, (8,), torch.float32)
    staged.all_reduce(tensor.clone(), None)
    (block,) = staged.blocks()
    block.busy = True
    before = block.block.clone()
    got = staged.all_reduce(tensor.clone(), None)
    want = pc.Collectives(persistent=False).all_reduce(tensor.clone(), None)
    return {
        "equal": bits(got) == bits(want),
        "block_kept": torch.equal(before, block.block),
        "fallbacks": staged.fallbacks,
    }
