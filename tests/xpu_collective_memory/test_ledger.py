# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The collective ledger on a real one-rank gloo group in this process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from xpu_collective_memory.ledger import COLLECTIVES, CollectiveLedger, _buffers

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

NBYTES = 4096 * 4
POINT_TO_POINT = {"send", "recv", "batch_isend_irecv"}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _gather_in_place(buffer: torch.Tensor) -> None:
    dist.all_gather_single(buffer, buffer)


def _gather_fresh() -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = torch.empty(4096), torch.randn(4096)
    dist.all_gather_single(out, inp)
    return out, inp


def test_an_allocation_is_registered_once_and_seen_again_as_a_hit():
    buffer = torch.zeros(4096)
    with CollectiveLedger() as ledger:
        _gather_in_place(buffer)
        first = ledger.end_request()
        _gather_in_place(buffer)
        _gather_in_place(buffer[:100])  # a view of the same allocation
        second = ledger.end_request()
    assert first.new_registrations == 1 and first.pinned_bytes == NBYTES
    assert list(first.new_by_site.values()) == [{"send+recv": 1}]
    assert second.new_registrations == 0 and second.calls == 2 and second.pinned_bytes == NBYTES


def test_fresh_buffers_register_every_call_and_stay_pinned_at_new_addresses():
    with CollectiveLedger() as ledger:
        seen = set()
        for _ in range(3):
            out, inp = _gather_fresh()
            seen |= {out.untyped_storage().data_ptr(), inp.untyped_storage().data_ptr()}
            del out, inp  # only the ledger holds them now, as an open IPC handle would
            report = ledger.end_request()
            assert report.new_registrations == 2
            ((site, sides),) = report.new_by_site.items()
            assert sides == {"send": 1, "recv": 1} and "_gather_fresh (test_ledger.py" in site
    assert len(seen) == 6  # pinned memory cannot be handed out again
    assert report.pinned_bytes == 6 * NBYTES and report.registrations == 6


def test_list_all_gather_adds_a_hidden_receive_temp_on_every_call():
    tensor = torch.randn(4096)
    with CollectiveLedger() as ledger:
        for _ in range(2):
            dist.all_gather([torch.empty(4096)], tensor)
        report = ledger.end_request()
    ((_, sides),) = report.new_by_site.items()
    assert sides == {"send": 1, "recv (backend temp)": 2}
    assert report.pinned_bytes == 3 * NBYTES


def test_barrier_is_counted_as_a_temp_apart_from_registrations():
    with CollectiveLedger() as ledger:
        dist.barrier()
        dist.barrier()
        report = ledger.end_request()
    assert report.barrier_temps == 2 and report.new_registrations == 0 and report.calls == 2


def test_lru_limit_releases_the_least_recently_used_registration():
    keep = torch.zeros(4096)
    with CollectiveLedger(limit=2) as ledger:
        _gather_in_place(keep)
        _gather_fresh()  # registers send and recv: three entries, one over the limit
        report = ledger.end_request()
    assert report.evictions == 1 and report.registrations == 2 and report.pinned_bytes == 2 * NBYTES
    with ledger:
        _gather_in_place(keep)  # evicted first, so registered anew
        assert ledger.end_request().new_registrations == 1


def test_every_modelled_collective_is_observed_and_originals_come_back():
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    with CollectiveLedger() as ledger:  # fresh tensors each call, so each call registers something new
        dist.all_gather([torch.empty(8)], torch.ones(8))
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(8))
        dist.all_gather_single(torch.empty(8), torch.ones(8))
        dist.all_reduce(torch.ones(8))
        dist.all_to_all_single(torch.empty(8), torch.ones(8))
        dist.broadcast(torch.ones(8), src=0)
        dist.gather(torch.ones(8), [torch.empty(8)], dst=0)
        dist.scatter(torch.empty(8), [torch.ones(8)], src=0)
        dist.reduce(torch.ones(8), dst=0)
        dist.all_to_all([torch.empty(8)], [torch.ones(8)])
        dist.reduce_scatter(torch.empty(8), [torch.ones(8)])
        dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8))
        dist.reduce_scatter_single(torch.empty(8), torch.ones(8))
        dist.barrier()
        report = ledger.end_request()
    one_rank = set(COLLECTIVES) - POINT_TO_POINT  # a lone rank has no peer to send to
    assert report.calls == len(one_rank)
    assert {site.split(" @ ")[0] for site in report.new_by_site} == one_rank - {"barrier"}
    assert all(getattr(dist, name) is original for name, original in originals.items())


