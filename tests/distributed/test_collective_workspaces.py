# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The workspace pool's allocation policy and the registry of persistent blocks, in one process."""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_omni.distributed import collective_workspaces
from vllm_omni.distributed.collective_workspaces import (
    ALIGN,
    WorkspacePool,
    allocate_bytes,
    contiguous_region,
    is_persistent,
    region_of,
)

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]

CPU = torch.device("cpu")


def test_the_smallest_free_workspace_that_fits_is_reused_without_allocating():
    pool = WorkspacePool(CPU, None)
    small, large = pool.acquire(100), pool.acquire(10_000)
    pool.release(small)
    pool.release(large)
    assert (small.nbytes, large.nbytes) == (ALIGN, 10_240)
    assert pool.acquire(300) is small and pool.acquire(5_000) is large
    assert pool.allocations == 2 and pool.resident_bytes == ALIGN + 10_240


def test_when_none_fits_the_largest_free_one_grows_instead_of_adding_another():
    pool = WorkspacePool(CPU, None)
    small, large = pool.acquire(100), pool.acquire(1_000)
    pool.release(small)
    pool.release(large)
    old_block = large.block.data_ptr()
    assert pool.acquire(50_000) is large
    assert large.nbytes == 50_176 and large.block.data_ptr() != old_block
    assert len(pool.workspaces) == 2 and pool.allocations == 3


def test_busy_workspaces_are_never_handed_out_and_the_limit_bounds_them():
    pool = WorkspacePool(CPU, None, limit=2)
    first, second = pool.acquire(64), pool.acquire(64)
    assert first is not second and pool.acquire(64) is None
    assert pool.peak_busy == 2
    pool.release(first)
    assert pool.acquire(64) is first


def test_a_failed_growth_leaves_the_workspace_empty_and_free(monkeypatch):
    pool = WorkspacePool(CPU, None)
    pool.release(pool.acquire(64))

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("stand-in: no device memory")

    monkeypatch.setattr(collective_workspaces, "allocate_bytes", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        pool.acquire(4096)
    (workspace,) = pool.workspaces
    assert workspace.block is None and not workspace.busy


def test_carved_regions_are_aligned_views_of_one_block():
    pool = WorkspacePool(CPU, None)
    regions = [contiguous_region(torch.Size([3, 5]), torch.bfloat16), region_of(torch.empty(7, 2).t())]
    workspace = pool.acquire(collective_workspaces.regions_nbytes(regions))
    first, second = workspace.carve(regions)
    assert (first.shape, first.dtype, second.shape, second.dtype) == ((3, 5), torch.bfloat16, (2, 7), torch.float32)
    assert first.is_contiguous() and second.stride() == (1, 2)  # a region keeps its tensor's element order
    assert second.data_ptr() - first.data_ptr() == ALIGN
    assert first.untyped_storage().data_ptr() == workspace.block.data_ptr()


def test_a_block_is_persistent_while_any_view_of_it_lives_and_forgotten_after():
    view = allocate_bytes(256, CPU, None).view(torch.float32)  # the uint8 tensor itself is gone at once
    ptr = view.untyped_storage().data_ptr()
    assert is_persistent(view) and is_persistent(view[10:20])
    assert not is_persistent(torch.empty(64))
    del view
    gc.collect()
    assert ptr not in collective_workspaces._persistent


class _StreamRecorder:
    """Stand-in for a device module (no card here): its events log where they are recorded and waited on."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, str]] = []
        self.stream = "s1"

    def Event(self):  # noqa: N802 - torch's device modules spell it so
        recorder, number = self, sum(1 for entry in self.log if entry[0] == "record") + 1

        class Event:
            def record(self):
                recorder.log.append(("record", number, recorder.stream))

            def wait(self):
                recorder.log.append(("wait", number, recorder.stream))

        return Event()

    def synchronize(self, device=None):
        self.log.append(("synchronize", 0, self.stream))


def test_a_released_workspace_is_next_used_only_after_its_last_users_stream_reaches_the_release(monkeypatch):
    streams = _StreamRecorder()
    monkeypatch.setattr(collective_workspaces, "device_module", lambda device: streams)
    pool = WorkspacePool(CPU, None)
    first = pool.acquire(64)  # a new workspace: nothing to wait for
    assert streams.log == []
    pool.release(first)  # copied out on s1
    streams.stream = "s2"
    assert pool.acquire(64) is first  # the next copy-in, on s2, waits for s1's copy-out
    assert streams.log == [("record", 1, "s1"), ("wait", 1, "s2")]
    pool.release(first)
    assert pool.acquire(64) is first and streams.log[-2:] == [("record", 2, "s2"), ("wait", 2, "s2")]


def test_growing_a_workspace_waits_for_the_device_before_its_old_block_goes(monkeypatch):
    streams = _StreamRecorder()
    monkeypatch.setattr(collective_workspaces, "device_module", lambda device: streams)
    pool = WorkspacePool(CPU, None)
    pool.release(pool.acquire(64))
    pool.acquire(100_000)
    assert [entry[0] for entry in streams.log] == ["record", "wait", "synchronize"]
