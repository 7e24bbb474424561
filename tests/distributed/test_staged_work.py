# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``StagedWork`` against what a plain ``Work`` does, with stand-in backend works (no process group needed)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from vllm_omni.distributed.persistent_collectives import SWITCH_ENV, PersistentCollectives
from vllm_omni.distributed.staged_work import Completion, StagedWork

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]


class _BackendWork:
    """Stand-in for a backend's work: completes when told, fails if told."""

    def __init__(self, error: Exception | None = None) -> None:
        self.completed, self.error, self.waits = False, error, 0

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, *args, **kwargs) -> bool:
        self.waits += 1
        if self.error is not None:
            raise self.error
        return True


def _staged(
    work: _BackendWork, layer: PersistentCollectives, group: object = None, touches: tuple = ()
) -> tuple[StagedWork, list[str]]:
    events: list[str] = []
    completion = Completion([work], lambda: events.append("copied out"), lambda: events.append("released"))
    layer.track(completion, group, touches)
    return StagedWork(completion, layer.adopt), events


def test_a_staged_work_is_a_work_that_copies_out_once_when_waited():
    work, events = _staged(_BackendWork(), PersistentCollectives("cpu", {}))
    assert isinstance(work, dist.Work)
    assert work.wait() and work.wait() and events == ["copied out", "released"]


def test_a_failed_work_reports_completion_keeps_its_error_and_raises_it_on_every_wait():
    backend = _BackendWork(RuntimeError("stand-in: the collective timed out"))
    work, events = _staged(backend, PersistentCollectives("cpu", {}))
    assert not work.is_completed()
    backend.completed = True
    assert work.is_completed() and not work.is_success()
    assert str(work.exception()) == "stand-in: the collective timed out"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="timed out"):
            work.wait()
    assert events == ["released"] and backend.waits == 1  # never copied out; the backend waited once


def test_a_dropped_work_never_blocks_and_is_finished_by_a_later_call_once_complete():
    layer = PersistentCollectives("cpu", {})
    backend = _BackendWork()
    work, events = _staged(backend, layer)
    del work
    gc.collect()
    assert backend.waits == 0 and events == []  # collected: nothing waited for
    layer.settle()
    assert backend.waits == 0 and events == []  # not complete yet: left alone
    backend.completed = True
    layer.settle()
    assert events == ["copied out", "released"]


def test_a_call_on_the_storage_of_a_work_in_flight_finishes_that_work_first():
    layer, backend, tensor = PersistentCollectives("cpu", {}), _BackendWork(), torch.ones(8)
    work, events = _staged(backend, layer, touches=(tensor,))
    layer.settle((torch.ones(8),))
    assert events == []  # another storage: the works are independent, as plain ones are
    layer.settle((tensor[4:],))
    assert events == ["copied out", "released"] and backend.waits == 1  # a view of the same storage: in order
    assert work.wait() and backend.waits == 1


def test_calls_on_disjoint_views_of_one_buffer_are_independent_and_sparse_tensors_are_no_obstacle():
    layer, backend, buffer = PersistentCollectives("cpu", {}), _BackendWork(), torch.ones(8)
    work, events = _staged(backend, layer, touches=(buffer[:4],))
    layer.settle((buffer[4:], torch.eye(3).to_sparse()))
    assert events == [] and backend.waits == 0
    layer.settle((buffer[2:6],))
    assert events == ["copied out", "released"]


def test_a_barrier_does_not_wait_for_point_to_point_batches_in_flight():
    layer, group, backend = PersistentCollectives("cpu", {}), object(), _BackendWork()
    events: list[str] = []
    completion = Completion([backend], lambda: events.append("copied out"), lambda: events.append("released"))
    layer.track(completion, group, (), collective=False)
    layer.settle(group=group)
    assert events == [] and backend.waits == 0  # gloo's barrier does not wait for sends and receives either


def test_a_wait_that_times_out_keeps_the_workspace_busy_and_a_later_wait_finishes():
    backend = _BackendWork(RuntimeError("stand-in: wait timed out"))
    work, events = _staged(backend, PersistentCollectives("cpu", {}))
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait()
    assert events == []  # the backend still writes the workspace: neither copied out nor released
    backend.error, backend.completed = None, True
    assert work.wait() and events == ["copied out", "released"]


def test_a_barrier_finishes_the_works_in_flight_on_its_group_and_no_others():
    layer, group, other = PersistentCollectives("cpu", {}), object(), object()
    mine, theirs = _BackendWork(), _BackendWork()
    kept = [_staged(mine, layer, group), _staged(theirs, layer, other)]
    layer.settle(group=group)
    assert kept[0][1] == ["copied out", "released"] and kept[1][1] == [] and theirs.waits == 0


def test_uninstall_finishes_dropped_works_so_their_results_land():
    layer, dropped, held = PersistentCollectives("cpu", {}), _BackendWork(), _BackendWork()
    work, dropped_events = _staged(dropped, layer)
    kept, held_events = _staged(held, layer)
    del work
    gc.collect()
    layer.finish_dropped()  # blocks on a dropped work even before it completes: nothing later will finish it
    assert dropped_events == ["copied out", "released"] and dropped.waits == 1
    assert held_events == [] and held.waits == 0  # its holder waits for it


def test_result_and_get_future_are_refused_naming_the_switch():
    work, _ = _staged(_BackendWork(), PersistentCollectives("cpu", {}))
    for method in (work.result, work.get_future):
        with pytest.raises(NotImplementedError, match=f"{SWITCH_ENV}=0"):
            method()


def test_a_work_in_flight_keeps_the_callers_tensors_alive_until_it_finishes():
    # A broadcast's source is read only: without this its storage could be freed and reused by a later call,
    # which would then wait for a work it has nothing to do with.
    source = torch.ones(8)
    storage = weakref.ref(source.untyped_storage())
    completion = Completion([_BackendWork()], lambda: None, lambda: None, holds=(source,))
    del source
    gc.collect()
    assert storage() is not None
    completion.wait()
    gc.collect()
    assert storage() is None