def test_point_to_point_collectives_book_their_tensor_on_the_side_it_moves():
    sent, received = torch.ones(8), torch.empty(8)
    assert _buffers("send", (sent, 1), {}) == ([sent], [], 0)
    assert _buffers("recv", (), {"tensor": received}) == ([], [received], 0)
    ops = [SimpleNamespace(op=dist.isend, tensor=sent), SimpleNamespace(op=dist.irecv, tensor=received)]
    assert _buffers("batch_isend_irecv", (ops,), {}) == ([sent], [received], 0)


def test_ledger_cannot_be_entered_twice_and_rejects_a_bad_limit():
    ledger = CollectiveLedger()
    with ledger, pytest.raises(RuntimeError, match="already active"):
        ledger.__enter__()
    for bad in (0, -1, 1.5, "1000"):
        with pytest.raises(ValueError, match=f"limit={bad!r}"):
            CollectiveLedger(limit=bad)


def test_an_error_in_the_bookkeeping_is_logged_once_and_the_collective_still_runs(caplog):
    def broken(frame):
        raise KeyError("injected: bookkeeping failed")

    values = torch.arange(8.0)
    with CollectiveLedger(classify=broken) as ledger:
        for _ in range(3):
            dist.all_reduce(values)  # on one rank a sum leaves the values as they are: it ran, and was not booked
        report = ledger.end_request()
    assert torch.equal(values, torch.arange(8.0))
    assert report.calls == 3 and report.new_registrations == 0 and report.bookkeeping_errors == 3
    assert len([r for r in caplog.records if "could not book a all_reduce call" in r.getMessage()]) == 1


@pytest.mark.parametrize("hold", [True, False])
def test_only_a_holding_ledger_keeps_a_buffer_alive_after_its_owner_drops_it(hold):
    import weakref

    with CollectiveLedger(hold_buffers=hold) as ledger:
        buffer = torch.zeros(4096)
        storage_ref = weakref.ref(buffer.untyped_storage())  # lives as long as the memory does
        dist.all_reduce(buffer)
        report = ledger.end_request()
        del buffer
        assert report.new_registrations == 1 and report.pinned_bytes == NBYTES  # booked by the model either way
        assert (storage_ref() is not None) is hold


def _reduce_fresh(collectives) -> None:
    collectives.all_reduce(torch.randn(4096), None)


def test_under_persistent_collectives_the_ledger_counts_their_block_not_the_callers_tensors():
    from vllm_omni.distributed.persistent_collectives import Collectives

    staged = Collectives(persistent=True)
    with CollectiveLedger() as ledger:
        for _ in range(3):
            _reduce_fresh(staged)
            ledger.mark_release()
        first = ledger.end_request()
        _reduce_fresh(staged)
        later = ledger.end_request()
    assert first.new_registrations == 1 and first.calls == 3  # one block, three fresh callers
    ((site, books),) = first.books["all"].items()
    assert site.startswith("all_reduce @ _reduce_fresh (test_ledger.py")  # the caller, not the staging
    assert books["persistent_buffers"] == 2
    assert later.new_registrations == 0 and later.calls == 1
    assert first.unmanaged_sites == {} and later.unmanaged_sites == {}


def test_a_call_on_a_device_group_with_the_callers_own_tensor_is_an_unmanaged_site():
    with CollectiveLedger() as ledger:
        dist.all_reduce(torch.zeros(8))
        dist.barrier()
        report = ledger.end_request()
    assert [site.split(" @ ")[0] for site in report.unmanaged_sites] == ["all_reduce", "barrier"]
